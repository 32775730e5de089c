"""Pooling requests (embeddings, reranker scores) from the prefill, against sentence-transformers and
transformers on a tiny checkpoint: every method, chunked or whole, batched, after a radix-cache hit."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from kestrel import Engine, SamplingParams
from kestrel.core.pooling_params import PoolingParams
from tests.e2e.conftest import assert_pool_full

TEXTS = ["The quick brown fox jumps over the lazy dog.", "def add(a, b):\n    return a + b",
         "The quick brown fox jumps over a sleeping cat, then runs.", "Ça va?"]
ST_MODES = {"last": "pooling_mode_lasttoken", "mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token"}


def sentence_transformers_folder(model: str, dest: Path, method: str, normalize: bool) -> Path:
    """The tiny checkpoint as a sentence-transformers model: modules.json, 1_Pooling (and Normalize)."""
    shutil.copytree(model, dest)
    hidden = json.loads((dest / "config.json").read_text())["hidden_size"]
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (dest / "modules.json").write_text(json.dumps(modules))
    (dest / "1_Pooling").mkdir()
    (dest / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": hidden, **{key: key == ST_MODES[method] for key in ST_MODES.values()}}))
    return dest


def st_embeddings(folder: Path, texts: list[str]) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(folder), device="cpu")
    return torch.stack([torch.as_tensor(model.encode([t], convert_to_numpy=True)[0]) for t in texts])


@pytest.fixture(scope="module")
def model(tiny_model) -> str:
    return tiny_model("qwen3")


@pytest.fixture(scope="module")
def prompt_ids(model) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    return [tok(t)["input_ids"] for t in TEXTS]


@pytest.mark.parametrize("method,normalize,options", [
    ("last", True, {}), ("mean", False, {"chunked_prefill_size": 5, "page_size": 4}),
    ("cls", True, {"chunked_prefill_size": 6}), ("mean", True, {})])
def test_embeddings_equal_sentence_transformers(model, prompt_ids, tmp_path, method, normalize, options):
    folder = sentence_transformers_folder(model, tmp_path / "st", method, normalize)
    expected = st_embeddings(folder, TEXTS)
    params = SamplingParams(max_new_tokens=0, pooling=PoolingParams(method, normalize))
    with Engine(model=model, device="cpu", dtype="float32", **options) as engine:
        outs = engine.generate(prompt_token_ids=prompt_ids, sampling_params=params)
        # Again, one at a time: the shared prefixes now come from the radix cache.
        again = [engine.generate(prompt_token_ids=[p], sampling_params=params)[0] for p in prompt_ids]
        assert_pool_full(engine)
    for out, out2, want in zip(outs, again, expected):
        assert out.token_ids == [] and out.meta["finish_reason"] == "length"
        assert torch.tensor(out.meta["pooled"]) == pytest.approx(want, abs=1e-4)
        assert out2.meta["pooled"] == pytest.approx(out.meta["pooled"], abs=1e-5)
    assert sum(o.meta["cached_tokens"] for o in again) > 0 or method != "last"


def test_matryoshka_dimensions_cut_before_normalising(model, prompt_ids):
    with Engine(model=model, device="cpu", dtype="float32") as engine:
        full, cut = (engine.generate(prompt_token_ids=prompt_ids[:1], sampling_params=SamplingParams(
            max_new_tokens=0, pooling=PoolingParams("last", normalize, dims)))[0].meta["pooled"]
            for normalize, dims in ((False, None), (True, 8)))
    assert len(cut) == 8
    assert torch.tensor(cut) == pytest.approx(torch.nn.functional.normalize(torch.tensor(full[:8]), dim=0), abs=1e-5)


def test_reranker_score_is_the_softmax_of_two_logits_at_the_last_position(model, prompt_ids):
    from transformers import AutoModelForCausalLM

    yes, no = 17, 23
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = [torch.softmax(hf(torch.tensor([p])).logits[0, -1, [yes, no]], dim=0)[0].item() for p in prompt_ids]
    params = SamplingParams(max_new_tokens=0, pooling=PoolingParams("last", False, score_token_ids=(yes, no)))
    greedy = SamplingParams(max_new_tokens=3, temperature=0)
    with Engine(model=model, device="cpu", dtype="float32", chunked_prefill_size=7) as engine:
        # Scored beside generating requests: mixed batches, a pooling request finishing at its prefill.
        outs = engine.generate(prompt_token_ids=prompt_ids * 2, sampling_params=[params] * 4 + [greedy] * 4)
        assert_pool_full(engine)
    for out, want in zip(outs[:4], expected):
        probs = out.meta["pooled"]
        assert len(probs) == 2 and probs[0] + probs[1] == pytest.approx(1, abs=1e-5)
        assert probs[0] == pytest.approx(want, abs=1e-4)
    assert all(len(o.token_ids) == 3 and "pooled" not in o.meta for o in outs[4:])


def test_pooling_asks_for_a_prefill_only_request():
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=1, pooling=PoolingParams()).validate(100)
    with pytest.raises(ValueError, match="method"):
        SamplingParams(max_new_tokens=0, pooling=PoolingParams("max")).validate(100)
    with pytest.raises(ValueError, match="score_token_ids"):
        SamplingParams(max_new_tokens=0, pooling=PoolingParams(score_token_ids=(1, 100))).validate(100)

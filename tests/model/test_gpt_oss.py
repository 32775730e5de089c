"""gpt-oss against transformers' GptOssForCausalLM (eager attention) on tiny random configs: sinks,
alternating window/full layers, YaRN, attention/router/expert biases, the clamped SwiGLU; fp32 logits
at every position through kestrel's torch_native backend."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from kestrel.core.forward_mode import ForwardMode
from kestrel.models.loader import load_model
from tests.model.gpt_oss_tiny import WINDOW, make_gpt_oss, to_mxfp4_checkpoint
from tests.model.harness import Harness

PROMPT_LENS = (3, 9, 14)


def _prompts(vocab: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _hf_logits(path: Path, tokens: list[int]) -> torch.Tensor:
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    ids = torch.tensor([tokens])
    with torch.no_grad():
        return hf(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0].float()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_gpt_oss(tmp_path_factory.mktemp("gpt_oss"))


def test_prefill_and_decode_across_window_boundaries_match_transformers(tiny: Path) -> None:
    """Prefills of three lengths in one batch, then decode steps one at a time past several windows:
    every position's logits equal transformers' on the whole sequence."""
    model = load_model(tiny, torch.float32, "cpu")
    prompts = _prompts(model.config.vocab_size)
    harness = Harness(model, len(prompts), layout=model.kv_layout(torch.float32))
    got = [[logits] for logits in harness.step(prompts)]
    sequences = [list(p) for p in prompts]
    for _ in range(3 * WINDOW):  # greedy decode, batched
        nxt = [int(g[-1][-1].argmax()) for g in got]
        for seq, token in zip(sequences, nxt):
            seq.append(token)
        for g, logits in zip(got, harness.step([[t] for t in nxt], ForwardMode.DECODE)):
            g.append(logits)
    for seq, parts in zip(sequences, got):
        ours = torch.cat(parts)[:len(seq)]
        theirs = _hf_logits(tiny, seq)
        torch.testing.assert_close(ours, theirs, atol=2e-4, rtol=2e-4)
        assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_attention_without_biases_matches_transformers(tmp_path: Path) -> None:
    """`attention_bias` false (the config field; the released checkpoints have biases): no q/k/v/o biases."""
    path = make_gpt_oss(tmp_path / "nobias", seed=3, attention_bias=False)
    model = load_model(path, torch.float32, "cpu")
    assert model.model.layers[0].self_attn.qkv_proj.bias is None
    prompts = _prompts(model.config.vocab_size, seed=4)
    harness = Harness(model, len(prompts), layout=model.kv_layout(torch.float32))
    for prompt, logits in zip(prompts, harness.step(prompts)):
        torch.testing.assert_close(logits, _hf_logits(path, prompt), atol=2e-4, rtol=2e-4)


def test_batched_equals_one_at_a_time_and_chunked_equals_whole(tiny: Path) -> None:
    model = load_model(tiny, torch.float32, "cpu")
    prompts = _prompts(model.config.vocab_size, seed=2)
    batched = Harness(model, len(prompts), layout=model.kv_layout(torch.float32)).step(prompts)
    for prompt, logits in zip(prompts, batched):
        alone = Harness(model, 1, layout=model.kv_layout(torch.float32)).step([prompt])[0]
        torch.testing.assert_close(logits, alone, atol=1e-5, rtol=1e-5)
        chunked = Harness(model, 1, layout=model.kv_layout(torch.float32))
        parts = [chunked.step([prompt[i:i + 4]])[0] for i in range(0, len(prompt), 4)]
        torch.testing.assert_close(torch.cat(parts), alone, atol=1e-5, rtol=1e-5)


def test_mxfp4_checkpoint_matches_its_dequantised_reference(tiny: Path, tmp_path: Path) -> None:
    folders = to_mxfp4_checkpoint(tiny, tmp_path)
    quantized = load_model(folders / "mxfp4", torch.float32, "cpu")
    reference = load_model(folders / "reference", torch.float32, "cpu")
    for a, b in zip(quantized.state_dict().values(), reference.state_dict().values()):
        assert torch.equal(a, b)
    prompt = _prompts(quantized.config.vocab_size)[2]
    harness = Harness(quantized, 1, layout=quantized.kv_layout(torch.float32))
    torch.testing.assert_close(harness.step([prompt])[0], _hf_logits(folders / "reference", prompt),
                               atol=2e-4, rtol=2e-4)


def test_checkpoint_mismatches_are_named(tiny: Path, tmp_path: Path) -> None:
    import json

    from safetensors.torch import load_file, save_file

    tensors = load_file(tiny / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.down_proj"]
    tensors["model.layers.0.mlp.experts.up_scales"] = torch.zeros(1, dtype=torch.uint8)
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((tiny / "config.json").read_text())
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.experts.e0.down.*layers.0.mlp.experts.up \(scale without its pair\)"):
        load_model(tmp_path, torch.float32, "cpu")
    config = json.loads((tiny / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "awq"}}))
    with pytest.raises(ValueError, match="'awq'.*mxfp4"):
        load_model(tmp_path, torch.float32, "cpu")

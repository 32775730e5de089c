"""EAGLE and EAGLE-3 heads: tiny random checkpoints in the public layouts, loaded and run through the
torch_native backend (prefill, decode, a multi-token extend), against a naive plain-torch reference
written from the checkpoint tensors; variant detection and the refusals."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from kestrel.config import EngineConfig
from kestrel.config_resolve import resolve_config
from kestrel.core.forward_mode import ForwardMode
from kestrel.models.llama_eagle import (TargetParts, detect_eagle_variant, eagle3_target_layers,
                                        load_eagle_head)
from kestrel.models.loader import load_model
from tests.model.harness import Harness
from tests.tiny_models import make_tiny_model

H, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB, DRAFT_VOCAB = 64, 4, 2, 16, 96, 512, 100
EPS, THETA = 1e-6, 10000.0
TARGET_LAYERS = 2  # make_tiny_model's depth


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = make_tiny_model("llama", tmp_path_factory.mktemp("target"))
    model = load_model(path, torch.float32, "cpu")
    return model, load_file(path / "model.safetensors")


def _head_config(**extra) -> dict:
    return dict(hidden_size=H, intermediate_size=INTER, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                num_hidden_layers=1, vocab_size=VOCAB, rms_norm_eps=EPS, rope_theta=THETA, hidden_act="silu",
                max_position_embeddings=32, **extra)


def _random(shape: tuple[int, ...], gen: torch.Generator, norm: bool = False) -> torch.Tensor:
    if norm:
        return 1.0 + 0.2 * torch.randn(shape, generator=gen)
    return 0.15 * torch.randn(shape, generator=gen)


def _layer_tensors(prefix: str, qkv_in: int, gen: torch.Generator, norms: tuple[str, ...]) -> dict[str, torch.Tensor]:
    t = {f"{prefix}self_attn.q_proj.weight": _random((HEADS * HEAD_DIM, qkv_in), gen),
         f"{prefix}self_attn.k_proj.weight": _random((KV_HEADS * HEAD_DIM, qkv_in), gen),
         f"{prefix}self_attn.v_proj.weight": _random((KV_HEADS * HEAD_DIM, qkv_in), gen),
         f"{prefix}self_attn.o_proj.weight": _random((H, HEADS * HEAD_DIM), gen),
         f"{prefix}mlp.gate_proj.weight": _random((INTER, H), gen),
         f"{prefix}mlp.up_proj.weight": _random((INTER, H), gen),
         f"{prefix}mlp.down_proj.weight": _random((H, INTER), gen)}
    t.update({f"{prefix}{n}.weight": _random((H,), gen, norm=True) for n in norms})
    return t


def make_eagle(path: Path, seed: int = 0, extra_tensors: bool = False) -> dict[str, torch.Tensor]:
    """An EAGLE-1 head as the EAGLE repo exports it (LlamaConfig, unprefixed names, fc with bias)."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {"fc.weight": _random((H, 2 * H), gen), "fc.bias": _random((H,), gen),
               **_layer_tensors("layers.0.", H, gen, ("post_attention_layernorm",))}
    if extra_tensors:  # what real exports carry besides: the unused layer-0 input norm, an embedding copy
        tensors["layers.0.input_layernorm.weight"] = torch.ones(H)
        tensors["embed_tokens.weight"] = torch.zeros(VOCAB, H)
    _save(path, _head_config(architectures=["LlamaForCausalLM"]), tensors)
    return tensors


def make_eagle3(path: Path, seed: int = 1, vllm_names: bool = False, aux_ids: list[int] | None = (0, 0, 1),
                d2t: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """An EAGLE-3 head: midlayer.*, its own norm and lm_head over a 100-token draft vocabulary; by default
    trained on the outputs of the tiny target's layers 0, 0 and 1."""
    gen = torch.Generator().manual_seed(seed)
    draft_ids = torch.randperm(VOCAB, generator=gen)[:DRAFT_VOCAB].sort().values
    prefix = "layers.0." if vllm_names else "midlayer."
    tensors = {"fc.weight": _random((H, 3 * H), gen), "norm.weight": _random((H,), gen, norm=True),
               "lm_head.weight": _random((DRAFT_VOCAB, H), gen),
               "d2t": draft_ids - torch.arange(DRAFT_VOCAB) if d2t is None else d2t,
               "t2d": torch.zeros(VOCAB, dtype=torch.bool).index_fill(0, draft_ids, True),
               **_layer_tensors(prefix, 2 * H, gen, ("input_layernorm", "hidden_norm", "post_attention_layernorm"))}
    eagle_config = {"use_aux_hidden_state": True}
    if aux_ids is not None:
        eagle_config["eagle_aux_hidden_state_layer_ids"] = list(aux_ids)
    _save(path, _head_config(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=DRAFT_VOCAB,
                             target_hidden_size=H, eagle_config=eagle_config), tensors)
    return {(k.replace("layers.0.", "midlayer.") if vllm_names else k): v for k, v in tensors.items()}


def _save(path: Path, config: dict, tensors: dict[str, torch.Tensor]) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, path / "model.safetensors")


# ---- the naive reference: one whole sequence at a time, causal attention over all of it ----------
def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))


def rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    inv = 1.0 / THETA ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM)
    angle = positions[:, None].float() * inv[None]
    cos, sin = angle.cos()[:, None], angle.sin()[:, None]
    x1, x2 = x[..., :HEAD_DIM // 2], x[..., HEAD_DIM // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def reference_layer(w: dict[str, torch.Tensor], p: str, attn_in: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    n = attn_in.shape[0]
    pos = torch.arange(n)
    q = rope((attn_in @ w[p + "self_attn.q_proj.weight"].T).view(n, HEADS, HEAD_DIM), pos)
    k = rope((attn_in @ w[p + "self_attn.k_proj.weight"].T).view(n, KV_HEADS, HEAD_DIM), pos)
    v = (attn_in @ w[p + "self_attn.v_proj.weight"].T).view(n, KV_HEADS, HEAD_DIM)
    k, v = k.repeat_interleave(HEADS // KV_HEADS, 1), v.repeat_interleave(HEADS // KV_HEADS, 1)
    scores = torch.einsum("thd,shd->hts", q, k) * HEAD_DIM ** -0.5
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    attn = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(n, -1) @ w[p + "self_attn.o_proj.weight"].T
    h = attn + residual
    x = rms(h, w[p + "post_attention_layernorm.weight"])
    mlp = (F.silu(x @ w[p + "mlp.gate_proj.weight"].T) * (x @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    return mlp + h


def reference_eagle(w, target_w, ids, features):
    x = torch.cat([target_w["model.embed_tokens.weight"][ids], features], -1) @ w["fc.weight"].T + w["fc.bias"]
    out = reference_layer(w, "layers.0.", x, x)
    return out, out @ target_w["lm_head.weight"].T


def reference_eagle3(w, target_w, ids, aux):
    feature = aux @ w["fc.weight"].T
    embeds = target_w["model.embed_tokens.weight"][ids]
    attn_in = torch.cat([rms(embeds, w["midlayer.input_layernorm.weight"]), rms(feature, w["midlayer.hidden_norm.weight"])], -1)
    out = reference_layer(w, "midlayer.", attn_in, feature)
    draft_logits = rms(out, w["norm.weight"]) @ w["lm_head.weight"].T
    logits = torch.full((len(ids), VOCAB), float("-inf"))
    logits[:, torch.arange(DRAFT_VOCAB) + w["d2t"]] = draft_logits
    return out, logits


# ---- running a head through kestrel, in three steps ----------------------------------------------
STEPS = [([5, 9, 3], ForwardMode.EXTEND), ([1, 1, 1], ForwardMode.DECODE), ([2, 3, 1], ForwardMode.DRAFT_EXTEND)]


def run_head(head, gen: torch.Generator, feature_width: int):
    """Feed random tokens and features in STEPS; return per request (ids, features, hidden, logits)."""
    harness = Harness(head, num_requests=3)
    seqs = [([], [], [], []) for _ in range(3)]
    for lens, mode in STEPS:
        chunks = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lens]
        batch = harness.batch(chunks, mode)
        features = torch.randn(sum(lens), feature_width, generator=gen)
        with torch.no_grad():
            hidden, logits = head(batch.input_ids, batch.positions, head.project_target_hidden(features), batch)
        for seq, c, f, h, lg in zip(seqs, chunks, features.split(lens), hidden.split(lens), logits.split(lens)):
            seq[0].extend(c)
            seq[1].append(f), seq[2].append(h), seq[3].append(lg)
    return [(torch.tensor(ids), torch.cat(f), torch.cat(h), torch.cat(lg)) for ids, f, h, lg in seqs]


def test_eagle_head_matches_the_naive_reference(target, tmp_path):
    model, target_w = target
    weights = make_eagle(tmp_path / "eagle", extra_tensors=True)
    head = load_eagle_head(tmp_path / "eagle", "EAGLE", TargetParts.of(model), TARGET_LAYERS, max_positions=256,
                           dtype=torch.float32, device="cpu")
    assert head.variant == "EAGLE" and head.fc.bias is not None and head.target_hidden_layers is None
    assert not any(name.startswith("target") for name in head.state_dict())  # the target's weights stay its own
    for ids, features, hidden, logits in run_head(head, torch.Generator().manual_seed(3), H):
        ref_hidden, ref_logits = reference_eagle(weights, target_w, ids, features)
        torch.testing.assert_close(hidden, ref_hidden, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("vllm_names", [False, True])
def test_eagle3_head_matches_the_naive_reference(target, tmp_path, vllm_names):
    model, target_w = target
    weights = make_eagle3(tmp_path / "eagle3", vllm_names=vllm_names)
    head = load_eagle_head(tmp_path / "eagle3", "EAGLE3", TargetParts.of(model), TARGET_LAYERS, max_positions=256,
                           dtype=torch.float32, device="cpu")
    assert head.variant == "EAGLE3" and not head.identity_vocab and head.target_hidden_layers == (1, 1, 2)
    for ids, aux, hidden, logits in run_head(head, torch.Generator().manual_seed(4), 3 * H):
        ref_hidden, ref_logits = reference_eagle3(weights, target_w, ids, aux)
        torch.testing.assert_close(hidden, ref_hidden, atol=1e-5, rtol=1e-5)
        drafted = torch.isfinite(ref_logits)
        assert torch.equal(torch.isfinite(logits), drafted) and drafted.sum(-1).eq(DRAFT_VOCAB).all()
        torch.testing.assert_close(logits[drafted], ref_logits[drafted], atol=1e-4, rtol=1e-5)


def test_eagle3_aux_layers_come_from_the_config_or_the_default(tmp_path):
    assert eagle3_target_layers({}, 32) == (2, 16, 29)
    # The config names layers whose output was captured: the head reads the next layers' inputs.
    assert eagle3_target_layers({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 15, 28]}}, 32) == (2, 16, 29)
    assert eagle3_target_layers({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 3, 5]}}, 6) == (1, 4, 6)
    with pytest.raises(ValueError, match="do not fit a 6-layer target"):
        eagle3_target_layers({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 3, 6]}}, 6)


def test_variant_is_detected_and_a_mismatch_is_refused(target, tmp_path):
    model, _ = target
    make_eagle(tmp_path / "eagle")
    make_eagle3(tmp_path / "eagle3")
    assert detect_eagle_variant(tmp_path / "eagle") == "EAGLE"
    assert detect_eagle_variant(tmp_path / "eagle3") == "EAGLE3"
    # Names alone tell EAGLE-3 apart even when the config says LlamaForCausalLM.
    cfg = json.loads((tmp_path / "eagle3" / "config.json").read_text())
    (tmp_path / "eagle3" / "config.json").write_text(json.dumps({**cfg, "architectures": ["LlamaForCausalLM"]}))
    assert detect_eagle_variant(tmp_path / "eagle3") == "EAGLE3"
    parts = TargetParts.of(model)
    with pytest.raises(ValueError, match="is a EAGLE3 head, asked to load it as EAGLE"):
        load_eagle_head(tmp_path / "eagle3", "EAGLE", parts, TARGET_LAYERS, 256, torch.float32, "cpu")
    with pytest.raises(ValueError, match="is a EAGLE head, asked to load it as EAGLE3"):
        load_eagle_head(tmp_path / "eagle", "EAGLE3", parts, TARGET_LAYERS, 256, torch.float32, "cpu")
    save_file({"model.embed_tokens.weight": torch.zeros(4, 4)}, tmp_path / "eagle" / "model.safetensors")
    with pytest.raises(ValueError, match="is not an EAGLE head"):
        detect_eagle_variant(tmp_path / "eagle")


def test_engine_config_refuses_the_wrong_variant_at_start_up(tmp_path):
    target_path = make_tiny_model("llama", tmp_path / "target")
    make_eagle(tmp_path / "eagle")
    make_eagle3(tmp_path / "eagle3")

    def resolve(algorithm: str, draft: Path):
        return resolve_config(EngineConfig.from_flat(model=str(target_path), device="cpu",
                                                     speculative_algorithm=algorithm,
                                                     speculative_draft_model_path=str(draft)))

    with pytest.raises(ValueError, match="is an EAGLE-3 head but speculative_algorithm is EAGLE; use "
                                         "--speculative-algorithm EAGLE3"):
        resolve("EAGLE", tmp_path / "eagle3")
    with pytest.raises(ValueError, match="is an EAGLE head but speculative_algorithm is EAGLE3"):
        resolve("EAGLE3", tmp_path / "eagle")
    assert resolve("EAGLE3", tmp_path / "eagle3").speculative.speculative_draft_model_path == str(tmp_path / "eagle3")
    cfg = json.loads((tmp_path / "eagle" / "config.json").read_text())
    (tmp_path / "eagle" / "config.json").write_text(json.dumps({**cfg, "hidden_size": 2 * H}))
    with pytest.raises(ValueError, match="has hidden_size 128, the target's hidden size is 64"):
        resolve("EAGLE", tmp_path / "eagle")


def test_broken_vocabulary_maps_and_missing_tensors_are_refused(target, tmp_path):
    model, _ = target
    parts = TargetParts.of(model)
    make_eagle3(tmp_path / "dup", d2t=torch.zeros(DRAFT_VOCAB, dtype=torch.int64).index_fill(0, torch.tensor([1]), -1))
    with pytest.raises(ValueError, match="d2t does not map the draft vocabulary to distinct target ids"):
        load_eagle_head(tmp_path / "dup", "EAGLE3", parts, TARGET_LAYERS, 256, torch.float32, "cpu")
    weights = make_eagle3(tmp_path / "t2d")
    weights["t2d"] = weights["t2d"].roll(1)
    _save(tmp_path / "t2d", json.loads((tmp_path / "t2d" / "config.json").read_text()), weights)
    with pytest.raises(ValueError, match="t2d does not mark exactly the target ids that d2t maps to"):
        load_eagle_head(tmp_path / "t2d", "EAGLE3", parts, TARGET_LAYERS, 256, torch.float32, "cpu")
    weights = make_eagle(tmp_path / "missing")
    del weights["layers.0.post_attention_layernorm.weight"]
    _save(tmp_path / "missing", json.loads((tmp_path / "missing" / "config.json").read_text()), weights)
    with pytest.raises(ValueError, match=r"missing \['layers.0.post_attention_layernorm.weight'\]"):
        load_eagle_head(tmp_path / "missing", "EAGLE", parts, TARGET_LAYERS, 256, torch.float32, "cpu")

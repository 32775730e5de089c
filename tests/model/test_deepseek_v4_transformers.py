"""DeepSeek-V4 against transformers' port (a second, independent oracle), where it agrees with
docs/design/deepseek-v4.md.

With `index_topk >= seq_len / 4` every visible block is attended, so indexer ties cannot make the two
differ (docs/design/deepseek-v4.md §8). The weights are the reference's, renamed here by hand to transformers' names; the
transformers model is then saved and read back through kestrel's loader, so this also tests the HF
naming path. Known differences are in docs/deepseek-v4.md.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
DeepseekV4Config = getattr(transformers, "DeepseekV4Config", None)
if DeepseekV4Config is None:
    pytest.skip(f"transformers {transformers.__version__} has no DeepSeek-V4 (needs >= 5.24)", allow_module_level=True)

from kestrel.models.loader import load_model  # noqa: E402
from tests.model import dsv4_reference as ref  # noqa: E402
from tests.model.dsv4_harness import V4Harness  # noqa: E402

CFG = ref.RefConfig(index_n_heads=16, index_topk=32)
SEQ = 120  # 30 ratio-4 blocks <= index_topk
LAYER_TYPE = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # the module-scoped setup too


def hf_config() -> "DeepseekV4Config":
    c = CFG
    return DeepseekV4Config(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, moe_intermediate_size=c.moe_intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads, num_key_value_heads=1,
        head_dim=c.head_dim, partial_rotary_factor=c.qk_rope_head_dim / c.head_dim, q_lora_rank=c.q_lora_rank,
        num_experts_per_tok=c.num_experts_per_tok, n_routed_experts=c.n_routed_experts, n_shared_experts=1,
        scoring_func="sqrtsoftplus", routed_scaling_factor=c.routed_scaling_factor, rope_theta=c.rope_theta,
        compress_rope_theta=c.compress_rope_theta,
        rope_parameters={"rope_type": "yarn", "factor": c.yarn_factor, "beta_fast": c.yarn_beta_fast,
                         "beta_slow": c.yarn_beta_slow, "original_max_position_embeddings": c.yarn_original_max},
        layer_types=[LAYER_TYPE[r] for r in c.compress_ratios[:-1]],
        mlp_layer_types=["hash_moe"] * c.num_hash_layers + ["moe"] * (c.num_hidden_layers - c.num_hash_layers),
        hc_mult=c.hc_mult, hc_sinkhorn_iters=c.hc_sinkhorn_iters, hc_eps=c.hc_eps, swiglu_limit=c.swiglu_limit,
        sliding_window=c.sliding_window, o_groups=c.o_groups, o_lora_rank=c.o_lora_rank,
        index_n_heads=c.index_n_heads, index_head_dim=c.index_head_dim, index_topk=c.index_topk,
        rms_norm_eps=c.rms_norm_eps, max_position_embeddings=4096, num_nextn_predict_layers=0,
        tie_word_embeddings=False,
    )


def to_hf(w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The reference's native names -> transformers' (written out here, independently of kestrel's loader)."""
    out = {"model.embed_tokens.weight": w["embed.weight"], "lm_head.weight": w["head.weight"],
           "model.norm.weight": w["norm.weight"]}
    for part in ("fn", "base", "scale"):
        out[f"model.hc_head.hc_{part}"] = w[f"hc_head_{part}"]
    compressor = {"wkv.weight": "kv_proj.weight", "wgate.weight": "gate_proj.weight", "ape": "position_bias",
                  "norm.weight": "kv_norm.weight"}
    attn = {"wq_a": "q_a_proj", "q_norm": "q_a_norm", "wq_b": "q_b_proj", "wkv": "kv_proj", "kv_norm": "kv_norm",
            "wo_a": "o_a_proj", "wo_b": "o_b_proj"}
    for i in range(CFG.num_hidden_layers):
        n, h = f"layers.{i}", f"model.layers.{i}"
        out[f"{h}.input_layernorm.weight"] = w[f"{n}.attn_norm.weight"]
        out[f"{h}.post_attention_layernorm.weight"] = w[f"{n}.ffn_norm.weight"]
        for part in ("fn", "base", "scale"):
            out[f"{h}.attn_hc.{part}"] = w[f"{n}.hc_attn_{part}"]
            out[f"{h}.ffn_hc.{part}"] = w[f"{n}.hc_ffn_{part}"]
        for ours, theirs in attn.items():
            out[f"{h}.self_attn.{theirs}.weight"] = w[f"{n}.attn.{ours}.weight"]
        out[f"{h}.self_attn.sinks"] = w[f"{n}.attn.attn_sink"]
        if CFG.compress_ratios[i]:
            for ours, theirs in compressor.items():
                out[f"{h}.self_attn.compressor.{theirs}"] = w[f"{n}.attn.compressor.{ours}"]
        if CFG.compress_ratios[i] == 4:
            idx = f"{h}.self_attn.compressor.indexer"
            out[f"{idx}.q_b_proj.weight"] = w[f"{n}.attn.indexer.wq_b.weight"]
            out[f"{idx}.scorer.weights_proj.weight"] = w[f"{n}.attn.indexer.weights_proj.weight"]
            for ours, theirs in compressor.items():
                out[f"{idx}.{theirs}"] = w[f"{n}.attn.indexer.compressor.{ours}"]
        out[f"{h}.mlp.gate.weight"] = w[f"{n}.ffn.gate.weight"]
        if i < CFG.num_hash_layers:
            out[f"{h}.mlp.gate.tid2eid"] = w[f"{n}.ffn.gate.tid2eid"]
        else:
            out[f"{h}.mlp.gate.e_score_correction_bias"] = w[f"{n}.ffn.gate.bias"]
        experts = range(CFG.n_routed_experts)
        out[f"{h}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([w[f"{n}.ffn.experts.{e}.w1.weight"], w[f"{n}.ffn.experts.{e}.w3.weight"]]) for e in experts])
        out[f"{h}.mlp.experts.down_proj"] = torch.stack([w[f"{n}.ffn.experts.{e}.w2.weight"] for e in experts])
        for ours, theirs in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
            out[f"{h}.mlp.shared_experts.{theirs}.weight"] = w[f"{n}.ffn.shared_experts.{ours}.weight"]
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    weights = ref.random_weights(CFG, seed=0)
    hf = transformers.DeepseekV4ForCausalLM(hf_config()).float().eval()
    hf.load_state_dict(to_hf(weights), strict=True)
    folder = Path(tmp_path_factory.mktemp("dsv4_hf"))
    hf.save_pretrained(folder)
    ids = torch.randint(0, CFG.vocab_size, (SEQ,), generator=torch.Generator().manual_seed(7)).tolist()
    with torch.no_grad():
        hf_logits = hf(torch.tensor([ids]), use_cache=False).logits[0]
    return weights, folder, ids, hf_logits


def test_transformers_agrees_with_the_reference(setup) -> None:
    weights, _, ids, hf_logits = setup
    torch.testing.assert_close(hf_logits, ref.forward(ids, weights, CFG).logits, atol=5e-4, rtol=0)


def test_kestrel_loads_the_transformers_folder_and_agrees(setup) -> None:
    _, folder, ids, hf_logits = setup
    model = load_model(folder, torch.float32, "cpu")
    assert len(model.mtp) == 0  # transformers keeps no MTP layer: loaded without it
    h = V4Harness(model, 1)
    got = torch.cat([h.logits([ids[:50]])[0]] + [h.logits([[t]])[0] for t in ids[50:]])  # prefill, then decode
    torch.testing.assert_close(got, hf_logits, atol=5e-4, rtol=0)


def test_transformers_in_memory_names_load_like_native(setup) -> None:
    """The names of transformers' modules (`self_attn.q_a_proj`, stacked `gate_up_proj`, ...) map onto
    the same parameters as DeepSeek's native names."""
    weights, folder, _, _ = setup
    from kestrel.models.deepseek_v4.config import parse_v4_config
    from kestrel.models.deepseek_v4.model import DeepseekV4ForCausalLM

    native = DeepseekV4ForCausalLM(parse_v4_config(CFG.native_config()))
    native.load_checkpoint(weights.items(), "native")
    hf = DeepseekV4ForCausalLM(parse_v4_config(CFG.native_config()))
    hf.load_checkpoint(to_hf(weights).items(), "transformers names")  # no mtp.*: loads without MTP
    expected = {k: v for k, v in native.state_dict().items() if not k.startswith("mtp.")}
    got = hf.state_dict()
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k]) for k in got)

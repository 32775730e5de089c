"""Tiny DeepSeek-V3 checkpoints (transformers' DeepseekV3ForCausalLM, random weights with non-trivial norms
and correction biases) and a dense, cache-less MLA reference for checking the model's math alone."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from kestrel.attention.mla.base import LatentAttentionBackend

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}


def make_dsv3(path: Path, q_lora_rank: int | None = 24, **overrides) -> Path:
    torch.manual_seed(0)
    sizes = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
                 num_experts_per_tok=3, n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
                 kv_lora_rank=16, q_lora_rank=q_lora_rank, qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=12,
                 max_position_embeddings=256, rope_parameters=YARN, tie_word_embeddings=False)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**{**sizes, **overrides})).float().eval()
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if "norm" in name or "e_score_correction_bias" in name:
                t.add_(torch.randn_like(t) * 0.1)
    model.save_pretrained(path)
    return path


def hf_logits(path: Path, tokens: list[int]) -> torch.Tensor:
    model = DeepseekV3ForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    ids = torch.tensor([tokens])
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0].float()


class DenseMLA(LatentAttentionBackend):
    """One causal sequence, no KV cache: keys and values expanded from the latent per head."""

    def __init__(self) -> None:
        self.name = "dense_reference"

    def forward_mla(self, q_nope, q_rope, latent, k_rope, layer, batch):
        w_uk, w_uv = layer.w_uk, layer.w_uv
        heads = q_nope.shape[1]
        k = torch.cat([torch.einsum("tr,hnr->htn", latent, w_uk), k_rope[None].expand(heads, -1, -1)], dim=-1)
        v = torch.einsum("tr,hvr->htv", latent, w_uv)
        q = torch.cat([q_nope, q_rope], dim=-1).transpose(0, 1)
        out = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, scale=layer.scaling)
        return out[0].transpose(0, 1).flatten(1)


def dense_logits(model, tokens: list[int]) -> torch.Tensor:
    batch = SimpleNamespace(attn_backend=DenseMLA())
    with torch.no_grad():
        return model.compute_logits(model(torch.tensor(tokens), torch.arange(len(tokens)), batch))

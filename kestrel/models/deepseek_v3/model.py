"""DeepSeek-V3 (V3, R1, V3.1; Kimi-K2 has the same architecture): MLA attention (attention.py), the first
`first_k_dense_replace` layers with a dense MLP and the rest with the shared MoE layer (sigmoid routing
with a correction bias, group-limited top-k, one shared expert). The checkpoint's MTP layers (layer
ids from `num_hidden_layers` on) are not the target's: it skips them (transformers' folders have none);
a NEXTN draft reads the first (mtp.py).

Parameter names are the checkpoint's (transformers' and DeepSeek's agree), except the shared expert's
`gate_proj|up_proj|down_proj` -> `w1|w3|w2` and the dense MLP's gate|up, merged into `gate_up_proj`.
FP8 checkpoints (128 x 128 block scales) load as the Llama family's do: their linears become FP8
layers, the experts are dequantised by the MoE layer's loader and `kv_b_proj` by the MLA layer's
(kestrel/layers/mla.py), which splits it into the absorbed W_UK / W_UV.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from kestrel.cache.kv_layout import KVLayout
from kestrel.core.forward_batch import ForwardBatch
from kestrel.distributed.parallel_state import ParallelState
from kestrel.layers.activation import SiluAndMul
from kestrel.layers.kernels import Kernels
from kestrel.layers.linear import MergedLinear, column_slices, row_parallel_linear
from kestrel.layers.moe import MoE
from kestrel.layers.norm import RMSNorm
from kestrel.layers.rotary import RotaryEmbedding
from kestrel.layers.vocab_parallel import VocabParallelEmbedding, lm_logits, untied_lm_head
from kestrel.models.base import CausalLM
from kestrel.models.deepseek_v3.attention import V3Attention
from kestrel.models.deepseek_v3.config import V3Config, parse_v3_config

RENAMES = ((r"\.mlp\.shared_experts\.gate_proj\.", ".mlp.shared_experts.w1."),
           (r"\.mlp\.shared_experts\.up_proj\.", ".mlp.shared_experts.w3."),
           (r"\.mlp\.shared_experts\.down_proj\.", ".mlp.shared_experts.w2."),
           (r"\.self_attn\.kv_b_proj\.", ".self_attn.attn.kv_b_proj."))
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class DenseMLP(nn.Module):
    def __init__(self, cfg: V3Config, kernels: Kernels, parallel: ParallelState) -> None:
        super().__init__()
        sizes = [cfg.intermediate_size] * 2
        self.gate_up_proj = MergedLinear(cfg.hidden_size, sizes, bias=False, slices=column_slices(sizes, parallel))
        self.down_proj = row_parallel_linear(cfg.intermediate_size, cfg.hidden_size, False, parallel)
        self.act_fn = SiluAndMul(use_triton=kernels.triton_elementwise)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class V3DecoderLayer(nn.Module):
    def __init__(self, cfg: V3Config, layer_id: int, moe: bool, rotary: RotaryEmbedding, kernels: Kernels,
                 parallel: ParallelState) -> None:
        super().__init__()
        self.self_attn = V3Attention(cfg, layer_id, rotary, parallel, fused=kernels.triton_elementwise)
        self.mlp = MoE(cfg.moe, parallel) if moe else DenseMLP(cfg, kernels, parallel)
        fused = kernels.triton_elementwise
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, use_triton=fused)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, use_triton=fused)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(sub-layer output, residual stream) -> the same for the next layer; each residual add is
        fused into the norm after it."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden, residual = self.post_attention_layernorm(self.self_attn(positions, hidden, batch), residual)
        return self.mlp(hidden), residual


class V3Model(nn.Module):

    def __init__(self, cfg: V3Config, kernels: Kernels, parallel: ParallelState) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size) if parallel.tp_size == 1 else \
            VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, parallel)
        self.rotary_emb = RotaryEmbedding(cfg.qk_rope_head_dim, cfg.max_position_embeddings, cfg.rope,
                                          use_triton=kernels.triton_rope)
        self.layers = nn.ModuleList(V3DecoderLayer(cfg, i, cfg.moe_layers[i], self.rotary_emb, kernels, parallel)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, use_triton=kernels.triton_elementwise)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, batch)
        return self.norm(hidden, residual)[0]


class DeepseekV3ForCausalLM(CausalLM):
    """forward: input_ids [T], positions [T] -> final-normed hidden [T, hidden]; compute_logits: hidden
    [N, hidden] -> float32 logits [N, vocab]. Loaded by name."""

    parse_config = staticmethod(parse_v3_config)
    stacked_params = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    has_routed_experts = True

    def __init__(self, cfg: V3Config, kernels: Kernels = Kernels(), parallel: ParallelState = ParallelState()) -> None:
        super().__init__(cfg, parallel)
        self.model = V3Model(cfg, kernels, parallel)
        self.lm_head = untied_lm_head(cfg.hidden_size, cfg.vocab_size, cfg.tie_word_embeddings, parallel)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self.model(input_ids, positions, batch)

    def input_embedding(self) -> nn.Module:
        return self.model.embed_tokens

    def kv_layout(self, dtype: torch.dtype, speculative_tokens: int = 1) -> KVLayout:
        """One latent + rope key per token of each main layer, the same on every tensor-parallel rank (a
        NEXTN draft's pools hold its MTP layer's, `V3MTPDraft.kv_layout`)."""
        cfg = self.config
        return KVLayout.latent_attention(cfg.num_hidden_layers, cfg.kv_lora_rank, cfg.qk_rope_head_dim, dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return lm_logits(hidden, self.model.embed_tokens, self.lm_head, self.config.vocab_size, self.parallel)

    def skips_checkpoint_tensor(self, name: str) -> bool:
        """The MTP layers' tensors (`model.layers.{num_hidden_layers + j}.*`): a NEXTN draft's, not the target's."""
        m = _LAYER.match(name)
        return m is not None and int(m.group(1)) >= self.config.num_hidden_layers

    def checkpoint_name(self, name: str) -> str:
        for pattern, repl in RENAMES:
            name = re.sub(pattern, repl, name)
        return name

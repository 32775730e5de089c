"""gpt-oss (20b, 120b): a decoder whose attention alternates sliding-window (128) and full layers, each
with q/k/v/o biases, a learned sink logit per head and YaRN rope; every layer's MLP is a MoE of
clamped-SwiGLU experts with biases, routed by a softmax over the top-k logits of a biased gate.

The attention is the backends' (sinks and windows are per-layer settings of `AttentionLayer`); the MoE
is the shared layer (kestrel/layers/moe/). Parameter names follow transformers' where the checkpoint's
tensors map one to one; `loading.py` fills the rest (q|k|v merged, sinks, the experts' layout, MXFP4).
"""
from __future__ import annotations


import torch
from torch import nn

from kestrel.cache.kv_layout import KVLayout
from kestrel.core.forward_batch import ForwardBatch
from kestrel.distributed.parallel_state import ParallelState
from kestrel.layers.attention import AttentionLayer
from kestrel.layers.kernels import Kernels
from kestrel.layers.linear import MergedLinear, attention_heads, qkv_slices, row_parallel_linear
from kestrel.layers.moe import MoE
from kestrel.layers.norm import RMSNorm
from kestrel.layers.rotary import RotaryEmbedding
from kestrel.layers.vocab_parallel import VocabParallelEmbedding, lm_logits, untied_lm_head
from kestrel.models.base import CausalLM
from kestrel.models.gpt_oss.config import GptOssConfig, parse_gpt_oss_config
from kestrel.models.gpt_oss.loading import GPT_OSS_EXPERTS, RENAMES, STACKED_PARAMS


class GptOssAttention(nn.Module):
    """This rank's heads (`attention_heads`); their sinks live on the `AttentionLayer`, which every
    backend reads."""

    def __init__(self, cfg: GptOssConfig, layer_id: int, rotary: RotaryEmbedding, parallel: ParallelState) -> None:
        super().__init__()
        all_heads, all_kv_heads, head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        heads, kv_heads, _ = attention_heads(all_heads, all_kv_heads, parallel)
        self.qkv_proj = MergedLinear(cfg.hidden_size, [all_heads * head_dim, all_kv_heads * head_dim,
                                                       all_kv_heads * head_dim],
                                     bias=cfg.attention_bias,
                                     slices=qkv_slices(all_heads, all_kv_heads, head_dim, parallel))
        self.q_size, self.kv_size = heads * head_dim, kv_heads * head_dim
        self.o_proj = row_parallel_linear(all_heads * head_dim, cfg.hidden_size, cfg.attention_bias, parallel)
        self.rotary_emb = rotary
        self.attn = AttentionLayer(layer_id, heads, kv_heads, head_dim, head_dim ** -0.5,
                                   sliding_window=cfg.sliding_windows[layer_id], sinks=True,
                                   first_head=parallel.tp_rank * heads)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        qk, v = self.qkv_proj(hidden).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, qk).split([self.q_size, self.kv_size], dim=-1)
        return self.o_proj(self.attn(q, k, v, batch))


class GptOssDecoderLayer(nn.Module):
    def __init__(self, cfg: GptOssConfig, layer_id: int, rotary: RotaryEmbedding, kernels: Kernels,
                 parallel: ParallelState) -> None:
        super().__init__()
        self.self_attn = GptOssAttention(cfg, layer_id, rotary, parallel)
        self.mlp = MoE(cfg.moe, parallel, GPT_OSS_EXPERTS)
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
        hidden = self.self_attn(positions, hidden, batch)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class GptOssModel(nn.Module):
    def __init__(self, cfg: GptOssConfig, kernels: Kernels, parallel: ParallelState) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size) if parallel.tp_size == 1 else \
            VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, parallel)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope,
                                          use_triton=kernels.triton_rope)
        self.layers = nn.ModuleList(GptOssDecoderLayer(cfg, i, self.rotary_emb, kernels, parallel)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, use_triton=kernels.triton_elementwise)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, batch)
        return self.norm(hidden, residual)[0]


class GptOssForCausalLM(CausalLM):
    """forward: input_ids [T], positions [T] -> final-normed hidden [T, hidden]; compute_logits: hidden
    [N, hidden] -> float32 logits [N, vocab]. Loaded by name in transformers' naming (`loading.py`), its
    experts float or MXFP4."""

    parse_config = staticmethod(parse_gpt_oss_config)
    stacked_params = STACKED_PARAMS
    checkpoint_quantizations = ("mxfp4",)
    has_routed_experts = True

    def __init__(self, cfg: GptOssConfig, kernels: Kernels = Kernels(), parallel: ParallelState = ParallelState()) -> None:
        super().__init__(cfg, parallel)
        self.model = GptOssModel(cfg, kernels, parallel)
        self.lm_head = untied_lm_head(cfg.hidden_size, cfg.vocab_size, cfg.tie_word_embeddings, parallel)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self.model(input_ids, positions, batch)

    def input_embedding(self) -> nn.Module:
        return self.model.embed_tokens

    def kv_layout(self, dtype: torch.dtype, speculative_tokens: int = 1) -> KVLayout:
        """Full layers' K/V per token, window layers' in a per-request ring of about two windows
        (docs/design/window-rings.md §1): about half the bytes per token of full K/V everywhere (the 20b: 12
        of its 24 layers are window layers), at the price of radix prefix reuse."""
        cfg = self.config
        _, kv_heads, _ = attention_heads(cfg.num_attention_heads, cfg.num_key_value_heads, self.parallel)
        return KVLayout.windowed_attention(cfg.sliding_windows, kv_heads, cfg.head_dim, dtype, speculative_tokens)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return lm_logits(hidden, self.model.embed_tokens, self.lm_head, self.config.vocab_size, self.parallel)

    def checkpoint_name(self, name: str) -> str:
        for old, new in RENAMES:
            name = name.replace(old, new)
        return name

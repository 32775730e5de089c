"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3): one class, differences driven by `ArchConfig`.
The MoE families (llama_moe.py) are this decoder with MoE layers in place of some or all MLPs.

Parameter names mirror transformers' (`model.layers.N.self_attn.q_proj.weight`, ...) so loading a
checkpoint is a copy by name. Activations are flat: T tokens of all requests concatenated.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kestrel.cache.kv_layout import KVLayout
from kestrel.core.forward_batch import ForwardBatch
from kestrel.distributed.parallel_state import ParallelState
from kestrel.layers.activation import SiluAndMul
from kestrel.layers.attention import AttentionLayer
from kestrel.layers.kernels import Kernels
from kestrel.layers.linear import MergedLinear, attention_heads, column_slices, qkv_slices, row_parallel_linear
from kestrel.layers.vocab_parallel import VocabParallelEmbedding, lm_logits, untied_lm_head
from kestrel.layers.norm import RMSNorm
from kestrel.layers.rotary import RotaryEmbedding
from kestrel.models.arch_config import ArchConfig, parse_arch_config
from kestrel.models.base import CausalLM, SegmentShapes


class LlamaAttention(nn.Module):
    """`input_size` defaults to the hidden size (EAGLE-3's draft layer reads a 2 x hidden input).
    Under tensor parallelism the layer holds this rank's heads (`attention_heads`)."""

    def __init__(self, cfg: ArchConfig, layer_id: int, rotary: RotaryEmbedding, input_size: int | None = None,
                 parallel: ParallelState = ParallelState(), kernels: Kernels = Kernels()) -> None:
        super().__init__()
        all_heads, all_kv_heads, head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        heads, kv_heads, _ = attention_heads(all_heads, all_kv_heads, parallel)
        self.qkv_proj = MergedLinear(input_size or cfg.hidden_size,
                                     [all_heads * head_dim, all_kv_heads * head_dim, all_kv_heads * head_dim],
                                     bias=cfg.qkv_bias, slices=qkv_slices(all_heads, all_kv_heads, head_dim, parallel))
        self.q_size, self.kv_size = heads * head_dim, kv_heads * head_dim
        self.o_proj = row_parallel_linear(all_heads * head_dim, cfg.hidden_size, cfg.o_proj_bias, parallel)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.fused_qk_norm = None
        if cfg.qk_norm and kernels.triton_elementwise:  # imported only here: triton is optional
            from kestrel.layers.fused_triton import head_rmsnorm

            self.fused_qk_norm = head_rmsnorm
        # With rope in Triton too, the head norm's launch rotates q and k as well.
        self.rope_in_qk_norm = self.fused_qk_norm is not None and rotary.triton_kernel is not None
        self.head_dim = head_dim
        self.rotary_emb = rotary  # one module shared by all layers; its cache is not in the state dict
        self.attn = AttentionLayer(layer_id, heads, kv_heads, head_dim, head_dim ** -0.5,
                                   sliding_window=cfg.sliding_windows[layer_id])

    def qkv(self, positions: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The attention call's inputs: q and k normed (Qwen3) and rotated, v."""
        qk, v = self.qkv_proj(hidden).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        if self.fused_qk_norm is not None:
            rope = (positions, self.rotary_emb.cos_sin_cache) if self.rope_in_qk_norm else ()
            qk = self.fused_qk_norm(qk, self.q_norm.weight, self.k_norm.weight, self.q_size // self.head_dim,
                                    self.q_norm.eps, *rope)
            if self.rope_in_qk_norm:  # rotated in the same launch
                return *qk.split([self.q_size, self.kv_size], dim=-1), v
        elif self.qk_norm:
            q, k = qk.split([self.q_size, self.kv_size], dim=-1)
            q = self.q_norm(q.reshape(q.shape[0], -1, self.head_dim)).flatten(1)
            k = self.k_norm(k.reshape(k.shape[0], -1, self.head_dim)).flatten(1)
            qk = torch.cat([q, k], dim=-1)
        # Query and key heads sit side by side in `qk`: one rope call rotates both.
        q, k = self.rotary_emb(positions, qk).split([self.q_size, self.kv_size], dim=-1)
        return q, k, v

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self.o_proj(self.attn(*self.qkv(positions, hidden), batch))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ArchConfig, kernels: Kernels, parallel: ParallelState = ParallelState()) -> None:
        super().__init__()
        sizes = [cfg.intermediate_size] * 2
        self.gate_up_proj = MergedLinear(cfg.hidden_size, sizes, bias=cfg.mlp_bias,
                                         slices=column_slices(sizes, parallel))
        self.down_proj = row_parallel_linear(cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias, parallel)
        self.act_fn = SiluAndMul(use_triton=kernels.triton_elementwise)
        self.gated_down = None
        if kernels.triton_elementwise:  # imported only here: triton is optional
            from kestrel.layers.one_row_gemv import gated_down

            self.gated_down = gated_down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gate_up_proj(x)
        if self.gated_down is not None:  # at one row, the activation inside the down GEMV where it can be
            y = self.gated_down(self.down_proj, h)
            if y is not None:
                return y
        return self.down_proj(self.act_fn(h))


class LlamaDecoderLayer(nn.Module):
    """`mlp`: the feed-forward sublayer, hidden [T, H] -> [T, H] summed over the ranks (a LlamaMLP, or a
    MoE layer)."""

    def __init__(self, cfg: ArchConfig, layer_id: int, rotary: RotaryEmbedding, kernels: Kernels,
                 parallel: ParallelState, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_id, rotary, parallel=parallel, kernels=kernels)
        self.mlp = mlp
        fused = kernels.triton_elementwise
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, use_triton=fused)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, use_triton=fused)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(sub-layer output, residual stream) -> the same for the next layer; the residual add is
        fused into the next norm."""
        q, k, v, residual = self.pre_attention(positions, hidden, residual)
        return self.post_attention(self.attention(q, k, v, batch), residual)

    # The layer split at its attention call (`DecoderLayerHalves`), for forwards that run the halves apart
    # (kestrel.runner.piecewise_graph). Neither half reads the batch: only the attention call does.
    def pre_attention(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Input norm (adding the previous sub-layer's output to the residual) and the attention's
        q, k, v -> (q, k, v, residual)."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        return *self.self_attn.qkv(positions, hidden), residual

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """The batch's attention backend: stores k/v in the KV pool, returns [T, heads * head_dim]."""
        return self.self_attn.attn(q, k, v, batch)

    def post_attention(self, attn_out: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """o_proj, the residual add fused into the post-attention norm, the MLP -> (MLP output, residual)."""
        hidden, residual = self.post_attention_layernorm(self.self_attn.o_proj(attn_out), residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    """The decoder; also its `SegmentedDecoder` (embed, the layers' halves, final norm). `layer_mlp(i)`
    builds layer i's feed-forward sublayer."""

    def __init__(self, cfg: ArchConfig, kernels: Kernels, parallel: ParallelState,
                 layer_mlp: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size) if parallel.tp_size == 1 else \
            VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, parallel)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope,
                                          use_triton=kernels.triton_rope)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, self.rotary_emb, kernels, parallel, layer_mlp(i))
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, use_triton=kernels.triton_elementwise)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        hidden, residual = self.embed(input_ids), None
        captured = {}
        for i, layer in enumerate(self.layers):
            if i in batch.capture_hidden:  # the residual stream entering layer i (EAGLE-3's features)
                captured[i] = hidden if residual is None else hidden + residual
            hidden, residual = layer(positions, hidden, residual, batch)
        if len(self.layers) in batch.capture_hidden:  # "entering" the end: the last layer's output
            captured[len(self.layers)] = hidden + residual
        if captured:
            batch.captured_hidden = torch.cat([captured[i] for i in batch.capture_hidden], dim=-1)
        return self.final_norm(hidden, residual)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def final_norm(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The last layer's (MLP output, residual) -> the final-normed hidden state."""
        return self.norm(hidden, residual)[0]

    def segment_shapes(self) -> SegmentShapes:
        attn, weight = self.layers[0].self_attn, self.embed_tokens.weight
        return SegmentShapes(hidden_size=weight.shape[1], q_size=attn.q_size, kv_size=attn.kv_size, dtype=weight.dtype)


class LlamaForCausalLM(CausalLM):
    """forward: input_ids [T], positions [T] -> final-normed hidden [T, hidden];
    compute_logits: hidden [N, hidden] -> float32 logits [N, vocab]. Loaded by parameter name; prefills
    run as piecewise CUDA graphs; EAGLE and EAGLE-3 heads draft for it."""

    parse_config = staticmethod(parse_arch_config)
    stacked_params = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                      "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    accepts_eagle_heads = True

    def __init__(self, cfg: ArchConfig, kernels: Kernels = Kernels(), parallel: ParallelState = ParallelState()) -> None:
        super().__init__(cfg, parallel)
        self.model = LlamaModel(cfg, kernels, parallel, lambda i: self.layer_mlp(i, kernels))
        self.lm_head = untied_lm_head(cfg.hidden_size, cfg.vocab_size, cfg.tie_word_embeddings, parallel)

    def layer_mlp(self, layer_id: int, kernels: Kernels) -> nn.Module:
        """Layer `layer_id`'s feed-forward sublayer (a MoE family's override places its MoE layers)."""
        return LlamaMLP(self.config, kernels, self.parallel)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self.model(input_ids, positions, batch)

    def segmented_decoder(self) -> LlamaModel:
        return self.model

    def input_embedding(self) -> nn.Module:
        return self.model.embed_tokens

    def kv_layout(self, dtype: torch.dtype, speculative_tokens: int = 1) -> KVLayout:
        """This rank's KV heads (all of them at tp_size 1). `speculative_tokens` needs nothing here: a
        verify's rejected tokens are rolled back by slot."""
        cfg = self.config
        _, kv_heads, _ = attention_heads(cfg.num_attention_heads, cfg.num_key_value_heads, self.parallel)
        return KVLayout.full_attention(cfg.num_hidden_layers, kv_heads, cfg.head_dim, dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return lm_logits(hidden, self.model.embed_tokens, self.lm_head, self.config.vocab_size, self.parallel)

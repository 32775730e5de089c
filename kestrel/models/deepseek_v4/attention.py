"""One V4 attention sublayer (docs/design/deepseek-v4.md §2): low-rank q with a per-head norm, one K=V head, partial
interleaved rope, sliding window + compressed entries (ratio 4: indexer top-k; ratio 128: all visible
blocks), attention sink, inverse rope on the output and the grouped low-rank output projection."""
from __future__ import annotations

import torch
from torch import nn

from kestrel.attention.dsv4 import dsv4_backend
from kestrel.core.forward_batch import ForwardBatch
from kestrel.layers.norm import RMSNorm
from kestrel.models.deepseek_v4.compressor import Compressor
from kestrel.models.deepseek_v4.config import V4Config
from kestrel.models.deepseek_v4.indexer import Indexer
from kestrel.models.deepseek_v4.rope import V4Rope


class V4Attention(nn.Module):
    def __init__(self, cfg: V4Config, layer_id: int, ratio: int, fused: bool = False) -> None:
        super().__init__()
        self.layer_id, self.ratio = layer_id, ratio
        self.heads, self.head_dim, self.groups = cfg.num_attention_heads, cfg.head_dim, cfg.o_groups
        self.window, self.eps = cfg.sliding_window, cfg.rms_norm_eps
        self.scale = self.head_dim ** -0.5  # no YaRN mscale (docs/design/deepseek-v4.md §2.1)
        self.wq_a = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, use_triton=fused)
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.heads * self.head_dim, bias=False)
        self.wkv = nn.Linear(cfg.hidden_size, self.head_dim, bias=False)
        self.kv_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, use_triton=fused)
        # wo_a is G blocks [o_lora, H*D/G] stacked on the output dim, DeepSeek's layout.
        self.wo_a = nn.Linear(self.heads * self.head_dim // self.groups, self.groups * cfg.o_lora_rank, bias=False)
        self.wo_b = nn.Linear(self.groups * cfg.o_lora_rank, cfg.hidden_size, bias=False)
        self.attn_sink = nn.Parameter(torch.zeros(self.heads, dtype=torch.float32))
        # One frequency table per layer serves q, kv, the compressed keys, the indexer and the inverse.
        self.rope = V4Rope.for_ratio(cfg, ratio)
        self.rope.triton = self.fused = fused  # the compressor and the indexer share it
        if ratio:
            self.compressor = Compressor(cfg.hidden_size, self.head_dim, ratio, self.rope, cfg.rms_norm_eps,
                                         state=("comp_kv", "comp_score"), entries="ckv", fused=fused)
        if ratio == 4:
            self.indexer = Indexer(cfg, self.rope, fused)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        backend = dsv4_backend(batch)
        c_q = self.q_norm(self.wq_a(x))
        q = self.wq_b(c_q).unflatten(-1, (self.heads, self.head_dim))
        if self.fused:  # each norm and its rope in one launch
            from kestrel.models.deepseek_v4.triton_ops import norm_rope  # triton is optional

            r = self.rope
            q = norm_rope(q, None, self.eps, positions, r.omega, r.rope_dim)
            kv = norm_rope(self.wkv(x), self.kv_norm.weight, self.kv_norm.eps, positions, r.omega, r.rope_dim)
        else:
            q = q * torch.rsqrt(q.float().pow(2).mean(-1, keepdim=True) + self.eps).to(q.dtype)
            q = self.rope(q, positions)
            kv = self.rope(self.kv_norm(self.wkv(x)), positions)
        window = backend.window_keys(self.layer_id, kv, self.window)
        selected = None
        if self.ratio:
            self.compressor(x, positions, backend, self.layer_id)  # before attention: a block is visible
            if self.ratio == 4:  # from its last token on
                selected = self.indexer(x, c_q, positions, backend, self.layer_id)
        out = backend.attend(self.layer_id, q, window, self.attn_sink, self.scale, self.ratio, selected)
        out = self.rope(out, positions, inverse=True)  # K=V: undo the rope the values carried
        groups = out.flatten(1).unflatten(-1, (self.groups, -1))  # [T, G, H*D/G]
        wo_a = self.wo_a.weight.unflatten(0, (self.groups, -1))  # [G, o_lora, H*D/G]
        return self.wo_b(torch.einsum("tgk,gok->tgo", groups, wo_a).flatten(1))

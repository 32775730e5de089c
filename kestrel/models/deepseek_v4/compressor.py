"""The KV compressor: every `ratio` tokens become one gated-pooled, normalised, roped entry
(docs/design/deepseek-v4.md §2.5).

Ratio 4 overlaps ("κ = 2"): block i pools over 8 candidates, the previous block's tokens through the
first half of the projections and its own tokens through the second half. Ratio 128 pools over its own
128 tokens. The softmax runs per channel over the candidates. Raw rows of a block still open live in
the backend's state ring between steps; a block is emitted in the step that processes its last token.
"""
from __future__ import annotations

import torch
from torch import nn

from kestrel.attention.dsv4 import DSV4Backend
from kestrel.attention.dsv4_plan import NewBlocks
from kestrel.layers.norm import RMSNorm
from kestrel.models.deepseek_v4.rope import V4Rope

# With the model's fused kernels, a decode step's compressor runs `triton_ops.compress_decode` after its
# projections, and the indexer scores blocks with `triton_ops.index_scores`; False keeps the torch paths
# (a benchmark sets it to compare in one process).
DECODE_KERNEL = True


class Compressor(nn.Module):
    """`wkv` (A), `wgate` (Z) and `ape` in float32, as DeepSeek keeps them; entries of width `dim`.

    `state` names the backend's two state rings (kv rows, score rows) and `entries` its BLOCK buffer;
    `fused`: the entries' norm as the fused Triton RMSNorm (the model's fused kernels, CUDA).
    """

    def __init__(self, hidden_size: int, dim: int, ratio: int, rope: V4Rope, eps: float,
                 state: tuple[str, str], entries: str, fused: bool = False) -> None:
        super().__init__()
        self.ratio, self.dim, self.overlap = ratio, dim, ratio == 4
        width = (2 if self.overlap else 1) * dim
        self.wkv = nn.Linear(hidden_size, width, bias=False, dtype=torch.float32)
        self.wgate = nn.Linear(hidden_size, width, bias=False, dtype=torch.float32)
        self.ape = nn.Parameter(torch.zeros(ratio, width, dtype=torch.float32))
        self.norm = RMSNorm(dim, eps, use_triton=fused)
        self.rope = rope
        self.state, self.entries = state, entries
        self.fused = fused

    def forward(self, x: torch.Tensor, positions: torch.Tensor, backend: DSV4Backend, layer_id: int) -> None:
        """Project this step's tokens x [T, d]; write the blocks they complete to the backend."""
        xf = x.float()
        kv = xf @ self.wkv.weight.T
        decode = backend.decode_rows() if self.fused and DECODE_KERNEL else None
        if decode is not None:  # one new token per request: the rest in one launch (triton_ops.compress_decode)
            from kestrel.models.deepseek_v4.triton_ops import compress_decode  # triton is optional

            rows, pos, table = decode
            entries, slots = compress_decode(
                kv, xf @ self.wgate.weight.T, self.ape, backend.state_rings(layer_id, self.state), rows, pos, table,
                self.norm.weight, self.norm.eps, self.rope.omega, self.rope.rope_dim, self.ratio, self.overlap, x.dtype)
            backend.write_entries(layer_id, self.entries, slots, entries)
            return
        score = xf @ self.wgate.weight.T + self.ape[positions % self.ratio]
        rows = backend.compressor_rows(layer_id, self.state, kv, score, self.ratio, self.overlap)
        if rows is None:
            return
        blocks, kv_rows, score_rows = rows
        entries = self.norm(self._pool(kv_rows, score_rows, blocks).to(x.dtype))
        backend.write_blocks(layer_id, self.entries, blocks, self.rope(entries, blocks.positions))

    def _pool(self, kv: torch.Tensor, score: torch.Tensor, blocks: NewBlocks) -> torch.Tensor:
        """The completed blocks' pooled entries [N, dim] from the row sources kv, score [S, width]."""
        c = self.dim
        own_kv, own_score = kv[blocks.own], score[blocks.own]  # [N, m, width]
        if self.overlap:
            # Each block also pools the previous block's "a" half; block 0 of a sequence has no
            # predecessor (zero value, -inf score: weight 0).
            gone = ~blocks.has_prev[:, None, None]
            prev_kv = kv[blocks.prev][:, :, :c].masked_fill(gone, 0.0)
            prev_score = score[blocks.prev][:, :, :c].masked_fill(gone, float("-inf"))
            own_kv = torch.cat([prev_kv, own_kv[:, :, c:]], dim=1)
            own_score = torch.cat([prev_score, own_score[:, :, c:]], dim=1)
        return (torch.softmax(own_score, dim=1) * own_kv).sum(1)

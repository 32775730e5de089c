"""The KV compressor (spec §2.5): every `ratio` tokens become one gated-pooled, normalised, roped entry.

Ratio 4 overlaps ("κ = 2"): block i pools over 8 candidates, the previous block's tokens through the
first half of the projections and its own tokens through the second half. Ratio 128 pools over its own
128 tokens. The softmax runs per channel over the candidates. Raw rows of a block still open live in
the backend's state ring between steps; a block is emitted in the step that processes its last token.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kestrel.attention.dsv4 import DSV4Backend
from kestrel.layers.norm import RMSNorm
from kestrel.models.deepseek_v4.rope import V4Rope


class Compressor(nn.Module):
    """`wkv` (A), `wgate` (Z) and `ape` in float32, as DeepSeek keeps them; entries of width `dim`.

    `state` names the backend's two state rings (kv rows, score rows) and `entries` its BLOCK buffer.
    """

    def __init__(self, hidden_size: int, dim: int, ratio: int, rope: V4Rope, eps: float,
                 state: tuple[str, str], entries: str) -> None:
        super().__init__()
        self.ratio, self.dim, self.overlap = ratio, dim, ratio == 4
        width = (2 if self.overlap else 1) * dim
        self.wkv = nn.Linear(hidden_size, width, bias=False, dtype=torch.float32)
        self.wgate = nn.Linear(hidden_size, width, bias=False, dtype=torch.float32)
        self.ape = nn.Parameter(torch.zeros(ratio, width, dtype=torch.float32))
        self.norm = RMSNorm(dim, eps)
        self.rope = rope
        self.state, self.entries = state, entries

    def forward(self, x: torch.Tensor, positions: torch.Tensor, backend: DSV4Backend, layer_id: int) -> None:
        """Project this step's tokens x [T, d]; write the blocks they complete to the backend."""
        xf = x.float()
        kv = xf @ self.wkv.weight.T
        score = xf @ self.wgate.weight.T + self.ape[positions % self.ratio]
        rows = backend.compressor_rows(layer_id, self.state, kv, score, self.ratio, self.overlap)
        out = []
        for span, (kv_rows, score_rows, first) in zip(backend.spans, rows):
            new_first, new_last = span.prefix // self.ratio, span.seq // self.ratio
            pooled = self._pool(kv_rows, score_rows, first // self.ratio, new_first, new_last)
            entries = self.norm(pooled.to(x.dtype))
            block_pos = torch.arange(new_first, new_last, device=x.device) * self.ratio
            out.append((new_first, self.rope(entries, block_pos)))
        backend.write_blocks(layer_id, self.entries, self.ratio, out)

    def _pool(self, kv: torch.Tensor, score: torch.Tensor, row_block: int, first: int, last: int) -> torch.Tensor:
        """Blocks [first, last) from raw rows starting at block `row_block` -> [last - first, dim]."""
        if last <= first:
            return kv.new_zeros(0, self.dim)
        m, c = self.ratio, self.dim
        n_rows = (last - row_block) * m
        kv = kv[:n_rows].unflatten(0, (-1, m))  # [blocks, m, width]
        score = score[:n_rows].unflatten(0, (-1, m))
        if self.overlap:
            # Each block also pools the previous block's "a" half. The rows start one block before
            # `first` to supply it, and that earlier block is dropped below; block 0 of a sequence has
            # no predecessor (zero value, -inf score: weight 0).
            prev_kv = F.pad(kv[:-1, :, :c], (0, 0, 0, 0, 1, 0))
            prev_score = F.pad(score[:-1, :, :c], (0, 0, 0, 0, 1, 0), value=float("-inf"))
            kv = torch.cat([prev_kv, kv[:, :, c:]], dim=1)
            score = torch.cat([prev_score, score[:, :, c:]], dim=1)
        pooled = (torch.softmax(score, dim=1) * kv).sum(1)
        return pooled[first - row_block:]

"""Sliding-window rings (`KVLayout.windowed_attention`) as the per-head-KV backends address them.

A window layer's K/V buffers are [rows, ring, kv_heads, head_dim]; flattened to [rows * ring, ...] a
request's key at index p (its position; a verify chain's token: prefix + its index) has slot
`row * ring + p % ring`, so the kernels that read slots through a table read a ring with that formula
in place of the table. A step writes its new keys before its queries read, which a ring of
`window + s - 1` entries allows for `s` new tokens per request (`sub_step_tokens`); a longer extend (a
prefill chunk) runs as sub-steps of at most s tokens each, in order (`sub_steps`). Verify trees are
refused over rings (runner/build.py): accepting a branch would move entries a ring cannot move.
"""
from __future__ import annotations

import torch


def flat(buf: torch.Tensor) -> torch.Tensor:
    """A ring buffer [rows, ring, ...] as slots [rows * ring, ...]."""
    return buf.view(-1, *buf.shape[2:])


def ring_slots(rows: torch.Tensor, index: torch.Tensor, ring: int) -> torch.Tensor:
    """Slots (in `flat`'s view) of keys `index` of requests `rows` (broadcast together)."""
    return rows * ring + index % ring


def sub_step_tokens(ring: int, window: int) -> int:
    """The most new tokens per request a step may write before reading: their keys overwrite only
    positions that none of its queries sees."""
    return ring - window + 1


def sub_steps(prefix_lens: list[int], extend_lens: list[int], size: int) -> list[tuple[list[int], list[int], int]]:
    """An extend cut into sub-steps of at most `size` new tokens per request: (prefix lens, extend lens,
    offset) each, where request i's sub-step is its new tokens [offset, offset + extend) after `prefix`
    positions (its extend may be 0)."""
    longest = max(extend_lens, default=0)
    return [([p + offset for p in prefix_lens], [min(size, max(0, e - offset)) for e in extend_lens], offset)
            for offset in range(0, longest, size)]

"""The segmented LoRA matmul: y += (x A[slot]^T) B[slot]^T per token, each token with its own adapter slot
(-1: none), over the pool's fixed-size weight stacks.

For a projection of n merged parts (q|k|v: 3) with pool rank R, `a` is [S, n * R, in] (the parts' A
stacked) and `b` is [S, out, R] (the parts' B concatenated on the output rows); part i's output rows read
only its own R shrink columns. Shapes never depend on which adapters a batch holds, so the same call
serves every batch under a CUDA graph.
"""
from __future__ import annotations

import torch


def lora_delta_reference(x: torch.Tensor, slots: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                         part_sizes: tuple[int, ...]) -> torch.Tensor:
    """The delta in torch (CPU, or a GPU without Triton): every slot's shrink for every token, masked to
    the token's own slot, then one matmul per part over the S * R masked columns. S times the LoRA work
    of a gather, but static shapes and no host sync. x [T, in] -> [T, out] in x's dtype."""
    s, nr, _ = a.shape
    n, r = len(part_sizes), nr // len(part_sizes)
    t = x.shape[0]
    shrink = (x @ a.reshape(s * nr, -1).t()).view(t, s, n, r)
    own = (slots[:, None] == torch.arange(s, device=x.device)[None, :]).to(x.dtype)  # [T, S]; -1 matches none
    shrink = shrink * own[:, :, None, None]
    outs, start = [], 0
    for i, size in enumerate(part_sizes):
        part_b = b[:, start:start + size, :].permute(0, 2, 1).reshape(s * r, size)  # [S * R, size]
        outs.append(shrink[:, :, i, :].reshape(t, s * r) @ part_b)
        start += size
    return torch.cat(outs, dim=-1)


def add_lora(y: torch.Tensor, x: torch.Tensor, slots: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             part_sizes: tuple[int, ...], use_triton: bool) -> torch.Tensor:
    """y + the LoRA delta of x (y is the base projection's output, [T, out])."""
    if use_triton:
        from kestrel.lora.triton_ops import lora_shrink_expand

        return lora_shrink_expand(y, x, slots, a, b, part_sizes)
    return y + lora_delta_reference(x, slots, a, b, part_sizes)

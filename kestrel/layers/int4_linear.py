"""A linear layer with 4-bit weights from an AWQ or GPTQ checkpoint (kestrel.quant.int4), served by the
W4A16 Triton GEMM on CUDA and by the dequantised weight in torch elsewhere.

The layer is built with the checkpoint's tensors under the checkpoint's names and shapes (`qweight`,
`qzeros`, `scales`, GPTQ's `g_idx`, `bias`), so the loader copies them by name; a merged projection
(q|k|v, gate|up) takes each part's output columns, and one `g_idx` row per part. `finish_loading` then
turns them into kestrel's layout (`Int4Weight`) once; from then on the parameters are `qweight`
[K/8, N], `zeros`, `scales`, `perm` (act-order only) and `bias`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kestrel.quant.int4 import PACK, Int4Config, Int4Weight, dequantize, from_checkpoint


def int4_linear_reference(x: torch.Tensor, weight: Int4Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """The GEMM's numerics in torch: the weight dequantised in float32, cast to x's dtype, multiplied."""
    return F.linear(x, dequantize(weight).to(x.dtype), bias)


def _param(shape: tuple[int, ...], dtype: torch.dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.zeros(shape, dtype=dtype, device=device), requires_grad=False)


class Int4Linear(nn.Module):
    """y = x W^T + b with W [out, in] in 4 bits. `shard_sizes` as in MergedLinear (multiples of 8)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, cfg: Int4Config,
                 shard_sizes: list[int] | None = None, use_triton: bool = False, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        g = cfg.group_size
        if in_features % g or out_features % PACK or any(s % PACK for s in shard_sizes or []):
            raise ValueError(f"a {cfg.method} layer of {in_features} inputs and {shard_sizes or out_features} outputs "
                             f"does not fit group_size {g} and 8 outputs per int32 word")
        self.in_features, self.out_features, self.cfg = in_features, out_features, cfg
        k, n = in_features, out_features
        self.qweight = _param((k, n // PACK) if cfg.method == "awq" else (k // PACK, n), torch.int32, device)
        self.qzeros = _param((k // g, n // PACK), torch.int32, device)
        self.scales = _param((k // g, n), torch.float16, device)
        if cfg.method == "gptq":
            self.g_idx = _param((len(shard_sizes), k) if shard_sizes else (k,), torch.int32, device)
        self.bias = _param((n,), dtype or torch.get_default_dtype(), device) if bias else None
        if shard_sizes is not None:
            self.shard_sizes = shard_sizes
            self.shard_offsets = [sum(shard_sizes[:i]) for i in range(len(shard_sizes))]
        self.gemm = None
        if use_triton:  # imported only here: triton is optional
            from kestrel.layers.int4_gemm_triton import int4_gemm

            self.gemm = int4_gemm

    def shard(self, param: torch.Tensor, shard_id: int) -> torch.Tensor:
        """Projection `shard_id`'s part of a checkpoint-layout parameter: its output columns (a word per 8
        where they are packed), its g_idx row, or its bias rows."""
        start, size = self.shard_offsets[shard_id], self.shard_sizes[shard_id]
        if param.dim() == 1:  # bias
            return param[start:start + size]
        if getattr(self, "g_idx", None) is not None and param.data_ptr() == self.g_idx.data_ptr():
            return param[shard_id]
        packed = param.shape[1] != self.out_features
        return param[:, start // PACK:(start + size) // PACK] if packed else param[:, start:start + size]

    def finish_loading(self, name: str = "") -> None:
        """The loaded checkpoint tensors -> kestrel's layout (kestrel.quant.int4), in place."""
        g_idx = getattr(self, "g_idx", None)
        if g_idx is not None and g_idx.dim() == 2:
            if not all(torch.equal(g_idx[0], row) for row in g_idx[1:]):
                raise ValueError(f"{name}: the projections merged into this layer have different act-order g_idx; "
                                 "kestrel runs them as one GEMM, which needs one input order")
            g_idx = g_idx[0]
        w = from_checkpoint(self.cfg, self.qweight.data, self.qzeros.data, self.scales.data, g_idx, name)
        for old in ("qweight", "qzeros", "scales", "g_idx"):
            if hasattr(self, old):
                delattr(self, old)
        self.qweight = nn.Parameter(w.qweight.contiguous(), requires_grad=False)
        self.zeros = nn.Parameter(w.zeros.contiguous(), requires_grad=False)
        self.scales = nn.Parameter(w.scales.contiguous(), requires_grad=False)
        self.perm = nn.Parameter(w.perm, requires_grad=False) if w.perm is not None else None

    @property
    def int4_weight(self) -> Int4Weight:
        """The loaded weight in kestrel's layout (after `finish_loading`)."""
        return Int4Weight(self.qweight, self.zeros, self.scales, self.perm, self.cfg.group_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        w = self.int4_weight
        if self.gemm is not None:
            y = self.gemm(rows, w.qweight, w.zeros, w.scales, w.perm, w.group_size, self.bias)
        else:
            y = int4_linear_reference(rows, w, self.bias)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"method={self.cfg.method}, group_size={self.cfg.group_size}")

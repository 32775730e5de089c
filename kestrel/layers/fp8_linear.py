"""A linear layer with FP8 weights: e4m3 with 128 x 128 block scales, activations quantized per token.

Parameters are named as FP8 checkpoints name them (`weight`, `weight_scale_inv`, `bias`), so the loader
copies a checkpoint by name; a merged projection (q|k|v, gate|up) takes its parts' rows, and their
block-scale rows when every part starts on a 128-row boundary.
"""
from __future__ import annotations

import torch
from torch import nn

from kestrel.quant.fp8 import (BLOCK, dequantize_blocks, dequantize_token_groups, quantize_blocks,
                               quantize_token_groups)


def fp8_linear_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                         bias: torch.Tensor | None) -> torch.Tensor:
    """The FP8 GEMM's numerics in float32 torch (CPU, or a GPU without Triton): quantize x as the kernel
    does, dequantize both operands, multiply. x [M, K] -> [M, N] in x's dtype."""
    q, scales = quantize_token_groups(x)
    y = dequantize_token_groups(q, scales) @ dequantize_blocks(weight, weight_scale_inv).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


class Fp8Linear(nn.Module):
    """y = x W^T + b with W float8_e4m3fn [out, in] and `weight_scale_inv` [ceil(out/128), ceil(in/128)]
    float32 (what each block is multiplied by). `shard_sizes` as in MergedLinear. `use_triton`: the
    Triton GEMM (CUDA); otherwise `fp8_linear_reference`."""

    def __init__(self, in_features: int, out_features: int, bias: bool, shard_sizes: list[int] | None = None,
                 use_triton: bool = False, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        blocks = (-(-out_features // BLOCK), -(-in_features // BLOCK))
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn, device=device),
                                   requires_grad=False)
        self.weight_scale_inv = nn.Parameter(torch.ones(blocks, dtype=torch.float32, device=device),
                                             requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False) \
            if bias else None
        if shard_sizes is not None:
            self.shard_sizes = shard_sizes
            self.shard_offsets = [sum(shard_sizes[:i]) for i in range(len(shard_sizes))]
        self.gemm = None
        if use_triton:  # imported only here: triton is optional
            from kestrel.layers.fp8_gemm_triton import fp8_gemm

            self.gemm = fp8_gemm

    @classmethod
    def from_linear(cls, linear: nn.Linear, use_triton: bool) -> "Fp8Linear":
        """Quantize a float linear layer (online quantization: `--quantization fp8`)."""
        weight = linear.weight.data
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None,
                    getattr(linear, "shard_sizes", None), use_triton, weight.dtype, weight.device)
        q, scale_inv = quantize_blocks(weight)
        layer.weight.data.copy_(q)
        layer.weight_scale_inv.data.copy_(scale_inv)
        if linear.bias is not None:
            layer.bias.data.copy_(linear.bias.data)
        return layer

    def shard(self, param: torch.Tensor, shard_id: int) -> torch.Tensor:
        """The rows of `param` (weight, bias or weight_scale_inv) that hold projection `shard_id`."""
        start, size = self.shard_offsets[shard_id], self.shard_sizes[shard_id]
        if param.data_ptr() != self.weight_scale_inv.data_ptr():
            return param[start:start + size]
        if start % BLOCK or (size % BLOCK and start + size != self.out_features):
            raise ValueError(f"an FP8 checkpoint's projections of {self.shard_sizes} rows cannot be merged into one "
                             f"layer: each must start on a {BLOCK}-row boundary of its block scales")
        return param[start // BLOCK:-(-(start + size) // BLOCK)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.gemm is not None:
            y = self.gemm(rows, self.weight, self.weight_scale_inv, self.bias)
        else:
            y = fp8_linear_reference(rows, self.weight, self.weight_scale_inv, self.bias)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


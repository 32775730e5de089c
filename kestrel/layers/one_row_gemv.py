"""Batch-1 decode's float linear layers through kestrel's Triton GEMV instead of cuBLAS.

At one row a linear layer only streams its weight. On the H100 (docs/benchmarks.md, "The one-row
GEMV, the int4 nibble GEMV and offline r=0 on the H100") the GEMV of kestrel/layers/fp8_gemm_triton.py
over bf16 weights, 8 rows x 512 inputs per program with the cross-thread reduction deferred to the end
(`GemvConfig.defer_reduce`), read Llama-3.1-8B's projections at 92.6 % of copy bandwidth against cuBLAS's
86.2 % (qkv 85.9 against 70.3 %), with no split-K reduce launch; a batch-1 step of the 8B went from 6.08
to 5.71 ms. `route_one_row_linears` gives every plain float linear of a model (nn.Linear and the merged /
column-parallel ones, whose forward is nn.Linear's) a forward that takes the GEMV at one row and F.linear
otherwise; quantized layers keep their own kernels.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kestrel.layers.fp8_gemm_triton import GemvConfig, gemv

CONFIG = GemvConfig(block_n=8, block_k=512, split_k=1, num_warps=4, defer_reduce=True)
ENABLED = True  # False: cuBLAS at one row too (to compare in one process)


def route_one_row_linears(model: nn.Module) -> int:
    """Give the model's plain bf16 / fp16 linear layers the one-row GEMV; returns how many took it."""
    routed = 0
    for module in model.modules() if ENABLED else ():
        if isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward \
                and module.weight.dtype in (torch.bfloat16, torch.float16) and module.weight.stride(1) == 1:
            module.forward = _one_row_forward(module)
            routed += 1
    return routed


def _one_row_forward(module: nn.Linear):
    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] == 1 and x.stride(1) == 1 and x.dtype == module.weight.dtype:
            return gemv(x, module.weight, bias=module.bias, config=CONFIG)
        return F.linear(x, module.weight, module.bias)
    return forward

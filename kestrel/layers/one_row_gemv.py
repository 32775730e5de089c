"""Batch-1 decode's float linear layers through kestrel's Triton GEMV instead of cuBLAS.

At one row a linear layer only streams its weight. On the H100 (docs/benchmarks.md, "The one-row
GEMV, the int4 nibble GEMV and offline r=0 on the H100") the GEMV of kestrel/layers/fp8_gemm_triton.py
over bf16 weights, 8 rows x 512 inputs per program with the cross-thread reduction deferred to the end
(`GemvConfig.defer_reduce`), read Llama-3.1-8B's projections at 92.6 % of copy bandwidth against cuBLAS's
86.2 % (qkv 85.9 against 70.3 %), with no split-K reduce launch; a batch-1 step of the 8B went from 6.08
to 5.71 ms. `route_one_row_linears` gives every plain float linear of a model (nn.Linear and the merged /
column-parallel ones, whose forward is nn.Linear's) a forward that takes the GEMV at one row and F.linear
otherwise; quantized layers keep their own kernels.

`gated_down` is a gated MLP's down projection at one row with silu(gate) * up computed inside the GEMV, for
the linears that run a GEMV there (these, and FP8 ones): one launch a layer fewer than the activation
kernel and the GEMV, the same values bit for bit (`GATED_DOWN`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kestrel.layers import fp8_gemm_triton
from kestrel.layers.fp8_gemm_triton import GemvConfig, gemv
from kestrel.layers.fp8_linear import Fp8Linear

CONFIG = GemvConfig(block_n=8, block_k=512, split_k=1, num_warps=4, defer_reduce=True)
ENABLED = True  # False: cuBLAS at one row too (to compare in one process)
# Whether gated_down fuses at all: it saves a launch a layer, and each GEMV program recomputes silu for its
# strips (the 8B's bf16 down GEMV: 512 column blocks x 14,336 inputs). With PDL on, the 8B at batch 1 on the
# H100: FP8 3.475 -> 3.447 ms, bf16 5.514 -> 5.511 ms (`bash scripts/gpu.sh OUT pdl`, docs/benchmarks.md).
GATED_DOWN = True


def route_one_row_linears(model: nn.Module) -> int:
    """Give the model's plain bf16 / fp16 linear layers the one-row GEMV; returns how many took it."""
    routed = 0
    for module in model.modules() if ENABLED else ():
        if isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward \
                and module.weight.dtype in (torch.bfloat16, torch.float16) and module.weight.stride(1) == 1:
            module.forward = _one_row_forward(module)
            module.one_row_gemv = True  # for gated_down
            routed += 1
    return routed


def _one_row_forward(module: nn.Linear):
    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] == 1 and x.stride(1) == 1 and x.dtype == module.weight.dtype:
            return gemv(x, module.weight, bias=module.bias, config=CONFIG)
        return F.linear(x, module.weight, module.bias)
    return forward


def gated_down(linear: nn.Module, h: torch.Tensor) -> torch.Tensor | None:
    """linear(silu(gate) * up) for one row h [1, 2I] = gate | up, in one GEMV launch, where `linear` runs a GEMV
    at one row: a float linear routed here, or an Fp8Linear on the Triton path whose one-row default is the
    GEMV. None otherwise (another linear, a row-parallel or LoRA one among them): the caller runs the
    activation and the linear."""
    if not GATED_DOWN or h.dim() != 2 or h.shape[0] != 1 or h.stride(1) != 1:
        return None
    if getattr(linear, "one_row_gemv", False) and h.dtype == linear.weight.dtype:
        return gemv(h, linear.weight, bias=linear.bias, config=CONFIG, gated=True)
    if isinstance(linear, Fp8Linear) and linear.gemm is not None and fp8_gemm_triton.GEMV_MAX_M >= 1:
        cfg = fp8_gemm_triton.default_gemv_config(1, linear.out_features, linear.in_features, h.device)
        if cfg.fused_quant or not cfg.quantize_x:
            return gemv(h, linear.weight, linear.weight_scale_inv, linear.bias, cfg, gated=True)
    return None

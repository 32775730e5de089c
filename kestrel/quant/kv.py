"""The FP8 KV cache (`--kv-cache-dtype`): the pool's dtype, and how values go in and out of it.

An FP8 pool holds value / scale, clipped to the format's finite range: an outlier is saturated rather
than stored as inf (e5m2) or NaN, which would poison every later attention over it. The scale is one
float per buffer (`KVBuffer.scale`), fixed when the pools are built, so CUDA graphs capture it as a
constant. kestrel uses 1.0: SGLang's choice for a checkpoint without k_scale / v_scale (kestrel reads no
such scales yet). Readers dequantize in registers (Triton) or right after the gather (torch_native).
"""
from __future__ import annotations

import torch

from kestrel.quant.fp8 import is_fp8, saturate_to_fp8

KV_CACHE_DTYPES = {"auto": None, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool dtype for `--kv-cache-dtype name`: `auto` keeps the model's dtype."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")
    return KV_CACHE_DTYPES[name] or model_dtype


def to_pool(x: torch.Tensor, pool_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """What a pool of `pool_dtype` stores for the values x."""
    if not is_fp8(pool_dtype):
        return x.to(pool_dtype)
    return saturate_to_fp8(x.float() / scale, pool_dtype)


def from_pool(stored: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """The values a pool's entries stand for, in `dtype`."""
    if not is_fp8(stored.dtype):
        return stored.to(dtype)
    return (stored.float() * scale).to(dtype)

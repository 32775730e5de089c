"""MXFP4 weights as gpt-oss checkpoints store its experts, dequantised to the model dtype at load.

A weight [..., rows, cols] is stored as two tensors:
- `<name>_blocks`: uint8 [..., rows, cols // 32, 16], each byte two FP4 (e2m1) codes, the low nibble
  the even column and the high nibble the odd one;
- `<name>_scales`: uint8 [..., rows, cols // 32], one E8M0 exponent per 32 columns (2^(e - 127)).

kestrel runs the experts in the model dtype: dequantising at load costs memory (bf16 is 4x the packed
bytes) but no kernel of its own, which Hopper's bf16 grouped GEMM then serves.
"""
from __future__ import annotations

from typing import Any

import torch

BLOCK = 32  # values per scale
E8M0_BIAS = 127
# e2m1: sign bit, 2 exponent bits, 1 mantissa bit; code c (0..15) stands for E2M1_VALUES[c].
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SUFFIXES = ("_blocks", "_scales")


def is_mxfp4_checkpoint(hf_config: dict[str, Any]) -> bool:
    return (hf_config.get("quantization_config") or {}).get("quant_method") == "mxfp4"


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, name: str = "") -> torch.Tensor:
    """blocks uint8 [..., rows, groups, 16], scales [..., rows, groups] (the E8M0 bytes, as uint8 or as
    their integer values in any dtype) -> [..., rows, groups * 32] in `dtype`, on the blocks' device. Exact
    in bfloat16 and float32 (each value is a code times a power of two). `name` names it in the errors."""
    if blocks.dtype != torch.uint8:
        raise ValueError(f"MXFP4 weight {name}: blocks must be uint8 (two e2m1 codes a byte), got {blocks.dtype}")
    if blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 weight {name}: blocks {tuple(blocks.shape)} must be scales {tuple(scales.shape)} "
                         f"+ ({BLOCK // 2},) bytes")
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2)  # [..., groups, 32], even column first
    exponents = scales.to(torch.int32) - E8M0_BIAS
    values = torch.ldexp(table[codes.long()], exponents.unsqueeze(-1))
    return values.flatten(-2).to(dtype)


def check_mxfp4_config(hf_config: dict[str, Any]) -> None:
    """An MXFP4 checkpoint's quantization_config: only `quant_method` and the modules it left in float
    (`modules_to_not_convert`) mean anything to kestrel; anything else is refused by name."""
    qc = dict(hf_config.get("quantization_config") or {})
    qc.pop("quant_method", None)
    qc.pop("modules_to_not_convert", None)
    if qc:
        raise ValueError(f"the mxfp4 checkpoint's quantization_config has {sorted(qc)}, which kestrel does not "
                         "know; it loads quant_method 'mxfp4' with optional modules_to_not_convert")

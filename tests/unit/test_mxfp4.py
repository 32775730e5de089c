"""MXFP4 dequantisation against a naive per-value reference, and against transformers' own."""
from __future__ import annotations

import pytest
import torch

from kestrel.quant.mxfp4 import dequantize_mxfp4

# e2m1 by its bits: sign, exponent (2 bits, bias 1), mantissa (1 bit); exponent 0 is subnormal.
def e2m1(code: int) -> float:
    sign = -1.0 if code & 8 else 1.0
    exponent, mantissa = (code >> 1) & 3, code & 1
    if exponent == 0:
        return sign * mantissa * 0.5
    return sign * (1 + mantissa / 2) * 2.0 ** (exponent - 1)


def naive(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    rows, groups, _ = blocks.shape
    out = torch.empty(rows, groups * 32, dtype=torch.float64)
    for r in range(rows):
        for g in range(groups):
            for j in range(16):
                byte = int(blocks[r, g, j])
                scale = 2.0 ** (int(scales[r, g]) - 127)
                out[r, g * 32 + 2 * j] = e2m1(byte & 15) * scale  # the low nibble is the even column
                out[r, g * 32 + 2 * j + 1] = e2m1(byte >> 4) * scale
    return out


def random_mxfp4(shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*shape, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(118, 136, shape, generator=gen, dtype=torch.uint8)
    return blocks, scales


def test_matches_naive_reference():
    blocks, scales = random_mxfp4((3, 2), seed=0)
    got = dequantize_mxfp4(blocks, scales, torch.float32)
    assert got.shape == (3, 64)
    torch.testing.assert_close(got.double(), naive(blocks, scales), rtol=0, atol=0)
    # Exact in bfloat16 too: a 2-bit mantissa times a power of two.
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.bfloat16).double(), naive(blocks, scales))


def test_leading_dims_and_float_scales():
    blocks, scales = random_mxfp4((2, 3, 2), seed=1)
    got = dequantize_mxfp4(blocks, scales, torch.float32)
    assert torch.equal(got, dequantize_mxfp4(blocks, scales.float(), torch.float32))
    for e in range(2):
        torch.testing.assert_close(got[e].double(), naive(blocks[e], scales[e]), rtol=0, atol=0)


def test_bad_shapes_and_dtypes_are_refused():
    blocks, scales = random_mxfp4((2, 2), seed=2)
    with pytest.raises(ValueError, match="w.down_proj.*uint8"):
        dequantize_mxfp4(blocks.int(), scales, torch.float32, "w.down_proj")
    with pytest.raises(ValueError, match="blocks"):
        dequantize_mxfp4(blocks[..., :8], scales, torch.float32)


def test_matches_transformers():
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    blocks, scales = random_mxfp4((4, 6, 2), seed=3)  # [experts, rows, groups]
    theirs = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, cols, rows]
    torch.testing.assert_close(dequantize_mxfp4(blocks, scales, torch.float32), theirs.transpose(1, 2),
                               rtol=0, atol=0)

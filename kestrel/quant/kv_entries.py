"""Packed FP8 KV entries: DeepSeek-V4's format (docs/design/deepseek-v4.md §6, SGLang's), one uint8 row per entry.

A pool buffer declared with a codec (`KVBuffer.codec`) stores `codec.nbytes` bytes per entry of
`codec.width` values; the backend encodes on store and decodes the rows a step gathers, straight to the
compute dtype (never the whole pool).

- `RopeEntryFP8`, a K=V entry of D values whose last r are rope dims: the D - r "nope" values in
  float8_e4m3fn, one ue8m0 scale byte per 64 of them (the scale is a power of two, the byte its biased
  exponent, so it is exact), a pad byte that aligns what follows, then the r rope values in bf16 (the
  rotation's phase is what a low-bit rope value would lose). D 512, r 64: 448 + 7 + 1 + 128 = 584 B.
- `ScaledKeyFP8`, an indexer key of c values: c float8_e4m3fn values and one float32 scale (amax / 448).
  c 128: 132 B.

Per group, value / scale lies in [-448, 448], so each value is off by at most half an e4m3 step: 1/16 of
its magnitude (3 mantissa bits), or 2^-10 x scale below e4m3's smallest normal (2^-6).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kestrel.quant.fp8 import fp8_max, saturate_to_fp8

FP8 = torch.float8_e4m3fn
GROUP = 64  # nope values per ue8m0 scale
_E4M3_MAX = fp8_max(FP8)
_TINY = 1e-12  # an all-zero key gets a finite scale (its values stay 0)


def ue8m0_scale_bytes(amax: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= amax / 448, as its biased exponent (uint8; scale = 2^(byte - 127)),
    read off the float32 bits: exponent field + 1 when any mantissa bit is set. Kept within normal
    float32 exponents [1, 254]."""
    y = (amax.float() / _E4M3_MAX).clamp(min=2.0 ** -126)
    bits = y.view(torch.int32)
    exponent = (bits >> 23) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return exponent.clamp(1, 254).to(torch.uint8)


def ue8m0_to_float(scale_bytes: torch.Tensor) -> torch.Tensor:
    """2^(byte - 127) as float32, exactly (the byte is the float's exponent field)."""
    return (scale_bytes.to(torch.int32) << 23).view(torch.float32)


@dataclass(frozen=True)
class RopeEntryFP8:
    """D = `width` values, the last `rope_dim` of them rope dims (see the module docstring)."""

    width: int
    rope_dim: int

    @property
    def nope(self) -> int:
        return self.width - self.rope_dim

    @property
    def groups(self) -> int:
        return -(-self.nope // GROUP)

    @property
    def rope_offset(self) -> int:
        """Bytes before the bf16 rope values: nope bytes, scale bytes, a pad byte when their sum is odd."""
        head = self.nope + self.groups
        return head + head % 2

    @property
    def nbytes(self) -> int:
        return self.rope_offset + 2 * self.rope_dim

    @property
    def decode_bytes(self) -> int:
        """Transient bytes per entry a gather-and-decode holds beyond its result: the packed row and its
        float32 values."""
        return self.nbytes + 4 * self.width

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., width] (any float dtype) -> uint8 [..., nbytes]."""
        lead, n, g = x.shape[:-1], self.nope, self.groups
        nope = x[..., :n].float()
        if g * GROUP != n:  # the last group is partial: zeros change neither its amax nor its values
            nope = torch.nn.functional.pad(nope, (0, g * GROUP - n))
        nope = nope.unflatten(-1, (g, GROUP))
        scale_bytes = ue8m0_scale_bytes(nope.abs().amax(-1))  # [..., g]
        values = saturate_to_fp8(nope / ue8m0_to_float(scale_bytes)[..., None], FP8).flatten(-2)[..., :n]
        out = torch.zeros(*lead, self.nbytes, dtype=torch.uint8, device=x.device)
        out[..., :n] = values.view(torch.uint8)
        out[..., n:n + g] = scale_bytes
        out[..., self.rope_offset:] = x[..., n:].to(torch.bfloat16).contiguous().view(torch.uint8)
        return out

    def decode(self, packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """uint8 [..., nbytes] -> [..., width] in `dtype`."""
        n, g = self.nope, self.groups
        scales = ue8m0_to_float(packed[..., n:n + g])
        nope = packed[..., :n].view(FP8).float()
        if n == g * GROUP:  # whole groups: broadcast the scales rather than expanding them
            nope = (nope.unflatten(-1, (g, GROUP)) * scales[..., None]).flatten(-2)
        else:
            nope = nope * scales.repeat_interleave(GROUP, -1)[..., :n]
        rope = packed[..., self.rope_offset:].view(torch.bfloat16)  # a gathered row: aligned
        return torch.cat([nope.to(dtype), rope.to(dtype)], dim=-1)


@dataclass(frozen=True)
class ScaledKeyFP8:
    """c = `width` values in e4m3 with one float32 scale per key (see the module docstring)."""

    width: int

    def __post_init__(self) -> None:
        if self.width % 4:
            raise ValueError(f"an FP8 indexer key needs a width divisible by 4 (its float32 scale follows the "
                             f"values, aligned), got {self.width}")

    @property
    def nbytes(self) -> int:
        return self.width + 4

    @property
    def decode_bytes(self) -> int:
        return self.nbytes + 4 * self.width

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., width] -> uint8 [..., nbytes]."""
        xf = x.float()
        # Times the reciprocal, not divided: CUDA turns a division by a Python number into this product,
        # so writing it out gives the same bytes on every device.
        scale = xf.abs().amax(-1, keepdim=True).clamp(min=_TINY) * (1.0 / _E4M3_MAX)
        values = saturate_to_fp8(xf / scale, FP8).view(torch.uint8)
        return torch.cat([values, scale.view(torch.uint8)], dim=-1)

    def decode(self, packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """uint8 [..., nbytes] -> [..., width] in `dtype`."""
        c = self.width
        scale = packed[..., c:].view(torch.float32)  # a gathered row: aligned
        return (packed[..., :c].view(FP8).float() * scale).to(dtype)


KVEntryCodec = RopeEntryFP8 | ScaledKeyFP8

"""DeepSeek-V4's packed FP8 KV entries (kestrel/quant/kv_entries.py, docs/design/deepseek-v4.md §6): the round trip of a K=V
entry and of an indexer key against the e4m3 bound, the byte counts, and which kv_cache_dtype V4 takes.
Runtime < 1 s."""
from __future__ import annotations

import pytest
import torch

from kestrel.models.deepseek_v4.config import parse_v4_config
from kestrel.models.deepseek_v4.kv_layout import mtp_kv_layout, v4_kv_layout
from kestrel.quant.kv_entries import GROUP, RopeEntryFP8, ScaledKeyFP8, ue8m0_to_float
from kestrel.quant.resolve import resolve_quantization
from tests.model.dsv4_reference import RefConfig

# e4m3: 3 mantissa bits, so rounding moves a normal value by at most 2^-4 of it; below the smallest
# normal (2^-6, after dividing by the scale) by at most half the subnormal step, 2^-10 x scale.
REL, SUBNORMAL = 2.0 ** -4, 2.0 ** -10


def _entries(n: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows whose 64-value groups span many magnitudes (a scale per group matters), one all-zero group."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, width, generator=g) * torch.exp2(torch.randint(-12, 12, (n, width // 16), generator=g)
                                                         .float()).repeat_interleave(16, 1)
    x[0, :GROUP] = 0.0
    return x.to(dtype)


@pytest.mark.parametrize("width, rope, dtype", [(512, 64, torch.bfloat16), (64, 16, torch.float32)])
def test_kv_entry_round_trip_is_within_the_e4m3_bound(width: int, rope: int, dtype: torch.dtype) -> None:
    codec = RopeEntryFP8(width, rope)
    x = _entries(200, width, dtype)
    packed = codec.encode(x)
    assert packed.dtype == torch.uint8 and packed.shape == (200, codec.nbytes)
    back = codec.decode(packed, torch.float32)
    nope = width - rope
    # Rope dims: bf16, exactly.
    assert torch.equal(back[:, nope:], x[:, nope:].to(torch.bfloat16).float())
    # Scales: exact powers of two, the smallest >= each group's amax / 448.
    scales = ue8m0_to_float(packed[:, nope:nope + codec.groups])  # [n, groups]
    mantissa, _ = torch.frexp(scales)
    assert bool((mantissa == 0.5).all())
    groups = torch.nn.functional.pad(x[:, :nope].float().abs(), (0, codec.groups * GROUP - nope))
    amax = groups.unflatten(-1, (codec.groups, GROUP)).amax(-1)
    assert bool((scales >= amax / 448).all()) and bool((scales / 2 < amax / 448)[amax > 0].all())
    # Values: within half an e4m3 step of each.
    per_value = scales.repeat_interleave(GROUP, 1)[:, :nope]
    err = (back[:, :nope] - x[:, :nope].float()).abs()
    assert bool((err <= REL * x[:, :nope].float().abs() + SUBNORMAL * per_value).all())
    assert bool((back[0, :min(GROUP, nope)] == 0).all())
    assert err.max() > 0  # the bound is not met by storing the values as they are


def test_entry_bytes_are_the_specs() -> None:
    assert RopeEntryFP8(512, 64).nbytes == 448 + 7 + 1 + 128  # 584
    assert ScaledKeyFP8(128).nbytes == 128 + 4  # 132
    assert RopeEntryFP8(64, 16).nbytes == 48 + 1 + 1 + 32  # the tier-A config's: one (partial) group


def test_indexer_key_round_trip_is_within_the_e4m3_bound() -> None:
    codec = ScaledKeyFP8(128)
    x = _entries(100, 128, torch.bfloat16).float()
    packed = codec.encode(x)
    assert packed.shape == (100, 132)
    scale = packed[:, 128:].contiguous().view(torch.float32)  # [n, 1]
    torch.testing.assert_close(scale, (x.abs().amax(-1, keepdim=True) / 448).clamp(min=1e-12 / 448))
    back = codec.decode(packed, torch.float32)
    # + 1e-6 relative: value / scale is itself rounded to float32 before the cast.
    assert bool(((back - x).abs() <= (REL + 1e-6) * x.abs() + SUBNORMAL * scale).all())


def test_layouts_pack_entries_and_refuse_e5m2() -> None:
    cfg = parse_v4_config(RefConfig().native_config())
    layout = v4_kv_layout(cfg, torch.float8_e4m3fn)
    buffers = {b.name: b for g in layout.groups for b in g.buffers}
    assert buffers["swa_kv"].shape == (cfg.sliding_window, 82) and buffers["ckv"].shape == (82,)
    assert buffers["idx_k"].shape == (36,) and buffers["comp_kv"].dtype == torch.float32
    assert mtp_kv_layout(cfg, torch.float8_e4m3fn).bytes_per_token == 82
    for make in (lambda: v4_kv_layout(cfg, torch.float8_e5m2), lambda: mtp_kv_layout(cfg, torch.float8_e5m2)):
        with pytest.raises(ValueError, match="'auto' or 'fp8_e4m3'"):
            make()
    hf = {"architectures": ["DeepseekV4ForCausalLM"]}
    with pytest.raises(ValueError, match="not supported for DeepSeek-V4.*'auto' .* or 'fp8_e4m3'"):
        resolve_quantization(None, "fp8_e5m2", hf, "cpu")
    assert resolve_quantization(None, "fp8_e4m3", hf, "cpu") is None

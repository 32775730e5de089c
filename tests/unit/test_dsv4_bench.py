"""The pieces of kestrel.bench.dsv4 whose figures are arithmetic or a baseline, checked on CPU: the KV
bytes it reads off the engine's memory, the estimate of docs/design/deepseek-v4.md §6, and that its dense
layer is full causal attention. (The benchmark itself runs end to end with `--smoke`.)"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kestrel.bench.dsv4_kv import kv_bytes_measured, spec_kv_bytes
from kestrel.bench.dsv4_layers import DenseLayer
from kestrel.cache.kv_memory import KVMemory
from kestrel.models.deepseek_v4.config import parse_v4_config
from kestrel.models.deepseek_v4.kv_layout import v4_kv_layout

SLICE = Path(__file__).parents[2] / "kestrel/assets/configs/deepseek-v4-flash-slice"


def test_spec_estimate_reproduces_the_flash_figure_and_the_slice_arithmetic() -> None:
    cfg = parse_v4_config(json.loads((SLICE / "config.json").read_text()))
    spec = spec_kv_bytes(cfg, 32768)
    assert spec["entry_bytes"] == 584 and spec["index_key_bytes"] == 132
    assert spec["flash_slope"] == pytest.approx(3850, abs=1)  # docs/design/deepseek-v4.md §6: ≈ 3.85 KB/token for full Flash
    # The slice: 3 ratio-4 and 3 ratio-128 layers, 8 + 1 rings of 128 entries.
    assert spec["bytes_per_token"] == 3 * 716 / 4 + 3 * 584 / 128 + 9 * 128 * 584 / 32768


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_measured_kv_bytes_are_the_layouts_declared_bytes(dtype: torch.dtype) -> None:
    """Read off the tensors of a KV memory built from the slice's layout = the layout's own accounting,
    with entries in bf16 and packed FP8 (584 B entries and 132 B indexer keys)."""
    cfg = parse_v4_config(json.loads((SLICE / "config.json").read_text()))
    layout = v4_kv_layout(cfg, dtype)
    memory = KVMemory([layout], 1024, 128, 2, 1024, "cpu")
    got = kv_bytes_measured(memory, 300)
    assert got["slots_held"] == 384  # three pages of 128
    assert got["bytes_per_request"] == 384 * layout.bytes_per_token + layout.bytes_per_request
    entry, key = (584, 132) if dtype == torch.float8_e4m3fn else (1024, 256)
    assert got["bytes_by_group"]["c4_blocks"] == 384 / 4 * 3 * (entry + key)
    assert got["bytes_by_group"]["swa"] == 8 * 128 * entry


def test_dense_layer_is_full_causal_attention() -> None:
    """DenseLayer.core (the decode fold, the prefill's lower-right causal mask, and its query tiles with an
    explicit mask) against an explicit softmax over every earlier position, for two requests at the
    same positions."""
    from torch.nn.attention import SDPBackend

    from tests.model.dsv4_reference import RefConfig
    from kestrel.models.deepseek_v4.attention import V4Attention

    cfg = parse_v4_config(RefConfig().native_config())
    attn = V4Attention(cfg, layer_id=1, ratio=4)
    batch, context, H, D = 2, 40, cfg.num_attention_heads, cfg.head_dim
    dense = DenseLayer(attn, batch, context, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    dense.cache.copy_(torch.randn(batch, context, D, generator=g))
    for prefix, extend, tile in ((39, 1, None), (25, 15, None), (25, 15, 4)):
        q = torch.randn(batch * extend, H, D, generator=g)
        out = dense.core(q, prefix, extend, SDPBackend.MATH, tile=tile).view(batch, extend, H, D)
        keys = dense.cache[:, :prefix + extend]  # [B, S, D]
        logits = torch.einsum("bthd,bsd->bths", q.view(batch, extend, H, D), keys) * attn.scale
        visible = torch.arange(prefix + extend)[None, :] <= prefix + torch.arange(extend)[:, None]  # [T, S]
        weights = torch.softmax(logits.masked_fill(~visible[None, :, None, :], float("-inf")), dim=-1)
        torch.testing.assert_close(out, torch.einsum("bths,bsd->bthd", weights, keys), rtol=1e-5, atol=1e-5)

"""4-bit weights with group scales and zero points: AWQ and GPTQ checkpoints, read into one layout.

A weight W [N outputs, K inputs] is stored as unsigned 4-bit codes q with, per group of `group_size`
consecutive inputs and per output, a scale s and a zero point z: W[n, k] = (q[n, k] - z[g, n]) * s[g, n].
The two published layouts (int32 words of eight 4-bit codes, lowest nibble first):

- AWQ (AutoAWQ's "gemm" version): `qweight` [K, N/8], packed along the outputs, word c holding
  outputs 8c..8c+7 in the interleaved nibble order AWQ_ORDER (nibble i holds output 8c + AWQ_ORDER[i]);
  `qzeros` [K/g, N/8] packed the same way; `scales` [K/g, N] fp16. Zero points as they are.
- GPTQ (AutoGPTQ / GPTQModel, `checkpoint_format` "gptq"): `qweight` [K/8, N], packed along the
  inputs, word r holding inputs 8r..8r+7 in order; `qzeros` [K/g, N/8] packed along the outputs in order,
  storing z - 1 (the historical offset: readers add 1 back, so a stored 15 means 16); `scales` [K/g, N];
  `g_idx` [K] int32, each input's group. With `desc_act` (act-order) the inputs were quantized in another
  order, so a group's inputs are scattered; otherwise g_idx[k] = k // g. "gptq_v2" stores z itself.

kestrel serves both in one layout (`Int4Weight`): codes packed along the inputs as GPTQ packs them,
zero points unpacked (uint8 [K/g, N]: GPTQ's 16 does not fit a nibble), scales as stored, and for
act-order a permutation of the inputs that makes every group contiguous: the codes' rows are permuted once
here, and the GEMM reads x's columns through `perm` (one int32 per input, gathered with the activations),
which costs a K-long index load per tile rather than a scale row per input.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

PACK = 8  # 4-bit codes per int32 word
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds output 8c + AWQ_ORDER[i]
GROUP_SIZES = (32, 64, 128)
INT4_METHODS = ("awq", "gptq")
GPTQ_ZERO_OFFSET = {"gptq": 1, "gptq_v2": 0}


@dataclass(frozen=True)
class Int4Config:
    """What an AWQ or GPTQ checkpoint's quantization_config says, validated."""

    method: str  # "awq" | "gptq"
    group_size: int
    desc_act: bool = False  # GPTQ act-order: g_idx is not k // group_size
    zero_offset: int = 0  # added to every stored zero point (GPTQ v1: 1)


def int4_config(qc: dict[str, Any]) -> Int4Config:
    """An AWQ / GPTQ `quantization_config` -> Int4Config; ValueError naming what kestrel does not load."""
    method = qc.get("quant_method")
    bits = qc.get("bits", qc.get("w_bit"))
    group = qc.get("group_size", qc.get("q_group_size"))
    if bits != 4:
        raise ValueError(f"the {method} checkpoint has bits={bits}; kestrel loads 4-bit {method} weights only")
    if group not in GROUP_SIZES:
        raise ValueError(f"the {method} checkpoint has group_size={group}; kestrel loads group sizes "
                         f"{', '.join(map(str, GROUP_SIZES))} (not per-channel -1)")
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"the awq checkpoint has version {version!r}; kestrel loads AutoAWQ's 'gemm' layout "
                             "(qweight [in, out/8]) only, not 'gemv' / 'gemv_fast' / 'marlin' / 'exllama'")
        if not qc.get("zero_point", True):
            raise ValueError("the awq checkpoint has zero_point false; kestrel loads AWQ with zero points only")
        return Int4Config("awq", group)
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in GPTQ_ZERO_OFFSET:
        raise ValueError(f"the gptq checkpoint has checkpoint_format {fmt!r}; kestrel loads "
                         f"{' and '.join(map(repr, GPTQ_ZERO_OFFSET))} (not marlin / bitblas repacks)")
    return Int4Config("gptq", group, bool(qc.get("desc_act", False)), GPTQ_ZERO_OFFSET[fmt])


# ---- unpacking the published layouts ---------------------------------------------------------------------
def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., c] -> int32 [..., c, 8]: nibble i of each word (bits 4i..4i+3)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=words.device)
    return (words.unsqueeze(-1) >> shifts) & 0xF


def unpack_columns(words: torch.Tensor, awq_order: bool) -> torch.Tensor:
    """int32 [rows, cols/8] packed along the columns -> int32 [rows, cols] codes; `awq_order`: AWQ's
    interleaved nibbles, else nibble i is column 8c + i."""
    codes = _nibbles(words)
    if awq_order:
        inverse = torch.empty(PACK, dtype=torch.long)
        inverse[list(AWQ_ORDER)] = torch.arange(PACK)  # column j sits in nibble inverse[j]
        codes = codes[..., inverse.to(words.device)]
    return codes.flatten(-2)


def unpack_rows(words: torch.Tensor) -> torch.Tensor:
    """int32 [rows/8, cols] packed along the rows (GPTQ) -> int32 [rows, cols]."""
    return _nibbles(words.t()).flatten(-2).t()


def pack_rows(codes: torch.Tensor) -> torch.Tensor:
    """int32 [rows, cols] codes in 0..15 -> int32 [rows/8, cols], input 8r + i in nibble i of word r."""
    rows, cols = codes.shape
    parts = codes.view(rows // PACK, PACK, cols).to(torch.int64)
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=codes.device).view(1, PACK, 1)
    words = (parts << shifts).sum(1)  # disjoint bits: the sum is the OR; int64 keeps bit 31 positive
    return (words - ((words >> 31) << 32)).to(torch.int32)  # the same 32 bits as a signed int32


# ---- kestrel's layout -------------------------------------------------------------------------------------
@dataclass
class Int4Weight:
    """One linear layer's weight as the GEMM reads it: `qweight` int32 [K/8, N] (GPTQ's packing, rows in
    group order), `zeros` uint8 [K/g, N], `scales` [K/g, N], `perm` int32 [K] (act-order: row i of the
    codes is input perm[i]) or None."""

    qweight: torch.Tensor
    zeros: torch.Tensor
    scales: torch.Tensor
    perm: torch.Tensor | None
    group_size: int


def from_checkpoint(cfg: Int4Config, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                    g_idx: torch.Tensor | None, name: str = "") -> Int4Weight:
    """The checkpoint tensors of one layer (the published layout of `cfg.method`) -> kestrel's layout."""
    groups, n = scales.shape
    zeros = unpack_columns(qzeros, awq_order=cfg.method == "awq") + cfg.zero_offset
    if zeros.shape != (groups, n):
        raise ValueError(f"{name}: qzeros {tuple(qzeros.shape)} do not match scales {tuple(scales.shape)}")
    if cfg.method == "awq":
        codes = unpack_columns(qweight, awq_order=True)
        if codes.shape != (groups * cfg.group_size, n):
            raise ValueError(f"{name}: AWQ qweight {tuple(qweight.shape)} does not match scales {tuple(scales.shape)} "
                             f"with group_size {cfg.group_size}")
        return Int4Weight(pack_rows(codes), zeros.to(torch.uint8), scales, None, cfg.group_size)
    k = qweight.shape[0] * PACK
    if qweight.shape[1] != n or k != groups * cfg.group_size or g_idx is None or g_idx.shape != (k,):
        raise ValueError(f"{name}: GPTQ qweight {tuple(qweight.shape)}, scales {tuple(scales.shape)} and g_idx "
                         f"{None if g_idx is None else tuple(g_idx.shape)} do not fit group_size {cfg.group_size}")
    g_idx = g_idx.long()
    if torch.equal(g_idx, torch.arange(k, device=g_idx.device) // cfg.group_size):
        return Int4Weight(qweight, zeros.to(torch.uint8), scales, None, cfg.group_size)
    if bool((g_idx < 0).any() or (g_idx >= groups).any()) or \
            not bool((torch.bincount(g_idx, minlength=groups) == cfg.group_size).all()):
        raise ValueError(f"{name}: g_idx must give every group exactly {cfg.group_size} inputs (act-order "
                         "permutes the inputs; kestrel makes each group contiguous)")
    perm = torch.argsort(g_idx, stable=True)
    codes = unpack_rows(qweight)[perm]
    return Int4Weight(pack_rows(codes), zeros.to(torch.uint8), scales, perm.to(torch.int32), cfg.group_size)


def dequantize(w: Int4Weight) -> torch.Tensor:
    """float32 W [N, K] in the checkpoint's input order: the oracle of the GEMM, and its CPU path."""
    codes = unpack_rows(w.qweight).float()  # [K, N], group order
    g = w.group_size
    values = (codes - w.zeros.float().repeat_interleave(g, 0)) * w.scales.float().repeat_interleave(g, 0)
    if w.perm is not None:
        values = torch.empty_like(values).index_copy_(0, w.perm.long(), values)
    return values.t()


def check_int4_family(cls: type, method: str) -> None:
    """ValueError unless the model family `cls` serves `method` (4-bit) checkpoints: dense families only."""
    if cls.has_routed_experts or cls.loads_own_checkpoint:
        raise ValueError(f"{method} checkpoints load into dense models only: kestrel's 4-bit GEMM serves linear "
                         f"layers, not the routed experts of {cls.__name__}")

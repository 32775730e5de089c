"""Tiny AWQ and GPTQ checkpoints written by the tests' own packing code, from the formats' published
layouts (AutoAWQ's "gemm" WQLinear, AutoGPTQ's QuantLinear), independently of kestrel.quant.int4.

Each decoder projection of a tiny float Llama is quantized round-to-nearest per group of inputs (with
zero points, or symmetric), packed into int32 words, and saved with the quantization_config transformers
writes; its "twin" holds the dequantised weights as float, for transformers as the oracle.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.tiny_models import make_tiny_model

AWQ_NIBBLE_COLUMN = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds output 8c + this
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Inputs shared by projections: GPTQ's act-order comes from the input's statistics, so they share g_idx.
SAME_INPUT = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}
# Every width a multiple of 128: group sizes up to 128 divide every projection's inputs.
WIDE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32)


@dataclass(frozen=True)
class Int4Case:
    method: str  # "awq" | "gptq"
    group_size: int
    act_order: bool = False
    sym: bool = False

    @property
    def quantization_config(self) -> dict:
        if self.method == "awq":
            return {"quant_method": "awq", "bits": 4, "group_size": self.group_size, "zero_point": True,
                    "version": "gemm", "modules_to_not_convert": None}
        return {"quant_method": "gptq", "bits": 4, "group_size": self.group_size, "desc_act": self.act_order,
                "sym": self.sym, "checkpoint_format": "gptq", "true_sequential": True, "damp_percent": 0.01,
                "static_groups": False}


def rtn_quantize(w: torch.Tensor, group: int, sym: bool, min_zero: int) -> tuple[torch.Tensor, ...]:
    """w [N, K] (inputs in quantization order) -> (codes int64 [N, K] in 0..15, zeros int64 [N, K/g],
    fp16 scales [N, K/g]). The scale is rounded to fp16 before the codes are taken, so
    (codes - zeros) * scales is exactly the weight the checkpoint stands for."""
    n, k = w.shape
    groups = w.float().view(n, k // group, group)
    if sym:
        scales = (groups.abs().amax(-1) / 7.5).clamp_min(1e-6).half()
        zeros = torch.full((n, k // group), 8, dtype=torch.int64)
    else:
        lo, hi = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
        scales = ((hi - lo) / 15).clamp_min(1e-6).half()
        zeros = torch.round(-lo / scales.float()).long().clamp(min_zero, 15)
    codes = torch.round(groups / scales.float()[..., None]).long() + zeros[..., None]
    return codes.clamp(0, 15).view(n, k), zeros, scales


def words_along_rows(codes: torch.Tensor) -> torch.Tensor:
    """int64 [R, C] -> int32 [R/8, C]: word r holds rows 8r..8r+7, row 8r + j in bits 4j..4j+3 (GPTQ)."""
    out = torch.zeros(codes.shape[0] // 8, codes.shape[1], dtype=torch.int64)
    for j in range(8):
        out |= codes[j::8] << (4 * j)
    return _signed(out)


def words_along_columns(codes: torch.Tensor, nibble_column: tuple[int, ...]) -> torch.Tensor:
    """int64 [R, C] -> int32 [R, C/8]: word c holds columns 8c + nibble_column[i] in bits 4i..4i+3."""
    out = torch.zeros(codes.shape[0], codes.shape[1] // 8, dtype=torch.int64)
    for i, col in enumerate(nibble_column):
        out |= codes[:, col::8] << (4 * i)
    return _signed(out)


def _signed(words: torch.Tensor) -> torch.Tensor:
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_layer(w: torch.Tensor, case: Int4Case, order: torch.Tensor | None) -> tuple[dict, torch.Tensor]:
    """One projection's weight [N, K] -> (checkpoint tensors by suffix, the dequantised float weight).
    `order` (GPTQ act-order): the inputs in the order they were quantized; input order[i] is in group
    i // g."""
    g = case.group_size
    n, k = w.shape
    order = order if order is not None else torch.arange(k)
    # GPTQ v1 stores zero - 1 in 4 bits, so a zero point of 0 cannot be written: AutoGPTQ's quantizer
    # never makes one (its range always holds 0 strictly inside for real weights); keep it >= 1 here.
    codes, zeros, scales = rtn_quantize(w[:, order], g, case.sym, 1 if case.method == "gptq" else 0)
    deq_ordered = (codes - zeros.repeat_interleave(g, 1)).float() * scales.float().repeat_interleave(g, 1)
    deq = torch.empty_like(deq_ordered)
    deq[:, order] = deq_ordered
    codes_in = torch.empty_like(codes)
    codes_in[:, order] = codes  # back to the input order the checkpoint stores
    if case.method == "awq":
        tensors = {"qweight": words_along_columns(codes_in.t().contiguous(), AWQ_NIBBLE_COLUMN),
                   "qzeros": words_along_columns(zeros.t().contiguous(), AWQ_NIBBLE_COLUMN),
                   "scales": scales.t().contiguous()}
    else:
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[order] = (torch.arange(k) // g).to(torch.int32)
        tensors = {"qweight": words_along_rows(codes_in.t().contiguous()),
                   "qzeros": words_along_columns((zeros - 1).t().contiguous(), tuple(range(8))),
                   "scales": scales.t().contiguous(), "g_idx": g_idx}
    return tensors, deq


def write_int4_checkpoint(root: Path, case: Int4Case, arch: str = "llama", seed: int = 0) -> tuple[Path, Path]:
    """(the 4-bit checkpoint folder, its dequantised float twin) of a tiny `arch` model under `root`."""
    src = make_tiny_model(arch, root / "float", seed=seed, **WIDE)
    tensors = load_file(str(src / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    orders: dict[str, torch.Tensor] = {}
    packed, twin = {}, {}
    for name, t in sorted(tensors.items()):
        parts = name.split(".")
        if name.endswith(".weight") and parts[-2] in PROJECTIONS:
            prefix = ".".join(parts[:-2])
            order = None
            if case.act_order:
                key = f"{prefix}.{SAME_INPUT.get(parts[-2], parts[-2])}"
                order = orders.setdefault(key, torch.randperm(t.shape[1], generator=gen))
            layer, twin[name] = pack_layer(t, case, order)
            packed |= {name.removesuffix("weight") + suffix: v for suffix, v in layer.items()}
        else:
            packed[name] = twin[name] = t
    quant_dir, twin_dir = root / case.method, root / "twin"
    quant_dir.mkdir()
    twin_dir.mkdir()
    config = json.loads((src / "config.json").read_text())
    (twin_dir / "config.json").write_text(json.dumps(config))
    (quant_dir / "config.json").write_text(json.dumps({**config, "quantization_config": case.quantization_config}))
    save_file(packed, str(quant_dir / "model.safetensors"))
    save_file(twin, str(twin_dir / "model.safetensors"))
    return quant_dir, twin_dir

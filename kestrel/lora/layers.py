"""The projections adapters change, wrapped so each adds its LoRA delta to the base output.

The wrap happens after the base weights are loaded (and quantized): the base layer is any module of
x [T, in] -> [T, out] (nn.Linear, MergedLinear, Fp8Linear), so LoRA rides on FP8 weights unchanged.
"""
from __future__ import annotations

import torch
from torch import nn

from kestrel.lora.adapter import LoRATarget
from kestrel.lora.ops import add_lora
from kestrel.lora.pool import LoRAPool

# The projections of a Llama-family decoder layer a PEFT adapter may target.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRALinear(nn.Module):
    """base(x) + the LoRA delta of each token's adapter slot (the pool's `token_slots`)."""

    def __init__(self, base: nn.Module, target: LoRATarget, pool: LoRAPool, use_triton: bool) -> None:
        super().__init__()
        self.base = base
        self.target = target
        self.pool = pool
        self.use_triton = use_triton

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pool, module = self.pool, self.target.module
        slots = pool.token_slots[:x.shape[0]]
        return add_lora(self.base(x), x, slots, pool.a[module], pool.b[module], self.target.part_sizes,
                        self.use_triton)


def lora_targets(model: nn.Module, projections: tuple[str, ...]) -> list[LoRATarget]:
    """The model's modules holding any of `projections` (checkpoint names, merged ones by the model's
    `stacked_params`), with their parts in the module's row order. Raises ValueError when the model has
    none (a family whose projections kestrel does not adapt)."""
    merged: dict[str, list[tuple[int, str]]] = {}
    for part, (module, index) in getattr(model, "stacked_params", {}).items():
        merged.setdefault(module, []).append((index, part))
    targets = []
    for name, module in model.named_modules():
        layer_path, _, leaf = name.rpartition(".")
        if ".layers." not in f".{layer_path}" or not hasattr(module, "in_features"):
            continue
        parts = tuple(p for _, p in sorted(merged[leaf])) if leaf in merged else (leaf,)
        if not all(p in PROJECTIONS for p in parts) or not any(p in projections for p in parts):
            continue
        sizes = tuple(getattr(module, "shard_sizes", None) or [module.out_features])
        targets.append(LoRATarget(name, parts, sizes, module.in_features))
    if not targets:
        raise ValueError(f"{type(model).__name__} has none of the projections {', '.join(projections)} that LoRA "
                         f"adapters target; LoRA is served for Llama-family models")
    return targets


def attach_lora(model: nn.Module, pool: LoRAPool, use_triton: bool) -> None:
    """Wrap every target module of the pool in a LoRALinear."""
    for target in pool.targets.values():
        parent, _, leaf = target.module.rpartition(".")
        owner = model.get_submodule(parent)
        setattr(owner, leaf, LoRALinear(getattr(owner, leaf), target, pool, use_triton))

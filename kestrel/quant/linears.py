"""Which linear layers of a Llama-family model run in FP8, and the swap of nn.Linear for Fp8Linear.

The projections of every decoder layer (q|k|v, o, gate|up, down) run in FP8; the LM head and the
embeddings stay in the model dtype, as FP8 checkpoints keep them. An FP8 checkpoint says per layer
what it holds (a `weight_scale_inv` next to an FP8 weight), so a layer it left in float stays float.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from kestrel.layers.fp8_linear import Fp8Linear

if TYPE_CHECKING:
    from kestrel.models.base import CausalLM


def _candidates(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and name != "lm_head"]


def _replace(model: nn.Module, name: str, layer: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, layer)


def _return_freed_memory() -> None:
    """The replaced float weights go back to the GPU, not to torch's cache: the KV pool is sized from
    the GPU's free memory."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def quantize_linears(model: nn.Module, use_triton: bool) -> None:
    """Online quantization (`--quantization fp8` over a float checkpoint): every decoder projection's
    loaded weight becomes e4m3 with 128 x 128 block scales (each float weight freed as its layer goes)."""
    for name in _candidates(model):
        _replace(model, name, Fp8Linear.from_linear(model.get_submodule(name), use_triton))
    _return_freed_memory()


def use_checkpoint_fp8_linears(model: CausalLM, checkpoint_names: list[str], use_triton: bool) -> None:
    """Before loading an FP8 checkpoint: an empty Fp8Linear for every layer the checkpoint stores in FP8
    (all the checkpoint projections merged into it, e.g. q/k/v, must agree)."""
    scaled = {n.removesuffix(".weight_scale_inv") for n in checkpoint_names if n.endswith(".weight_scale_inv")}
    stacked = model.stacked_params
    for name in _candidates(model):
        prefix, _, leaf = name.rpartition(".")
        parts = [f"{prefix}.{part}" for part, (merged, _) in stacked.items() if merged == leaf] or [name]
        fp8 = [p in scaled for p in parts]
        if any(fp8) != all(fp8):
            raise ValueError(f"the FP8 checkpoint quantizes only some of {parts}; kestrel runs them as one layer "
                             f"({name}), which needs all of them in FP8 or none")
        if all(fp8):
            _replace(model, name, _empty_fp8_like(model.get_submodule(name), use_triton))
    _return_freed_memory()


def _empty_fp8_like(linear: nn.Linear, use_triton: bool) -> Fp8Linear:
    weight = linear.weight
    return Fp8Linear(linear.in_features, linear.out_features, linear.bias is not None,
                     getattr(linear, "shard_sizes", None), use_triton, weight.dtype, weight.device)

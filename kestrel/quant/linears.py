"""Which linear layers of a Llama-family model run in FP8, and the swap of nn.Linear for Fp8Linear.

The projections of every decoder layer (q|k|v, o, gate|up, down) run in FP8; the LM head and the
embeddings stay in the model dtype, as FP8 checkpoints keep them. An FP8 checkpoint says per layer
what it holds (a `weight_scale_inv` next to an FP8 weight), so a layer it left in float stays float.
"""
from __future__ import annotations

from torch import nn

from kestrel.layers.fp8_linear import Fp8Linear


def _candidates(model: nn.Module) -> dict[str, nn.Linear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear) and name != "lm_head"}


def _replace(model: nn.Module, name: str, layer: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, layer)


def quantize_linears(model: nn.Module, use_triton: bool) -> None:
    """Online quantization (`--quantization fp8` over a float checkpoint): every decoder projection's
    loaded weight becomes e4m3 with 128 x 128 block scales; the float weight is freed."""
    for name, linear in _candidates(model).items():
        _replace(model, name, Fp8Linear.from_linear(linear, use_triton))


def use_checkpoint_fp8_linears(model: nn.Module, checkpoint_names: list[str], use_triton: bool) -> None:
    """Before loading an FP8 checkpoint: an empty Fp8Linear for every layer the checkpoint stores in FP8
    (all the checkpoint projections merged into it, e.g. q/k/v, must agree)."""
    scaled = {n.removesuffix(".weight_scale_inv") for n in checkpoint_names if n.endswith(".weight_scale_inv")}
    stacked = getattr(model, "stacked_params", {})
    for name, linear in _candidates(model).items():
        prefix, _, leaf = name.rpartition(".")
        parts = [f"{prefix}.{part}" for part, (merged, _) in stacked.items() if merged == leaf] or [name]
        fp8 = [p in scaled for p in parts]
        if any(fp8) != all(fp8):
            raise ValueError(f"the FP8 checkpoint quantizes only some of {parts}; kestrel runs them as one layer "
                             f"({name}), which needs all of them in FP8 or none")
        if all(fp8):
            weight = linear.weight
            _replace(model, name, Fp8Linear(linear.in_features, linear.out_features, linear.bias is not None,
                                            getattr(linear, "shard_sizes", None), use_triton, weight.dtype,
                                            weight.device))

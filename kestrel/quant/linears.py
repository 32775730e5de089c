"""Which linear layers of a Llama-family model run quantized, and the swap of nn.Linear for Fp8Linear
or Int4Linear.

The projections of every decoder layer (q|k|v, o, gate|up, down) run in FP8 or 4 bits; the LM head and
the embeddings stay in the model dtype, as quantized checkpoints keep them. A checkpoint says per layer
what it holds (a `weight_scale_inv` next to an FP8 weight, a `qweight` for AWQ / GPTQ), so a layer it
left in float stays float.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from kestrel.layers.fp8_linear import Fp8Linear
from kestrel.layers.int4_linear import Int4Linear
from kestrel.quant.int4 import Int4Config

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


def _stored_layers(model: CausalLM, checkpoint_names: list[str], suffix: str, what: str) -> list[str]:
    """The candidate layers whose checkpoint tensors (every part merged into one, e.g. q/k/v) have a
    tensor named `<part>.<suffix>`; all parts or none."""
    stored = {n.removesuffix(f".{suffix}") for n in checkpoint_names if n.endswith(f".{suffix}")}
    stacked = model.stacked_params
    layers = []
    for name in _candidates(model):
        prefix, _, leaf = name.rpartition(".")
        parts = [f"{prefix}.{part}" for part, (merged, _) in stacked.items() if merged == leaf] or [name]
        held = [p in stored for p in parts]
        if any(held) != all(held):
            raise ValueError(f"the {what} checkpoint quantizes only some of {parts}; kestrel runs them as one layer "
                             f"({name}), which needs all of them in {what} or none")
        if all(held):
            layers.append(name)
    return layers


def use_checkpoint_fp8_linears(model: CausalLM, checkpoint_names: list[str], use_triton: bool) -> None:
    """Before loading an FP8 checkpoint: an empty Fp8Linear for every layer the checkpoint stores in FP8
    (all the checkpoint projections merged into it, e.g. q/k/v, must agree)."""
    for name in _stored_layers(model, checkpoint_names, "weight_scale_inv", "FP8"):
        _replace(model, name, _empty_fp8_like(model.get_submodule(name), use_triton))
    _return_freed_memory()


def _empty_fp8_like(linear: nn.Linear, use_triton: bool) -> Fp8Linear:
    weight = linear.weight
    return Fp8Linear(linear.in_features, linear.out_features, linear.bias is not None,
                     getattr(linear, "shard_sizes", None), use_triton, weight.dtype, weight.device)


def use_checkpoint_int4_linears(model: CausalLM, checkpoint_names: list[str], cfg: Int4Config,
                                use_triton: bool) -> None:
    """Before loading an AWQ / GPTQ checkpoint: an empty Int4Linear, in the checkpoint's layout, for
    every layer the checkpoint stores in 4 bits (a `qweight`); `finish_int4_linears` after the copy."""
    for name in _stored_layers(model, checkpoint_names, "qweight", cfg.method):
        _replace(model, name, _empty_int4_like(model.get_submodule(name), cfg, use_triton))
    _return_freed_memory()


def finish_int4_linears(model: nn.Module) -> None:
    """After the copy: every Int4Linear's checkpoint tensors -> kestrel's layout."""
    for name, m in model.named_modules():
        if isinstance(m, Int4Linear):
            m.finish_loading(name)
    _return_freed_memory()


def random_int4_linears(model: nn.Module, cfg: Int4Config, use_triton: bool) -> None:
    """`--load-format dummy` with an AWQ / GPTQ config: every decoder projection gets random codes and
    zero points and scales that give weights of about 0.02 RMS (the float dummy's), through the same
    layout conversion as a checkpoint, so a benchmark reads the bytes a real 4-bit model holds."""
    gen = None
    for name in _candidates(model):
        layer = _empty_int4_like(model.get_submodule(name), cfg, use_triton)
        if gen is None:
            gen = torch.Generator(layer.scales.device).manual_seed(0)
        with torch.no_grad():
            for packed in (layer.qweight, layer.qzeros):
                packed.random_(-2**31, 2**31, generator=gen)
            layer.scales.fill_(0.02 / 4.6)  # codes minus zero points: RMS about 4.6 when both are uniform
            if cfg.method == "gptq":
                layer.g_idx.copy_(torch.arange(layer.in_features, device=layer.g_idx.device) // cfg.group_size)
        layer.finish_loading(name)
        _replace(model, name, layer)
    _return_freed_memory()


def _empty_int4_like(linear: nn.Linear, cfg: Int4Config, use_triton: bool) -> Int4Linear:
    weight = linear.weight
    return Int4Linear(linear.in_features, linear.out_features, linear.bias is not None, cfg,
                      getattr(linear, "shard_sizes", None), use_triton, weight.dtype, weight.device)

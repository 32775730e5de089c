"""A PEFT LoRA adapter folder read into host tensors, checked against the projections the pool serves.

A PEFT folder holds `adapter_config.json` (r, lora_alpha, target_modules, use_rslora, ...) and
`adapter_model.safetensors` with `base_model.model.<module>.lora_A.weight` [r, in] and `.lora_B.weight`
[out, r] per adapted projection. The scaling (lora_alpha / r, or / sqrt(r) with rsLoRA) is folded into B
here, so the kernels compute x A^T B^T alone.
"""
from __future__ import annotations

import itertools
import json
import math
import os
from dataclasses import dataclass, field

import torch


class LoRAAdapterError(ValueError):
    """An adapter that cannot be served (a missing file, a rank over the maximum, a projection the pool
    does not hold, a shape that is not the model's): the load call fails, the server keeps serving."""


@dataclass(frozen=True)
class LoRATarget:
    """One projection of the model adapters may change: the kestrel module (`model.layers.3.self_attn.
    qkv_proj`), the checkpoint projections merged in it (q_proj, k_proj, v_proj), their output rows each
    and the input width."""

    module: str
    parts: tuple[str, ...]
    part_sizes: tuple[int, ...]
    in_features: int


@dataclass(eq=False)
class LoRAAdapter:
    """`weights[module][part index] = (A [r, in], B * scaling [out_part, r])`, host tensors. `uid` is
    unique per load: the radix cache keys this adapter's prefixes by it, so a reloaded adapter of the
    same name never meets KV computed with the old weights."""

    name: str
    path: str
    rank: int
    uid: int
    weights: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = field(repr=False)


_uids = itertools.count(1)
PEFT_PREFIX = "base_model.model."
# Adapter options that change what the adapter computes, refused by name rather than served wrong. The first
# ones first: PEFT's "all-linear" on a MoE model sets target_parameters and per-parameter rank patterns.
UNSUPPORTED_OPTIONS = {
    "target_parameters": "target_parameters (LoRA on raw parameters such as MoE experts and routers; kestrel "
                         "serves LoRA on the attention and dense MLP projections)",
    "use_dora": "DoRA", "modules_to_save": "modules_to_save (whole trained layers)",
    "rank_pattern": "rank_pattern (per-module ranks)", "alpha_pattern": "alpha_pattern",
    "lora_bias": "lora_bias (a bias on lora_B)", "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "layer_replication": "layer_replication", "use_qalora": "QA-LoRA", "use_bdlora": "BD-LoRA"}


def _read_config(path: str) -> dict:
    config_file = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(config_file):
        raise LoRAAdapterError(f"{path!r} is not a PEFT adapter folder: it has no adapter_config.json")
    with open(config_file) as f:
        try:
            config = json.load(f)
        except json.JSONDecodeError as e:
            raise LoRAAdapterError(f"{config_file} is not valid JSON: {e}") from None
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise LoRAAdapterError(f"{path!r} is a {config['peft_type']} adapter; only LORA adapters are served")
    for key, what in UNSUPPORTED_OPTIONS.items():
        if config.get(key):
            raise LoRAAdapterError(f"adapter {path!r} uses {what}, which kestrel does not serve")
    if config.get("bias", "none") != "none":
        raise LoRAAdapterError(f"adapter {path!r} trains biases (bias={config['bias']!r}); only bias='none' is served")
    if not isinstance(config.get("r"), int) or config["r"] < 1:
        raise LoRAAdapterError(f"adapter_config.json of {path!r} needs a positive integer r, got {config.get('r')!r}")
    return config


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    weights_file = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(weights_file):
        raise LoRAAdapterError(f"adapter folder {path!r} has no adapter_model.safetensors")
    try:
        return load_file(weights_file)
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file: the caller's 400
        raise LoRAAdapterError(f"cannot read {weights_file}: {e}") from None


def load_adapter(name: str, path: str, targets: dict[str, tuple[str, int]], target_info: dict[str, LoRATarget],
                 max_rank: int) -> LoRAAdapter:
    """Read and check the adapter at `path`. `targets` maps a checkpoint projection path
    (`model.layers.3.self_attn.q_proj`) to (its kestrel module, part index); `target_info` describes
    each module. Raises LoRAAdapterError naming what is wrong."""
    config = _read_config(path)
    rank = config["r"]
    if rank > max_rank:
        raise LoRAAdapterError(f"adapter {name!r} has rank {rank}, above --max-lora-rank {max_rank}")
    alpha = config.get("lora_alpha", rank)
    scaling = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    tensors = _read_tensors(path)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        stem = key.removeprefix(PEFT_PREFIX)
        for side in ("lora_A", "lora_B"):
            if stem.endswith(f".{side}.weight"):
                pairs.setdefault(stem.removesuffix(f".{side}.weight"), {})[side] = tensor
                break
        else:
            raise LoRAAdapterError(f"adapter {name!r} holds {key!r}, which is no LoRA A or B weight; only "
                                   f"lora_A / lora_B weights are served")
    if not pairs:
        raise LoRAAdapterError(f"adapter {name!r} holds no LoRA weights")
    weights: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    for projection, ab in sorted(pairs.items()):
        if projection not in targets:
            known = sorted({p.rpartition(".")[2] for p in targets})
            raise LoRAAdapterError(f"adapter {name!r} adapts {projection!r}, which this server does not serve; the "
                                   f"projections it serves are {', '.join(known)} of the decoder layers "
                                   f"(--lora-target-modules)")
        if set(ab) != {"lora_A", "lora_B"}:
            raise LoRAAdapterError(f"adapter {name!r} has only {', '.join(ab)} for {projection!r}")
        module, part = targets[projection]
        info = target_info[module]
        a, b = ab["lora_A"], ab["lora_B"]
        want_a, want_b = (rank, info.in_features), (info.part_sizes[part], rank)
        if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
            raise LoRAAdapterError(f"adapter {name!r}: {projection} has lora_A {tuple(a.shape)} and lora_B "
                                   f"{tuple(b.shape)}; this model needs {want_a} and {want_b} (rank {rank}) - "
                                   f"is it an adapter of another base model?")
        weights.setdefault(module, {})[part] = (a.float(), b.float() * scaling)
    return LoRAAdapter(name, path, rank, next(_uids), weights)

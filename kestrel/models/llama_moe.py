"""The Llama-family decoder with MoE layers (kestrel/layers/moe) in place of some or all of its MLPs:
what Qwen3-MoE, Qwen2-MoE and Mixtral share. Each family (qwen3_moe.py, qwen2_moe.py, mixtral.py) says
how its config.json describes the MoE layer and how its checkpoint names the experts."""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from torch import nn

from kestrel.layers.kernels import Kernels
from kestrel.layers.moe import MoE, MoEConfig
from kestrel.layers.moe.loading import QWEN_EXPERTS, ExpertCheckpoint
from kestrel.models.arch_config import ArchConfig, parse_arch_config
from kestrel.models.llama import LlamaForCausalLM


@dataclass(frozen=True)
class MoeArchConfig(ArchConfig):
    """A Llama-family architecture whose layer i's MLP is the MoE layer `moe` where `moe_layers[i]`
    (a dense MLP of `intermediate_size` elsewhere)."""

    moe: MoEConfig
    moe_layers: tuple[bool, ...]


def required(config: dict[str, Any], *keys: str) -> Any:
    """The first of `keys` that config.json sets; ValueError naming them if none."""
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    raise ValueError(f"config.json of {config.get('architectures')} has no {' or '.join(keys)}")


def parse_moe_arch(config: dict[str, Any], moe: MoEConfig, moe_layers: Sequence[bool]) -> MoeArchConfig:
    base = parse_arch_config(config)
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    return MoeArchConfig(**fields, moe=moe, moe_layers=tuple(moe_layers))


def qwen_sparse_layers(config: dict[str, Any]) -> list[bool]:
    """Qwen-MoE's MoE layers: every `decoder_sparse_step`-th, except those in `mlp_only_layers`."""
    step, dense = config.get("decoder_sparse_step", 1), set(config.get("mlp_only_layers") or ())
    return [i not in dense and (i + 1) % step == 0 for i in range(config["num_hidden_layers"])]


class LlamaMoeForCausalLM(LlamaForCausalLM):
    """LlamaForCausalLM with `config.moe` layers where `config.moe_layers` says. `expert_checkpoint`:
    how the family's checkpoint names its experts; `checkpoint_renames`: (pattern, replacement) pairs
    that turn its other module names into the model's."""

    has_routed_experts = True
    expert_checkpoint: ClassVar[ExpertCheckpoint] = QWEN_EXPERTS
    checkpoint_renames: ClassVar[tuple[tuple[str, str], ...]] = ()

    def layer_mlp(self, layer_id: int, kernels: Kernels) -> nn.Module:
        if self.config.moe_layers[layer_id]:
            return MoE(self.config.moe, self.parallel, self.expert_checkpoint)
        return super().layer_mlp(layer_id, kernels)

    def checkpoint_name(self, name: str) -> str:
        for pattern, repl in self.checkpoint_renames:
            name = re.sub(pattern, repl, name)
        return name

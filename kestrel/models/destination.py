"""Where a checkpoint tensor goes in a model: the parameter of its name, or its rows of a merged one,
and this rank's slice of it under tensor parallelism. Shared by the loader's copy by name and the
families that read their checkpoints themselves."""
from __future__ import annotations

import torch
from torch import nn

from kestrel.layers.linear import Slice
from kestrel.models.base import StackedParams


def checkpoint_destination(model: nn.Module, params: dict[str, torch.Tensor], stacked_params: StackedParams, name: str):
    """(bookkeeping key, tensor view to copy into, this rank's Slice of the checkpoint tensor or None
    for all of it) for a checkpoint name (after renaming), or (None, None, None). `params`: the model's
    `state_dict(keep_vars=True)`."""
    for part, (merged, shard_id) in stacked_params.items():
        if f".{part}." in name:
            merged_name = name.replace(f".{part}.", f".{merged}.")
            param = params.get(merged_name)
            if param is None:
                return None, None, None
            module_name, _, param_name = merged_name.rpartition(".")
            module = model.get_submodule(module_name)
            return f"{merged_name}#{shard_id}", module.shard(param.data, shard_id), _slice(module, param_name, shard_id)
    param = params.get(name)
    if param is None:
        return None, None, None
    module_name, _, param_name = name.rpartition(".")
    return name, param.data, _slice(model.get_submodule(module_name), param_name, None)


def _slice(module: nn.Module, param_name: str, shard_id: int | None) -> Slice | None:
    """The part of a checkpoint tensor this rank's `module` holds; None: all of it (no tensor parallelism,
    or a layer that is whole on every rank, such as an FP8 checkpoint's)."""
    return module.checkpoint_slice(param_name, shard_id) if hasattr(module, "checkpoint_slice") else None


def expected_keys(model: nn.Module, params: dict[str, torch.Tensor]) -> set[str]:
    """Every parameter (and persistent buffer) name, merged parameters expanded to one key per shard ("name#i")."""
    keys = set()
    for name in params:
        shards = getattr(model.get_submodule(name.rpartition(".")[0]), "shard_sizes", None)
        keys |= {f"{name}#{i}" for i in range(len(shards))} if shards else {name}
    return keys

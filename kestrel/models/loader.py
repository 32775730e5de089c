"""HF checkpoint directory (config.json + safetensors, single or sharded) -> model on a device."""
from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from kestrel.layers.kernels import Kernels
from kestrel.models.registry import model_class

# Buffers some checkpoints store that kestrel recomputes (rope frequencies).
_HARMLESS_SUFFIXES = ("rotary_emb.inv_freq",)


def read_config(model_path: str | Path) -> dict:
    path = Path(model_path) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; model_path must be a HF model directory")
    return json.loads(path.read_text())


def read_arch_config(model_path: str | Path):
    """The model's architecture config (its class's `parse_config`: an ArchConfig for the Llama family,
    a V4Config for DeepSeek-V4), without building the model."""
    config = read_config(model_path)
    return model_class(config.get("architectures") or []).parse_config(config)


def load_model(model_path: str | Path, dtype: torch.dtype, device: torch.device | str,
               kernels: Kernels = Kernels(), load_format: str = "auto", hf_config: dict | None = None) -> nn.Module:
    """Build the model directly on `device` in `dtype` and fill it from the checkpoint.

    Checkpoint names map to parameters by name, except projections the model merges
    (`stacked_params`: q/k/v → qkv_proj, gate/up → gate_up_proj), which are copied into their rows.
    `load_format="dummy"` fills random weights instead (benchmarks of a config-only folder).
    `kernels` picks Triton or torch implementations of rope, norms and activations.
    `hf_config` is the folder's config.json when the caller has read it already.
    A model class with its own `load_checkpoint` / `fill_dummy` (DeepSeek-V4: other namings, FP8/FP4
    dequantisation) fills itself from the same tensor stream.
    Raises ValueError listing missing or unexpected parameter names.
    """
    if load_format not in ("auto", "dummy"):
        raise ValueError(f"load_format must be 'auto' or 'dummy', got {load_format!r}")
    config = hf_config if hf_config is not None else read_config(model_path)
    cls = model_class(config.get("architectures") or [])
    cfg = cls.parse_config(config)
    with torch.device(device), _default_dtype(dtype):
        model = cls(cfg, kernels)
    own_loader = hasattr(model, "load_checkpoint")
    if load_format == "dummy":
        if own_loader:
            model.fill_dummy()
        else:
            _fill_random(model)
        return model.eval()
    if own_loader:
        model.load_checkpoint(_checkpoint_tensors(Path(model_path)), str(model_path))
        return model.eval()
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    unexpected: list[str] = []
    with torch.no_grad():
        for name, tensor in _checkpoint_tensors(Path(model_path)):
            if name.endswith(_HARMLESS_SUFFIXES) or (cfg.tie_word_embeddings and name == "lm_head.weight"):
                continue
            target, rows = _destination(model, params, name)
            if target is None:
                unexpected.append(name)
                continue
            if rows.shape != tensor.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(rows.shape)}")
            rows.copy_(tensor)  # casts to the model dtype and moves to its device
            loaded.add(target)
    missing = sorted(_expected_keys(model, params) - loaded)
    if missing or unexpected:
        raise ValueError(f"checkpoint at {model_path} does not match {cfg.architecture}: "
                         f"missing {missing}, unexpected {sorted(unexpected)}")
    return model.eval()


def _destination(model: nn.Module, params: dict[str, nn.Parameter], name: str):
    """(bookkeeping key, tensor view to copy into) for a checkpoint name, or (None, None)."""
    for part, (merged, shard_id) in getattr(model, "stacked_params", {}).items():
        if f".{part}." in name:
            merged_name = name.replace(f".{part}.", f".{merged}.")
            param = params.get(merged_name)
            if param is None:
                return None, None
            module = model.get_submodule(merged_name.rsplit(".", 1)[0])
            return f"{merged_name}#{shard_id}", module.shard(param.data, shard_id)
    param = params.get(name)
    return (name, param.data) if param is not None else (None, None)


def _expected_keys(model: nn.Module, params: dict[str, nn.Parameter]) -> set[str]:
    """Every parameter name, with merged parameters expanded to one key per shard ("name#i")."""
    keys = set()
    for name in params:
        shards = getattr(model.get_submodule(name.rsplit(".", 1)[0]), "shard_sizes", None)
        keys |= {f"{name}#{i}" for i in range(len(shards))} if shards else {name}
    return keys


def _fill_random(model: nn.Module) -> None:
    """Small random weights (norm weights 1, biases 0), the same on every load: a fixed-seed generator."""
    device = next(model.parameters()).device
    gen = torch.Generator(device).manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.fill_(1.0 if name.endswith("norm.weight") else 0.0)
            else:
                param.normal_(0.0, 0.02, generator=gen)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _checkpoint_tensors(model_path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, CPU tensor) for every tensor in `model.safetensors` or the shards of its index."""
    index = model_path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (model_path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {model_path}")
    for file in files:
        with safe_open(str(model_path / file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)

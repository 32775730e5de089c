"""Validation of the LoRA options against the rest of the config, and their defaults."""
from __future__ import annotations

import dataclasses
import json
import os

from kestrel.config import LoRAConfig
from kestrel.lora.layers import PROJECTIONS

DEFAULT_MAX_RANK = 16
# Weight formats LoRA rides on: the base output is computed as usual and the delta added in the
# activation dtype. AWQ / GPTQ bases are refused: adapters over their layers were never checked.
LORA_QUANTIZATIONS = (None, "fp8")


def parse_lora_paths(entries: tuple[str, ...] | list[str] | None) -> list[tuple[str, str]]:
    """NAME=PATH entries (a bare PATH is named by its folder) -> [(name, path)]."""
    out = []
    for entry in entries or ():
        name, sep, path = entry.partition("=")
        if not sep:
            name, path = os.path.basename(os.path.normpath(entry)), entry
        if not name or not path:
            raise ValueError(f"--lora-paths entry {entry!r}: give NAME=PATH or PATH")
        out.append((name, path))
    names = [n for n, _ in out]
    if len(set(names)) != len(names):
        raise ValueError(f"--lora-paths names an adapter twice: {', '.join(names)}")
    return out


def _rank_of(path: str) -> int:
    try:
        with open(os.path.join(path, "adapter_config.json")) as f:
            return int(json.load(f)["r"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--lora-paths {path!r}: cannot read the adapter's rank from adapter_config.json "
                         f"({type(e).__name__}: {e})") from None


def resolve_lora(lora: LoRAConfig, quantization: str | None, tp_size: int) -> LoRAConfig:
    """The LoRA section with its lists as tuples and its defaults filled; ValueError on a bad choice."""
    paths = tuple(lora.lora_paths) if lora.lora_paths else None
    targets = tuple(lora.lora_target_modules) if lora.lora_target_modules else None
    if not lora.enable_lora:
        given = [flag for flag, v in (("--lora-paths", paths), ("--lora-target-modules", targets),
                                      ("--max-lora-rank", lora.max_lora_rank)) if v]
        if given:
            raise ValueError(f"{', '.join(given)} need --enable-lora")
        return lora
    if quantization not in LORA_QUANTIZATIONS:
        raise ValueError(f"LoRA adapters are served over float or fp8 weights; this model loads with quantization "
                         f"{quantization!r}. Serve it without --enable-lora, or use a float/fp8 checkpoint")
    if tp_size != 1:
        raise ValueError(f"LoRA adapters are served at tp_size 1 only (got {tp_size}): the pool holds whole "
                         f"adapters, not their tensor-parallel shards")
    unknown = sorted(set(targets or ()) - set(PROJECTIONS))
    if unknown:
        raise ValueError(f"--lora-target-modules {', '.join(unknown)}: valid projections are "
                         f"{', '.join(PROJECTIONS)}")
    if lora.max_loras_per_batch < 1:
        raise ValueError(f"max_loras_per_batch must be >= 1, got {lora.max_loras_per_batch}")
    named = parse_lora_paths(paths)
    if lora.max_loaded_loras is not None and lora.max_loaded_loras < max(1, len(named)):
        raise ValueError(f"max_loaded_loras ({lora.max_loaded_loras}) must be >= 1 and hold the {len(named)} "
                         f"adapters of --lora-paths")
    rank = lora.max_lora_rank
    if rank is None:
        rank = max([DEFAULT_MAX_RANK] + [_rank_of(p) for _, p in named]) if named else DEFAULT_MAX_RANK
    if rank < 1:
        raise ValueError(f"max_lora_rank must be >= 1, got {rank}")
    return dataclasses.replace(lora, lora_paths=paths, lora_target_modules=targets or PROJECTIONS,
                               max_lora_rank=rank)

"""Adapters by name (host memory) and the device pool of adapter slots a batch's tokens point into.

The pool holds `max_loras_per_batch` slots of every served projection's A and B stacks (ops.py's
layout, rank padded with zeros to the pool's rank). A request pins its adapter's slot from admission
to release; an adapter not in a slot is copied into a free one, or into the least recently used slot
that no request pins. So the adapters of a running batch always have slots, at most one per slot:
a request whose adapter finds none waits. Slot copies run on the device stream, after the forwards
already launched, so a step in flight still reads the weights it was launched with.

`token_slots` is the forward's per-token slot index (-1: no adapter) in a fixed device buffer, which
CUDA graphs read at replay; a batch larger than it (an eager prefill) gets a tensor of its own.
"""
from __future__ import annotations

import logging
from collections import OrderedDict

import torch

from kestrel.lora.adapter import LoRAAdapter, LoRAAdapterError, LoRATarget, load_adapter

logger = logging.getLogger(__name__)


class LoRANotFoundError(ValueError):
    """A request names an adapter that is not loaded (404, with the loaded ones named)."""

    status = 404


class LoRAPool:
    def __init__(self, targets: list[LoRATarget], served: tuple[str, ...], num_slots: int, max_rank: int,
                 max_loaded: int | None, dtype: torch.dtype, device: torch.device, max_tokens: int) -> None:
        """`served`: the checkpoint projections (q_proj, ...) adapters may change."""
        self.targets = {t.module: t for t in targets}
        # Checkpoint projection path -> (kestrel module, part index), as adapters name them.
        self.projections = {f"{t.module.rpartition('.')[0]}.{part}": (t.module, i)
                            for t in targets for i, part in enumerate(t.parts) if part in served}
        self.num_slots, self.max_rank, self.max_loaded = num_slots, max_rank, max_loaded
        self.a = {t.module: torch.zeros(num_slots, len(t.parts) * max_rank, t.in_features, dtype=dtype,
                                        device=device) for t in targets}
        self.b = {t.module: torch.zeros(num_slots, sum(t.part_sizes), max_rank, dtype=dtype, device=device)
                  for t in targets}
        self.adapters: dict[str, LoRAAdapter] = {}
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # adapter uid -> slot, least recently used first
        self.holder: list[LoRAAdapter | None] = [None] * num_slots
        self.pins = [0] * num_slots
        self._static_slots = torch.full((max_tokens,), -1, dtype=torch.int64, device=device)
        self.token_slots = self._static_slots

    # ---- adapters by name ----------------------------------------------------------------------
    def load(self, name: str, path: str) -> LoRAAdapter:
        """Read and check the adapter; LoRAAdapterError (a 400) leaves the pool as it was."""
        if not name or ":" in name:
            raise LoRAAdapterError(f"adapter name {name!r} must be non-empty and without ':'")
        if name in self.adapters:
            raise LoRAAdapterError(f"an adapter named {name!r} is already loaded (from "
                                   f"{self.adapters[name].path!r}); unload it first")
        if self.max_loaded is not None and len(self.adapters) >= self.max_loaded:
            raise LoRAAdapterError(f"{len(self.adapters)} adapters are loaded, the most --max-loaded-loras allows; "
                                   f"unload one first")
        adapter = load_adapter(name, path, self.projections, self.targets, self.max_rank)
        self.adapters[name] = adapter
        logger.info("LoRA adapter %r loaded from %s (rank %d, %d projections)", name, path, adapter.rank,
                    sum(len(p) for p in adapter.weights.values()))
        return adapter

    def unload(self, name: str) -> None:
        """Forget the adapter by name. Requests already holding it finish with it; its slot is reused
        once they have."""
        self.get(name)
        del self.adapters[name]

    def get(self, name: str) -> LoRAAdapter:
        adapter = self.adapters.get(name)
        if adapter is None:
            loaded = ", ".join(repr(n) for n in self.adapters) or "none"
            raise LoRANotFoundError(f"the LoRA adapter {name!r} is not loaded; loaded adapters: {loaded}")
        return adapter

    # ---- slots ---------------------------------------------------------------------------------
    def can_acquire(self, adapter: LoRAAdapter) -> bool:
        return adapter.uid in self.slot_of or any(p == 0 for p in self.pins)

    def acquire(self, adapter: LoRAAdapter) -> int:
        """The adapter's slot, pinned once more (copied in first when it has none)."""
        slot = self.slot_of.get(adapter.uid)
        if slot is None:
            slot = self._free_slot()
            self._copy_in(adapter, slot)
        self.slot_of.move_to_end(adapter.uid)
        self.pins[slot] += 1
        return slot

    def release(self, slot: int) -> None:
        assert self.pins[slot] > 0, "release of an unpinned LoRA slot"
        self.pins[slot] -= 1

    def _free_slot(self) -> int:
        empty = next((s for s, h in enumerate(self.holder) if h is None), None)
        if empty is not None:
            return empty
        for uid, slot in self.slot_of.items():  # least recently used first
            if self.pins[slot] == 0:
                del self.slot_of[uid]
                return slot
        raise RuntimeError("no LoRA slot is free; the scheduler checks can_acquire first")

    def _copy_in(self, adapter: LoRAAdapter, slot: int) -> None:
        r = self.max_rank
        for module, a in self.a.items():
            a[slot].zero_()
            self.b[module][slot].zero_()
            start = 0
            for part, size in enumerate(self.targets[module].part_sizes):
                pair = adapter.weights.get(module, {}).get(part)
                if pair is not None:
                    rank = pair[0].shape[0]
                    a[slot, part * r:part * r + rank].copy_(pair[0])
                    self.b[module][slot, start:start + size, :rank].copy_(pair[1])
                start += size
        self.holder[slot] = adapter
        self.slot_of[adapter.uid] = slot

    # ---- the forward's token slots -------------------------------------------------------------
    def stage(self, token_slots: torch.Tensor | None, num_tokens: int) -> None:
        """Set the slot of each of the forward's `num_tokens` tokens (None: no adapter for any)."""
        if num_tokens > self._static_slots.shape[0]:
            self.token_slots = token_slots if token_slots is not None else \
                torch.full((num_tokens,), -1, dtype=torch.int64, device=self._static_slots.device)
            return
        self.token_slots = self._static_slots
        if token_slots is None:
            self._static_slots[:num_tokens].fill_(-1)
        else:
            self._static_slots[:num_tokens].copy_(token_slots)

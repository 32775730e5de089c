"""Sampled token ids that the host does not know yet, for overlap scheduling.

With overlap, step N+1 is built before step N's sampled tokens reach the host. The sampler's output
is copied into this device ring and a request's next input names it by index (as `-1 - index`
among the input ids); `resolve()` swaps those for the values on the device, in stream order.
"""
from __future__ import annotations

import torch


class FutureTokens:
    def __init__(self, capacity: int, device: torch.device) -> None:
        # A value is read only by the next step's input gather, which runs on the stream before that
        # step's own put(); so reusing the ring from the start never overwrites an unread value.
        self.values = torch.zeros(capacity, dtype=torch.int64, device=device)
        self.capacity = capacity
        self._next = 0

    def put(self, token_ids: torch.Tensor) -> list[int]:
        """Store one step's sampled ids (device) and return their indices."""
        indices = self.reserve(token_ids.numel())
        self.write(indices, token_ids)
        return indices

    def reserve(self, n: int) -> list[int]:
        """Indices for n ids that `write()` stores later in the same step (a sample launched after the
        step's forward, see Engine.step); the next step's input gather must come after that write."""
        if n > self.capacity:
            raise ValueError(f"{n} sampled tokens in one step exceed the FutureTokens capacity {self.capacity}")
        if self._next + n > self.capacity:
            self._next = 0
        start, self._next = self._next, self._next + n
        return list(range(start, start + n))

    def write(self, indices: list[int], token_ids: torch.Tensor) -> None:
        """Store the ids at indices from `reserve()` (consecutive)."""
        self.values[indices[0]:indices[0] + len(indices)].copy_(token_ids)

    def resolve(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids with every `-1 - index` replaced by the stored token (all on the device)."""
        index = (-1 - input_ids).clamp_(min=0)
        return torch.where(input_ids < 0, self.values[index], input_ids)

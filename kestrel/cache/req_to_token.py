"""Request slot → KV slot table."""
from __future__ import annotations

import torch


class ReqToTokenPool:
    """Row `i` lists the KV slots of the request holding row `i`, position by position.

    One extra row, `padding_row`, is never handed out and stays all zeros (slot 0, the reserved
    page): CUDA-graph batches padded to a bucket point their padding entries at it.
    """

    def __init__(self, max_requests: int, max_context_len: int, device: torch.device | str) -> None:
        self.table = torch.zeros((max_requests + 1, max_context_len), dtype=torch.int64, device=device)
        self._free = list(range(max_requests))
        self.max_requests = max_requests
        self.padding_row = max_requests

    def available(self) -> int:
        return len(self._free)

    def alloc(self) -> int:
        if not self._free:
            raise RuntimeError("no free request slot; the scheduler must cap running requests")
        return self._free.pop()

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        """Set row[start:start + len(slots)] from host slots without waiting for the device."""
        self.table[row, start:start + len(slots)].copy_(slots, non_blocking=True)

    def free(self, idx: int) -> None:
        self._free.append(idx)

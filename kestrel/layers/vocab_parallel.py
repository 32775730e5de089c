"""The embedding and LM head split by vocabulary rows over the tensor-parallel ranks.

Rank r holds rows [r * k, (r + 1) * k) with k = ceil(vocab / tp_size); rows past the vocabulary are
zero padding. A token's embedding comes from the one rank holding its row (the others contribute
zeros to an all-reduce); each rank's logits cover its rows and an all-gather puts them side by side,
so every rank ends with the same full logits (and samples the same token from them).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kestrel.distributed.parallel_state import ParallelState
from kestrel.layers.linear import Slice


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, parallel: ParallelState) -> None:
        super().__init__()
        self.parallel = parallel
        self.vocab_size = vocab_size
        rows = -(-vocab_size // parallel.tp_size)
        self.start = parallel.tp_rank * rows
        self.weight = nn.Parameter(torch.zeros(rows, hidden_size))
        self._slice = Slice(0, self.start, max(0, min(rows, vocab_size - self.start)))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        hidden = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.parallel.all_reduce(hidden.masked_fill_(outside[:, None], 0.0))

    def checkpoint_slice(self, param_name: str, shard_id: int | None) -> Slice:
        return self._slice


class VocabParallelHead(nn.Module):
    """An untied LM head's weight, split like VocabParallelEmbedding."""

    def __init__(self, vocab_size: int, hidden_size: int, parallel: ParallelState) -> None:
        super().__init__()
        rows = -(-vocab_size // parallel.tp_size)
        start = parallel.tp_rank * rows
        self.weight = nn.Parameter(torch.zeros(rows, hidden_size))
        self._slice = Slice(0, start, max(0, min(rows, vocab_size - start)))

    def checkpoint_slice(self, param_name: str, shard_id: int | None) -> Slice:
        return self._slice


def vocab_parallel_logits(hidden: torch.Tensor, weight: torch.Tensor, vocab_size: int,
                          parallel: ParallelState) -> torch.Tensor:
    """float32 logits [N, vocab] from this rank's rows of the head `weight`, the same on every rank."""
    local = F.linear(hidden, weight).float()
    return parallel.all_gather_last(local)[:, :vocab_size]


def untied_lm_head(hidden_size: int, vocab_size: int, tied: bool, parallel: ParallelState) -> nn.Module | None:
    """The `lm_head` of a model: None when tied (the logits reuse the embedding), else this rank's rows."""
    if tied:
        return None
    if parallel.tp_size == 1:
        return nn.Linear(hidden_size, vocab_size, bias=False)
    return VocabParallelHead(vocab_size, hidden_size, parallel)


def lm_logits(hidden: torch.Tensor, embedding: nn.Module, lm_head: nn.Module | None, vocab_size: int,
              parallel: ParallelState) -> torch.Tensor:
    """float32 logits [N, vocab] through the untied head, or the embedding's weight when tied."""
    weight = embedding.weight if lm_head is None else lm_head.weight
    if parallel.tp_size > 1:
        return vocab_parallel_logits(hidden, weight, vocab_size, parallel)
    return F.linear(hidden, weight).float()

"""What a prefill-only request returns in place of tokens: its pooled hidden state (an embedding) or a
softmax over chosen tokens' logits at its last position (a reranker's score)."""
from __future__ import annotations

from dataclasses import dataclass

POOLING_METHODS = ("last", "mean", "cls")


@dataclass(frozen=True)
class PoolingParams:
    """`method` pools the final-normed hidden states of the prompt: the last token's, the mean over every
    token, or the first token's (cls). The first `dimensions` components are kept (a Matryoshka model's
    shorter embedding), then the vector is scaled to unit L2 norm when `normalize`.

    With `score_token_ids`, the request returns instead the softmax over those tokens' logits at the last
    prompt position (a yes/no reranker: the first id's probability is the score)."""

    method: str = "last"
    normalize: bool = True
    dimensions: int | None = None
    score_token_ids: tuple[int, ...] | None = None

    def validate(self, vocab_size: int | None) -> None:
        if self.method not in POOLING_METHODS:
            raise ValueError(f"pooling.method must be one of {', '.join(POOLING_METHODS)}, got {self.method!r}")
        if self.dimensions is not None and (not isinstance(self.dimensions, int) or self.dimensions < 1):
            raise ValueError(f"pooling.dimensions must be None or an integer >= 1, got {self.dimensions!r}")
        if self.score_token_ids is not None:
            if self.method != "last":
                raise ValueError("pooling.score_token_ids reads the last position's logits: method must be 'last'")
            if not self.score_token_ids or not all(
                    isinstance(t, int) and 0 <= t < (vocab_size or t + 1) for t in self.score_token_ids):
                raise ValueError(f"pooling.score_token_ids must be token ids in [0, {vocab_size}), "
                                 f"got {self.score_token_ids!r}")

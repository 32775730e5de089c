"""What a step costs: its time as a linear function of its shape, fitted from the engine's own steps.

    seconds = base + per_decode x decodes + per_kv x context_tokens / 1024 + per_prefill x prefill_tokens / 1024

`decodes` are the step's decoding requests, `context_tokens` the KV their attention reads,
`prefill_tokens` the step's new prompt tokens (their attention over the prompt's earlier chunks is
folded into their weight: counting it as context would make the two features move together). The fit is least squares
over every observed step, older steps weighing less (FORGETTING per step), so that the model follows
the machine (warm caches, CUDA graphs, clocks). A weak ridge pulls toward the previous fit, which keeps
the 4x4 system solvable before the steps have varied in every feature. The scheduler asks it only once
it has seen MIN_OBSERVATIONS steps; before that, nothing is capped.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kestrel.core.batch import ScheduledBatch

FORGETTING = 0.995  # weight of a step 140 steps old: 1/2
MIN_OBSERVATIONS = 8
REFIT_EVERY = 4  # steps between two solves: the coefficients move slowly, the solve is not free
RIDGE = 1e-6
FEATURES = ("base", "per_decode", "per_1k_context", "per_1k_prefill")


@dataclass(frozen=True)
class StepShape:
    decodes: int
    context_tokens: int
    prefill_tokens: int

    @classmethod
    def of(cls, batch: ScheduledBatch) -> "StepShape":
        n = batch.num_prefill
        context = sum(batch.prefix_lens[n:]) + sum(batch.extend_lens[n:])
        return cls(batch.batch_size - n, context, sum(batch.extend_lens[:n]))

    def features(self) -> np.ndarray:
        return np.array([1.0, self.decodes, self.context_tokens / 1024, self.prefill_tokens / 1024])


class StepCostModel:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget every step seen."""
        self._gram = np.zeros((4, 4))
        self._moment = np.zeros(4)
        self.coef = np.zeros(4)
        self.observations = 0

    @property
    def fitted(self) -> bool:
        # A prefill coefficient of 0 would promise free prefill: not a model to size chunks with.
        return self.observations >= MIN_OBSERVATIONS and self.coef[3] > 0

    def observe(self, shape: StepShape, seconds: float) -> None:
        x = shape.features()
        self._gram = FORGETTING * self._gram + np.outer(x, x)
        self._moment = FORGETTING * self._moment + seconds * x
        self.observations += 1
        if self.observations % REFIT_EVERY == 0 or self.observations == MIN_OBSERVATIONS:
            self.refit()

    def refit(self) -> None:
        ridge = RIDGE * max(1.0, float(np.trace(self._gram)))
        coef = np.linalg.solve(self._gram + ridge * np.eye(4), self._moment + ridge * self.coef)
        # No feature makes a step faster; a negative weight is noise of features that moved together.
        self.coef = np.clip(coef, 0.0, None)

    def predict(self, shape: StepShape) -> float:
        return float(shape.features() @ self.coef)

    def prefill_tokens_within(self, seconds: float, decodes: int, context_tokens: int) -> int:
        """The most prefill tokens a step of `decodes` decodes over `context_tokens` can carry in
        `seconds`; 0 when the rest alone takes longer."""
        rest = self.predict(StepShape(decodes, context_tokens, 0))
        per_token = self.coef[3] / 1024
        return max(0, int((seconds - rest) / per_token))

    def describe(self) -> str:
        return ", ".join(f"{name}={value * 1e3:.4g}ms" for name, value in zip(FEATURES, self.coef))

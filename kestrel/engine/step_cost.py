"""What a step costs: its time as a linear function of its shape, fitted from the engine's own steps.

    seconds = base + per_decode x decodes + per_kv x context_tokens / 1024
              + [the step prefills] x (prefill_step + per_prefill x prefill_tokens / 1024
                                       + per_prefill_attention x prefill_pairs / 2**20)

`decodes` are the step's decoding requests, `context_tokens` the KV their attention reads,
`prefill_tokens` the step's new prompt tokens and `prefill_pairs` the (query, key) pairs of their
attention: a chunk of c tokens after p earlier ones has c x (p + (c + 1) / 2). Without the pairs a
long prompt's later chunks, which attend over all the earlier ones, take longer than the model says
(on the CPU, 20 % more at the end of a 1280-token prompt). `prefill_step` is what a step pays for
carrying any prefill at all: on a GPU, decode steps replay CUDA graphs while a step with prefill
launches its kernels from the host (~5 ms for an 8B model on the H100, eager). Without it the fit
spreads that fixed cost over the prefill tokens, so that it overestimates large chunks and
underestimates small ones; chunks sized to a target then come out small and many, each paying the
fixed cost again (on the H100, a 30 ms target cost 22 % of the c64 output rate). A weight per
prefilled request was tried and left out: fitted from the few prefill steps seen early, it made the
chunk's weights less certain and the predicted chunks larger than they turned out.
The fit is least squares over every observed step with non-negative weights (no feature makes a step
faster), older steps weighing less (FORGETTING per step), so that the model follows the machine (warm
caches, CUDA graphs, clocks). A weak ridge pulls toward the previous fit, which keeps the system
solvable before the steps have varied in every feature.

The weights are solved under the constraint, not clipped after an unconstrained solve: served steps
vary little at first (decode steps of one batch size, one prefill), and a clipped solve of such steps
puts a prefill's time on `base` and then predicts every decode step at the prefill's time. A linear
model is trusted only near what it has seen: `trusted_prefill_tokens` is GROWTH times the largest
prefill of one request it has observed, so a chunk sized from it grows step by step as it learns. And
it knows how wrong it is: `overrun` is the largest ratio of measured to predicted time over the last
OVERRUN_WINDOW steps that prefilled (those a target sizes), starting from OVERRUN_PRIOR, never below 1.
"""
from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass

import numpy as np

from kestrel.core.batch import ScheduledBatch

FORGETTING = 0.995  # weight of a step 140 steps old: 1/2
MIN_OBSERVATIONS = 8
REFIT_EVERY = 4  # steps between two solves: the coefficients move slowly, the solve is not free
RIDGE = 1e-6
RIDGE_FLOOR = 1e-12  # for features no step has had yet: their weights stay where they were
GROWTH = 2
OVERRUN_PRIOR = 1.3  # until OVERRUN_WINDOW steps have been predicted: early CPU steps err by up to 25 %
OVERRUN_WINDOW = 32
FEATURES = ("base", "per_decode", "per_1k_context", "prefill_step", "per_1k_prefill", "per_1m_prefill_pairs")
PREFILL_STEP, PER_1K_PREFILL, PER_1M_PAIRS = map(FEATURES.index, ("prefill_step", "per_1k_prefill", "per_1m_prefill_pairs"))
# Every subset of the features that may have non-zero weights, for the non-negative solve.
SUPPORTS = [list(s) for n in range(1, len(FEATURES) + 1) for s in itertools.combinations(range(len(FEATURES)), n)]
_SUPPORT_MASKS = np.array([[i in s for i in range(len(FEATURES))] for s in SUPPORTS])
_PAIRS_IN = _SUPPORT_MASKS[:, :, None] & _SUPPORT_MASKS[:, None, :]
_OUTSIDE_EYE = np.eye(len(FEATURES)) * ~_SUPPORT_MASKS[:, None, :]


@dataclass(frozen=True)
class StepShape:
    decodes: int
    context_tokens: int
    prefill_tokens: int
    prefill_pairs: int = 0
    prefill_requests: int = 0  # the trust region counts per request (`trusted_prefill_tokens`)

    @classmethod
    def of(cls, batch: ScheduledBatch) -> "StepShape":
        n = batch.num_prefill
        context = sum(batch.prefix_lens[n:]) + sum(batch.extend_lens[n:])
        pairs = sum(prefill_pairs(c, p) for c, p in zip(batch.extend_lens[:n], batch.prefix_lens[:n]))
        return cls(batch.batch_size - n, context, sum(batch.extend_lens[:n]), pairs, n)

    def features(self) -> np.ndarray:
        return np.array([1.0, self.decodes, self.context_tokens / 1024, float(self.prefill_tokens > 0),
                         self.prefill_tokens / 1024, self.prefill_pairs / 2**20])


def prefill_pairs(tokens: int, prefix: int) -> int:
    """(query, key) pairs of causal attention of `tokens` new tokens after `prefix` earlier ones."""
    return tokens * prefix + tokens * (tokens + 1) // 2


class StepCostModel:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget every step seen."""
        self._gram = np.zeros((len(FEATURES), len(FEATURES)))
        self._moment = np.zeros(len(FEATURES))
        self.coef = np.zeros(len(FEATURES))
        self.observations = 0
        self.largest_prefill = 0  # tokens of the largest prefill of one request seen
        self._overruns = deque([OVERRUN_PRIOR], maxlen=OVERRUN_WINDOW)

    @property
    def fitted(self) -> bool:
        # Prefill weights of 0 would promise free prefill: not a model to size chunks with.
        return self.observations >= MIN_OBSERVATIONS and (self.coef[PER_1K_PREFILL] > 0 or self.coef[PER_1M_PAIRS] > 0)

    def observe(self, shape: StepShape, seconds: float) -> None:
        if shape.prefill_tokens and self.fitted:
            self._overruns.append(seconds / self.predict(shape))
        x = shape.features()
        self._gram = FORGETTING * self._gram + np.outer(x, x)
        self._moment = FORGETTING * self._moment + seconds * x
        self.observations += 1
        per_request = shape.prefill_tokens // max(1, shape.prefill_requests)
        larger = per_request > self.largest_prefill  # news the next chunk's size depends on
        self.largest_prefill = max(self.largest_prefill, per_request)
        if larger or self.observations % REFIT_EVERY == 0 or self.observations == MIN_OBSERVATIONS:
            self.refit()

    def refit(self) -> None:
        """Minimise the weighted squared error plus the ridge toward the previous fit, weights >= 0. The
        problem is convex, so its optimum is the best of the unconstrained optima over the subsets of
        free weights that come out non-negative (63 subsets of 6 features: small solves)."""
        # Each feature's ridge is in its own scale: one ridge for all would be set by the largest feature
        # (decodes, in the tens) and hold the small ones (prefill pairs / 2**20) at their previous weights.
        ridge = RIDGE * np.diag(self._gram) + RIDGE_FLOOR
        gram = self._gram + np.diag(ridge)
        moment = self._moment + ridge * self.coef
        # Every support's system at once (the engine refits on its own loop): a support's block of the
        # Gram matrix with the identity on the features outside it, whose weights then come out 0.
        systems = np.where(_PAIRS_IN, gram, 0.0) + _OUTSIDE_EYE
        free = np.linalg.solve(systems, np.where(_SUPPORT_MASKS, moment, 0.0)[..., None])[..., 0]
        values = -(free @ moment)  # the quadratic's value at each optimum, less the constant
        values[(free < 0).any(axis=1) | (values >= 0)] = np.inf  # every weight 0 scores 0: the fallback
        best = int(np.argmin(values))
        self.coef = free[best] if np.isfinite(values[best]) else np.zeros(len(FEATURES))

    def predict(self, shape: StepShape) -> float:
        return float(shape.features() @ self.coef)

    @property
    def overrun(self) -> float:
        """How much longer than predicted the recent prefill steps took, at most (>= 1)."""
        return max(1.0, max(self._overruns))

    @property
    def trusted_prefill_tokens(self) -> int:
        """The largest prefill of one request the model may size a step for: GROWTH times the largest
        it has seen."""
        return GROWTH * self.largest_prefill

    def prefill_tokens_within(self, seconds: float, decodes: int, context_tokens: int, prefix: int = 0) -> int:
        """The most prefill tokens of one request, after `prefix` earlier ones of its prompt, that a step
        of `decodes` decodes over `context_tokens` is predicted to carry in `seconds`; 0 when the rest
        alone takes longer. (The cost is a quadratic in the tokens: its positive root.)"""
        spare = seconds - self.predict(StepShape(decodes, context_tokens, 0)) - self.coef[PREFILL_STEP]
        return self.prefill_tokens_costing(spare, prefix)

    def prefill_tokens_costing(self, seconds: float, prefix: int = 0) -> int:
        """The prefill tokens of one request, after `prefix` earlier ones, whose own work (tokens and
        attention pairs, not the fixed cost of a prefilling step) is predicted to take `seconds`."""
        if seconds <= 0:
            return 0
        per_pair = self.coef[PER_1M_PAIRS] / 2**20
        linear = self.coef[PER_1K_PREFILL] / 1024 + per_pair * (prefix + 0.5)  # pairs: c x prefix + c (c + 1) / 2
        quadratic = per_pair / 2
        # The root written so that nothing cancels when the quadratic weight is (nearly) 0.
        return int(2 * seconds / (linear + np.sqrt(linear * linear + 4 * quadratic * seconds)))

    def describe(self) -> str:
        weights = ", ".join(f"{name}={value * 1e3:.4g}ms" for name, value in zip(FEATURES, self.coef))
        return f"{weights}; steps take up to {self.overrun:.2f}x the prediction"

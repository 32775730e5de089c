"""The start-up profile that seeds the step-cost model: a few synthetic steps, timed as served ones are.

Synthetic requests (random prompts of a few sizes, greedy, ignoring EOS) arrive one per step over the
first half of the profile, so its steps vary in all three features of the model: prefill alone,
prefill beside a growing decode batch, decodes alone. The profile runs twice and the model keeps only
the second run: the first one pays for kernel compilation and warm-up, which served steps never see.
The fitted coefficients go to the start-up log.
"""
from __future__ import annotations

import logging
import random

from kestrel.core.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

PROMPT_SIZES = (32, 128, 512, 2048)


def profile_step_cost(engine, steps: int) -> None:
    """Run `steps` synthetic engine steps (twice) on an idle `engine` and seed its step-cost model."""
    longest = min(engine.max_req_len // 2, max(PROMPT_SIZES))
    sizes = [min(size, longest) for size in PROMPT_SIZES]
    rng = random.Random(0)
    with engine.scheduler.policy.uncapped():  # the profile is there to time large prefills beside decodes
        for keep in (False, True):
            _profile_run(engine, steps, sizes, rng, keep)
    cost = engine.scheduler.cost
    cost.refit()
    logger.info("step-cost model from %d profile steps: %s", cost.observations, cost.describe())


def _profile_run(engine, steps: int, sizes: list[int], rng: random.Random, keep: bool) -> None:
    """One run of the profile's steps on a reset model (the last run is the one kept); `keep` names its requests."""
    engine.scheduler.cost.reset()  # the warm-up run is forgotten
    rids = []
    params = SamplingParams(max_new_tokens=steps, temperature=0.0, ignore_eos=True, seed=0)
    for step in range(steps):
        if step < (steps + 1) // 2:
            prompt = [rng.randrange(engine.vocab_size) for _ in range(sizes[step % len(sizes)])]
            rids.append(engine.add_request(prompt_token_ids=prompt, sampling_params=params,
                                           rid=f"step-cost-profile-{int(keep)}-{step}"))
        engine.step()
    engine.discard(rids)

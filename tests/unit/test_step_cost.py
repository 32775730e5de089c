"""The step-cost model and the prefill budget it sets, on made-up step times."""
from __future__ import annotations

import pytest

from kestrel.config import SchedulerConfig
from kestrel.core.request import Request
from kestrel.core.sampling_params import SamplingParams
from kestrel.engine import policy as policy_module
from kestrel.engine.policy import MIN_PREFILL_TOKENS, SchedulePolicy
from kestrel.engine.step_cost import FEATURES, OVERRUN_PRIOR, OVERRUN_WINDOW, StepCostModel, StepShape, prefill_pairs


def law(shape: StepShape) -> float:
    """A device: 1 ms a step, 0.3 ms a decode, 80 us a prefill token, 40 ns an attention pair."""
    return 1e-3 + 3e-4 * shape.decodes + 8e-5 * shape.prefill_tokens + 4e-8 * shape.prefill_pairs


def chunk(tokens: int, prefix: int = 0) -> StepShape:
    return StepShape(0, 0, tokens, prefill_pairs(tokens, prefix), 1)


def test_decode_steps_and_one_prefill_fit_both():
    """Served steps vary little at first: one decode batch size and one prefill. A solve clipped after the
    fact put the prefill's time on the intercept and predicted every decode step at ~the prefill's time;
    the constrained solve predicts both."""
    cost = StepCostModel()
    decode = StepShape(8, 600, 0)
    prefill = StepShape(0, 0, 512, 8 * prefill_pairs(64, 0), 8)
    cost.observe(prefill, law(prefill))
    for _ in range(12):
        cost.observe(decode, law(decode))
    cost.refit()
    assert cost.fitted
    assert cost.predict(decode) == pytest.approx(law(decode), rel=0.02)
    assert cost.predict(prefill) == pytest.approx(law(prefill), rel=0.02)


def test_a_long_prompts_chunks_are_predicted_with_their_attention_over_the_earlier_ones():
    cost = StepCostModel()
    for prefix in range(0, 4096, 256):
        for tokens in (64, 256):
            cost.observe(chunk(tokens, prefix), law(chunk(tokens, prefix)))
    cost.refit()
    late = chunk(200, 6000)
    assert cost.predict(late) == pytest.approx(law(late), rel=0.01)
    # The chunk that fits 20 ms after 6000 tokens: the root of the quadratic.
    tokens = cost.prefill_tokens_within(0.02, 0, 0, prefix=6000)
    assert law(chunk(tokens, 6000)) <= 0.02 < law(chunk(tokens + 2, 6000))


def test_a_vanishing_attention_weight_gives_the_linear_chunk():
    """The root is written so that a pair weight of ~0 does not cancel into noise."""
    cost = StepCostModel()
    cost.coef[:] = [1e-3, 0.0, 0.0, 0.0, 0.08, 1e-14]
    assert cost.prefill_tokens_within(0.021, 0, 0, prefix=3000) == pytest.approx(256, abs=1)


def test_the_model_trusts_itself_near_what_it_has_seen_and_knows_its_error():
    cost = StepCostModel()
    assert cost.trusted_prefill_tokens == 0 and cost.overrun == OVERRUN_PRIOR
    cost.observe(StepShape(0, 0, 512, 0, 8), 0.01)  # 8 prompts of 64
    assert cost.trusted_prefill_tokens == 128
    for _ in range(8):
        cost.observe(StepShape(4, 100, 0), law(StepShape(4, 100, 0)))
    for n in (64, 128, 96, 80):
        cost.observe(chunk(n), law(chunk(n)))
    cost.refit()
    for _ in range(OVERRUN_WINDOW):  # every prefill step 1.5x what the model says
        cost.observe(chunk(100), 1.5 * cost.predict(chunk(100)))
    assert cost.overrun == pytest.approx(1.5, rel=0.05)


def request(rid: str, prompt: int, generated: int = 0) -> Request:
    req = Request(rid, [5] * prompt, SamplingParams(max_new_tokens=100), seed=0, arrival=0)
    req.output_ids = [7] * generated
    return req


def fitted_policy(itl_target_ms: float | None = 20.0) -> SchedulePolicy:
    cost = StepCostModel()
    shapes = [StepShape(d, 100 * d, 0) for d in (1, 4, 8, 16)] + [chunk(n, p) for n in (64, 256) for p in (0, 512)]
    for shape in shapes * 3:
        cost.observe(shape, law(shape))
    cost.refit()
    cost._overruns.clear()
    cost._overruns.append(1.0)
    return SchedulePolicy(SchedulerConfig(itl_target_ms=itl_target_ms), cost, lambda: 0.0)


def test_prefill_beside_decodes_is_sized_to_the_target_and_uncapped_alone():
    policy = fitted_policy()
    decodes = [request(f"d{i}", 100, 10) for i in range(8)]
    assert policy.prefill_budget([], mixed=False, gap_spent_s=0.0) is None  # nothing decoding: no cap
    assert fitted_policy(None).prefill_budget(decodes, mixed=False, gap_spent_s=0.0) is None
    long = request("long", 4000)
    tokens = policy.prefill_budget(decodes, mixed=False, gap_spent_s=0.0, chunked=long)
    decode = StepShape(8, 8 * 110, 0)
    assert MIN_PREFILL_TOKENS < tokens <= policy.cost.trusted_prefill_tokens
    assert law(chunk(tokens)) + law(decode) <= 0.02 * 1.01
    # The prompt's last chunk: the decode step after it carries the prompt too, so its chunk is smaller.
    long.kv_len = 3900
    last = policy.prefill_budget(decodes, mixed=False, gap_spent_s=0.0, chunked=long)
    assert last < 100 and law(chunk(last, 3900)) + law(StepShape(9, 8 * 110 + 4000, 0)) <= 0.02 * 1.01


def test_an_unfitted_model_allows_a_small_chunk_per_decode_step():
    policy = SchedulePolicy(SchedulerConfig(itl_target_ms=20.0), StepCostModel(), lambda: 0.0)
    decodes = [request("d", 100, 10)]
    assert policy.prefill_budget(decodes, mixed=False, gap_spent_s=0.0) == MIN_PREFILL_TOKENS
    assert policy.gap_spent(chunk(MIN_PREFILL_TOKENS)) == pytest.approx(0.02)  # unknown: the decodes go next
    assert policy.prefill_budget(decodes, mixed=False, gap_spent_s=0.02) == 0
    assert policy.prefill_budget(decodes, mixed=True, gap_spent_s=0.0) == MIN_PREFILL_TOKENS


def test_a_fixed_cost_of_prefilling_steps_is_fitted_apart_from_the_tokens():
    """Decode steps replay graphs, steps with prefill launch eagerly (a fixed cost): the model fits that
    cost on its own, and the chunk it sizes fills the budget, neither over nor (much) under."""
    def graph_law(shape: StepShape) -> float:
        return law(shape) + (5e-3 if shape.prefill_tokens else 0.0)

    cost = StepCostModel()
    for decodes in (1, 8, 32, 8):
        cost.observe(StepShape(decodes, 100 * decodes, 0), graph_law(StepShape(decodes, 100 * decodes, 0)))
    for tokens in (32, 512, 128, 2048):
        mixed = StepShape(4, 400, tokens, prefill_pairs(tokens, 0), 1)
        cost.observe(mixed, graph_law(mixed))
    cost.refit()
    assert cost.coef[FEATURES.index("prefill_step")] == pytest.approx(5e-3, rel=0.05)
    tokens = cost.prefill_tokens_within(0.03, 8, 800)
    fits = StepShape(8, 800, tokens, prefill_pairs(tokens, 0), 1)
    more = StepShape(8, 800, tokens + 2, prefill_pairs(tokens + 2, 0), 1)
    assert graph_law(fits) <= 0.03 * 1.01 and graph_law(more) > 0.03 * 0.99


def test_a_step_past_the_target_carries_the_chunk_that_costs_its_fixed_cost(monkeypatch):
    """Where the decodes and a prefilling step's fixed cost alone take longer than the target, the chunk
    is sized so that its own work costs as much as that fixed cost (its step overshoots the target), not
    64 tokens that each pay the fixed cost again."""
    def graph_law(shape: StepShape) -> float:
        return law(shape) + (3e-2 if shape.prefill_tokens else 0.0)

    cost = StepCostModel()
    shapes = [StepShape(d, 100 * d, 0) for d in (1, 4, 8, 16)] + \
        [StepShape(4, 400, n, prefill_pairs(n, p), 1) for n in (64, 256) for p in (0, 512)]
    for shape in shapes * 3:
        cost.observe(shape, graph_law(shape))
    cost.refit()
    cost._overruns.clear()
    cost._overruns.append(1.0)
    policy = SchedulePolicy(SchedulerConfig(itl_target_ms=10.0), cost, lambda: 0.0)
    decodes = [request(f"d{i}", 100, 10) for i in range(16)]  # 6.3 ms of decodes + 30 ms fixed: over 10 ms
    tokens = policy.prefill_budget(decodes, mixed=True, gap_spent_s=0.0)
    own = law(chunk(tokens)) - law(chunk(0))  # the chunk's own work
    assert own == pytest.approx(3e-2, rel=0.05) and tokens > 4 * MIN_PREFILL_TOKENS
    monkeypatch.setattr(policy_module, "AMORTIZE_PREFILL_STEP", False)  # before: the 64-token floor
    assert policy.prefill_budget(decodes, mixed=True, gap_spent_s=0.0) == MIN_PREFILL_TOKENS

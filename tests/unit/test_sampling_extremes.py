"""Every float sampling field swept over subnormal, tiny, huge and non-finite values and the edges of its
range: SamplingParams.validate refuses what is outside the range, and whatever it accepts samples valid
tokens (in the vocabulary, not blocked, finite logprobs) on the torch and the Triton sampler; a
temperature or top_p too small to compute with samples the greedy token."""
from __future__ import annotations

import math

import pytest
import torch

from kestrel.core.request import Request
from kestrel.core.sampling_params import GREEDY_BELOW_TEMPERATURE, SamplingParams
from kestrel.sampling.sampler import Sampler, SamplingBatch

VOCAB, EOS = 64, 3
INF = math.inf
SUBNORMAL = [5e-324, 1e-320, 1e-45]  # float64 subnormals, and float32's smallest
TINY = [1e-38, 1e-30]
HUGE = [1e30, 1e308]
# field -> (low, low included, high, high included): the range SamplingParams accepts.
RANGES = {
    "temperature": (0.0, True, INF, False),
    "top_p": (0.0, False, 1.0, True),
    "min_p": (0.0, True, 1.0, True),
    "repetition_penalty": (0.01, True, 2.0, True),
    "frequency_penalty": (-2.0, True, 2.0, True),
    "presence_penalty": (-2.0, True, 2.0, True),
    "logit_bias": (-100.0, True, 100.0, True),  # the bias of one token
}


def sweep(field: str) -> list[float]:
    low, _, high, _ = RANGES[field]
    edges = [e for e in (low, high) if math.isfinite(e)]
    around = [math.nextafter(e, d) for e in edges for d in (-INF, INF)]
    values = [0.0, -0.0, *SUBNORMAL, *TINY, 1.0, *HUGE, INF, -INF, math.nan, *edges, *around,
              GREEDY_BELOW_TEMPERATURE, math.nextafter(GREEDY_BELOW_TEMPERATURE, 0)]
    return values + [-v for v in values if v > 0]


def params_with(field: str, value: float) -> SamplingParams:
    if field == "logit_bias":
        return SamplingParams(logit_bias={5: value, EOS: value})
    return SamplingParams(**{field: value})


def allowed(field: str, value: float) -> bool:
    low, low_in, high, high_in = RANGES[field]
    return (low < value or (low_in and value == low)) and (value < high or (high_in and value == high))


CASES = [(f, v) for f in RANGES for v in sweep(f)]


@pytest.mark.parametrize("field", list(RANGES))
def test_validate_accepts_exactly_the_finite_range(field):
    for value in sweep(field):
        params = params_with(field, value)
        if allowed(field, value):
            params.validate(VOCAB)
        else:
            with pytest.raises(ValueError, match=field):
                params.validate(VOCAB)


def accepted_requests() -> list[tuple[str, float, Request]]:
    """One request per accepted (field, value), with output tokens for the penalties to read and EOS
    blocked by min_new_tokens."""
    out = []
    for i, (field, value) in enumerate(CASES):
        params = params_with(field, value)
        if not allowed(field, value):
            continue
        params.min_new_tokens, params.max_new_tokens, params.logprobs = 4, 8, 3
        params.validate(VOCAB)
        r = Request(rid=f"{field}={value}", prompt_ids=[1, 2, 5, 9], params=params, seed=i, arrival=0)
        r.output_ids = [5, 5, 9]
        out.append((field, value, r))
    return out


@pytest.mark.parametrize("triton_argmax", [False, True], ids=["torch", "triton"])
def test_every_accepted_value_samples_a_valid_token(triton_argmax):
    if triton_argmax:
        pytest.importorskip("triton")
    cases = accepted_requests()
    reqs = [r for _, _, r in cases]
    logits = torch.randn(len(reqs), VOCAB, generator=torch.Generator().manual_seed(0)) * 4
    logits[:, 5] += 10  # a seen token far ahead, so penalties (and tiny ones) have work to do
    logits[:, 7] = -INF  # a token the model rules out (as a grammar or a padded vocab does)
    out = Sampler(triton_argmax)(logits, SamplingBatch.from_requests(reqs, VOCAB, {EOS}, "cpu"))
    for (field, value, _), token, lp, top in zip(cases, out.token_ids, out.logprobs, out.top_logprobs):
        where = f"{field}={value!r}"
        assert 0 <= token < VOCAB and token not in (EOS, 7), where
        assert math.isfinite(lp), where
        assert len(top) == 3 and all(0 <= t < VOCAB and math.isfinite(v) for t, v in top), where


@pytest.mark.parametrize("triton_argmax", [False, True], ids=["torch", "triton"])
def test_a_temperature_or_top_p_too_small_to_compute_with_is_greedy(triton_argmax):
    if triton_argmax:
        pytest.importorskip("triton")
    tiny = [*SUBNORMAL, *TINY, math.nextafter(GREEDY_BELOW_TEMPERATURE, 0)]
    params = [dict(temperature=t) for t in tiny] + [dict(top_p=p, temperature=2.0) for p in [*SUBNORMAL, *TINY]]
    reqs = [Request(rid=str(i), prompt_ids=[1], params=SamplingParams(**p), seed=i, arrival=0)
            for i, p in enumerate(params)]
    logits = torch.randn(len(reqs), VOCAB, generator=torch.Generator().manual_seed(1)) * 4
    logits[0, 10] = logits[0, 20] = logits[0].max() + 1  # a tie: greedy takes the lower id
    logits[-1, 30] = logits[-1, 31] = logits[-1].max() + 1
    out = Sampler(triton_argmax)(logits, SamplingBatch.from_requests(reqs, VOCAB, set(), "cpu"))
    assert out.token_ids == logits.argmax(-1).tolist()


def test_a_huge_temperature_draws_uniformly_from_the_tokens_not_ruled_out():
    """1e308 is inf in float32; -inf / inf would be NaN. It acts as the largest float32: every finite
    logit divides to about 0."""
    n = 2000
    reqs = [Request(rid=str(s), prompt_ids=[1], params=SamplingParams(temperature=1e308), seed=s, arrival=0)
            for s in range(n)]
    logits = (torch.randn(VOCAB, generator=torch.Generator().manual_seed(2)) * 4).expand(n, -1).clone()
    logits[:, :VOCAB // 2] = -INF
    out = Sampler()(logits, SamplingBatch.from_requests(reqs, VOCAB, set(), "cpu"))
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=VOCAB)
    assert counts[:VOCAB // 2].sum() == 0
    assert counts[VOCAB // 2:].min() > 0.5 * n / (VOCAB // 2)  # each kept token near its 1/32 share

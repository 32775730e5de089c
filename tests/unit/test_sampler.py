"""Sampler: greedy/filters, distribution, batch invariance of seeded draws, penalties, logprobs."""
from __future__ import annotations

import math

import pytest
import torch

from kestrel.core.request import Request
from kestrel.core.sampling_params import SamplingParams
from kestrel.sampling.sampler import Sampler, SamplingBatch, bits_to_unit, uniform_coins, uniform_noise

EOS = 3
sampler = Sampler()


def req(seed: int = 1, prompt: list[int] | None = None, output: list[int] | None = None, **params) -> Request:
    r = Request(rid=f"r{seed}", prompt_ids=prompt or [0, 1], params=SamplingParams(**params), seed=seed, arrival=0)
    r.output_ids = list(output or [])
    return r


def sample(logits: torch.Tensor, reqs: list[Request], eos: set[int] = frozenset({EOS})):
    batch = SamplingBatch.from_requests(reqs, logits.shape[-1], set(eos), "cpu")
    return sampler(logits, batch)


def random_logits(bs: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(bs, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_and_ignores_filters():
    logits = random_logits(4, 50)
    reqs = [req(i, temperature=0.0, top_k=3, top_p=0.1, min_p=0.5) for i in range(4)]
    assert sample(logits, reqs).token_ids == logits.argmax(-1).tolist()


def test_half_precision_logits_are_accepted():
    logits = random_logits(2, 50).to(torch.bfloat16)
    out = sample(logits, [req(1, temperature=0.0), req(2, temperature=0.8)])
    assert out.token_ids[0] == logits.float().argmax(-1)[0].item()


@pytest.mark.parametrize("filters", [dict(top_k=1), dict(top_p=1e-6), dict(min_p=0.999)])
def test_tight_filters_equal_greedy(filters):
    logits = random_logits(8, 50)
    reqs = [req(i, temperature=1.5, **filters) for i in range(8)]
    assert sample(logits, reqs).token_ids == logits.argmax(-1).tolist()


def draw_counts(logits_row: torch.Tensor, n: int, **params) -> torch.Tensor:
    """Token counts from n requests with different seeds, all seeing the same logits."""
    logits = logits_row.expand(n, -1).clone()
    out = sample(logits, [req(s, **params) for s in range(n)], eos=set())
    return torch.bincount(torch.tensor(out.token_ids), minlength=logits.shape[-1]).double()


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.double() * counts.sum()
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def test_empirical_distribution_matches_softmax_with_temperature():
    logits = torch.tensor([1.0, 0.0, 2.0, -1.0, 0.5])
    counts = draw_counts(logits, 4000, temperature=0.7)
    # 4 degrees of freedom: P(chi2 > 25) ~ 5e-5; seeds are fixed so the test is deterministic.
    assert chi_square(counts, torch.softmax(logits / 0.7, -1)) < 25


def test_top_k_keeps_only_top_tokens_with_renormalized_ratio():
    logits = torch.tensor([1.0, 0.0, 2.0, -1.0, 0.5])
    counts = draw_counts(logits, 4000, top_k=2)
    assert counts[[1, 3, 4]].sum() == 0
    expected = torch.zeros(5)
    expected[[0, 2]] = torch.softmax(logits[[0, 2]], -1)
    assert chi_square(counts, expected) < 15  # 1 degree of freedom


def test_top_p_keeps_smallest_prefix_reaching_mass():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    counts = draw_counts(probs.log(), 2000, top_p=0.8)  # 0.5 + 0.3 reaches 0.8: tokens 0 and 1
    assert counts[2:].sum() == 0 and counts[:2].min() > 0
    counts = draw_counts(probs.log(), 2000, top_p=0.81)  # needs token 2 as well
    assert counts[3] == 0 and counts[:3].min() > 0


def test_min_p_drops_tokens_below_fraction_of_max():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    counts = draw_counts(probs.log(), 2000, min_p=0.3)  # threshold 0.15 keeps tokens 0..2
    assert counts[3] == 0 and counts[:3].min() > 0


def test_same_seed_and_position_same_token_regardless_of_batch():
    vocab = 64
    target_logits = torch.zeros(vocab)  # flat: any batch dependence would show up
    for seed in range(20):
        alone = sample(target_logits[None], [req(seed, output=[5] * seed)]).token_ids[0]
        for row, bs in [(0, 3), (2, 3), (5, 7)]:
            logits = random_logits(bs, vocab, seed=seed + bs)
            logits[row] = target_logits
            reqs = [req(1000 + i, temperature=0.5 + i / 10, top_k=10) for i in range(bs)]
            reqs[row] = req(seed, output=[5] * seed)
            assert sample(logits, reqs).token_ids[row] == alone


def generate(seed: int, steps: int = 30, vocab: int = 64) -> list[int]:
    """Sample successive positions of one request from flat logits."""
    r = req(seed)
    for _ in range(steps):
        r.output_ids.append(sample(torch.zeros(1, vocab), [r], eos=set()).token_ids[0])
    return r.output_ids


def test_seeds_and_positions_give_different_draws():
    a, b = generate(1), generate(2)
    assert a != b
    assert len(set(a)) > 10  # successive positions are not stuck on one draw
    assert generate(1) == a


def test_seed_halves_and_negative_seeds_matter():
    logits = torch.zeros(1, 1000)
    draws = {s: sample(logits, [req(s)]).token_ids[0] for s in [7, 7 + (1 << 32), -7, (1 << 63) + 7]}
    assert len(set(draws.values())) == 4


def test_uniform_noise_is_in_open_interval_and_roughly_uniform():
    seeds = torch.arange(64)
    u = uniform_noise(seeds, seeds * 3, seeds + 10, 4096)
    assert u.min() > 0 and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.01
    hist = torch.histc(u, bins=10, min=0, max=1)
    assert (hist / u.numel() - 0.1).abs().max() < 0.005


def test_bits_to_unit_is_strictly_inside_and_unchanged_below_the_top_over_all_2_24_values():
    """Every 24-bit value the mapping can see (low bits clear and set): u in (0, 1), and equal to the old
    (x + 0.5) * 2**-24 wherever that was below 1, so only draws that were wrong change."""
    top = torch.arange(1 << 24, dtype=torch.int64)
    old = ((top.to(torch.float32) + 0.5) * (1.0 / (1 << 24)))
    for low in (0, 0xFF):
        u = bits_to_unit((top << 8) | low)
        assert u.dtype == torch.float32
        assert u.min().item() > 0 and u.max().item() < 1
        ok = old < 1
        assert torch.equal(u[ok], old[ok])
        assert int((~ok).sum()) == 1  # x = 2**24 - 1 alone rounded to 1.0


# (seed, position, token): rows of a vocabulary of 8,192 where the old mapping gave u = 1.0 exactly.
HITS = [(280, 5, 2261), (1497, 5, 7807), (2001, 5, 7242), (4999, 5, 6399), (15166, 5, 86)]


def test_noise_of_the_seeds_that_hit_1_is_below_1_and_filtered_tokens_never_win():
    seeds = torch.tensor([s for s, _, _ in HITS])
    u = uniform_noise(seeds, torch.zeros_like(seeds), torch.tensor([p for _, p, _ in HITS]), 8192)
    assert u.max().item() < 1
    for seed, pos, token in HITS:
        logits = random_logits(1, 8192, seed=seed)
        logits[0, token] = logits.min() - 1  # the worst token: outside every filter below
        for params in (dict(top_k=5), dict(top_p=0.5), dict(min_p=0.5)):
            r = req(seed, prompt=[0] * pos, temperature=0.7, **params)
            top = set(logits[0].topk(5).indices.tolist())
            got = sample(logits, [r], eos=set()).token_ids[0]
            assert got != token
            if "top_k" in params:
                assert got in top


def test_sampling_never_picks_a_masked_token_even_with_noise_at_the_extremes(monkeypatch):
    """Robust to the noise anyway: with u = 1 (E = 0) everywhere, masked tokens (prob 0) still lose."""
    import kestrel.sampling.sampler as sampler_module

    monkeypatch.setattr(sampler_module, "uniform_noise", lambda s, h, p, v: torch.ones(s.shape[0], v))
    logits = random_logits(3, 100, seed=9)
    out = sample(logits, [req(i, temperature=1.0, top_k=3) for i in range(3)], eos=set())
    for row, token in enumerate(out.token_ids):
        assert token in logits[row].topk(3).indices.tolist()


def test_coins_are_a_stream_apart_from_the_token_noise():
    seeds = torch.arange(16)
    coins = uniform_coins(seeds, seeds, seeds + 3, 4)
    assert coins.shape == (16, 4) and coins.min() > 0 and coins.max() < 1
    noise = uniform_noise(seeds, seeds, seeds + 3, 4)
    assert not torch.isin(coins, noise).any()
    assert torch.equal(coins, uniform_coins(seeds, seeds, seeds + 3, 4))


def test_penalties_match_reference():
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0, -0.5, 0.0]])
    r = req(prompt=[0, 1], output=[2, 2, 4], temperature=0.0,
            repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    batch = SamplingBatch.from_requests([r], 6, set(), "cpu")
    got = batch.penalties.apply(logits)
    expected = torch.tensor([[2.0 / 2, -1.0 * 2, 0.5 / 2 - 2 * 0.5 - 0.25, 1.0, -0.5 * 2 - 0.5 - 0.25, 0.0]])
    torch.testing.assert_close(got, expected)


def test_penalties_only_touch_rows_that_ask():
    logits = random_logits(2, 6)
    reqs = [req(1, output=[2], temperature=0.0, frequency_penalty=1.0), req(2, output=[2], temperature=0.0)]
    got = SamplingBatch.from_requests(reqs, 6, set(), "cpu").penalties.apply(logits)
    assert torch.equal(got[1], logits[1])
    assert got[0, 2] == logits[0, 2] - 1.0
    assert SamplingBatch.from_requests([reqs[1]], 6, set(), "cpu").penalties is None


def test_penalty_changes_greedy_choice():
    logits = torch.tensor([[0.0, 1.0, 0.9]])
    assert sample(logits, [req(output=[1], temperature=0.0, presence_penalty=0.5)]).token_ids == [2]


def test_min_new_tokens_blocks_eos_and_stop_ids():
    logits = torch.tensor([[0.0, 0.0, 5.0, 9.0, 0.0, 1.0]])  # EOS=3 best, stop id 2 next
    params = dict(temperature=0.0, min_new_tokens=2, stop_token_ids=[2])
    assert sample(logits, [req(output=[0], **params)]).token_ids == [5]
    assert sample(logits, [req(output=[0, 0], **params)]).token_ids == [3]  # min reached
    # ignore_eos lifts the block for eos only; stop ids stay blocked.
    assert sample(logits, [req(output=[0], ignore_eos=True, **params)]).token_ids == [3]
    logits[0, 3] = -9.0
    assert sample(logits, [req(output=[0], ignore_eos=True, **params)]).token_ids == [5]


def test_logprobs_chosen_and_top_n():
    logits = random_logits(3, 20)
    reqs = [req(1, temperature=0.0, logprobs=4), req(2), req(3, temperature=0.9, logprobs=0)]
    out = sample(logits, reqs)
    ref = torch.log_softmax(logits, -1)
    for row in (0, 2):
        assert out.logprobs[row] == pytest.approx(ref[row, out.token_ids[row]].item(), abs=1e-5)
    assert out.logprobs[1] is None and out.top_logprobs[1] is None
    assert out.top_logprobs[2] == []
    top = out.top_logprobs[0]
    assert len(top) == 4 and [v for _, v in top] == sorted((v for _, v in top), reverse=True)
    assert top[0][0] == out.token_ids[0]
    for tok, v in top:
        assert v == pytest.approx(ref[0, tok].item(), abs=1e-5)


def test_logprobs_are_before_temperature_but_after_blocking():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    out = sample(logits, [req(temperature=0.3, logprobs=2, min_new_tokens=1)])
    blocked = logits.clone()
    blocked[0, EOS] = -math.inf
    ref = torch.log_softmax(blocked, -1)[0]
    assert out.token_ids[0] != EOS
    assert out.logprobs[0] == pytest.approx(ref[out.token_ids[0]].item(), abs=1e-5)
    assert [t for t, _ in out.top_logprobs[0]] == [2, 1]


def test_triton_argmax_sampler_gives_the_same_tokens():
    """The Triton argmax (interpreter on CPU) picks what torch's does, ties and -inf rows included,
    for greedy rows and for the sampled rows' exponential race."""
    pytest.importorskip("triton")
    from kestrel.sampling.argmax_triton import argmax_rows

    logits = random_logits(4, 9000, seed=5)
    logits[1, 4100] = logits[1, 8200] = 100.0  # a tie across chunks
    logits[2, 7] = logits[2, 8] = 100.0  # a tie inside a chunk
    logits[3] = float("-inf")
    assert argmax_rows(logits, block=1024).tolist() == logits.argmax(-1).tolist()
    reqs = [req(i, temperature=0.0 if i % 2 else 0.9, top_k=50) for i in range(3)]
    batch = SamplingBatch.from_requests(reqs, logits.shape[-1], {EOS}, "cpu")
    assert Sampler(triton_argmax=True)(logits[:3], batch).token_ids == sampler(logits[:3], batch).token_ids


def test_logit_bias_is_added_to_the_logits_of_its_row_for_greedy_and_sampled_rows():
    logits = random_logits(4, 40, seed=3)
    low, best = int(logits[0].argmin()), int(logits[1].argmax())
    reqs = [req(1, temperature=0.0, logit_bias={low: 100.0}, logprobs=2),  # forces the worst token
            req(2, temperature=0.0, logit_bias={best: -100.0, 7: 0.5}, logprobs=2),  # bans the best one
            req(3, temperature=0.9, logit_bias={low: 100.0}),
            req(4, temperature=0.0, logprobs=2)]  # no bias: untouched by its neighbours'
    out = sample(logits, reqs, eos=set())
    biased = logits.clone()
    biased[0, low] += 100.0
    biased[1, best] -= 100.0
    biased[1, 7] += 0.5
    assert out.token_ids[:2] == biased[:2].argmax(-1).tolist()
    assert out.token_ids[0] == low and out.token_ids[1] != best
    assert out.token_ids[2] == low  # e**-100 leaves the others no chance
    assert out.token_ids[3] == int(logits[3].argmax())
    # Logprobs describe the biased logits, as penalties and blocking are included in them.
    ref = torch.log_softmax(biased, -1)
    for row in (0, 1, 3):
        assert out.logprobs[row] == pytest.approx(ref[row, out.token_ids[row]].item(), abs=1e-5)
        assert [t for t, _ in out.top_logprobs[row]] == ref[row].topk(2).indices.tolist()


def test_logit_bias_cannot_lift_a_blocked_token_and_follows_penalties():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 0.5]])
    # EOS (3) is blocked by min_new_tokens: +100 cannot bring it back.
    blocked = req(output=[0], temperature=0.0, min_new_tokens=2, logit_bias={EOS: 100.0})
    assert sample(logits, [blocked]).token_ids == [2]
    # Penalty first (2 / 2 = 1), then the bias: 1 + 0.75 beats token 1 (1.0) and token 4 (0.5).
    r = req(output=[2], temperature=0.0, repetition_penalty=2.0, logit_bias={2: 0.75, EOS: -100.0})
    assert sample(logits, [r]).token_ids == [2]


def test_logit_bias_applies_at_every_node_of_a_verify():
    """A verify's logits [B, n, V]: each row's bias at each of its n positions (same as n single steps)."""
    from kestrel.sampling.sampler import LogitBias

    logits = torch.randn(3, 4, 10, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    bias = LogitBias(torch.tensor([0, 0, 2]), torch.tensor([1, 9, 1]), torch.tensor([5.0, -3.0, 2.5]))
    got = bias.apply(logits)
    want = logits.float().clone()
    want[0, :, 1] += 5.0
    want[0, :, 9] -= 3.0
    want[2, :, 1] += 2.5
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert torch.equal(bias.apply(logits[:, 0]), want[:, 0])


@pytest.mark.parametrize("bias,message", [({50: 1.0}, "50 is not a token id"), ({-1: 1.0}, "-1 is not a token id"),
                                          ({"5": 1.0}, "'5' is not a token id"), ({5: 100.5}, "token 5 has 100.5"),
                                          ({5: math.nan}, "token 5 has nan"), ([5], "got list")])
def test_logit_bias_outside_the_vocabulary_or_range_is_refused(bias, message):
    with pytest.raises(ValueError, match=r"^logit_bias must be a map from token ids in \[0, 50\) to numbers in "
                                         r"\[-100, 100\].*" + message.replace("[", r"\[")):
        SamplingParams(logit_bias=bias).validate(vocab_size=50)
    SamplingParams(logit_bias={0: -100, 49: 100.0}).validate(vocab_size=50)

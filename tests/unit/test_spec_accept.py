"""Acceptance: greedy walks on hand-made trees; sampling keeps the target's (filtered) distribution
(chi-square on a 6-token vocabulary over thousands of seeds, for topk 1 and 3 drafts), is reproducible
from the seeds, and a leaf's bonus is exactly the non-speculative sample."""
from __future__ import annotations

import pytest
import torch

from kestrel.core.request import Request
from kestrel.core.sampling_params import SamplingParams
from kestrel.sampling.sampler import Sampler, SamplingBatch
from kestrel.speculative.accept import accept_greedy, accept_sampling
from kestrel.speculative.tree import DraftTree, ancestor_mask

VOCAB = 6


def tree_of(tokens: list[int], parents: list[int], bs: int = 1) -> DraftTree:
    depths = []
    for p in parents:
        depths.append(0 if p < 0 else depths[p] + 1)
    parents_t = torch.tensor([parents] * bs)
    return DraftTree(tokens=torch.tensor([tokens] * bs), parents=parents_t, depths=torch.tensor([depths] * bs),
                     mask=ancestor_mask(parents_t, max(depths)), max_depth=max(depths))


# Root 1 with children 5 (node 1) and 7 (node 2); 8 (node 3) under 5; 10 (node 4) under 7; 14 (node 5) under 10.
HAND = ([1, 5, 7, 8, 10, 14], [-1, 0, 0, 1, 2, 4])


def test_greedy_walks_to_the_argmax_child_while_one_exists():
    tree = tree_of(*HAND, bs=4)
    argmax = torch.tensor([
        [7, 0, 10, 0, 14, 99],  # the whole right branch, bonus after the leaf
        [5, 8, 0, 42, 0, 0],  # left branch to its leaf 8, bonus 42
        [7, 0, 3, 0, 0, 0],  # 7 accepted, its child 10 is not the argmax 3: bonus 3
        [42, 8, 10, 0, 14, 0],  # nothing accepted: the bonus is the root's argmax
    ])
    out = accept_greedy(tree, argmax)
    assert out.accepted_nodes.tolist() == [[0, 2, 4, 5], [0, 1, 3, -1], [0, 2, -1, -1], [0, -1, -1, -1]]
    assert out.num_accepted.tolist() == [4, 3, 2, 1]
    assert out.bonus_tokens.tolist() == [99, 42, 3, 42]
    assert out.new_tokens.tolist() == [[7, 10, 14, 99], [5, 8, 42, -1], [7, 3, -1, -1], [42, -1, -1, -1]]


def test_greedy_takes_the_first_of_two_equal_siblings():
    # Padded n-gram trees can hold a token twice under one parent.
    tree = tree_of([0, 3, 3, 4], [-1, 0, 0, 2])
    out = accept_greedy(tree, torch.tensor([[3, 9, 4, 5]]))
    assert out.accepted_nodes.tolist() == [[0, 1, -1]] and out.new_tokens.tolist() == [[3, 9, -1]]


# ---- sampling ----------------------------------------------------------------------------------------
def requests(n: int, first_seed: int = 0, **params) -> list[Request]:
    reqs = []
    for i in range(n):
        r = Request(rid=str(i), prompt_ids=[0, 1, 2], params=SamplingParams(**params), seed=first_seed + i, arrival=i)
        r.output_ids = [3]  # the root, committed by the last round
        reqs.append(r)
    return reqs


def sampling_batch(reqs: list[Request]) -> SamplingBatch:
    return SamplingBatch.from_requests(reqs, VOCAB, eos_token_ids=set(), device="cpu")


def filtered(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None) -> torch.Tensor:
    """The target distribution the output must follow, written out plainly."""
    p = torch.softmax(logits.double() / temperature, -1)
    if top_k is not None:
        p = torch.where(p >= p.topk(top_k).values[-1], p, 0.0)
    return p / p.sum()


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.double() * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was produced"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


LOGITS = torch.tensor([[1.2, 0.3, 0.9, -0.5, 0.1, -1.0],  # root: the first token's distribution
                       [0.0, 1.0, -1.0, 0.5, 0.2, 0.0], [0.8, -0.2, 0.0, 0.0, 1.1, -0.6],
                       [0.3, 0.3, 0.3, -2.0, 0.0, 1.0], [-1.0, 0.0, 2.0, 0.0, 0.0, 0.5]])
N_SEEDS = 6000
# P(chi-square with 5 degrees of freedom > 25) ~ 1.4e-4; the seeds are fixed, so the test is deterministic.
THRESHOLD_5DF = 25.0


@pytest.mark.parametrize("draft, params", [
    (([3, 2, 0, 4], [-1, 0, 1, 2]), {}),  # topk 1: a chain drafting 2, then 0, then 4
    (([3, 2, 0, 5, 1], [-1, 0, 0, 0, 1]), {}),  # topk 3: children 2, 0, 5 of the root; 1 under 2
    (([3, 2, 0, 5, 1], [-1, 0, 0, 0, 1]), dict(temperature=0.7, top_k=4)),
])
def test_first_token_follows_the_filtered_target_distribution(draft, params):
    tree = tree_of(*draft, bs=N_SEEDS)
    logits = LOGITS[:len(draft[0])].expand(N_SEEDS, -1, -1)
    out = accept_sampling(logits, tree, sampling_batch(requests(N_SEEDS, **{"temperature": 1.0, **params})))
    q = filtered(LOGITS[0], params.get("temperature", 1.0), params.get("top_k"))
    counts = torch.bincount(out.new_tokens[:, 0], minlength=VOCAB)
    assert chi_square(counts, q) < THRESHOLD_5DF
    # The children are drafts that do get accepted, and some are rejected (the test exercises both).
    accepted = (out.num_accepted > 1).double().mean().item()
    assert 0.05 < accepted < 0.95
    if len(draft[0]) == 5 and not params:
        # Power: a classic bug, resampling from the whole q after rejecting the children instead of
        # from q without them, moves this much mass; at this sample size the test would see it.
        kids = torch.tensor([2, 0, 5])
        buggy = q.clone() * (1 - q[kids].sum())
        buggy[kids] += q[kids]
        assert N_SEEDS * float(((buggy - q) ** 2 / q).sum()) > 4 * THRESHOLD_5DF


def test_second_token_follows_the_target_given_the_first():
    # Root children 2, 0, 5 (nodes 1-3), node 4 = token 1 under node 1: the joint law of the first two
    # committed tokens is q_root(a) * q_node(a)(b) when a is drafted; the round stops otherwise.
    draft = ([3, 2, 0, 5, 1], [-1, 0, 0, 0, 1])
    n = 3 * N_SEEDS
    out = accept_sampling(LOGITS.expand(n, -1, -1), tree_of(*draft, bs=n), sampling_batch(requests(n)))
    q = [filtered(row) for row in LOGITS]
    first, second = out.new_tokens[:, 0], out.new_tokens[:, 1]
    cells, expected = [], []
    for a, node in ((2, 1), (0, 2), (5, 3)):
        for b in range(VOCAB):
            cells.append(((first == a) & (second == b)).sum())
            expected.append(q[0][a] * q[node][b])
    for a in range(VOCAB):
        if a not in (2, 0, 5):
            cells.append(((first == a) & (second == -1)).sum())
            expected.append(q[0][a])
    counts, probs = torch.stack(cells).double(), torch.stack(expected)
    assert torch.isclose(probs.sum(), torch.tensor(1.0, dtype=torch.float64))
    assert counts.sum() == n
    # 20 degrees of freedom: P(chi-square > 50) ~ 2e-4.
    assert chi_square(counts, probs) < 50


def test_a_draft_the_filters_remove_is_never_accepted():
    # top_k=2 at the root keeps tokens 0 and 2; the drafted child 5 must always be rejected.
    out = accept_sampling(LOGITS[:2].expand(2000, -1, -1), tree_of([3, 5], [-1, 0], bs=2000),
                          sampling_batch(requests(2000, top_k=2)))
    assert (out.num_accepted == 1).all() and set(out.new_tokens[:, 0].tolist()) == {0, 2}


def test_same_seeds_same_tokens_whatever_the_batch():
    draft = ([3, 2, 0, 5, 1], [-1, 0, 0, 0, 1])
    logits = torch.randn(64, 5, VOCAB, generator=torch.Generator().manual_seed(0))
    reqs = requests(64, first_seed=1000, temperature=0.9)
    full = accept_sampling(logits, tree_of(*draft, bs=64), sampling_batch(reqs))
    again = accept_sampling(logits, tree_of(*draft, bs=64), sampling_batch(reqs))
    assert torch.equal(full.new_tokens, again.new_tokens)
    rows = [5, 17, 40]
    part = accept_sampling(logits[rows], tree_of(*draft, bs=3), sampling_batch([reqs[i] for i in rows]))
    assert torch.equal(part.new_tokens, full.new_tokens[rows])
    other = accept_sampling(logits, tree_of(*draft, bs=64), sampling_batch(requests(64, first_seed=5000, temperature=0.9)))
    assert not torch.equal(other.new_tokens, full.new_tokens)


def test_a_leaf_bonus_is_the_non_speculative_sample():
    reqs = requests(500, temperature=0.8, top_p=0.9)
    logits = torch.randn(500, 1, VOCAB, generator=torch.Generator().manual_seed(1))
    batch = sampling_batch(reqs)
    out = accept_sampling(logits, tree_of([3], [-1], bs=500), batch)
    assert out.num_accepted.eq(1).all()
    assert out.bonus_tokens.tolist() == Sampler()(logits[:, 0], batch).token_ids


def test_greedy_rows_of_a_sampling_batch_walk_greedily():
    tree = tree_of(*HAND, bs=2)
    logits = torch.full((2, 6, 16), -5.0)
    for node, token in enumerate([7, 0, 10, 0, 14, 9]):
        logits[:, node, token] = 5.0
    reqs = requests(2)
    reqs[0].params = SamplingParams(temperature=0.0)
    out = accept_sampling(logits, tree, SamplingBatch.from_requests(reqs, 16, set(), "cpu"))
    assert out.new_tokens[0].tolist() == [7, 10, 14, 9]


def test_penalties_must_be_applied_by_the_caller():
    reqs = requests(2, repetition_penalty=1.2)
    with pytest.raises(ValueError, match="penalties and min_new_tokens blocking applied per node"):
        accept_sampling(LOGITS[:2].expand(2, -1, -1), tree_of([3, 2], [-1, 0], bs=2), sampling_batch(reqs))

"""Draft trees: a hand-worked example, a brute-force reference on random drafts, chains, masks."""
from __future__ import annotations

import pytest
import torch

from kestrel.speculative.tree import ancestor_mask, build_tree, draft_step


def log(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64).log().float()


def test_hand_worked_tree():
    # Root token 1; topk 2, three steps. Candidates in order: step 0 [5, 7], step 1 [8, 9 | 10, 11],
    # step 2 [12, 13 | 14, 15]; path probabilities 5: .6, 7: .3, 8: .3, 9: .24, 10: .27, 11: .015,
    # 12: .15, 13: .15, 14: .2673, 15: .0027. The frontier after step 1 is {8, 10}.
    s0 = draft_step(log([[[0.6, 0.3]]]), torch.tensor([[[5, 7]]]), None, topk=2)
    assert s0.frontier_tokens.tolist() == [[5, 7]]
    s1 = draft_step(log([[[0.5, 0.4], [0.9, 0.05]]]), torch.tensor([[[8, 9], [10, 11]]]), s0.frontier_scores, 2)
    assert s1.frontier_tokens.tolist() == [[8, 10]] and s1.frontier_parent_lanes.tolist() == [[0, 1]]
    s2 = draft_step(log([[[0.5, 0.5], [0.99, 0.01]]]), torch.tensor([[[12, 13], [14, 15]]]), s1.frontier_scores, 2)
    tree = build_tree(torch.tensor([1]), [s0, s1, s2], num_draft_tokens=6)
    # The five best: 5, 7, 8, 10, 14 (9 at .24 is next), in candidate order.
    assert tree.tokens.tolist() == [[1, 5, 7, 8, 10, 14]]
    assert tree.parents.tolist() == [[-1, 0, 0, 1, 2, 4]]
    assert tree.depths.tolist() == [[0, 1, 1, 2, 2, 3]]
    assert tree.max_depth == 3
    expected = [[0], [0, 1], [0, 2], [0, 1, 3], [0, 2, 4], [0, 2, 4, 5]]
    assert tree.mask[0].tolist() == [[j in row for j in range(6)] for row in expected]
    assert tree.positions(torch.tensor([40])).tolist() == [[40, 41, 41, 42, 42, 43]]


def reference_tree(steps: list[tuple[list[list[float]], list[list[int]]]], topk: int, n: int) -> set[tuple]:
    """Plain Python: paths (tuples of tokens) of the n-1 best candidates by summed logprob."""
    frontier = [((), 0.0)]  # (path, score)
    candidates = []
    for logps, toks in steps:
        proposed = [(path + (t,), score + lp) for (path, score), lps, ts in zip(frontier, logps, toks)
                    for lp, t in zip(lps, ts)]
        candidates += proposed
        frontier = sorted(proposed, key=lambda c: -c[1])[:topk]
    return {c[0] for c in sorted(candidates, key=lambda c: -c[1])[:n - 1]}


@pytest.mark.parametrize("topk, num_steps, n", [(3, 4, 10), (4, 5, 8), (2, 2, 7), (1, 4, 5)])
def test_random_drafts_match_a_brute_force_reference(topk, num_steps, n):
    gen = torch.Generator().manual_seed(topk * 10 + num_steps)
    bs, vocab = 4, 50
    roots = torch.randint(0, vocab, (bs,), generator=gen)
    steps, raw, lane_scores = [], [], None
    for step in range(num_steps):
        lanes = 1 if step == 0 else topk
        logits = torch.randn(bs, lanes, vocab, generator=gen) * 2
        lp, tok = torch.log_softmax(logits, -1).topk(topk, dim=-1)
        s = draft_step(lp, tok, lane_scores, topk)
        steps.append(s)
        raw.append((lp, tok))
        lane_scores = s.frontier_scores
    tree = build_tree(roots, steps, n)
    assert tree.tokens.shape == tree.parents.shape == tree.depths.shape == (bs, n)
    for b in range(bs):
        parents, tokens = tree.parents[b].tolist(), tree.tokens[b].tolist()
        assert parents[0] == -1 and tokens[0] == roots[b].item()
        assert all(0 <= parents[i] < i for i in range(1, n))
        paths = {0: ()}
        for i in range(1, n):
            paths[i] = paths[parents[i]] + (tokens[i],)
            assert tree.depths[b, i] == len(paths[i])
            ancestors = {j for j in paths if paths[j] == paths[i][:len(paths[j])] and j <= i}
            assert {j for j in range(n) if tree.mask[b, i, j]} == ancestors
        # Lane j of a step is the j-th best of the previous frontier, in both.
        expected = reference_tree([(lp[b].tolist(), tok[b].tolist()) for lp, tok in raw], topk, n)
        assert set(paths[i] for i in range(1, n)) == expected


def test_topk_1_is_a_chain_of_the_drafts_argmax():
    tokens = [3, 9, 4]
    steps, lane = [], None
    for t in tokens:
        s = draft_step(torch.tensor([[[-0.1]]]) if lane is None else torch.tensor([[[-0.2]]]),
                       torch.tensor([[[t]]]), lane, topk=1)
        steps.append(s)
        lane = s.frontier_scores
    tree = build_tree(torch.tensor([7]), steps, num_draft_tokens=4)
    assert tree.tokens.tolist() == [[7, 3, 9, 4]] and tree.parents.tolist() == [[-1, 0, 1, 2]]
    assert torch.equal(tree.mask[0], torch.ones(4, 4, dtype=torch.bool).tril())


def test_equal_scores_never_orphan_a_node():
    # Probability-1 drafts give children the score of their parents: ties must keep parents in.
    steps, lane = [], None
    for t in range(4):
        s = draft_step(torch.zeros(1, 1 if lane is None else 2, 2), torch.tensor([[[10 + t, 20 + t]]]).expand(
            1, 1 if lane is None else 2, 2), lane, topk=2)
        steps.append(s)
        lane = s.frontier_scores
    tree = build_tree(torch.tensor([0]), steps, num_draft_tokens=7)
    parents = tree.parents[0].tolist()
    assert all(0 <= parents[i] < i for i in range(1, 7))


def test_asking_for_more_nodes_than_proposed_is_refused():
    s = draft_step(torch.zeros(1, 1, 2), torch.tensor([[[1, 2]]]), None, topk=2)
    with pytest.raises(ValueError, match="num_draft_tokens=4 needs 3 candidates, the steps proposed 2"):
        build_tree(torch.tensor([0]), [s], 4)


def test_ancestor_mask_of_a_hand_tree():
    mask = ancestor_mask(torch.tensor([[-1, 0, 0, 2, 3]]), max_depth=3)
    assert mask[0].int().tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 0, 1, 1, 0],
                                      [1, 0, 1, 1, 1]]

"""NGRAM proposals: longest and most recent matches first, chains and trees, exact sizes, padding,
and a proposal verified by greedy acceptance."""
from __future__ import annotations

import torch

from kestrel.speculative.accept import accept_greedy
from kestrel.speculative.ngram import match_ends, propose_ngram


def paths(draft, row: int = 0) -> list[tuple[int, ...]]:
    """Each node's token path below the root, in node order."""
    tokens, parents = draft.tree.tokens[row].tolist(), draft.tree.parents[row].tolist()
    out = [()]
    for i in range(1, len(tokens)):
        out.append(out[parents[i]] + (tokens[i],))
    return out


def test_matches_come_longest_then_most_recent():
    #         0  1  2  3  4  5  6  7  8
    tokens = [1, 2, 3, 9, 5, 3, 7, 2, 3]  # ends with (2, 3)
    # Position 2 ends "2, 3" (length 2), 5 ends "3" (length 1); 8 is the last token itself.
    assert match_ends(torch.tensor(tokens), max_match=12, min_match=1) == [2, 5]
    assert match_ends(torch.tensor(tokens), max_match=12, min_match=2) == [2]
    assert match_ends(torch.tensor([4, 7, 4, 7, 4]), 12, 1) == [2, 0]  # (4,7,4) beats (4)
    assert match_ends(torch.tensor([5]), 12, 1) == []


def test_a_chain_continues_the_longest_match():
    tokens = [10, 11, 12, 13, 14, 20, 21, 12, 13]  # "12 13" occurred before, followed by 14 20 21 12 13
    draft = propose_ngram([tokens], num_draft_tokens=5, max_depth=4, max_breadth=1)
    assert draft.tree.tokens.tolist() == [[13, 14, 20, 21, 12]]
    assert draft.tree.parents.tolist() == [[-1, 0, 1, 2, 3]] and draft.num_proposed == [4]
    assert draft.tree.max_depth == 4


def test_several_matches_make_a_tree_within_breadth_and_depth():
    # After "7": 1 2 (most recent), 3 4, and 1 5 (earliest).
    tokens = [7, 1, 5, 0, 7, 3, 4, 0, 7, 1, 2, 0, 7]
    draft = propose_ngram([tokens], num_draft_tokens=6, max_depth=2, max_breadth=2)
    # "0 7" occurred twice (most recent first: 1 2, then 3 4); the shorter match "7" at the start
    # continues 1 5, which shares 1 and adds 5.
    assert paths(draft) == [(), (1,), (1, 2), (3,), (3, 4), (1, 5)]
    assert draft.tree.depths.max() <= 2 and draft.num_proposed == [5]
    narrow = propose_ngram([tokens], num_draft_tokens=6, max_depth=2, max_breadth=1)
    assert paths(narrow)[:3] == [(), (1,), (1, 2)] and narrow.num_proposed == [2]


def test_every_request_gets_exactly_num_draft_tokens_nodes():
    batch = [[1, 2, 3], [4, 4, 4, 4, 4, 4], list(range(30)) + [5, 6, 5], [9]]
    draft = propose_ngram(batch, num_draft_tokens=8, max_depth=7, max_breadth=3)
    tree = draft.tree
    assert tree.tokens.shape == tree.parents.shape == tree.mask.shape[:2] == (4, 8)
    assert (tree.tokens[:, 0] == torch.tensor([3, 4, 5, 9])).all()
    for row in range(4):
        parents = tree.parents[row].tolist()
        assert parents[0] == -1 and all(0 <= parents[i] < i for i in range(1, 8))
        for i in range(1, 8):
            assert tree.depths[row, i] == tree.depths[row, parents[i]] + 1
            assert tree.mask[row, i, parents[i]] and tree.mask[row, i, i]
    assert draft.num_proposed[0] == 0 and draft.num_proposed[3] == 0  # no earlier occurrence: all padding
    assert (tree.tokens[0, 1:] == 3).all() and (tree.parents[0, 1:] == 0).all()
    assert draft.num_proposed[1] == 5  # "4" repeated: the chain 4 4 4 4 4 (then padding)
    assert draft.num_proposed[2] >= 1


def test_a_repeating_sequence_is_accepted_whole_by_greedy_verify():
    period = [3, 1, 4, 1, 5, 9, 2, 6]
    tokens = period * 3 + period[:3]
    draft = propose_ngram([tokens], num_draft_tokens=6, max_depth=5, max_breadth=1)
    # A target that continues the period: its argmax after each node is the next token of the period.
    nxt = {(period[i], period[(i + 1) % 8]): period[(i + 2) % 8] for i in range(8)}
    path = paths(draft)
    argmax = []
    for i in range(6):
        seq = tokens + list(path[i])
        argmax.append(nxt[(seq[-2], seq[-1])])
    out = accept_greedy(draft.tree, torch.tensor([argmax]))
    assert out.num_accepted.tolist() == [6]
    assert out.new_tokens[0].tolist() == (period * 4)[len(tokens) % 8:][:6]

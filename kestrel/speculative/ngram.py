"""NGRAM drafting: propose what followed earlier occurrences of the request's last tokens
(docs/design/speculative-decoding.md §1).

No model: the request's last 1..`max_match` tokens are matched against its own prompt + output so far,
longest match first and, among equally long ones, the most recent first. The continuations of the
matches are merged into a tree under the root (the request's last token): the first match gives the
first chain, later ones add branches (at most `max_breadth` children per node, `max_depth` deep) until
the tree holds `num_draft_tokens` nodes. A tree that cannot be filled is padded to exactly that size
with children of the root repeating the root's token (a guess like any other: verify decides), so every
request of a batch sends the same number of tokens to TARGET_VERIFY.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kestrel.speculative.tree import DraftTree, ancestor_mask


@dataclass
class NgramDraft:
    tree: DraftTree
    num_proposed: list[int]  # nodes per request that came from a match (the rest is padding), root excluded


def propose_ngram(token_lists: list[list[int]], num_draft_tokens: int, max_depth: int, max_breadth: int = 10,
                  max_match: int = 12, min_match: int = 1, device: torch.device | str = "cpu") -> NgramDraft:
    """One tree of exactly `num_draft_tokens` nodes per request (each list holds prompt + output, the
    last token being the root). `max_depth`: the deepest drafted node (speculative_num_steps);
    `max_breadth`: children per node (speculative_eagle_topk; 1 drafts a chain)."""
    if not 1 <= min_match <= max_match:
        raise ValueError(f"need 1 <= min_match <= max_match, got {min_match} and {max_match}")
    trees = [_tree(tokens, num_draft_tokens, max_depth, max_breadth, max_match, min_match) for tokens in token_lists]
    tokens, parents, depths = (torch.tensor([t[i] for t in trees], dtype=torch.int64, device=device) for i in range(3))
    deepest = max(max(t[2]) for t in trees)
    return NgramDraft(DraftTree(tokens, parents, depths, ancestor_mask(parents, deepest), deepest),
                      [t[3] for t in trees])


def match_ends(tokens: torch.Tensor, max_match: int, min_match: int) -> list[int]:
    """Positions i < len - 1 where tokens[..i] ends with the last >= min_match tokens, longest match
    first, then the most recent."""
    n = len(tokens)
    if n < 2:
        return []
    ends = torch.arange(n - 1, device=tokens.device)
    length = torch.zeros(n - 1, dtype=torch.int64, device=tokens.device)
    alive = torch.ones(n - 1, dtype=torch.bool, device=tokens.device)
    for back in range(min(max_match, n - 1)):
        # ends[i] - back must be a position, and its token must equal the one `back` before the last.
        ok = ends >= back
        alive &= ok & (tokens[(ends - back).clamp(min=0)] == tokens[n - 1 - back])
        length += alive
    keep = length >= min_match
    order = sorted(zip((-length[keep]).tolist(), (-ends[keep]).tolist()))
    return [-end for _, end in order]


def _tree(tokens: list[int], size: int, max_depth: int, max_breadth: int, max_match: int,
          min_match: int) -> tuple[list[int], list[int], list[int], int]:
    """(node tokens, parents, depths, matched nodes) of one request's tree."""
    node_tokens, parents, depths = [tokens[-1]], [-1], [0]
    children: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    breadth = [0]
    seq = torch.tensor(tokens)
    for end in match_ends(seq, max_match, min_match):
        if len(node_tokens) == size:
            break
        node = 0
        for token in tokens[end + 1:end + 1 + max_depth]:
            child = children.get((node, token))
            if child is None:
                if len(node_tokens) == size or breadth[node] == max_breadth:
                    break
                child = len(node_tokens)
                children[(node, token)] = child
                node_tokens.append(token)
                parents.append(node)
                depths.append(depths[node] + 1)
                breadth[node] += 1
                breadth.append(0)
            node = child
    proposed, pad = len(node_tokens) - 1, size - len(node_tokens)
    return node_tokens + [tokens[-1]] * pad, parents + [0] * pad, depths + [1] * pad, proposed

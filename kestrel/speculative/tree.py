"""Draft trees: from the draft steps' top-k to the nodes TARGET_VERIFY scores
(docs/design/speculative-decoding.md §2, steps 1-3).

Pure tensor functions, batched over requests, on any device; the only Python loops run over draft
steps or tree depth. A round, per request:
- step 0 expands the root (last round's bonus token) into the draft's top-k children;
- each later step runs the draft on the `topk` frontier lanes, scores the topk x topk children by path
  log-probability (the sum of logprobs from the root) and keeps the best `topk` as the next frontier;
- `build_tree` keeps the best `num_draft_tokens - 1` of all candidates, plus the root.
Nodes are ordered so that a parent always comes before its children; node 0 is the root.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class DraftStep:
    """The candidates one draft step proposed, for each request (C = lanes x topk)."""

    scores: torch.Tensor  # [B, C] float: path log-probability of each candidate
    tokens: torch.Tensor  # [B, C] int64
    parent_lanes: torch.Tensor  # [B, C] int64: the previous frontier lane each candidate extends
    frontier: torch.Tensor  # [B, topk] int64: candidates kept as the next step's lanes, best first

    @property
    def frontier_scores(self) -> torch.Tensor:
        return self.scores.gather(1, self.frontier)

    @property
    def frontier_tokens(self) -> torch.Tensor:
        """[B, topk]: the next draft forward's input token for each lane."""
        return self.tokens.gather(1, self.frontier)

    @property
    def frontier_parent_lanes(self) -> torch.Tensor:
        """[B, topk]: whose hidden state (and KV lane) each next lane continues."""
        return self.parent_lanes.gather(1, self.frontier)


@dataclass
class DraftTree:
    """`num_draft` nodes per request, node 0 the root, parents before children.

    `mask[b, i, j]`: node i attends to node j (j is i or one of its ancestors); every node also sees
    the request's whole prefix. Node i sits at position `seq_len + depths[b, i]`, seq_len being the
    tokens whose KV exists before the round. `max_depth` bounds `depths` (a host int, so walking the
    tree needs no device sync)."""

    tokens: torch.Tensor  # [B, N] int64
    parents: torch.Tensor  # [B, N] int64; -1 for the root
    depths: torch.Tensor  # [B, N] int64; 0 for the root
    mask: torch.Tensor  # [B, N, N] bool
    max_depth: int

    def positions(self, seq_lens: torch.Tensor) -> torch.Tensor:
        """[B, N] position of every node, from the tokens with KV before the round [B]."""
        return seq_lens[:, None] + self.depths


def draft_step(logprobs: torch.Tensor, tokens: torch.Tensor, lane_scores: torch.Tensor | None,
               topk: int) -> DraftStep:
    """One step of tree drafting.

    `logprobs`, `tokens`: [B, lanes, topk], the draft's top-k (log-probabilities and ids) after each
    lane: lanes = 1 (the root) at step 0, `topk` later. `lane_scores`: [B, lanes], the lanes' path
    scores (the previous step's `frontier_scores`); None at step 0, where the root scores 0.
    """
    b, lanes, k = logprobs.shape
    # A log-probability is <= 0, so no child outscores its parent; clamping rounding noise keeps that
    # exact, which makes every best-first prefix of the candidates closed under ancestors.
    scores = logprobs.clamp(max=0.0)
    if lane_scores is not None:
        scores = scores + lane_scores[:, :, None]
    scores = scores.reshape(b, lanes * k)
    parent_lanes = torch.arange(lanes, device=logprobs.device).repeat_interleave(k).expand(b, -1)
    return DraftStep(scores, tokens.reshape(b, lanes * k), parent_lanes, best_first(scores)[:, :topk])


def best_first(scores: torch.Tensor) -> torch.Tensor:
    """Indices sorting each row by score, highest first; ties keep index order (a parent, whose
    index is lower, stays ahead of a child with its score)."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices


def build_tree(root_tokens: torch.Tensor, steps: list[DraftStep], num_draft_tokens: int) -> DraftTree:
    """The root plus the `num_draft_tokens - 1` best candidates of all steps (each request keeps its
    own best), in candidate order, which puts parents first. Needs at least that many candidates."""
    device = root_tokens.device
    b = root_tokens.shape[0]
    scores = torch.cat([s.scores for s in steps], 1)
    tokens = torch.cat([s.tokens for s in steps], 1)
    # Global candidate index of each candidate's parent: -1 (the root) for step 0; for step s, the
    # previous step's frontier candidate its lane came from.
    parents, depths, offset = [], [], 0
    for depth, step in enumerate(steps, start=1):
        if depth == 1:
            parents.append(torch.full_like(step.tokens, -1))
        else:
            previous = steps[depth - 2]
            parents.append(offset - previous.tokens.shape[1] + previous.frontier.gather(1, step.parent_lanes))
        depths.append(torch.full_like(step.tokens, depth))
        offset += step.tokens.shape[1]
    parents, depths = torch.cat(parents, 1), torch.cat(depths, 1)
    if num_draft_tokens - 1 > offset:
        raise ValueError(f"num_draft_tokens={num_draft_tokens} needs {num_draft_tokens - 1} candidates, "
                         f"the steps proposed {offset}")

    chosen = best_first(scores)[:, :num_draft_tokens - 1].sort(dim=1).values  # [B, N-1], parents first
    node_of = torch.full((b, offset), -1, dtype=torch.int64, device=device)
    node_of.scatter_(1, chosen, torch.arange(1, num_draft_tokens, device=device).expand(b, -1))
    chosen_parents = parents.gather(1, chosen)
    node_parents = torch.where(chosen_parents < 0, 0, node_of.gather(1, chosen_parents.clamp(min=0)))
    node_parents = torch.cat([torch.full((b, 1), -1, dtype=torch.int64, device=device), node_parents], 1)
    return DraftTree(
        tokens=torch.cat([root_tokens[:, None], tokens.gather(1, chosen)], 1),
        parents=node_parents,
        depths=torch.cat([torch.zeros((b, 1), dtype=torch.int64, device=device), depths.gather(1, chosen)], 1),
        mask=ancestor_mask(node_parents, len(steps)),
        max_depth=len(steps),
    )


def ancestor_mask(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """[B, N, N] bool: node i sees itself and its ancestors, from parents [B, N] (-1: the root)."""
    b, n = parents.shape
    mask = torch.eye(n, dtype=torch.bool, device=parents.device).expand(b, n, n).clone()
    ancestor = parents
    for _ in range(max_depth):
        found = ancestor >= 0
        mask |= F.one_hot(ancestor.clamp(min=0), n).bool() & found[..., None]
        ancestor = torch.where(found, parents.gather(1, ancestor.clamp(min=0)), -1)
    return mask

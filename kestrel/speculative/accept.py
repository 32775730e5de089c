"""Acceptance: which drafted nodes the target's verify confirms, and the bonus token
(docs/design/speculative-decoding.md §2, step 4).

Batched over requests, device-agnostic; loops run over tree depth only. Both rules walk from the
root: greedy takes the child equal to the target's argmax; sampling keeps the output distributed
exactly as the target's (filtered) distribution for deterministic top-k drafts:

- at the current node, with q the target's filtered distribution there, try its children c1, c2, ...
  in node order: accept c_i when its coin u_i < q(c_i) / (the mass of q not on c1 .. c_{i-1}), so
  P(c_i) = q(c_i) exactly, as sampling c_i from q after removing the rejected c1 .. c_{i-1};
- when every child is rejected, the bonus is drawn from q without the children, renormalised: the
  rest of q's mass. A leaf's bonus is therefore a plain sample from q.
Randomness is counter-based (kestrel.sampling.sampler): the coins of depth d come from `uniform_coins`
and the bonus race from `uniform_noise`, at (request seed, position of the token being chosen), so the
same seed gives the same tokens, whatever the batch. A leaf's bonus uses exactly the noise the
non-speculative sampler uses at that position.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kestrel.sampling.sampler import (SamplingBatch, exponential_race, filtered_probs, uniform_coins,
                                    uniform_noise)
from kestrel.speculative.tree import DraftTree


@dataclass
class Acceptance:
    """Per request: the accepted path and what to commit. D = the tree's max depth."""

    accepted_nodes: torch.Tensor  # [B, D + 1] node indices, root first, -1 after the path
    num_accepted: torch.Tensor  # [B] nodes on the path, root included = tokens committed this round
    bonus_tokens: torch.Tensor  # [B] the target's token after the last accepted node
    new_tokens: torch.Tensor  # [B, D + 1] the accepted drafts then the bonus (num_accepted of them), -1 after


def accept_greedy(tree: DraftTree, target_argmax: torch.Tensor) -> Acceptance:
    """`target_argmax` [B, N]: the target's argmax after each node (after any penalties or token
    blocking the caller applies)."""
    node = torch.zeros(tree.tokens.shape[0], dtype=torch.int64, device=tree.tokens.device)
    alive = torch.ones_like(node, dtype=torch.bool)
    path = [node]
    for _ in range(tree.max_depth):
        wanted = target_argmax.gather(1, node[:, None])
        match = (tree.parents == node[:, None]) & (tree.tokens == wanted)
        alive = alive & match.any(1)
        node = torch.where(alive, match.int().argmax(1), node)  # the first matching child
        path.append(torch.where(alive, node, -1))
    return _acceptance(tree, torch.stack(path, 1), target_argmax.gather(1, node[:, None])[:, 0])


def accept_sampling(logits: torch.Tensor, tree: DraftTree, batch: SamplingBatch) -> Acceptance:
    """`logits` [B, N, V]: the target's logits after each node. `batch` holds each request's sampling
    parameters, as `SamplingBatch.from_requests` builds them with the root already in the request's
    output (so `batch.positions` is the position of the token after the root). Greedy rows take the
    greedy rule."""
    if batch.penalties is not None or batch.blocked is not None:
        # Both depend on the tokens before each node, which differ along the tree.
        raise ValueError("accept_sampling takes logits with penalties and min_new_tokens blocking applied "
                         "per node; build the SamplingBatch without them")
    greedy = accept_greedy(tree, logits.argmax(-1))
    if batch.all_greedy:
        return greedy
    b, n, vocab = logits.shape
    rows = torch.arange(b, device=logits.device)

    def per_node(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else x.repeat_interleave(n)

    q = filtered_probs(logits.reshape(b * n, vocab).float(), per_node(batch.temperatures), per_node(batch.top_ks),
                       per_node(batch.top_ps), per_node(batch.min_ps)).view(b, n, vocab)
    q = q / q.sum(-1, keepdim=True)
    # Children of each node, the second of two siblings with one token dropped (its mass is the first's).
    siblings = (tree.parents[:, :, None] == tree.parents[:, None, :]) & (tree.tokens[:, :, None] == tree.tokens[:, None, :])
    duplicate = (siblings & torch.ones(n, n, dtype=torch.bool, device=logits.device).tril(-1)).any(-1)
    node = torch.zeros(b, dtype=torch.int64, device=logits.device)
    alive = torch.ones_like(node, dtype=torch.bool)
    bonus = torch.zeros_like(node)
    path = [node]
    for depth in range(tree.max_depth + 1):
        here = q[rows, node]  # [B, V]
        kids = (tree.parents == node[:, None]) & ~duplicate
        kid_mass = here.gather(1, tree.tokens) * kids
        on_kids = torch.zeros_like(here, dtype=torch.int32).scatter_add_(1, tree.tokens, kids.int()) > 0
        rest = here.masked_fill(on_kids, 0.0)
        # Mass not on the children tried before c_i: the rest plus the children from c_i on.
        untried = rest.sum(1, keepdim=True) + kid_mass.flip(1).cumsum(1).flip(1)
        rank = (kids.cumsum(1) - 1).clamp(min=0)
        coins = uniform_coins(batch.seed_lo, batch.seed_hi, batch.positions + depth, n).gather(1, rank)
        take = kids & (coins * untried < kid_mass)
        found = take.any(1)
        drawn = exponential_race(rest, uniform_noise(batch.seed_lo, batch.seed_hi, batch.positions + depth, vocab))
        bonus = torch.where(alive & ~found, drawn.argmax(1), bonus)
        alive = alive & found
        node = torch.where(alive, take.int().argmax(1), node)
        if depth < tree.max_depth:
            path.append(torch.where(alive, node, -1))
    sampled = _acceptance(tree, torch.stack(path, 1), bonus)
    return Acceptance(*(torch.where(batch.greedy.view(-1, *[1] * (g.dim() - 1)), g, s)
                        for g, s in zip(_fields(greedy), _fields(sampled))))


def _fields(a: Acceptance) -> tuple[torch.Tensor, ...]:
    return a.accepted_nodes, a.num_accepted, a.bonus_tokens, a.new_tokens


def _acceptance(tree: DraftTree, path: torch.Tensor, bonus: torch.Tensor) -> Acceptance:
    num = (path >= 0).sum(1)
    drafts = torch.where(path[:, 1:] >= 0, tree.tokens.gather(1, path[:, 1:].clamp(min=0)), -1)
    new_tokens = torch.cat([drafts, torch.full_like(bonus[:, None], -1)], 1)
    new_tokens.scatter_(1, (num - 1)[:, None], bonus[:, None])
    return Acceptance(path, num, bonus, new_tokens)

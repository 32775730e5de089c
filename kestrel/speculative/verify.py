"""One TARGET_VERIFY of a draft tree and its acceptance, as a commit plan
(docs/design/speculative-decoding.md §2, steps 3-4).

Shared by every algorithm: the proposer (a draft model, or n-gram matching) gives a DraftTree per
request; the target scores all its nodes in one forward with the tree mask; acceptance walks the tree
(greedy, or the distribution-preserving rule for sampled requests). The result is a `CommitPlan`: the
engine's step loop commits it (keeps the accepted path's KV, gives the other new slots back, step 5).
The logits of each node are processed as the sampler processes a step's (penalties, logit_bias, the
min_new_tokens block, the grammar's mask), for the output that the path to the node would make.
Logprobs of the committed tokens come from the same logits, as the non-speculative sampler computes
them (log-softmax after those, before temperature and filters).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache
from types import SimpleNamespace

import torch

from kestrel.core.batch import ScheduledBatch
from kestrel.sampling.sampler import SamplingBatch, token_dependent_inputs
from kestrel.core.forward_batch import DeviceInputs
from kestrel.core.forward_output import ForwardOutput
from kestrel.speculative.accept import Acceptance, accept_sampling
from kestrel.speculative.tree import DraftTree


@dataclass
class CommitPlan:
    """A verify round's result, per request of the batch (host lists), and the target's output. Nothing
    is committed yet: the step loop advances the requests by `num_new` positions, keeps the KV of each
    `paths[i]` (the other new slots are freed) and gives the requests their `tokens`."""

    num_new: int  # positions each request was given for the round: the tree's nodes
    counts: list[int]  # tokens committed: accepted drafts + the bonus
    paths: list[list[int]]  # accepted node indices, root first (counts[i] of them)
    tokens: list[list[int]]  # the committed tokens (counts[i] of them)
    logprobs: list[list[float] | None]
    top_logprobs: list[list[list[tuple[int, float]]] | None]
    target: ForwardOutput


def verify_tree(runner, batch: ScheduledBatch, tree: DraftTree, context_length: int,
                sampling: SamplingBatch, eos_token_ids: set[int], greedy_graphs=None) -> CommitPlan:
    """Score `tree` (on the runner's device) for `batch` (a TARGET_VERIFY from the scheduler, whose
    requests' sampled tokens are all resolved) and accept; the scheduler is left as it is.
    `greedy_graphs` (kestrel.speculative.draft_worker): greedy acceptance as CUDA graphs, for all-greedy batches."""
    reqs, n = batch.reqs, tree.tokens.shape[1]
    device = runner.device
    prefix = torch.tensor(batch.prefix_lens, dtype=torch.int64).to(device, non_blocking=True)
    # Nodes past the context are scored but never kept (resolve stops at the length limit); their
    # positions stay inside the rope tables.
    positions = (prefix[:, None] + tree.depths).clamp_(max=context_length - 1).flatten()
    batch.tree_mask = tree.mask.flatten()
    batch.logits_at_all_tokens = True
    constrained = [i for i, r in enumerate(reqs) if r.grammar is not None]
    per_node = sampling.penalties is not None or sampling.blocked is not None
    drafted = _tree_to_host(tree) if constrained or per_node else None  # copied while the verify runs
    out = runner.forward(batch, DeviceInputs(input_ids=tree.tokens.flatten(), positions=positions))
    logits = out.logits.view(len(reqs), n, -1)
    if drafted is not None:
        drafted = _host_lists(*drafted)  # (tokens, parents) per request: waits for the draft only
    # The sampler's order: penalties, logit_bias, min_new_tokens blocking, grammar. All but the bias depend
    # on the tokens before each node, which differ along the tree: those are applied per node.
    penalties, blocked = _per_node(reqs, *drafted, sampling.vocab_size, eos_token_ids, logits.device) \
        if per_node else (None, None)
    if penalties is not None:
        logits = penalties.apply(logits.reshape(-1, logits.shape[-1]).float()).view(logits.shape)
    if sampling.logit_bias is not None:  # the same at every node: it does not depend on the tokens before
        logits = sampling.logit_bias.apply(logits)
    if blocked is not None:
        logits = logits.reshape(-1, logits.shape[-1]).float().index_put(blocked, logits.new_full((), float("-inf")))
        logits = logits.view(len(reqs), n, -1)
    if constrained:
        logits = _grammar_masked(logits, [reqs[i].grammar for i in constrained], constrained, *drafted)
    if per_node:  # applied above; acceptance takes the logits as they are now
        sampling = dataclasses.replace(sampling, penalties=None, blocked=None)
    if sampling.all_greedy and greedy_graphs is not None and greedy_graphs.can_run(len(reqs)):
        acc = Acceptance(*greedy_graphs(tree.tokens, tree.parents, logits.argmax(-1)))
    else:
        acc = accept_sampling(logits, tree, sampling)
    asks = [(i, r.params.logprobs) for i, r in enumerate(reqs) if r.params.logprobs is not None]
    lp_host = _path_logprobs(logits, acc, asks) if asks else None
    host = torch.cat([acc.num_accepted[:, None], acc.accepted_nodes, acc.new_tokens], 1).tolist()  # the sync
    d = acc.accepted_nodes.shape[1]
    counts = [row[0] for row in host]
    paths = [row[1:1 + k] for row, k in zip(host, counts)]
    tokens = [row[1 + d:1 + d + k] for row, k in zip(host, counts)]
    logprobs: list = [None] * len(reqs)
    tops: list = [None] * len(reqs)
    for j, (i, top_n) in enumerate(asks):
        chosen, ids, vals = lp_host[j]
        k = counts[i]
        logprobs[i] = chosen[:k]
        tops[i] = [[(int(t), v) for t, v in zip(ids[p][:top_n], vals[p][:top_n])] for p in range(k)]
    return CommitPlan(n, counts, paths, tokens, logprobs, tops, out)


def _tree_to_host(tree: DraftTree) -> tuple[torch.Tensor, torch.Tensor, torch.cuda.Event | None]:
    """The tree's tokens and parents on the host, copied behind the draft's kernels but before the verify's
    (whose launch comes next): the host builds the per-node penalties and grammar masks while the verify
    runs. The event marks the copies' end on a CUDA device."""
    if tree.tokens.device.type != "cuda":
        return tree.tokens, tree.parents, None
    tokens, parents = _pinned(tuple(tree.tokens.shape))
    tokens.copy_(tree.tokens, non_blocking=True)
    parents.copy_(tree.parents, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    return tokens, parents, copied


def _host_lists(tokens: torch.Tensor, parents: torch.Tensor, copied: torch.cuda.Event | None
                ) -> tuple[list[list[int]], list[list[int]]]:
    if copied is not None:
        copied.synchronize()
    return tokens.tolist(), parents.tolist()


@lru_cache(maxsize=16)
def _pinned(shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Page-locked int64 host buffers for a tree's tokens and parents, reused by every round of that shape
    (a round reads them before the next one copies)."""
    return (torch.empty(shape, dtype=torch.int64, pin_memory=True),
            torch.empty(shape, dtype=torch.int64, pin_memory=True))


def _per_node(reqs: list, tokens: list[list[int]], parents: list[list[int]], vocab_size: int,
              eos_token_ids: set[int], device: torch.device):
    """Penalties and min_new_tokens blocking for every node of the tree (row i * N + j), as the sampler
    builds them for a request whose output is its own plus the drafted tokens on the path to that node."""
    rows = []
    for i, req in enumerate(reqs):
        paths: list[list[int]] = [[]]  # the drafted tokens from the root (committed) to each node
        for j in range(1, len(tokens[i])):
            paths.append(paths[parents[i][j]] + [tokens[i][j]])
        for path in paths:
            rows.append(SimpleNamespace(prompt_ids=req.prompt_ids, output_ids=req.output_ids + path, pending=(),
                                        params=req.params, num_generated=req.num_generated + len(path)))
    return token_dependent_inputs(rows, vocab_size, eos_token_ids, device)


def _grammar_masked(logits: torch.Tensor, states: list, rows: list[int], tokens: list[list[int]],
                    parents: list[list[int]]) -> torch.Tensor:
    """`logits` [B, N, V] with each node of the grammar requests `rows` masked to what its grammar allows
    after the path to it (kestrel.engine.grammar.GrammarBackend.fill_tree): a drafted token the grammar
    refuses is then never accepted, and the bonus token obeys it too."""
    from kestrel.engine.grammar import apply_grammar_mask  # xgrammar: only for grammar requests

    b, n, vocab = logits.shape
    mask = states[0].backend.fill_tree(states, [tokens[i] for i in rows], [parents[i] for i in rows])
    flat = torch.tensor([i * n + j for i in rows for j in range(n)], dtype=torch.int64)
    device = logits.device
    masked = apply_grammar_mask(logits.reshape(b * n, vocab), flat.to(device, non_blocking=True),
                                mask.to(device, non_blocking=True))
    return masked.view(b, n, vocab)


def _path_logprobs(logits: torch.Tensor, acc: Acceptance, asks: list[tuple[int, int]]):
    """Per logprob request: the committed tokens' logprobs and the top-n at each, along the path."""
    rows = torch.tensor([i for i, _ in asks], device=logits.device)
    n = max(1, max(top_n for _, top_n in asks))
    nodes = acc.accepted_nodes[rows].clamp(min=0)  # [R, D + 1]; entries past the path are ignored
    lp = torch.log_softmax(logits[rows[:, None], nodes].float(), dim=-1)  # [R, D + 1, V]
    chosen = lp.gather(2, acc.new_tokens[rows].clamp(min=0)[..., None])[..., 0]
    vals, ids = lp.topk(n, dim=-1)
    return list(zip(chosen.tolist(), ids.tolist(), vals.tolist()))

"""The speculative loop for NGRAM with greedy acceptance, on the engine's multi-token steps.

Each decoding round: the scheduler gives every running request `num_draft_tokens` slots (a
TARGET_VERIFY batch); the n-gram proposer fills them with a tree rooted at the request's last token;
the target scores all nodes in one forward with the tree mask; the greedy walk keeps the path the
target agrees with plus its bonus token; the other slots are given back. Prefill steps run as usual.
Rounds resolve before the next one is scheduled (how many tokens a request got decides its next
positions), so overlap scheduling is off while speculating.
"""
from __future__ import annotations

import torch

from kestrel.core.batch import ScheduledBatch
from kestrel.core.forward_mode import ForwardMode
from kestrel.core.request import Request
from kestrel.spec.accept import accept_greedy
from kestrel.spec.ngram import propose_ngram


class NgramWorker:
    def __init__(self, scheduler, runner, num_steps: int, topk: int, num_draft_tokens: int) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.num_steps, self.topk, self.num_draft = num_steps, topk, num_draft_tokens
        self.accept_lengths: list[int] = []  # tokens committed per request-round (histogram for metrics)

    def verify(self, batch: ScheduledBatch, context_length: int) -> list[Request]:
        """Run one TARGET_VERIFY round for `batch` (from `schedule(decode_tokens=num_draft)`); returns
        the requests that got tokens."""
        assert batch.mode is ForwardMode.TARGET_VERIFY
        reqs, n = batch.reqs, self.num_draft
        draft = propose_ngram([r.fill_ids for r in reqs], n, max_depth=self.num_steps, max_breadth=self.topk)
        tree = draft.tree
        batch.input_ids = tree.tokens.flatten().tolist()
        depths = tree.depths.tolist()
        # Nodes past the context are scored but never kept (resolve stops at the length limit); their
        # positions stay inside the rope tables.
        batch.positions = [min(p + d, context_length - 1) for p, row in zip(batch.prefix_lens, depths) for d in row]
        batch.tree_mask = tree.mask.flatten()
        batch.logits_at_all_tokens = True
        out = self.runner.forward(batch)
        acc = accept_greedy(tree, out.logits.argmax(-1).view(len(reqs), n).to(tree.tokens.device))
        self.scheduler.commit(batch, [], [])
        counts = acc.num_accepted.tolist()
        nodes, tokens = acc.accepted_nodes.tolist(), acc.new_tokens.tolist()
        for req, k, path in zip(reqs, counts, nodes):
            self.scheduler.keep_new_slots(req, n, path[:k])
        self.accept_lengths += counts
        return self.scheduler.resolve(reqs, [t[:k] for t, k in zip(tokens, counts)])

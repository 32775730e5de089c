"""The speculative loop for NGRAM, on the engine's multi-token steps.

Each decoding round: the scheduler gives every running request `num_draft_tokens` slots (a
TARGET_VERIFY batch); the n-gram proposer fills them with a tree rooted at the request's last token;
`verify_tree` scores, accepts (greedy, or the distribution-preserving rule: the proposals are
deterministic) and rolls the KV back. Prefill steps run as usual. Rounds resolve before the next one
is scheduled (how many tokens a request got decides its next positions), so overlap scheduling is off
while speculating.
"""
from __future__ import annotations

from kestrel.core.batch import ScheduledBatch
from kestrel.core.forward_mode import ForwardMode
from kestrel.sampling.sampler import SamplingBatch
from kestrel.speculative.ngram import propose_ngram
from kestrel.speculative.verify import Verified, verify_tree


class NgramWorker:
    def __init__(self, scheduler, runner, num_steps: int, topk: int, num_draft_tokens: int,
                 eos_token_ids: set[int]) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.num_steps, self.topk, self.num_draft = num_steps, topk, num_draft_tokens
        self.eos_token_ids = eos_token_ids
        self.context_length = runner.config.model.context_length
        self.accept_lengths: list[int] = []  # tokens committed per request-round
        runner.capture_graphs(ForwardMode.TARGET_VERIFY, num_draft_tokens)

    def verify(self, batch: ScheduledBatch) -> Verified:
        """One round for `batch` (from `schedule(decode_tokens=num_draft)`); the caller resolves."""
        assert batch.mode is ForwardMode.TARGET_VERIFY
        reqs = batch.reqs
        draft = propose_ngram([r.fill_ids for r in reqs], self.num_draft, max_depth=self.num_steps,
                              max_breadth=self.topk, device=self.runner.device)
        sampling = SamplingBatch.from_requests(reqs, self.runner.vocab_size, self.eos_token_ids, self.runner.device)
        verified = verify_tree(self.scheduler, self.runner, batch, draft.tree, self.context_length, sampling)
        self.accept_lengths += verified.counts
        return verified

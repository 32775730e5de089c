"""The speculative loop for NGRAM, on the engine's multi-token steps.

Each decoding round: the scheduler gives every running request `num_draft_tokens` slots (a
TARGET_VERIFY batch); the n-gram proposer fills them with a tree rooted at the request's last token;
`verify_tree` scores, accepts (greedy, or the distribution-preserving rule: the proposals are
deterministic) and rolls the KV back. Prefill steps run as usual. Rounds resolve before the next one
is scheduled (how many tokens a request got decides its next positions), so overlap scheduling is off
while speculating.
"""
from __future__ import annotations

from kestrel.config import SpeculativeConfig
from kestrel.core.batch import ScheduledBatch
from kestrel.core.forward_mode import ForwardMode
from kestrel.sampling.sampler import SamplingBatch
from kestrel.speculative.ngram import propose_ngram
from kestrel.speculative.verify import CommitPlan, verify_tree


class NgramWorker:
    """A `SpeculativeWorker` (kestrel.speculative.worker) without a draft model."""

    target_capture: tuple[int, ...] = ()
    has_draft_kv = False

    def __init__(self, spec: SpeculativeConfig, runner, eos_token_ids: set[int]) -> None:
        self.runner = runner
        self.num_steps, self.topk = spec.speculative_num_steps, spec.speculative_eagle_topk
        self.num_draft, self.disable_batch_size = spec.speculative_num_draft_tokens, spec.speculative_disable_batch_size
        self.eos_token_ids = eos_token_ids
        self.context_length = runner.config.model.context_length
        self.accept_lengths: list[int] = []  # tokens committed per request-round
        runner.capture_graphs(ForwardMode.TARGET_VERIFY, self.num_draft)

    def decode_tokens(self, num_running: int) -> int:
        return 1 if num_running > self.disable_batch_size else self.num_draft

    def verify(self, batch: ScheduledBatch) -> CommitPlan:
        """One round for `batch` (from `schedule(decode_tokens=num_draft)`); the step loop commits it."""
        assert batch.mode is ForwardMode.TARGET_VERIFY
        reqs = batch.reqs
        draft = propose_ngram([r.fill_ids for r in reqs], self.num_draft, max_depth=self.num_steps,
                              max_breadth=self.topk, device=self.runner.device)
        sampling = SamplingBatch.from_requests(reqs, self.runner.vocab_size, self.eos_token_ids, self.runner.device)
        plan = verify_tree(self.runner, batch, draft.tree, self.context_length, sampling, self.eos_token_ids)
        self.accept_lengths += plan.counts
        return plan

    def after_forward(self, batch: ScheduledBatch, out, sampled_rows: list[int], futures: list[int]) -> None:
        """Nothing to catch up: the proposals come from the request's own tokens."""

    def after_commit(self, batch: ScheduledBatch, plan: CommitPlan, writes, moves) -> None:
        """Not called: without draft KV the rollback's changes ride with the next target batch."""

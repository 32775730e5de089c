"""The speculative loop of the draft-model algorithms: EAGLE, EAGLE-3, NEXTN and STANDALONE
(docs/design/speculative-decoding.md §2).

Every step the target runs, the draft catches up on the same positions (DRAFT_EXTEND), so that at
the end of a step the draft's KV covers exactly the positions with target KV, and a feature draft
holds, per request row, its output at the last position (its feature and top-k: the next round's
first tree level). A round over the running requests:
1. draft: `DraftLanes` grows each request's tree from the root (the last committed token);
2. TARGET_VERIFY of the tree and acceptance (`kestrel.speculative.verify`), returned as a commit plan
   that the engine's step loop commits (KV rollback);
3. DRAFT_EXTEND over the committed tokens, in their kept slots, reading the target's features there
   (`after_commit`);
then the step loop gives the requests their committed tokens (a stop mid-path drops what follows it).
Prefill chunks and plain decode steps (speculation off above `speculative_disable_batch_size`) run
as usual, followed by their DRAFT_EXTEND. Rounds resolve before the next step is scheduled, so overlap
scheduling is off while speculating.

Radix reuse: a feature draft's KV at position p depends on token p + 1, so the radix tree keys position p
by both tokens when a feature draft runs (`request_kv.cache_key`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kestrel.attention.registry import REGISTRY
from kestrel.core.batch import ScheduledBatch
from kestrel.core.forward_mode import ForwardMode
from kestrel.sampling.sampler import SamplingBatch
from kestrel.core.forward_batch import DeviceInputs
from kestrel.core.forward_output import ForwardOutput
from kestrel.runner.model_runner import ModelRunner
from kestrel.speculative.draft_backends import create_draft_backends
from kestrel.speculative.draft_lanes import DraftLanes
from kestrel.speculative.draft_model import Draft
from kestrel.speculative.resolve import draft_forwards
from kestrel.runner.bucket_graphs import BucketGraphs
from kestrel.speculative.accept import accept_greedy
from kestrel.speculative.tree import DraftTree
from kestrel.speculative.verify import CommitPlan, verify_tree

_NO_WRITES = torch.empty(3, 0, dtype=torch.int64)
_NO_MOVES = torch.empty(2, 0, dtype=torch.int64)


class DraftWorker:
    """A `SpeculativeWorker` (kestrel.speculative.worker) with a draft model."""

    has_draft_kv = True

    def __init__(self, config, target: ModelRunner, draft: Draft, memory, future_tokens,
                 eos_token_ids: set[int]) -> None:
        spec = config.speculative
        self.target, self.draft, self.memory = target, draft, memory
        self.eos_token_ids = eos_token_ids
        self.num_steps, self.topk = spec.speculative_num_steps, spec.speculative_eagle_topk
        self.num_draft, self.disable_batch_size = spec.speculative_num_draft_tokens, spec.speculative_disable_batch_size
        # Tokens a round commits at most, so a DRAFT_EXTEND after a round has this fixed shape (padded).
        self.extend_tokens = min(self.num_steps + 1, self.num_draft)
        self.context_length = config.model.context_length
        self.device = memory.device
        max_requests = config.scheduler.max_running_requests
        forwards = draft_forwards(spec)
        lane_table = DraftLanes.lane_table_for(max_requests, self.topk, forwards, memory.req_to_token.table.shape[1],
                                               self.device)
        backends = create_draft_backends(config, memory.pools[1], memory.req_to_token, lane_table)
        decode_backends = backends.decode.attn_backends if backends.decode is not None else []
        self.runner = ModelRunner(config, draft.model, memory, memory.pools[1], future_tokens,
                                  attn_backend=backends.extend)
        first_level = feature = None
        if draft.uses_features:  # the last DRAFT_EXTEND's output per request row: the next tree's first level
            rows, dtype = max_requests + 1, next(draft.model.parameters()).dtype
            feature = (draft.model.feature_size, dtype)
            first_level = (torch.zeros(rows, self.topk, device=self.device),
                           torch.zeros(rows, self.topk, dtype=torch.int64, device=self.device),
                           torch.zeros(rows, feature[0], dtype=dtype, device=self.device))
        self.first_level = first_level
        self.lanes = DraftLanes(self.runner, decode_backends, lane_table, memory.req_to_token, self.topk,
                                self.num_draft, self.context_length, memory.scratch_base, first_level)
        self.greedy_graphs: BucketGraphs | None = None
        if target.spec_graphs_on and all(REGISTRY[b.name].cuda_graph and REGISTRY[b.name].cuda_graph_spec
                                         for b in decode_backends):
            target.capture_graphs(ForwardMode.TARGET_VERIFY, self.num_draft, draft.target_capture)
            self.runner.capture_graphs(ForwardMode.DRAFT_EXTEND, self.extend_tokens, features=feature)
            self.lanes.capture_graphs(target.graph_max_bs)
            self.greedy_graphs = greedy_acceptance_graphs(self.num_draft, self.lanes.num_forwards + bool(first_level),
                                                          target.graph_max_bs, self.device)
        self.accept_lengths: list[int] = []  # tokens committed per request-round

    @staticmethod
    def scratch_slots(config) -> int:
        spec = config.speculative
        return DraftLanes.scratch_needed(config.scheduler.max_running_requests, spec.speculative_eagle_topk,
                                         draft_forwards(spec))

    @property
    def target_capture(self) -> tuple[int, ...]:
        return self.draft.target_capture

    def decode_tokens(self, num_running: int) -> int:
        return 1 if num_running > self.disable_batch_size else self.num_draft

    # ---- plain steps: prefill chunks and decodes ----------------------------------------------
    @torch.inference_mode()
    def after_forward(self, batch: ScheduledBatch, out: ForwardOutput, sampled_rows: list[int],
                     futures: list[int]) -> None:
        """The draft's DRAFT_EXTEND over a plain step's new tokens, launched right after the target's
        forward and sampling (the sampled tokens are read on the device, as FutureTokens)."""
        ids = list(batch.input_ids)
        if self.draft.uses_features:  # position p reads token p + 1: shift each request's tokens left
            next_token = dict(zip(sampled_rows, (-1 - f for f in futures)))
            start = 0
            for i, (req, p, e) in enumerate(zip(batch.reqs, batch.prefix_lens, batch.extend_lens)):
                # A prefill chunk that is not the last reads the next prompt token.
                last = next_token[i] if i in next_token else req.fill_ids[p + e]
                ids[start:start + e] = batch.input_ids[start + 1:start + e] + [last]
                start += e
        extend = ScheduledBatch(ForwardMode.DRAFT_EXTEND, batch.req_pool_indices, batch.prefix_lens,
                                batch.extend_lens, ids, batch.positions, batch.out_cache_loc, _NO_WRITES, _NO_MOVES,
                                reqs=batch.reqs)
        self._extend(extend, self._target_features(out))

    # ---- a speculative round ------------------------------------------------------------------
    @torch.inference_mode()
    def verify(self, batch: ScheduledBatch) -> CommitPlan:
        """Draft and verify `batch` (from `schedule(decode_tokens=num_draft)`); the step loop commits
        the plan, then calls `after_commit`."""
        assert batch.mode is ForwardMode.TARGET_VERIFY
        reqs, n = batch.reqs, self.num_draft
        rows = torch.tensor(batch.req_pool_indices, dtype=torch.int64).to(self.device, non_blocking=True)
        roots = torch.tensor(batch.input_ids[::n], dtype=torch.int64).to(self.device, non_blocking=True)
        tree = self.lanes.draft(rows, batch.prefix_lens, roots)
        batch.capture_hidden = self.draft.target_capture
        sampling = SamplingBatch.from_requests(reqs, self.target.vocab_size, self.eos_token_ids, self.device)
        plan = verify_tree(self.target, batch, tree, self.context_length, sampling, self.eos_token_ids,
                           self.greedy_graphs)
        self.accept_lengths += plan.counts
        return plan

    @torch.inference_mode()
    def after_commit(self, batch: ScheduledBatch, v: CommitPlan, writes: torch.Tensor, moves: torch.Tensor) -> None:
        """DRAFT_EXTEND over each request's committed tokens, padded to `extend_tokens` per request (a
        fixed shape, so a CUDA graph serves it): padding writes the reserved slot 0 and, coming after the
        real tokens, never reaches them through the causal mask. `writes` and `moves` (the rollback's)
        are applied before it."""
        e = self.extend_tokens
        roots = batch.input_ids[::self.num_draft]  # each request's last committed token
        ids, positions, slots, picked, last = [], [], [], [], []
        for i, (req, p, k) in enumerate(zip(batch.reqs, batch.prefix_lens, v.counts)):
            # Feature draft: position p + j reads committed token p + j + 1; STANDALONE reads token p + j.
            ids += (v.tokens[i] if self.draft.uses_features else [roots[i]] + v.tokens[i][:k - 1]) + [0] * (e - k)
            positions += [min(q, self.context_length - 1) for q in range(p, p + e)]
            slots += req.slots[p:p + k] + [0] * (e - k)
            picked += [i * self.num_draft + node for node in v.paths[i]] + [i * self.num_draft] * (e - k)
            last.append(i * e + k - 1)
        b = batch.batch_size
        extend_batch = ScheduledBatch(ForwardMode.DRAFT_EXTEND, batch.req_pool_indices, batch.prefix_lens, [e] * b,
                                      ids, positions, torch.tensor(slots, dtype=torch.int64), writes, moves,
                                      logits_at_all_tokens=True, reqs=batch.reqs)
        features = self._target_features(v.target)
        if features is not None:
            features = features[torch.tensor(picked, dtype=torch.int64).to(self.device, non_blocking=True)]
        self._extend(extend_batch, features, torch.tensor(last, dtype=torch.int64))

    # ---- shared --------------------------------------------------------------------------------
    def _target_features(self, out: ForwardOutput) -> torch.Tensor | None:
        """The draft's feature input at every new token of the target's forward."""
        if not self.draft.uses_features:
            return None
        return self.draft.features(out.captured if self.draft.target_capture else out.token_hidden)

    def _extend(self, batch: ScheduledBatch, features: torch.Tensor | None, rows: torch.Tensor | None = None) -> None:
        """Run a DRAFT_EXTEND; a feature draft keeps its output at each request's last token (`rows` of
        the output when it has logits at every token)."""
        out = self.runner.forward(batch, DeviceInputs(features=features))
        if self.first_level is None:
            return
        hidden, logits = out.hidden, out.logits
        if rows is not None:
            rows = rows.to(self.device, non_blocking=True)
            hidden, logits = hidden[rows], logits[rows]
        req_rows = torch.tensor(batch.req_pool_indices, dtype=torch.int64).to(self.device, non_blocking=True)
        top_logprobs, top_tokens, features = self.first_level
        top_logprobs[req_rows], top_tokens[req_rows] = F.log_softmax(logits, dim=-1).topk(self.topk, dim=-1)
        features[req_rows] = hidden.to(features.dtype)


def greedy_acceptance_graphs(num_draft: int, max_depth: int, max_bs: int, device: torch.device) -> BucketGraphs:
    """Greedy acceptance (a walk of `max_depth` steps, a few kernels each) as CUDA graphs."""
    def accept(tokens: torch.Tensor, parents: torch.Tensor, target_argmax: torch.Tensor):
        tree = DraftTree(tokens, parents, parents, None, max_depth)  # the walk reads tokens and parents only
        acc = accept_greedy(tree, target_argmax)
        return acc.accepted_nodes, acc.num_accepted, acc.bonus_tokens, acc.new_tokens

    def inputs(bs: int) -> list[torch.Tensor]:
        zeros = torch.zeros(bs, num_draft, dtype=torch.int64, device=device)
        return [zeros, zeros - 1, zeros]

    return BucketGraphs(accept, inputs, (0, -1, 0), max_bs, device)

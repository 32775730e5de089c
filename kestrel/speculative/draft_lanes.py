"""A round's draft-decode forwards: `topk` lanes per request, tree drafting
(docs/design/speculative-decoding.md §2, step 1).

Each lane is a path of the draft tree being grown. Lane j of request b attends to the request's
committed draft KV (its `req_to_token` row, positions [0, P)) and to its own ancestors' draft KV from
the earlier forwards of this round, which lives in scratch slots past the slot space (only the draft
pools have them; KVMemory's `draft_scratch`). So each lane gets a row of its own in a lane table: the
request's prefix, copied once per round, then the scratch slots of its path; when the best `topk`
children are chosen, a lane continuing another lane's path takes that lane's scratch slots (slot
indices are copied, never KV). A draft-decode forward is then a plain DECODE batch over lane rows,
which every attention backend serves.

On CUDA everything after the prefix copy (every forward, the top-k steps and the tree) is one graph
per batch-size bucket: launched kernel by kernel it would cost more than the forwards themselves.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kestrel.cache.req_to_token import ReqToTokenPool
from kestrel.core.forward_batch import ForwardBatch
from kestrel.core.forward_mode import ForwardMode
from kestrel.runner.bucket_graphs import BucketGraphs
from kestrel.speculative.tree import DraftTree, build_tree, draft_step


class DraftLanes:
    def __init__(self, runner, backends: list, lane_table: ReqToTokenPool, table: ReqToTokenPool, topk: int,
                 num_draft_tokens: int, max_context: int, scratch_base: int,
                 first_level: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None) -> None:
        """`backends[i]` serves draft forward i (the draft-backend factory's container, built over
        `lane_table`: `DraftLanes.lane_table_for`); `table` is the requests' `req_to_token`.
        `first_level`: a feature draft's state per request row (top-k logprobs, top-k tokens, output
        feature) from its last DRAFT_EXTEND, the tree's first level; None: forward 0 runs on the root
        (STANDALONE)."""
        self.runner, self.backends, self.lane_table, self.table = runner, backends, lane_table, table
        self.topk, self.num_draft, self.num_forwards = topk, num_draft_tokens, len(backends)
        self.max_context, self.scratch_base = max_context, scratch_base
        self.first_level = first_level
        self.device = runner.device
        self.graphs: BucketGraphs | None = None

    @staticmethod
    def lane_table_for(max_requests: int, topk: int, num_forwards: int, table_width: int,
                       device: torch.device) -> ReqToTokenPool:
        """Row b * topk + j is lane j of the batch's request b (and the padding row for CUDA graphs)."""
        return ReqToTokenPool(max_requests * topk, table_width + num_forwards, device)

    @staticmethod
    def scratch_needed(max_requests: int, topk: int, num_forwards: int) -> int:
        """Scratch slots the draft pools need past the slot space: one per lane and forward."""
        return max_requests * topk * num_forwards

    def capture_graphs(self, max_requests: int) -> None:
        def inputs(bs: int) -> list[torch.Tensor]:
            zeros = torch.zeros(bs, dtype=torch.int64, device=self.device)
            return [torch.full_like(zeros, self.table.padding_row), zeros, zeros]

        self.graphs = BucketGraphs(self._grow, inputs, (self.table.padding_row, 0, 0), max_requests, self.device)

    def draft(self, rows: torch.Tensor, prefix_host: list[int], roots: torch.Tensor) -> DraftTree:
        """Each request's tree of `num_draft_tokens` nodes. `rows`: the requests' `req_to_token` rows
        (device); `prefix_host`: their committed draft positions P (the root sits at P); `roots`: the
        last committed tokens (device)."""
        b, k = rows.shape[0], self.topk
        width = max(prefix_host)
        if self.backends:
            self.lane_table.table[:b * k, :width] = self.table.table[rows.repeat_interleave(k), :width]
        prefix = torch.tensor(prefix_host, dtype=torch.int64).to(self.device, non_blocking=True)
        if self.graphs is not None and self.graphs.can_run(b):
            tensors = self.graphs(rows, prefix, roots)
        else:
            with torch.inference_mode():
                tensors = self._grow(rows, prefix, roots, prefix_host)
        return DraftTree(*tensors, max_depth=self.num_forwards + (self.first_level is not None))

    def _grow(self, rows: torch.Tensor, prefix: torch.Tensor, roots: torch.Tensor,
              prefix_host: list[int] | None = None) -> tuple[torch.Tensor, ...]:
        """The tree's (tokens, parents, depths, mask); `prefix_host` only outside a graph (backends that
        read lengths on the host need it)."""
        b, k = rows.shape[0], self.topk
        steps = []
        if self.first_level is not None:
            logprobs, tokens, features = self.first_level
            steps.append(draft_step(logprobs[rows][:, None], tokens[rows][:, None], None, k))
            lane_tokens, lane_features = steps[0].frontier_tokens, features[rows][:, None]
        else:
            lane_tokens, lane_features = roots[:, None], None
        parents = torch.zeros_like(lane_tokens)
        path_slots = torch.zeros(b, 1, max(1, self.num_forwards), dtype=torch.int64, device=self.device)
        for i, backend in enumerate(self.backends):
            lanes = lane_tokens.shape[1]
            path_slots = path_slots.gather(1, parents[..., None].expand(-1, -1, path_slots.shape[-1])).clone()
            lane_rows = torch.arange(b, device=self.device)[:, None] * k + torch.arange(lanes, device=self.device)
            path_slots[:, :, i] = self.scratch_base + lane_rows * self.num_forwards + i
            cols = prefix[:, None, None] + torch.arange(i + 1, device=self.device)
            self.lane_table.table[lane_rows[..., None], cols] = path_slots[:, :, :i + 1]
            feats = None if lane_features is None else lane_features.gather(
                1, parents[..., None].expand(-1, -1, lane_features.shape[-1])).flatten(0, 1)
            lengths = None if prefix_host is None else [p + i for p in prefix_host for _ in range(lanes)]
            fb = self._decode_batch(backend, lane_tokens.flatten(), (prefix + i).repeat_interleave(lanes),
                                    lane_rows.flatten(), path_slots[:, :, i].flatten(), lengths, feats)
            out = self.runner.execute(fb)
            logprobs, tokens = F.log_softmax(out.logits, dim=-1).topk(k, dim=-1)
            step = draft_step(logprobs.view(b, lanes, k), tokens.view(b, lanes, k),
                              steps[-1].frontier_scores if steps else None, k)
            steps.append(step)
            lane_tokens, parents = step.frontier_tokens, step.frontier_parent_lanes
            lane_features = None if lane_features is None else out.hidden.view(b, lanes, -1)
        tree = build_tree(roots, steps, self.num_draft)
        return tree.tokens, tree.parents, tree.depths, tree.mask

    def _decode_batch(self, backend, input_ids: torch.Tensor, prefix: torch.Tensor, lane_rows: torch.Tensor,
                      out_slots: torch.Tensor, prefix_host: list[int] | None,
                      features: torch.Tensor | None) -> ForwardBatch:
        """One new token per lane at position `prefix` (its KV count before the token)."""
        n = input_ids.shape[0]
        ones = torch.ones(n, dtype=torch.int64, device=self.device)
        # Lanes past the context are drafted but never kept; their rope positions stay in the tables.
        positions = prefix.clamp(max=self.max_context - 1)
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE, input_ids=input_ids, positions=positions, out_cache_loc=out_slots,
            req_pool_indices=lane_rows, seq_lens=prefix + 1, prefix_lens=prefix, extend_lens=ones,
            seq_lens_cpu=None if prefix_host is None else [p + 1 for p in prefix_host],
            prefix_lens_cpu=prefix_host, extend_lens_cpu=None if prefix_host is None else [1] * n,
            max_extend=1, logits_indices=torch.arange(n, device=self.device), attn_backend=backend,
            spec_features=features)

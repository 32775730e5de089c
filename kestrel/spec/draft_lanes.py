"""A round's draft-decode forwards (spec §2, step 1): `topk` lanes per request, tree drafting.

Each lane is a path of the draft tree being grown. Lane j of request b attends to the request's
committed draft KV (its `req_to_token` row, positions [0, P)) and to its own ancestors' draft KV from
the earlier forwards of this round, which lives in scratch slots past the slot space (only the draft
pools have them; KVMemory's `draft_scratch`). So each lane gets a row of its own in a lane table: the
request's prefix, copied once per round, then the scratch slots of its path; when the best `topk`
children are chosen, a lane continuing another lane's path takes that lane's scratch slots (slot
indices are copied, never KV). A draft-decode forward is then a plain DECODE batch over lane rows,
which every attention backend serves (and a CUDA graph can capture).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kestrel.cache.req_to_token import ReqToTokenPool
from kestrel.core.forward_batch import ForwardBatch
from kestrel.core.forward_mode import ForwardMode
from kestrel.runner.cuda_graph import CudaGraphRunner
from kestrel.spec.tree import DraftStep, DraftTree, build_tree, draft_step


class DraftLanes:
    def __init__(self, max_requests: int, topk: int, num_forwards: int, max_context: int, table_width: int,
                 scratch_base: int, device: torch.device) -> None:
        """`max_context`: the rope tables' length; `table_width`: the request table's columns."""
        self.topk, self.num_forwards = topk, num_forwards
        self.max_context = max_context
        # Row b * topk + j is lane j of the batch's request b; the pool's padding row serves CUDA graphs.
        self.lane_table = ReqToTokenPool(max_requests * topk, table_width + num_forwards, device)
        self.scratch_base = scratch_base
        self.device = device
        self.graphs: list[CudaGraphRunner | None] = [None] * num_forwards

    def capture_graphs(self, model, backends: list, max_requests: int, root_forward: bool,
                       features: tuple[int, torch.dtype] | None) -> None:
        """CUDA graphs for every draft-decode forward of a round, up to `max_requests` requests
        (`root_forward`: forward 0 runs one lane per request, on the root)."""
        for i, backend in enumerate(backends):
            lanes = 1 if root_forward and i == 0 else self.topk
            self.graphs[i] = CudaGraphRunner(model, backend, self.lane_table.padding_row, max_requests * lanes,
                                             self.device, ForwardMode.DECODE, features=features)

    @staticmethod
    def scratch_needed(max_requests: int, topk: int, num_forwards: int) -> int:
        """Scratch slots the draft pools need past the slot space: one per lane and forward."""
        return max_requests * topk * num_forwards

    def draft(self, runner, backends: list, table: torch.Tensor, rows: torch.Tensor, prefix_host: list[int],
              roots: torch.Tensor, first: DraftStep | None, features: torch.Tensor | None,
              num_draft_tokens: int) -> DraftTree:
        """Grow each request's tree and keep its best `num_draft_tokens` nodes.

        `rows`: the requests' `req_to_token` rows in `table` (device), `prefix_host`: their committed
        draft positions P (the root sits at P). `first`: step 0 when the draft already expanded the
        root (a feature draft's last DRAFT_EXTEND), with `features` [B, F] its output feature; None
        runs the first forward on the root itself (STANDALONE). `backends[i]` serves forward i."""
        b, k = rows.shape[0], self.topk
        width = max(prefix_host)
        self.lane_table.table[:b * k, :width] = table[rows.repeat_interleave(k), :width]
        prefix = torch.tensor(prefix_host, dtype=torch.int64).to(self.device, non_blocking=True)
        steps = [first] if first is not None else []
        if first is not None:
            lane_tokens, lane_features = first.frontier_tokens, features[:, None]
            parents = torch.zeros_like(lane_tokens)
        else:
            lane_tokens, lane_features = roots[:, None], None
            parents = torch.zeros_like(lane_tokens)
        path_slots = torch.zeros(b, 1, self.num_forwards, dtype=torch.int64, device=self.device)
        for i in range(self.num_forwards):
            lanes = lane_tokens.shape[1]
            path_slots = path_slots.gather(1, parents[..., None].expand(-1, -1, self.num_forwards)).clone()
            lane_rows = torch.arange(b, device=self.device)[:, None] * k + torch.arange(lanes, device=self.device)
            path_slots[:, :, i] = self.scratch_base + lane_rows * self.num_forwards + i
            cols = prefix[:, None, None] + torch.arange(i + 1, device=self.device)
            self.lane_table.table[lane_rows[..., None], cols] = path_slots[:, :, :i + 1]
            feats = None if lane_features is None else lane_features.gather(
                1, parents[..., None].expand(-1, -1, lane_features.shape[-1])).flatten(0, 1)
            fb = self._decode_batch(backends[i], lane_tokens.flatten(), (prefix + i).repeat_interleave(lanes),
                                    lane_rows.flatten(), path_slots[:, :, i].flatten(),
                                    [p + i for p in prefix_host for _ in range(lanes)], feats)
            out = runner.execute(fb, self.graphs[i])
            logprobs, tokens = F.log_softmax(out.logits, dim=-1).topk(k, dim=-1)
            step = draft_step(logprobs.view(b, lanes, k), tokens.view(b, lanes, k),
                              steps[-1].frontier_scores if steps else None, k)
            steps.append(step)
            lane_tokens, parents = step.frontier_tokens, step.frontier_parent_lanes
            lane_features = None if features is None else out.hidden.view(b, lanes, -1)
        return build_tree(roots, steps, num_draft_tokens)

    def _decode_batch(self, backend, input_ids: torch.Tensor, prefix: torch.Tensor, lane_rows: torch.Tensor,
                      out_slots: torch.Tensor, prefix_host: list[int], features: torch.Tensor | None) -> ForwardBatch:
        """One new token per lane at position `prefix` (its KV count before the token)."""
        n = input_ids.shape[0]
        ones = torch.ones(n, dtype=torch.int64, device=self.device)
        # Lanes past the context are drafted but never kept; their rope positions stay in the tables.
        positions = prefix.clamp(max=self.max_context - 1)
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE, input_ids=input_ids, positions=positions, out_cache_loc=out_slots,
            req_pool_indices=lane_rows, seq_lens=prefix + 1, prefix_lens=prefix, extend_lens=ones,
            seq_lens_cpu=[p + 1 for p in prefix_host], prefix_lens_cpu=prefix_host, extend_lens_cpu=[1] * n,
            max_extend=1, logits_indices=torch.arange(n, device=self.device), attn_backend=backend,
            spec_features=features)

"""The MoE sublayer: router, this rank's routed experts, the shared expert, and the one all-reduce.

A decode forward on CUDA may take the fused decode route instead (`paths.takes_decode_route`): the Triton
router (route_kernels.py), the two GEMV kernels (gemv_moe.py) and one combine kernel that adds the shared
expert and writes the layer's output: five launches where the torch router, the GEMV path and the torch
combine take about fourteen."""
from __future__ import annotations

import torch
from torch import nn

from kestrel.distributed.parallel_state import ParallelState
from kestrel.layers.moe import paths
from kestrel.layers.moe.config import MoEConfig
from kestrel.layers.moe.experts import Experts
from kestrel.layers.moe.loading import QWEN_EXPERTS, ExpertCheckpoint
from kestrel.layers.moe.routers import Router
from kestrel.layers.moe.shared import SharedExpert


class MoE(nn.Module):
    """forward: x [T, H] (and the tokens' ids [T], read by hash routing only) -> [T, H] in x's dtype,
    summed over the ranks. Submodules: `gate` (Router), `experts` (Experts: stacked, this rank's),
    `shared_experts` (SharedExpert or None), `shared_expert_gate` ([1, H] linear or None)."""

    def __init__(self, cfg: MoEConfig, parallel: ParallelState = ParallelState(),
                 checkpoint: ExpertCheckpoint = QWEN_EXPERTS) -> None:
        super().__init__()
        self.cfg, self.parallel = cfg, parallel
        self.gate = Router(cfg.router, cfg.hidden_size)
        self.experts = Experts(cfg, parallel, checkpoint)
        self.shared_experts = None
        if cfg.shared_intermediate_size:
            self.shared_experts = SharedExpert(cfg.hidden_size, cfg.shared_intermediate_size, cfg.activation, parallel)
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False) if cfg.shared_expert_gate else None

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        if paths.takes_decode_route(x, self.experts, self.cfg.router):
            return self.forward_decode(x)
        ids, weights = self.gate(x, input_ids)
        shared = self.shared_experts
        if shared is not None and shared.adds:  # the shared output first: the routed sum goes into it
            out = shared(x)
            if self.shared_expert_gate is not None:
                out = torch.sigmoid(self.shared_expert_gate(x)) * out
            out = out.float()
        else:
            out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        self.add_routed(x, ids, weights, out)
        if self.parallel.tp_size > 1:  # the one collective: routed experts (and shared slices) of every rank
            out = self.parallel.all_reduce(out)
        return out.to(x.dtype)

    def forward_decode(self, x: torch.Tensor) -> torch.Tensor:
        """`forward` through the fused decode route (a router kind of route_kernels.ROUTE_KINDS): the same
        sum, with the shared expert's gate applied in float32 in the combine kernel."""
        from kestrel.layers.moe.gemv_moe import combine_rows, gemv_rows  # Triton is only needed on this route
        from kestrel.layers.moe.route_kernels import route

        experts, shared, gate = self.experts, self.shared_experts, None
        ids, weights = route(x, self.gate.weight, self.gate.bias, self.cfg.router)
        rows = torch.empty(ids.numel(), x.shape[1], dtype=torch.float32, device=x.device)
        gemv_rows(x, ids, weights, experts.w13, experts.w2, experts.first, self.cfg.activation, experts.b13,
                  experts.down_bias(), rows)
        shared_out = None
        if shared is not None and shared.adds:
            shared_out = shared(x)
            if self.shared_expert_gate is not None:
                gate = self.shared_expert_gate(x)
        reduce = self.parallel.tp_size > 1  # the ranks' partial sums are added in float32, then cast
        out = torch.empty(x.shape, dtype=torch.float32 if reduce else x.dtype, device=x.device)
        combine_rows(rows, ids, experts.first, experts.count, out, shared_out, gate)
        if reduce:
            out = self.parallel.all_reduce(out).to(x.dtype)
        return out

    def routed_path(self, x: torch.Tensor) -> str:
        """Which of paths.ROUTED_PATHS this forward takes (paths.choose_path)."""
        return paths.choose_path(x, self.experts)

    def add_routed(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, out: torch.Tensor,
                   path: str | None = None) -> None:
        """out [T, H] float32 += this rank's routed experts' weighted outputs, by `path` (default: the
        layer's choice, `routed_path`)."""
        paths.ADD_ROUTED[path or self.routed_path(x)](x, ids, weights, self.experts, self.cfg.activation, out)

"""V4's MoE sublayer (docs/design/deepseek-v4.md §4): every layer is MoE; the first `num_hash_layers` route by a fixed
token-id table, the others by top-k of the scores plus a selection-only bias. Routed and shared
experts are SwiGLU with the same clamp; the routed weights are renormalised and scaled.

Expert parallelism (`ep_size` > 1): each rank holds n_routed_experts / ep_size consecutive routed
experts. Every rank holds every token (the rest of the model is replicated), so dispatching a token
to its experts' ranks is each rank picking the tokens routed to its own experts; the combine is one
all-reduce of the routed sums. The shared expert is replicated and added after it."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kestrel.distributed.parallel_state import ParallelState
from kestrel.models.deepseek_v4.config import V4Config

# The most local experts for which a captured step (decode) runs every expert on every token rather than
# the grouped GEMM (fused_moe.py): the 16-expert bench slice's decode graphs were measured with every-expert
# on the H200, and above that its waste grows with the expert count (at 256 experts and 6 per token, batch 1
# reads ~43x the weights it needs). scripts/bench_dsv4_moe.py's H200 comparison of the two decides the value.
EVERY_EXPERT_MAX = 16


def swiglu(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, limit: float) -> torch.Tensor:
    """W2 (SiLU(min(W1 x, L)) * clamp(W3 x, -L, L))."""
    return (F.silu((x @ w1.T).clamp(max=limit)) * (x @ w3.T).clamp(-limit, limit)) @ w2.T


def expert_scores(logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    if scoring_func == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    if scoring_func == "sigmoid":
        return logits.sigmoid()
    return logits.softmax(dim=-1)


def capturing(x: torch.Tensor) -> bool:
    """Whether this forward is being captured into a CUDA graph (then no op may read the device on the host)."""
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


class Gate(nn.Module):
    """`weight` [E, d]; `bias` (learned routing) or the `tid2eid` table [vocab, k] (hash routing)."""

    def __init__(self, cfg: V4Config, hash_routing: bool) -> None:
        super().__init__()
        self.cfg, self.hash_routing = cfg, hash_routing
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size, dtype=torch.float32))
        if hash_routing:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, cfg.num_experts_per_tok, dtype=torch.int64))
        else:
            self.bias = nn.Parameter(torch.zeros(cfg.n_routed_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids [T, k], weights [T, k] float32)."""
        scores = expert_scores(x.float() @ self.weight.T, self.cfg.scoring_func)
        if self.hash_routing:
            ids = self.tid2eid[input_ids]
        else:  # the bias picks the experts but does not weight them
            ids = (scores + self.bias).topk(self.cfg.num_experts_per_tok, dim=-1).indices
        weights = scores.gather(1, ids)
        return ids, weights / weights.sum(-1, keepdim=True) * self.cfg.routed_scaling_factor


class Experts(nn.Module):
    """This rank's routed experts of a layer stacked (all of them at ep_size 1), global ids `first` ..
    `first + count - 1`: `w13` [count, 2I, d] (w1 rows, then w3 rows), `w2` [count, d, I]."""

    def __init__(self, cfg: V4Config, parallel: ParallelState = ParallelState()) -> None:
        super().__init__()
        E, inter = cfg.n_routed_experts, cfg.moe_intermediate_size
        if E % parallel.ep_size:
            raise ValueError(f"ep_size {parallel.ep_size} must divide the model's n_routed_experts ({E})")
        self.count = E // parallel.ep_size
        self.first = parallel.ep_rank * self.count
        self.w13 = nn.Parameter(torch.zeros(self.count, 2 * inter, cfg.hidden_size))
        self.w2 = nn.Parameter(torch.zeros(self.count, cfg.hidden_size, inter))


class SharedExpert(nn.Module):
    def __init__(self, cfg: V4Config) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.hidden_size, cfg.moe_intermediate_size, bias=False)
        self.w2 = nn.Linear(cfg.moe_intermediate_size, cfg.hidden_size, bias=False)
        self.w3 = nn.Linear(cfg.hidden_size, cfg.moe_intermediate_size, bias=False)


class V4MoE(nn.Module):
    def __init__(self, cfg: V4Config, hash_routing: bool, parallel: ParallelState = ParallelState()) -> None:
        super().__init__()
        self.limit = cfg.swiglu_limit
        self.parallel = parallel
        self.gate = Gate(cfg, hash_routing)
        self.experts = Experts(cfg, parallel)
        self.shared_experts = SharedExpert(cfg)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        ids, weights = self.gate(x, input_ids)
        sh = self.shared_experts
        out = swiglu(x, sh.w1.weight, sh.w3.weight, sh.w2.weight, self.limit).float()
        split = self.parallel.ep_size > 1
        routed = torch.zeros_like(out) if split else out  # one rank: the routed sum goes straight into out
        path = self.routed_path(x)
        if path == "fused":
            self.add_routed_fused(x, ids, weights, routed)
        elif path == "every":
            self.add_routed_every_expert(x, ids, weights, routed)
        else:
            self.add_routed_hit_experts(x, ids, weights, routed)
        if split:
            out = out + self.parallel.all_reduce(routed)
        return out.to(x.dtype)

    def routed_path(self, x: torch.Tensor) -> str:
        """How this forward sums the routed experts: "loop" (add_routed_hit_experts: eager, reads the ids on
        the host; the CPU path), "every" (add_routed_every_expert: under capture, few local experts) or
        "fused" (add_routed_fused: CUDA, more than EVERY_EXPERT_MAX local experts; eager too, as one grouped
        GEMM is fewer launches than the loop's per-expert products)."""
        if x.is_cuda and self.experts.count > EVERY_EXPERT_MAX:
            return "fused"
        return "every" if capturing(x) else "loop"

    def add_routed_fused(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                         routed: torch.Tensor) -> None:
        """The same sum as add_routed_hit_experts by the Triton grouped GEMM (fused_moe.py): static shapes, no
        host read, and it reads only the experts the step hits."""
        from kestrel.models.deepseek_v4.fused_moe import fused_moe  # Triton is only needed on this path

        experts = self.experts
        routed += fused_moe(x, ids, weights, experts.w13, experts.w2, experts.first, self.limit)

    def add_routed_hit_experts(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                               routed: torch.Tensor) -> None:
        """routed [T, d] f32 += this rank's routed experts' weighted outputs: a token-by-expert loop over
        the experts actually hit (the torch path, not the GPU's grouped GEMM; it reads the ids on the host)."""
        experts = self.experts
        w1, w3 = experts.w13.chunk(2, dim=1)
        for expert in ids.unique().tolist():
            local = expert - experts.first
            if not 0 <= local < experts.count:  # another rank's expert
                continue
            token, slot = (ids == expert).nonzero(as_tuple=True)
            y = swiglu(x[token], w1[local], w3[local], experts.w2[local], self.limit)
            routed.index_add_(0, token, y.float() * weights[token, slot, None])

    def add_routed_every_expert(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                                routed: torch.Tensor) -> None:
        """The same sum with fixed shapes and no host read, for CUDA-graph capture (decode steps): every
        local expert runs on every token (two batched products that read each expert's weights once)
        and a token's weight for an expert it was not routed to is 0. It reads all local experts, not
        just the hit ones: fine for a decode batch that hits most of them, wasteful for a few tokens
        over many experts: above EVERY_EXPERT_MAX local experts add_routed_fused serves the graphs instead."""
        experts = self.experts
        local = ids - experts.first
        mine = (local >= 0) & (local < experts.count)
        combine = torch.zeros(x.shape[0], experts.count, dtype=torch.float32, device=x.device)
        combine.scatter_add_(1, local.clamp(0, experts.count - 1), weights.masked_fill(~mine, 0.0))
        inter = experts.w2.shape[2]
        h = torch.matmul(x[None], experts.w13.transpose(1, 2))  # [E, T, 2I]
        act = F.silu(h[..., :inter].clamp(max=self.limit)) * h[..., inter:].clamp(-self.limit, self.limit)
        y = torch.bmm(act, experts.w2.transpose(1, 2))  # [E, T, d]
        routed += (y.float() * combine.T[:, :, None]).sum(0)

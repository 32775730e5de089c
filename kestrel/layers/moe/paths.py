"""Four ways to add a rank's routed experts' weighted outputs to `out` [T, H] float32, one sum:

- "loop" (`add_hit_experts`): a loop over the experts the step hits, each on its tokens; it reads
  the ids on the host, so it runs eagerly only (the CPU's path);
- "every" (`add_every_expert`): every local expert on every token, weight 0 where a token was not
  routed; static shapes and no host read (CUDA-graph capture with few local experts);
- "fused" (`add_fused`): the Triton grouped GEMM (fused_moe.py): static shapes, no host read, and
  it reads only the experts the step hits (CUDA, many local experts; eager too: fewer launches);
- "gemv" (`add_gemv`): two Triton GEMV kernels (gemv_moe.py), a program per (token, slot) assignment
  that reads its expert id itself: no sort or tiles to build, static shapes, no host read (meant for
  decode's few tokens, where the grouped GEMM's 16-row tiles hold one real row; chosen up to
  GEMV_MAX_TOKENS tokens, as kestrel/bench/kernels/moe_paths.py measured it).
`choose_path` picks one; a benchmark times each by passing its name to `MoE.add_routed`.
With FUSED_DECODE_ROUTE on, a forward `choose_path` sends to "gemv" takes the fused decode route instead
where the router allows (`takes_decode_route`): the whole layer, router and combine included, in five
Triton launches (`MoE.forward_decode`: route_kernels.py, then gemv_moe.py's two GEMVs and its combine).

ids [T, k] are global expert ids (other ranks' experts are skipped), weights [T, k] float32."""
from __future__ import annotations

import torch

from kestrel.layers.moe.activation import gated
from kestrel.layers.moe.config import ExpertActivation, RouterConfig
from kestrel.layers.moe.experts import Experts

ROUTED_PATHS = ("loop", "every", "fused", "gemv")
# The most local experts for which a captured step (decode) runs every expert on every token rather than
# the grouped GEMM: DeepSeek-V4's 16-expert bench slice's decode graphs were measured with every-expert
# on the H200, and above that its waste grows with the expert count (at 256 experts and 6 per token,
# batch 1 reads ~43x the weights it needs). kestrel/bench/kernels/dsv4_moe.py compares the paths.
EVERY_EXPERT_MAX = 16
# The most tokens a CUDA forward sends down the "gemv" path, whatever the expert count: on the H100 it
# beat the grouped GEMM in a graph at 1 and 4 tokens for both Qwen3-30B-A3B (0.053 / 0.091 ms at one
# token) and gpt-oss-20b, tied at 16 for Qwen3 and lost there for gpt-oss (moe_paths, docs/benchmarks.md).
# A module constant so that a benchmark can set it in its process before the model is built.
GEMV_MAX_TOKENS = 4
# Whether a forward that takes "gemv" under a router kind of route_kernels.ROUTE_KINDS runs the whole layer as the
# fused decode route (`MoE.forward_decode`: Triton router, the two GEMVs, one combine kernel; 5 launches where
# the torch router, "gemv" and the torch combine take ~14). On the H100 one graphed layer took 0.050 ms
# instead of 0.077 (Qwen3-30B-A3B, one token) and a batch-4 decode step 7.44 ms instead of 8.69; gpt-oss-20b
# 8.05 instead of 8.65 (docs/benchmarks.md). Set it in the process before the model is built, as GEMV_MAX_TOKENS.
FUSED_DECODE_ROUTE = True


def capturing(x: torch.Tensor) -> bool:
    """Whether this forward is being captured into a CUDA graph (then no op may read the device on the host)."""
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def choose_path(x: torch.Tensor, experts: Experts) -> str:
    """"gemv" on CUDA up to GEMV_MAX_TOKENS tokens; "fused" on CUDA above EVERY_EXPERT_MAX local experts;
    else "every" under capture, "loop" eagerly."""
    if x.is_cuda and x.shape[0] <= GEMV_MAX_TOKENS:
        return "gemv"
    if x.is_cuda and experts.count > EVERY_EXPERT_MAX:
        return "fused"
    return "every" if capturing(x) else "loop"


def takes_decode_route(x: torch.Tensor, experts: Experts, router: RouterConfig) -> bool:
    """Whether `MoE.forward` takes the fused decode route: FUSED_DECODE_ROUTE on, a forward `choose_path`
    sends to "gemv" (CUDA, up to GEMV_MAX_TOKENS tokens) and a router the Triton router computes."""
    if not FUSED_DECODE_ROUTE or choose_path(x, experts) != "gemv":
        return False
    from kestrel.layers.moe.route_kernels import supports  # Triton is only needed on this route

    return supports(router)


def add_hit_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: Experts,
                    act: ExpertActivation, out: torch.Tensor) -> None:
    inter = experts.w2.shape[2]
    w1, w3 = experts.w13.chunk(2, dim=1)
    b13, b2 = experts.b13, experts.down_bias()
    for expert in ids.unique().tolist():
        if not experts.holds(expert):  # another rank's expert
            continue
        local = expert - experts.first
        token, slot = (ids == expert).nonzero(as_tuple=True)
        h = x[token]
        gate, up = h @ w1[local].T, h @ w3[local].T
        if b13 is not None:
            gate, up = gate + b13[local, :inter], up + b13[local, inter:]
        y = gated(gate, up, act) @ experts.w2[local].T
        if b2 is not None:
            y = y + b2[local]
        out.index_add_(0, token, y.float() * weights[token, slot, None])


def add_every_expert(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: Experts,
                     act: ExpertActivation, out: torch.Tensor) -> None:
    """Reads all local experts, not just the hit ones: fine for a decode batch that hits most of them,
    wasteful for a few tokens over many experts (above EVERY_EXPERT_MAX "fused" serves the graphs)."""
    local = ids - experts.first
    mine = (local >= 0) & (local < experts.count)
    combine = torch.zeros(x.shape[0], experts.count, dtype=torch.float32, device=x.device)
    combine.scatter_add_(1, local.clamp(0, experts.count - 1), weights.masked_fill(~mine, 0.0))
    inter = experts.w2.shape[2]
    h = torch.matmul(x[None], experts.w13.transpose(1, 2))  # [E, T, 2I]
    if experts.b13 is not None:
        h = h + experts.b13[:, None, :]
    y = torch.bmm(gated(h[..., :inter], h[..., inter:], act), experts.w2.transpose(1, 2))  # [E, T, H]
    if (b2 := experts.down_bias()) is not None:
        y = y + b2[:, None, :]
    out += (y.float() * combine.T[:, :, None]).sum(0)


def add_fused(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: Experts,
              act: ExpertActivation, out: torch.Tensor) -> None:
    from kestrel.layers.moe.fused_moe import fused_moe  # Triton is only needed on this path

    out += fused_moe(x, ids, weights, experts.w13, experts.w2, experts.first, act, experts.b13, experts.down_bias())


def add_gemv(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: Experts,
             act: ExpertActivation, out: torch.Tensor) -> None:
    from kestrel.layers.moe.gemv_moe import gemv_moe  # Triton is only needed on this path

    out += gemv_moe(x, ids, weights, experts.w13, experts.w2, experts.first, act, experts.b13, experts.down_bias())


ADD_ROUTED = {"loop": add_hit_experts, "every": add_every_expert, "fused": add_fused, "gemv": add_gemv}

"""A router for decode's few tokens in two Triton kernels, where torch launches about seven (the cast, the
matmul, the bias, softmax, top-k, the sum and the division); what `routers.Router.forward` returns for the
kinds "softmax_topk" and "topk_softmax" (ROUTE_KINDS), with or without a logit bias:
- `_logits_kernel`, a program per (token, BLOCK_E experts): logits [T, E] = x @ weight^T (+ bias) in float32.
  A small BLOCK_E spreads the float32 weight (1 MB for Qwen3-30B-A3B) over many SMs; the programs of one
  expert block for different tokens are adjacent in the grid, so a token past the first reads it from L2;
- `_select_kernel`, a program per token: its whole row of logits in registers, the top k picked by k rounds
  of argmax-and-mask (an equal value goes to the lower expert id, as torch.topk does on CUDA for distinct
  values), then the weights: the picked softmax probabilities, renormalised if asked ("softmax_topk"), or a
  softmax over the k picked logits ("topk_softmax"). Ids and weights are scattered to their slot by rank,
  so slot 0 holds the largest, as torch.topk's sorted output does.
The products are float32 in registers reduced with tl.sum (for float32 inputs no TF32, as torch's float32
matmul by default), so the experts picked do not depend on the batch a token runs in."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kestrel import pdl
from kestrel.envs import triton_jit
from kestrel.layers.moe.config import RouterConfig

ROUTE_KINDS = ("softmax_topk", "topk_softmax")
# The select kernel holds a token's row of logits in registers; no router kestrel loads has more experts.
MAX_EXPERTS = 1024


@dataclass(frozen=True)
class RouteConfig:
    """Untuned: 2 experts a program gives 64 programs a token for Qwen3-30B-A3B's 128 experts and 16 for
    gpt-oss-20b's 32; kestrel/bench/kernels/moe_paths.py times the whole decode route."""

    block_e: int = 2  # experts (weight rows) per program
    block_k: int = 512  # reduction step over the hidden size
    num_warps: int = 4


def supports(cfg: RouterConfig) -> bool:
    """Whether `route` computes this router (its kind and expert count)."""
    return cfg.kind in ROUTE_KINDS and cfg.num_experts <= MAX_EXPERTS


@triton_jit
def _logits_kernel(X, W, B, Logits, hidden, experts, stride_xt, stride_we, stride_lt,
                   BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr):
    pdl.sync(PDL)
    token = tl.program_id(0).to(tl.int64)
    offs_e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    e_ok = offs_e < experts
    w = W + offs_e[:, None].to(tl.int64) * stride_we
    acc = tl.zeros([BLOCK_E, BLOCK_K], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):  # per-lane partial sums; one tl.sum at the end
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < hidden
        x = tl.load(X + token * stride_xt + offs_k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        acc += tl.load(w + offs_k[None, :], mask=e_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32) * x
    logits = tl.sum(acc, axis=1)
    if HAS_BIAS:
        logits += tl.load(B + offs_e, mask=e_ok, other=0.0).to(tl.float32)
    tl.store(Logits + token * stride_lt + offs_e, logits, mask=e_ok)


@triton_jit
def _select_kernel(Logits, Ids, Weights, experts, stride_lt,
                   TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, SOFTMAX_FIRST: tl.constexpr,
                   RENORMALIZE: tl.constexpr, PDL: tl.constexpr):
    pdl.sync(PDL)
    token = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    e_ok = offs < experts
    logits = tl.load(Logits + token * stride_lt + offs, mask=e_ok, other=float("-inf"))
    top = tl.max(logits, axis=0)
    if SOFTMAX_FIRST:
        probs = tl.exp(logits - top)
        probs = probs / tl.sum(probs, axis=0)
        score = tl.where(e_ok, probs, -1.0)  # below any probability, even one that underflowed to 0
    else:
        score = logits
    rank = tl.full([BLOCK_E], -1, tl.int32)  # the slot each picked expert goes to
    for slot in tl.static_range(TOP_K):
        best = tl.max(score, axis=0)
        pick = tl.min(tl.where(score == best, offs, BLOCK_E), axis=0)  # the lowest id of equal values
        rank = tl.where(offs == pick, slot, rank)
        score = tl.where(offs == pick, float("-inf"), score)
    picked = rank >= 0
    if SOFTMAX_FIRST:
        weights = tl.where(picked, probs, 0.0)
        if RENORMALIZE:
            weights = weights / tl.sum(weights, axis=0)
    else:
        weights = tl.where(picked, tl.exp(logits - top), 0.0)  # the largest logit is always picked
        weights = weights / tl.sum(weights, axis=0)
    tl.store(Ids + token * TOP_K + rank, offs.to(tl.int64), mask=picked)
    tl.store(Weights + token * TOP_K + rank, weights, mask=picked)


def route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cfg: RouterConfig,
          launch: RouteConfig = RouteConfig()) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] (any float dtype) -> (ids [T, k] int64, weights [T, k] float32), as `Router.forward` for a
    router `cfg` that `supports`; weight [E, H] and bias [E] (or None) float32. Static shapes, no host read."""
    if not supports(cfg):
        raise ValueError(f"the Triton router computes the kinds {', '.join(ROUTE_KINDS)} with at most "
                         f"{MAX_EXPERTS} experts, not {cfg.kind!r} with {cfg.num_experts}")
    T, hidden = x.shape
    experts, k = weight.shape[0], cfg.top_k
    x, weight = x.contiguous(), weight.contiguous()
    logits = torch.empty(T, experts, dtype=torch.float32, device=x.device)
    ids = torch.empty(T, k, dtype=torch.int64, device=x.device)
    weights = torch.empty(T, k, dtype=torch.float32, device=x.device)
    if T == 0:
        return ids, weights
    _logits_kernel[(T, triton.cdiv(experts, launch.block_e))](
        x, weight, bias if bias is not None else weight, logits, hidden, experts, x.stride(0), weight.stride(0),
        logits.stride(0), BLOCK_E=launch.block_e, BLOCK_K=launch.block_k, HAS_BIAS=bias is not None,
        num_warps=launch.num_warps, **pdl.launch_options(x.device))
    _select_kernel[(T,)](
        logits, ids, weights, experts, logits.stride(0), TOP_K=k, BLOCK_E=triton.next_power_of_2(experts),
        SOFTMAX_FIRST=cfg.kind == "softmax_topk", RENORMALIZE=cfg.renormalize, num_warps=1,
        **pdl.launch_options(x.device))
    return ids, weights

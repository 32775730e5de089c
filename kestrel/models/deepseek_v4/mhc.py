"""Manifold-constrained hyper-connections (docs/design/deepseek-v4.md §3): the residual is `hc_mult` streams per token.

Pure functions over the parameters a block owns (`hc_attn_{fn,base,scale}`, `hc_ffn_*`, `hc_head_*`,
DeepSeek's names): the mixing weights are computed in float32, the streams stay in the model dtype.
"""
from __future__ import annotations

import torch
from torch import nn

from kestrel.models.deepseek_v4.config import V4Config


def hc_site_params(module: nn.Module, prefix: str, cfg: V4Config, head: bool = False) -> None:
    """Register `{prefix}_fn`, `_base`, `_scale` (float32) on `module`: a layer site mixes pre, post and
    comb ((2 + n) n rows, 3 scales); the head only collapses (n rows, 1 scale)."""
    n = cfg.hc_mult
    rows, scales = (n, 1) if head else ((2 + n) * n, 3)
    setattr(module, f"{prefix}_fn", nn.Parameter(torch.zeros(rows, n * cfg.hidden_size, dtype=torch.float32)))
    setattr(module, f"{prefix}_base", nn.Parameter(torch.zeros(rows, dtype=torch.float32)))
    setattr(module, f"{prefix}_scale", nn.Parameter(torch.ones(scales, dtype=torch.float32)))


def _mixes(X: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    """rho * fn @ vec(X): the projection of the RMS-normalised flattened streams (no weight)."""
    flat = X.flatten(1).float()
    rho = torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + eps)
    return rho * (flat @ fn.T)


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Row softmax, then alternate column / row normalisation: a (nearly) doubly stochastic matrix."""
    m = torch.softmax(logits, dim=-1) + eps
    m = m / (m.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        m = m / (m.sum(-1, keepdim=True) + eps)
        m = m / (m.sum(-2, keepdim=True) + eps)
    return m


def hc_pre(X: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
           cfg: V4Config) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """X [T, n, d] -> (sublayer input [T, d] in X's dtype, post [T, n], comb [T, n, n]) (float32)."""
    n = cfg.hc_mult
    mu = _mixes(X, fn, cfg.rms_norm_eps)
    pre = torch.sigmoid(scale[0] * mu[:, :n] + base[:n]) + cfg.hc_eps
    post = 2 * torch.sigmoid(scale[1] * mu[:, n:2 * n] + base[n:2 * n])  # 2σ, no eps (docs/design/deepseek-v4.md §3)
    comb = sinkhorn((scale[2] * mu[:, 2 * n:] + base[2 * n:]).unflatten(-1, (n, n)), cfg.hc_sinkhorn_iters,
                    cfg.hc_eps)
    x_in = (pre.unsqueeze(-1) * X.float()).sum(1).to(X.dtype)
    return x_in, post, comb


def hc_post(out: torch.Tensor, X: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """X'_j = post_j * out + sum_i comb_ij X_i (the sum runs over comb's *first* index)."""
    mixed = torch.einsum("tij,tid->tjd", comb, X.float())
    return (post.unsqueeze(-1) * out.float().unsqueeze(1) + mixed).to(X.dtype)


def hc_head(X: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
            cfg: V4Config) -> torch.Tensor:
    """Collapse the streams once, at the end of the model (no Sinkhorn, no post)."""
    pre = torch.sigmoid(scale[0] * _mixes(X, fn, cfg.rms_norm_eps) + base) + cfg.hc_eps
    return (pre.unsqueeze(-1) * X.float()).sum(1).to(X.dtype)

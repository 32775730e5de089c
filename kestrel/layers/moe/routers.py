"""Routers: a token's hidden state -> (expert ids [T, k] int64, weights [T, k] float32).

The gate's logits are computed in float32 (its weight is kept in float32 whatever the model dtype):
the choice of experts is a discontinuous function of them, and float32 keeps it the same for a
token whatever batch it runs in. Each kind (config.RouterConfig) is one small function below."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kestrel.layers.moe.config import RouterConfig


def softmax_topk(logits: torch.Tensor, cfg: RouterConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over every expert, the top k, renormalised to sum 1 if asked (Qwen-MoE, Mixtral)."""
    weights, ids = logits.softmax(dim=-1).topk(cfg.top_k, dim=-1)
    if cfg.renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return ids, weights


def topk_softmax(logits: torch.Tensor, cfg: RouterConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The top k logits, then a softmax over those k only (gpt-oss)."""
    top, ids = logits.topk(cfg.top_k, dim=-1)
    return ids, top.softmax(dim=-1)


def expert_scores(logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    if scoring_func == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    if scoring_func == "sigmoid":
        return logits.sigmoid()
    return logits.softmax(dim=-1)


def biased_selection(scores: torch.Tensor, correction_bias: torch.Tensor, cfg: RouterConfig) -> torch.Tensor:
    """The ids of the top k of scores + correction_bias (the bias picks experts, it does not weigh them),
    among the experts of the best `topk_group` groups; a group's score is the sum of its best two."""
    biased = scores + correction_bias
    if cfg.n_group > 1:
        groups = biased.view(biased.shape[0], cfg.n_group, -1)
        best = groups.topk(min(2, groups.shape[-1]), dim=-1).values.sum(-1)  # [T, n_group]
        keep = torch.zeros_like(best, dtype=torch.bool).scatter_(1, best.topk(cfg.topk_group, dim=-1).indices, True)
        biased = groups.masked_fill(~keep[..., None], float("-inf")).flatten(1)
    return biased.topk(cfg.top_k, dim=-1).indices


def scored_weights(scores: torch.Tensor, ids: torch.Tensor, cfg: RouterConfig) -> torch.Tensor:
    """The picked experts' scores, renormalised if asked, times the scaling factor (DeepSeek)."""
    weights = scores.gather(1, ids)
    if cfg.renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights * cfg.scaling_factor


class Router(nn.Module):
    """`weight` [E, H] float32 (and `bias` [E] with a logit bias); `e_score_correction_bias` [E]
    ("biased_topk"); the buffer `tid2eid` [vocab, k] ("hash")."""

    def __init__(self, cfg: RouterConfig, hidden_size: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, hidden_size, dtype=torch.float32))
        self.bias = nn.Parameter(torch.zeros(cfg.num_experts, dtype=torch.float32)) if cfg.logit_bias else None
        if cfg.kind == "biased_topk":
            self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.num_experts, dtype=torch.float32))
        if cfg.kind == "hash":
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, cfg.top_k, dtype=torch.int64))

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] (and the tokens' ids, for hash routing) -> (ids [T, k] int64, weights [T, k] float32)."""
        logits = x.float() @ self.weight.T
        if self.bias is not None:
            logits = logits + self.bias
        cfg = self.cfg
        if cfg.kind == "softmax_topk":
            return softmax_topk(logits, cfg)
        if cfg.kind == "topk_softmax":
            return topk_softmax(logits, cfg)
        scores = expert_scores(logits, cfg.scoring_func)
        if cfg.kind == "hash":
            if input_ids is None:
                raise ValueError("hash routing needs the tokens' ids")
            ids = self.tid2eid[input_ids]
        else:
            ids = biased_selection(scores, self.e_score_correction_bias, cfg)
        return ids, scored_weights(scores, ids, cfg)

"""A naive DeepSeek-V4 written from docs/design/deepseek-v4.md (the "§N" below are its sections), for tests only.

Full recomputation of one sequence at a time, in float32, with the tier-A choices of §7: the QAT
round-trips (FP8 / FP4 / Hadamard) are left out. Weights are a dict keyed by DeepSeek's native names
(§1.3). It shares no code with kestrel on purpose: it is the oracle the engine's incremental,
batched, cached implementation is compared against, so loops and masks here favour being obviously
right over being fast. A quantized KV cache is checked by passing the cache's round trip as
`kv_store` / `index_key_store`: the reference then reads every K=V entry and indexer key as stored.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class RefConfig:
    """§7 tier A. `compress_ratios` has one entry per main layer plus the MTP layer's."""

    vocab_size: int = 512
    hidden_size: int = 256
    num_hidden_layers: int = 4
    compress_ratios: tuple[int, ...] = (0, 4, 128, 4, 0)
    num_attention_heads: int = 8
    head_dim: int = 64
    qk_rope_head_dim: int = 16
    q_lora_rank: int = 64
    o_groups: int = 2
    o_lora_rank: int = 32
    sliding_window: int = 16
    rope_theta: float = 1e4
    compress_rope_theta: float = 1.6e5
    yarn_factor: float = 4.0
    yarn_original_max: int = 64
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    index_n_heads: int = 4
    index_head_dim: int = 32
    index_topk: int = 8
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 64
    num_hash_layers: int = 1
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 1.0  # small, so the clamp actually fires on random weights
    # What the KV cache gives back for stored K=V entries (window keys and compressed entries) and
    # indexer keys; None: the values themselves.
    kv_store: Callable[[torch.Tensor], torch.Tensor] | None = None
    index_key_store: Callable[[torch.Tensor], torch.Tensor] | None = None

    def native_config(self) -> dict:
        """The same model as a DeepSeek-native `config.json` (REF `ModelArgs` field names)."""
        return {
            "architectures": ["DeepseekV4ForCausalLM"], "vocab_size": self.vocab_size, "dim": self.hidden_size,
            "n_layers": self.num_hidden_layers, "compress_ratios": list(self.compress_ratios),
            "n_heads": self.num_attention_heads, "head_dim": self.head_dim,
            "rope_head_dim": self.qk_rope_head_dim, "q_lora_rank": self.q_lora_rank, "o_groups": self.o_groups,
            "o_lora_rank": self.o_lora_rank, "window_size": self.sliding_window, "rope_theta": self.rope_theta,
            "compress_rope_theta": self.compress_rope_theta, "rope_factor": self.yarn_factor,
            "original_seq_len": self.yarn_original_max, "beta_fast": self.yarn_beta_fast,
            "beta_slow": self.yarn_beta_slow, "index_n_heads": self.index_n_heads,
            "index_head_dim": self.index_head_dim, "index_topk": self.index_topk, "hc_mult": self.hc_mult,
            "hc_sinkhorn_iters": self.hc_sinkhorn_iters, "hc_eps": self.hc_eps, "norm_eps": self.rms_norm_eps,
            "n_routed_experts": self.n_routed_experts, "n_shared_experts": 1,
            "n_activated_experts": self.num_experts_per_tok, "moe_inter_dim": self.moe_intermediate_size,
            "n_hash_layers": self.num_hash_layers, "score_func": "sqrtsoftplus",
            "route_scale": self.routed_scaling_factor, "swiglu_limit": self.swiglu_limit,
            "n_mtp_layers": 1, "max_seq_len": 4096, "bos_token_id": 0, "eos_token_id": 1,
        }


# ---- weights ---------------------------------------------------------------------------------------
def random_weights(cfg: RefConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Native-named random weights at scales that keep activations O(1) (so softmaxes, the sink, the
    clamp and the Sinkhorn iteration all do something)."""
    g = torch.Generator().manual_seed(seed)

    def lin(out_f: int, in_f: int) -> torch.Tensor:
        return torch.randn(out_f, in_f, generator=g) / math.sqrt(in_f)

    def vec(n: int, scale: float = 1.0, center: float = 0.0) -> torch.Tensor:
        return center + scale * torch.randn(n, generator=g)

    d, H, D, n = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.hc_mult
    w: dict[str, torch.Tensor] = {"embed.weight": torch.randn(cfg.vocab_size, d, generator=g),
                                  "head.weight": lin(cfg.vocab_size, d), "norm.weight": vec(d, 0.1, 1.0)}

    def hc(prefix: str, rows: int, scales: int) -> None:
        w[f"{prefix}_fn"] = torch.randn(rows, n * d, generator=g) * 2 / math.sqrt(n * d)
        w[f"{prefix}_base"] = vec(rows, 0.5)
        w[f"{prefix}_scale"] = vec(scales, 0.2, 1.0)

    def compressor(prefix: str, c: int, ratio: int) -> None:
        kappa = 2 if ratio == 4 else 1
        w[f"{prefix}.wkv.weight"] = lin(kappa * c, d)
        w[f"{prefix}.wgate.weight"] = lin(kappa * c, d)
        w[f"{prefix}.ape"] = torch.randn(ratio, kappa * c, generator=g) * 0.5
        w[f"{prefix}.norm.weight"] = vec(c, 0.1, 1.0)

    def block(p: str, ratio: int, hash_layer: bool) -> None:
        w[f"{p}.attn_norm.weight"] = vec(d, 0.1, 1.0)
        w[f"{p}.ffn_norm.weight"] = vec(d, 0.1, 1.0)
        hc(f"{p}.hc_attn", (2 + n) * n, 3)
        hc(f"{p}.hc_ffn", (2 + n) * n, 3)
        a = f"{p}.attn"
        w[f"{a}.wq_a.weight"] = lin(cfg.q_lora_rank, d)
        w[f"{a}.q_norm.weight"] = vec(cfg.q_lora_rank, 0.1, 1.0)
        w[f"{a}.wq_b.weight"] = lin(H * D, cfg.q_lora_rank)
        w[f"{a}.wkv.weight"] = lin(D, d)
        w[f"{a}.kv_norm.weight"] = vec(D, 0.1, 1.0)
        w[f"{a}.wo_a.weight"] = lin(cfg.o_groups * cfg.o_lora_rank, H * D // cfg.o_groups)
        w[f"{a}.wo_b.weight"] = lin(d, cfg.o_groups * cfg.o_lora_rank)
        w[f"{a}.attn_sink"] = vec(H, 1.0)
        if ratio:
            compressor(f"{a}.compressor", D, ratio)
        if ratio == 4:
            w[f"{a}.indexer.wq_b.weight"] = lin(cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank)
            w[f"{a}.indexer.weights_proj.weight"] = lin(cfg.index_n_heads, d)
            compressor(f"{a}.indexer.compressor", cfg.index_head_dim, ratio)
        f_ = f"{p}.ffn"
        E, inter = cfg.n_routed_experts, cfg.moe_intermediate_size
        w[f"{f_}.gate.weight"] = lin(E, d)
        if hash_layer:
            w[f"{f_}.gate.tid2eid"] = torch.stack(
                [torch.randperm(E, generator=g)[:cfg.num_experts_per_tok] for _ in range(cfg.vocab_size)])
        else:
            w[f"{f_}.gate.bias"] = vec(E, 0.3)
        for e in [*(f"experts.{i}" for i in range(E)), "shared_experts"]:
            w[f"{f_}.{e}.w1.weight"] = lin(inter, d)
            w[f"{f_}.{e}.w3.weight"] = lin(inter, d)
            w[f"{f_}.{e}.w2.weight"] = lin(d, inter)

    for i in range(cfg.num_hidden_layers):
        block(f"layers.{i}", cfg.compress_ratios[i], i < cfg.num_hash_layers)
    hc("hc_head", n, 1)
    block("mtp.0", cfg.compress_ratios[-1], False)
    w["mtp.0.e_proj.weight"] = lin(d, d)
    w["mtp.0.h_proj.weight"] = lin(d, d)
    w["mtp.0.enorm.weight"] = vec(d, 0.1, 1.0)
    w["mtp.0.hnorm.weight"] = vec(d, 0.1, 1.0)
    w["mtp.0.norm.weight"] = vec(d, 0.1, 1.0)
    hc("mtp.0.hc_head", n, 1)
    return w


# ---- pieces ----------------------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight


def rope_omega(cfg: RefConfig, ratio: int) -> torch.Tensor:
    """§2.1: ratio-0 layers: rope_theta, no YaRN; compressed layers: compress_rope_theta with YaRN."""
    r = cfg.qk_rope_head_dim
    theta = cfg.rope_theta if ratio == 0 else cfg.compress_rope_theta
    k = torch.arange(r // 2, dtype=torch.float64)
    omega = theta ** (-2 * k / r)
    if ratio == 0:
        return omega.float()

    def corr(n_rot: float) -> float:
        return r * math.log(cfg.yarn_original_max / (2 * math.pi * n_rot)) / (2 * math.log(theta))

    lo = max(math.floor(corr(cfg.yarn_beta_fast)), 0)
    hi = min(math.ceil(corr(cfg.yarn_beta_slow)), r - 1)
    ramp = ((k - lo) / (hi - lo)).clamp(0, 1)
    return (omega * (1 - ramp) + omega / cfg.yarn_factor * ramp).float()


def rope(x: torch.Tensor, pos: torch.Tensor, omega: torch.Tensor, r: int, inverse: bool = False) -> torch.Tensor:
    """Rotate the last r dims of x [N, ..., D] as interleaved complex pairs by pos [N] * omega."""
    angle = pos.double()[:, None] * omega.double()[None, :]
    if inverse:
        angle = -angle
    rot = torch.polar(torch.ones_like(angle), angle).to(torch.complex64)
    shape = [x.shape[0]] + [1] * (x.dim() - 2) + [r // 2]
    pairs = torch.view_as_complex(x[..., -r:].reshape(*x.shape[:-1], r // 2, 2).contiguous())
    turned = torch.view_as_real(pairs * rot.reshape(shape)).reshape(*x.shape[:-1], r)
    return torch.cat([x[..., :-r], turned], dim=-1)


def hc_pre(X: torch.Tensor, fn, base, scale, cfg: RefConfig):
    """§3 hc_pre: X [N, n, d] -> (sublayer input [N, d], post [N, n], comb M [N, n, n])."""
    N, n, _ = X.shape
    flat = X.reshape(N, -1)
    rho = torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)
    mu = rho * (flat @ fn.T)
    pre = torch.sigmoid(scale[0] * mu[:, :n] + base[:n]) + cfg.hc_eps
    post = 2 * torch.sigmoid(scale[1] * mu[:, n:2 * n] + base[n:2 * n])
    M = (scale[2] * mu[:, 2 * n:] + base[2 * n:]).reshape(N, n, n)
    M = torch.softmax(M, dim=-1) + cfg.hc_eps
    M = M / (M.sum(-2, keepdim=True) + cfg.hc_eps)
    for _ in range(cfg.hc_sinkhorn_iters - 1):
        M = M / (M.sum(-1, keepdim=True) + cfg.hc_eps)
        M = M / (M.sum(-2, keepdim=True) + cfg.hc_eps)
    x_in = (pre[:, :, None] * X).sum(1)
    return x_in, post, M


def hc_post(Fout: torch.Tensor, X: torch.Tensor, post: torch.Tensor, M: torch.Tensor) -> torch.Tensor:
    """X'_j = post_j F + sum_i M_ij X_i."""
    return post[:, :, None] * Fout[:, None, :] + torch.einsum("nij,nid->njd", M, X)


def hc_head(X: torch.Tensor, fn, base, scale, cfg: RefConfig) -> torch.Tensor:
    N = X.shape[0]
    flat = X.reshape(N, -1)
    rho = torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)
    pre = torch.sigmoid(scale[0] * rho * (flat @ fn.T) + base) + cfg.hc_eps
    return (pre[:, :, None] * X).sum(1)


def compress(x: torch.Tensor, w: dict, prefix: str, ratio: int, c: int, omega: torch.Tensor,
             cfg: RefConfig) -> torch.Tensor:
    """§2.5: the complete blocks of x [N, d] -> normalised, roped entries [N // ratio, c]."""
    N = x.shape[0]
    A = x @ w[f"{prefix}.wkv.weight"].T
    Z = x @ w[f"{prefix}.wgate.weight"].T + w[f"{prefix}.ape"][torch.arange(N) % ratio]
    entries = []
    for i in range(N // ratio):
        cur = slice(i * ratio, (i + 1) * ratio)
        if ratio == 4:  # overlap: previous block's "a" half and this block's "b" half, 8 candidates
            a_rows, z_rows = [A[cur, c:]], [Z[cur, c:]]
            if i > 0:
                prev = slice((i - 1) * ratio, i * ratio)
                a_rows.insert(0, A[prev, :c])
                z_rows.insert(0, Z[prev, :c])
            a_cand, z_cand = torch.cat(a_rows), torch.cat(z_rows)
        else:
            a_cand, z_cand = A[cur], Z[cur]
        entries.append((torch.softmax(z_cand, dim=0) * a_cand).sum(0))  # per-channel softmax over tokens
    if not entries:
        return x.new_zeros(0, c)
    C = rms_norm(torch.stack(entries), w[f"{prefix}.norm.weight"], cfg.rms_norm_eps)
    return rope(C, torch.arange(len(entries)) * ratio, omega, cfg.qk_rope_head_dim)


def _as_stored(x: torch.Tensor, store: Callable[[torch.Tensor], torch.Tensor] | None) -> torch.Tensor:
    return x if store is None or x.shape[0] == 0 else store(x)


def indexer_topk(x, c_q, w, prefix, omega, cfg: RefConfig) -> list[list[int]]:
    """§2.6: per query t, the chosen compressed blocks (a list; empty when none is visible)."""
    N = x.shape[0]
    nI, cI = cfg.index_n_heads, cfg.index_head_dim
    K = _as_stored(compress(x, w, f"{prefix}.compressor", 4, cI, omega, cfg), cfg.index_key_store)
    q = rope((c_q @ w[f"{prefix}.wq_b.weight"].T).reshape(N, nI, cI), torch.arange(N), omega,
             cfg.qk_rope_head_dim)
    wts = (x @ w[f"{prefix}.weights_proj.weight"].T) * cI ** -0.5 * nI ** -0.5
    chosen = []
    for t in range(N):
        visible = (t + 1) // 4
        if visible == 0:
            chosen.append([])
            continue
        score = (wts[t][:, None] * torch.relu(q[t] @ K[:visible].T)).sum(0)
        k = min(cfg.index_topk, visible)
        chosen.append(sorted(score.topk(k).indices.tolist()))
    return chosen


def attention(x: torch.Tensor, w: dict, p: str, ratio: int, cfg: RefConfig, trace: dict | None = None):
    """§2: one attention sublayer over the whole sequence x [N, d] (already attn_norm-ed)."""
    N = x.shape[0]
    H, D, r = cfg.num_attention_heads, cfg.head_dim, cfg.qk_rope_head_dim
    a = f"{p}.attn"
    omega = rope_omega(cfg, ratio)
    pos = torch.arange(N)
    c_q = rms_norm(x @ w[f"{a}.wq_a.weight"].T, w[f"{a}.q_norm.weight"], cfg.rms_norm_eps)
    q = rms_norm((c_q @ w[f"{a}.wq_b.weight"].T).reshape(N, H, D), None, cfg.rms_norm_eps)
    q = rope(q, pos, omega, r)
    kv = rope(rms_norm(x @ w[f"{a}.wkv.weight"].T, w[f"{a}.kv_norm.weight"], cfg.rms_norm_eps), pos, omega, r)
    kv = _as_stored(kv, cfg.kv_store)
    comp = compress(x, w, f"{a}.compressor", ratio, D, omega, cfg) if ratio else x.new_zeros(0, D)
    comp = _as_stored(comp, cfg.kv_store)
    if ratio == 4:
        chosen = indexer_topk(x, c_q, w, f"{a}.indexer", omega, cfg)
    else:
        chosen = [list(range((t + 1) // ratio)) if ratio else [] for t in range(N)]
    if trace is not None:
        trace[f"{p}.chosen"] = chosen
    sink = w[f"{a}.attn_sink"]
    out = torch.empty(N, H, D)
    for t in range(N):
        keys = torch.cat([kv[max(0, t - cfg.sliding_window + 1):t + 1], comp[chosen[t]]])
        s = (q[t] @ keys.T) * D ** -0.5  # [H, keys]
        m = s.max(-1, keepdim=True).values
        e = torch.exp(s - m)
        out[t] = (e @ keys) / (e.sum(-1, keepdim=True) + torch.exp(sink[:, None] - m))
    out = rope(out, pos, omega, r, inverse=True)
    G = cfg.o_groups
    u = out.reshape(N, G, H * D // G)
    wo_a = w[f"{a}.wo_a.weight"].reshape(G, cfg.o_lora_rank, H * D // G)
    z = torch.einsum("ngk,gok->ngo", u, wo_a).reshape(N, -1)
    return z @ w[f"{a}.wo_b.weight"].T


def swiglu_expert(x, w, prefix, limit):
    a = (x @ w[f"{prefix}.w1.weight"].T).clamp(max=limit)
    u = (x @ w[f"{prefix}.w3.weight"].T).clamp(-limit, limit)
    return (F.silu(a) * u) @ w[f"{prefix}.w2.weight"].T


def moe(x: torch.Tensor, ids: torch.Tensor, w: dict, p: str, hash_layer: bool, cfg: RefConfig,
        trace: dict | None = None) -> torch.Tensor:
    """§4 for x [N, d] (already ffn_norm-ed)."""
    f_ = f"{p}.ffn"
    s = torch.sqrt(F.softplus(x @ w[f"{f_}.gate.weight"].T))
    if hash_layer:
        idx = w[f"{f_}.gate.tid2eid"][ids].long()
    else:
        idx = (s + w[f"{f_}.gate.bias"]).topk(cfg.num_experts_per_tok, dim=-1).indices
    g = s.gather(1, idx)
    g = g / g.sum(-1, keepdim=True) * cfg.routed_scaling_factor
    if trace is not None:
        trace[f"{p}.experts"] = idx
    out = swiglu_expert(x, w, f"{f_}.shared_experts", cfg.swiglu_limit)
    for t in range(x.shape[0]):
        for slot in range(idx.shape[1]):
            e = int(idx[t, slot])
            out[t] += g[t, slot] * swiglu_expert(x[t:t + 1], w, f"{f_}.experts.{e}", cfg.swiglu_limit)[0]
    return out


def block(X: torch.Tensor, ids: torch.Tensor, w: dict, p: str, ratio: int, hash_layer: bool, cfg: RefConfig,
          trace: dict | None = None) -> torch.Tensor:
    eps = cfg.rms_norm_eps
    x_in, post, M = hc_pre(X, w[f"{p}.hc_attn_fn"], w[f"{p}.hc_attn_base"], w[f"{p}.hc_attn_scale"], cfg)
    if trace is not None:
        trace[f"{p}.comb"] = M
    X = hc_post(attention(rms_norm(x_in, w[f"{p}.attn_norm.weight"], eps), w, p, ratio, cfg, trace), X, post, M)
    x_in, post, M = hc_pre(X, w[f"{p}.hc_ffn_fn"], w[f"{p}.hc_ffn_base"], w[f"{p}.hc_ffn_scale"], cfg)
    return hc_post(moe(rms_norm(x_in, w[f"{p}.ffn_norm.weight"], eps), ids, w, p, hash_layer, cfg, trace),
                   X, post, M)


def head_logits(X: torch.Tensor, w: dict, prefix: str, cfg: RefConfig) -> torch.Tensor:
    y = hc_head(X, w[f"{prefix}hc_head_fn"], w[f"{prefix}hc_head_base"], w[f"{prefix}hc_head_scale"], cfg)
    return rms_norm(y, w[f"{prefix}norm.weight"], cfg.rms_norm_eps) @ w["head.weight"].T


@dataclass
class RefOutput:
    logits: torch.Tensor  # [N, vocab]
    residual: torch.Tensor  # [N, hc_mult, hidden]: the pre-hc_head streams (the MTP layer's input)
    trace: dict = field(default_factory=dict)  # "{layer}.comb", "{layer}.experts", "{layer}.chosen"


@torch.no_grad()
def forward(ids: list[int], w: dict, cfg: RefConfig) -> RefOutput:
    """Logits at every position of one sequence."""
    ids_t = torch.tensor(ids)
    X = w["embed.weight"][ids_t][:, None, :].repeat(1, cfg.hc_mult, 1)
    trace: dict = {}
    for i in range(cfg.num_hidden_layers):
        X = block(X, ids_t, w, f"layers.{i}", cfg.compress_ratios[i], i < cfg.num_hash_layers, cfg, trace)
    return RefOutput(head_logits(X, w, "", cfg), X, trace)


@torch.no_grad()
def mtp_forward(residual: torch.Tensor, next_ids: list[int], w: dict, cfg: RefConfig) -> torch.Tensor:
    """§5: draft logits (for token t+2) from the target's pre-hc_head streams at t [N, n, d] and the
    tokens at t+1, positions 0..N-1, over the whole sequence."""
    eps = cfg.rms_norm_eps
    e = rms_norm(w["embed.weight"][torch.tensor(next_ids)], w["mtp.0.enorm.weight"], eps)
    h = rms_norm(residual, w["mtp.0.hnorm.weight"], eps)
    X = h @ w["mtp.0.h_proj.weight"].T + (e @ w["mtp.0.e_proj.weight"].T)[:, None, :]
    X = block(X, torch.tensor(next_ids), w, "mtp.0", cfg.compress_ratios[-1], False, cfg)
    return head_logits(X, w, "mtp.0.", cfg)

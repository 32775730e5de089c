"""Turn one step's logits into next tokens: penalties, min-token blocking, logprobs, greedy/sampling.

Randomness is a pure function of (request seed, token position, token id): a counter-based hash
computed with int64 tensor ops on the logits' device. No generator state exists, so batch
composition, row order, retraction and chunking cannot change what a request samples.
Everything stays on the device: `Sampler.sample()` returns a `PendingSample` whose one device-to-host
copy is already under way, and its `result()` waits for that copy alone. Building a SamplingBatch
copies host lists to the device without waiting either, so the engine can prepare the next step
while this one runs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from kestrel.core.request import Request

_M32 = 0xFFFFFFFF
# Token ids travel to the host inside a float32 tensor when logprobs are packed with them; float32
# represents every integer below 2**24 exactly.
_MAX_PACKED_VOCAB = 1 << 24

_ToTensor = Callable[[list, torch.dtype], torch.Tensor]  # host list -> tensor on the batch's device
# A temperature is a float32 on the device: a larger one (SGLang's /generate takes any, 1e308 too) would
# become inf, and -inf / inf (a blocked token) is NaN. Dividing by the largest float32 already makes
# every finite logit ~0: a uniform draw over the tokens not blocked.
_MAX_TEMPERATURE = torch.finfo(torch.float32).max


@dataclass
class Penalties:
    """Repetition / frequency / presence penalty inputs, as flat (row, token id) index pairs.

    `seen_*` covers prompt + output tokens (repetition penalty); `out_*` covers output tokens only,
    one pair per occurrence (frequency / presence penalties). Rows without penalties carry the
    identity values (1, 0, 0) and contribute no pairs.
    """

    seen_rows: torch.Tensor  # [N] int64
    seen_ids: torch.Tensor  # [N] int64
    out_rows: torch.Tensor  # [M] int64
    out_ids: torch.Tensor  # [M] int64
    repetition: torch.Tensor  # [B] float32
    frequency: torch.Tensor  # [B] float32
    presence: torch.Tensor  # [B] float32

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Return penalized float32 logits (out of place: the caller's tensor is left untouched)."""
        seen = torch.zeros_like(logits, dtype=torch.bool)
        seen[self.seen_rows, self.seen_ids] = True
        counts = torch.zeros_like(logits)
        counts.index_put_((self.out_rows, self.out_ids), torch.ones_like(self.out_ids, dtype=logits.dtype),
                          accumulate=True)
        rep = self.repetition[:, None]
        # HF convention: dividing a positive logit and multiplying a negative one both make the token
        # less likely when the penalty is > 1.
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
        return logits - counts * self.frequency[:, None] - (counts > 0) * self.presence[:, None]


@dataclass
class LogitBias:
    """Every row's logit_bias as flat (row, token id, bias) triples: one scatter, no loop over the vocab."""

    rows: torch.Tensor  # [N] int64
    ids: torch.Tensor  # [N] int64
    values: torch.Tensor  # [N] float32

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """float32 logits [B, V], or [B, n, V] (n positions per row, as a verify scores), with the bias
        added at every position of its row (out of place)."""
        biased = logits.float().reshape(logits.shape[0], -1, logits.shape[-1])
        positions = torch.arange(biased.shape[1], device=logits.device)
        biased = biased.index_put((self.rows[:, None], positions[None, :], self.ids[:, None]),
                                  self.values[:, None].expand(-1, biased.shape[1]), accumulate=True)
        return biased.view(logits.shape)


@dataclass
class SamplingBatch:
    """Per-batch sampling tensors built once per step from the requests being sampled (all on `device`).

    Row i describes `reqs[i]`. Optional fields are None when no row needs that stage, so the
    sampler skips it entirely. Greedy rows carry neutral values (temperature 1, no filters) so
    computing the sampled path for the whole batch is safe; their result is discarded.
    """

    vocab_size: int
    all_greedy: bool
    penalties: Penalties | None
    logit_bias: LogitBias | None
    blocked: tuple[torch.Tensor, torch.Tensor] | None  # (rows, token ids) forced to -inf
    logprob_rows: torch.Tensor | None  # [R] int64, rows with params.logprobs is not None
    logprob_asks: list[tuple[int, int]]  # host copy: (row, params.logprobs) per logprob row
    # The sampling-path tensors stay None in an all-greedy batch (argmax needs none of them, and each
    # would cost a host-to-device copy every step).
    greedy: torch.Tensor | None = None  # [B] bool, SamplingParams.greedy
    temperatures: torch.Tensor | None = None  # [B] float32, 1.0 on greedy rows
    seed_lo: torch.Tensor | None = None  # [B] int64, low 32 bits of the 64-bit seed
    seed_hi: torch.Tensor | None = None  # [B] int64, high 32 bits
    positions: torch.Tensor | None = None  # [B] int64, position of the token being generated
    top_ks: torch.Tensor | None = None  # [B] int64, vocab_size where disabled
    top_ps: torch.Tensor | None = None  # [B] float32, inf where disabled (keeps every token exactly)
    min_ps: torch.Tensor | None = None  # [B] float32, 0 where disabled
    # Structured outputs (kestrel.engine.grammar): bitmask row j ([G, ceil(V / 32)] int32) holds the
    # tokens row grammar_rows[j] may take. Set by the engine once the rows' matchers are up to date.
    grammar_rows: torch.Tensor | None = None  # [G] int64
    grammar_mask: torch.Tensor | None = None

    @classmethod
    def from_requests(cls, reqs: list[Request], vocab_size: int, eos_token_ids: set[int],
                      device: torch.device | str) -> "SamplingBatch":
        params = [r.params for r in reqs]
        greedy = [p.greedy for p in params]

        def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            # A plain torch.tensor(..., device=cuda) waits for the device; a non-blocking copy does not.
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        logprob_idx = [i for i, p in enumerate(params) if p.logprobs is not None]
        if logprob_idx and vocab_size > _MAX_PACKED_VOCAB:
            raise ValueError(f"logprobs need vocab_size <= {_MAX_PACKED_VOCAB}, got {vocab_size}")
        sampled = not all(greedy)
        return cls(
            vocab_size=vocab_size,
            all_greedy=not sampled,
            **(_sampling_tensors(reqs, greedy, vocab_size, tensor) if sampled else {}),
            penalties=_build_penalties(reqs, tensor),
            logit_bias=_build_logit_bias(reqs, tensor),
            blocked=_build_blocked(reqs, vocab_size, eos_token_ids, tensor),
            logprob_rows=tensor(logprob_idx, torch.int64) if logprob_idx else None,
            logprob_asks=[(i, params[i].logprobs) for i in logprob_idx],
        )


def token_dependent_inputs(reqs: list, vocab_size: int, eos_token_ids: set[int], device: torch.device | str
                           ) -> tuple[Penalties | None, tuple[torch.Tensor, torch.Tensor] | None]:
    """The SamplingBatch fields that depend on a row's tokens so far (penalties, min_new_tokens blocking),
    for rows given as objects with `prompt_ids`, `output_ids`, `pending`, `params` and `num_generated`
    (a verify builds one per draft-tree node)."""
    def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)
    return _build_penalties(reqs, tensor), _build_blocked(reqs, vocab_size, eos_token_ids, tensor)


def _sampling_tensors(reqs: list[Request], greedy: list[bool], vocab_size: int,
                      tensor: _ToTensor) -> dict[str, torch.Tensor | None]:
    """The SamplingBatch fields of a batch with at least one sampled row; greedy rows get neutral values."""
    params = [r.params for r in reqs]
    # Filters only matter on sampled rows; a batch where no sampled row uses one skips it.
    top_ks = [vocab_size if g or p.top_k == -1 else min(p.top_k, vocab_size) for p, g in zip(params, greedy)]
    top_ps = [float("inf") if g or p.top_p >= 1 else float(p.top_p) for p, g in zip(params, greedy)]
    min_ps = [0.0 if g else float(p.min_p) for p, g in zip(params, greedy)]
    seeds = [r.seed & 0xFFFFFFFFFFFFFFFF for r in reqs]  # two's complement for negative seeds
    return {
        "greedy": tensor(greedy, torch.bool),
        "temperatures": tensor([1.0 if g else min(float(p.temperature), _MAX_TEMPERATURE)
                                for p, g in zip(params, greedy)], torch.float32),
        "seed_lo": tensor([s & _M32 for s in seeds], torch.int64),
        "seed_hi": tensor([s >> 32 for s in seeds], torch.int64),
        "positions": tensor([r.seq_len for r in reqs], torch.int64),
        "top_ks": tensor(top_ks, torch.int64) if any(k < vocab_size for k in top_ks) else None,
        "top_ps": tensor(top_ps, torch.float32) if any(p != float("inf") for p in top_ps) else None,
        "min_ps": tensor(min_ps, torch.float32) if any(p > 0 for p in min_ps) else None,
    }


def _build_penalties(reqs: list[Request], tensor: _ToTensor) -> Penalties | None:
    """Penalty inputs, or None when no row has a penalty (the sampler then skips the stage)."""
    params = [r.params for r in reqs]
    if all(p.repetition_penalty == 1 and p.frequency_penalty == 0 and p.presence_penalty == 0 for p in params):
        return None
    rep_rows, rep_ids, out_rows, out_ids = [], [], [], []
    for i, (r, p) in enumerate(zip(reqs, params)):
        assert not r.pending, "penalties read the output tokens: the engine resolves them first"
        if p.repetition_penalty != 1:
            ids = r.prompt_ids + r.output_ids
            rep_rows += [i] * len(ids)
            rep_ids += ids
        if p.frequency_penalty != 0 or p.presence_penalty != 0:
            out_rows += [i] * len(r.output_ids)
            out_ids += r.output_ids
    return Penalties(
        seen_rows=tensor(rep_rows, torch.int64), seen_ids=tensor(rep_ids, torch.int64),
        out_rows=tensor(out_rows, torch.int64), out_ids=tensor(out_ids, torch.int64),
        repetition=tensor([float(p.repetition_penalty) for p in params], torch.float32),
        frequency=tensor([float(p.frequency_penalty) for p in params], torch.float32),
        presence=tensor([float(p.presence_penalty) for p in params], torch.float32),
    )


def _build_logit_bias(reqs: list[Request], tensor: _ToTensor) -> LogitBias | None:
    """The rows' logit_bias entries, or None when no row has one (the sampler then skips the stage)."""
    rows, ids, values = [], [], []
    for i, r in enumerate(reqs):
        if r.params.logit_bias:
            rows += [i] * len(r.params.logit_bias)
            ids += r.params.logit_bias.keys()
            values += r.params.logit_bias.values()
    if not rows:
        return None
    return LogitBias(tensor(rows, torch.int64), tensor(ids, torch.int64), tensor(values, torch.float32))


def _build_blocked(reqs: list[Request], vocab_size: int, eos_token_ids: set[int],
                   tensor: _ToTensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(row, token) pairs that may not be generated yet because min_new_tokens is not reached."""
    rows, ids = [], []
    for i, r in enumerate(reqs):
        p = r.params
        if r.num_generated >= p.min_new_tokens:
            continue
        stops = set(p.stop_token_ids or []) | (set() if p.ignore_eos else set(eos_token_ids))
        stops = sorted(t for t in stops if 0 <= t < vocab_size)
        rows += [i] * len(stops)
        ids += stops
    return (tensor(rows, torch.int64), tensor(ids, torch.int64)) if rows else None


# ---- counter-based randomness (32-bit lanes inside int64, so sign and overflow never matter) ----

def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """Low 32 bits of x * c for x in [0, 2**32): split c in 16-bit halves so no product exceeds 2**48."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _M32


def _rotl32(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) | (x >> (32 - r))) & _M32


def _mix_word(h: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """One murmur3_32 block step: fold the 32-bit word k into the running hash h."""
    k = _mul32(_rotl32(_mul32(k & _M32, 0xCC9E2D51), 15), 0x1B873593)
    h = _rotl32(h ^ k, 13)
    return (_mul32(h, 5) + 0xE6546B64) & _M32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3 finalizer: every input bit affects every output bit (avalanche)."""
    h = _mul32(h ^ (h >> 16), 0x85EBCA6B)
    h = _mul32(h ^ (h >> 13), 0xC2B2AE35)
    return h ^ (h >> 16)


# float32 holds 24 significant bits: (x + 0.5) * 2**-24 is exact only below 2**23 and rounds to
# 1.0 for x = 2**24 - 1, where -log(u) = 0 would let any token win the race. Clamping there keeps
# every other value (and so every other draw) bit for bit as it was.
_BELOW_ONE = 1.0 - 2.0 ** -24  # the largest float32 below 1
# Coins use counter words from here on; token ids (< 2**24) never reach it, so the two never share a draw.
_COIN_STREAM = 1 << 31


def bits_to_unit(h: torch.Tensor) -> torch.Tensor:
    """32-bit hashes (in int64) -> float32 in (0, 1) strictly: [2**-25, 1 - 2**-24] from the top 24 bits."""
    return (((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))).clamp_(max=_BELOW_ONE)


def uniform_noise(seed_lo: torch.Tensor, seed_hi: torch.Tensor, positions: torch.Tensor,
                  vocab_size: int, first_counter: int = 0) -> torch.Tensor:
    """[B, V] float32 uniforms in (0, 1), a pure function of (seed, position, counter) per cell, the
    counter being the token id (plus `first_counter`).

    Row i depends only on row i's inputs, so results are independent of batch composition.
    """
    h = _mix_word(torch.full_like(seed_lo, 0x9747B28C), seed_lo)
    h = _mix_word(_mix_word(h, seed_hi), positions)
    counters = torch.arange(first_counter, first_counter + vocab_size, dtype=torch.int64, device=seed_lo.device)
    h = _fmix32(_mix_word(h[:, None], counters[None, :]) ^ 16)  # 16 = bytes hashed, as murmur3 does
    return bits_to_unit(h)


def uniform_coins(seed_lo: torch.Tensor, seed_hi: torch.Tensor, positions: torch.Tensor, n: int) -> torch.Tensor:
    """[B, n] float32 coins in (0, 1) for (seed, position), independent of that position's token noise
    (speculative acceptance flips these)."""
    return uniform_noise(seed_lo, seed_hi, positions, n, first_counter=_COIN_STREAM)


# ---- filters and the race (shared with speculative acceptance, kestrel.speculative.accept) ----

def filtered_probs(logits: torch.Tensor, temperatures: torch.Tensor, top_ks: torch.Tensor | None,
                   top_ps: torch.Tensor | None, min_ps: torch.Tensor | None) -> torch.Tensor:
    """softmax(logits / temperature) per row [B, V] with the tokens top-k / top-p / min-p drop set to 0;
    not renormalized (the race does not need it). None disables a filter for every row."""
    probs = torch.softmax(logits / temperatures[:, None], dim=-1)
    keep = keep_mask(probs, top_ks, top_ps, min_ps)
    return probs if keep is None else probs.masked_fill(~keep, 0.0)


def keep_mask(probs: torch.Tensor, top_ks: torch.Tensor | None, top_ps: torch.Tensor | None,
              min_ps: torch.Tensor | None) -> torch.Tensor | None:
    """Tokens surviving top-k, then top-p (on the top-k-renormalized mass), then min-p; None if no filter.

    The most likely token always survives, so every row keeps a non-empty support (even where a tiny
    top_p, 1e-50, is 0 in float32).
    """
    keep = None
    if top_ks is not None or top_ps is not None:
        # Stable: among equal probabilities the lowest id comes first, the token argmax (greedy) picks.
        sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
        rank = torch.arange(probs.shape[-1], device=probs.device)
        keep_sorted = torch.ones_like(sorted_p, dtype=torch.bool)
        if top_ks is not None:
            keep_sorted = rank[None, :] < top_ks[:, None]
            sorted_p = sorted_p * keep_sorted
        if top_ps is not None:
            cum = sorted_p.cumsum(dim=-1)
            mass_before = cum - sorted_p
            # Keep a token while the mass strictly above it is below top_p, and the top token whatever
            # top_p is. Disabled rows hold inf so rounding can never drop a token.
            keep_sorted = keep_sorted & ((mass_before < top_ps[:, None] * cum[:, -1:]) | (rank[None, :] == 0))
        keep = torch.empty_like(keep_sorted).scatter_(1, order, keep_sorted)
    if min_ps is not None:
        above = probs >= min_ps[:, None] * probs.max(dim=-1, keepdim=True).values
        keep = above if keep is None else keep & above
    return keep


def exponential_race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Scores whose row argmax is token i with probability probs_i / sum(probs): probs / E with
    E = -log(noise) ~ Exp(1). Zero-probability tokens score -1, below every other."""
    # Robust to noise at the extremes anyway: E stays > 0 (-log(1) is -0.0, and p / -0.0 = -inf),
    # and a filtered token scores -1, below every kept one, never 0 / E (NaN for E = 0, which an
    # argmax takes).
    exp = (-torch.log(noise)).clamp_(min=torch.finfo(torch.float32).tiny)
    return torch.where(probs > 0, probs / exp, -1.0)


# ---- sampler ----

def sampled_logits(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """The logits rows a step samples from: all of them as they are (no copy) when `rows` is every row."""
    return logits if len(rows) == logits.shape[0] else logits[rows]


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float | None]  # chosen token's logprob; None where params.logprobs is None
    top_logprobs: list[list[tuple[int, float]] | None]  # top-n (token id, logprob), descending


def copy_to_host(t: torch.Tensor) -> tuple[torch.Tensor, "torch.cuda.Event | None"]:
    """Start `t`'s copy to the host without waiting; the event (None on CPU) marks when it is there."""
    host = t.to("cpu", non_blocking=True)
    event = None
    if t.is_cuda:
        event = torch.cuda.Event()
        event.record()
    return host, event


class PendingSample:
    """Sampled ids on the device, with their copy to the host (logprobs packed alongside) under way."""

    def __init__(self, token_ids: torch.Tensor, payload: torch.Tensor, logprob_asks: list[tuple[int, int]]) -> None:
        self.token_ids = token_ids  # [B] int64, on the logits' device
        self._asks = logprob_asks
        self._bs = token_ids.shape[0]
        self._host, self._event = copy_to_host(payload)

    def result(self) -> SamplerOutput:
        """Wait for this sample's copy (not for work queued after it) and unpack it."""
        if self._event is not None:
            self._event.synchronize()
        bs = self._bs
        logprobs: list[float | None] = [None] * bs
        top_logprobs: list[list[tuple[int, float]] | None] = [None] * bs
        if not self._asks:
            return SamplerOutput(self._host.tolist(), logprobs, top_logprobs)
        host = self._host.tolist()
        ids = [int(t) for t in host[:bs]]
        n = max(top_n for _, top_n in self._asks)
        width = 1 + 2 * n
        for j, (row, top_n) in enumerate(self._asks):
            rec = host[bs + j * width: bs + (j + 1) * width]
            logprobs[row] = rec[0]
            top_logprobs[row] = [(int(t), v) for t, v in zip(rec[1:1 + n], rec[1 + n:])][:top_n]
        return SamplerOutput(ids, logprobs, top_logprobs)


def _torch_argmax(x: torch.Tensor) -> torch.Tensor:
    return x.argmax(dim=-1)


class Sampler:
    """Stateless: the same logits and SamplingBatch always give the same tokens.

    `triton_argmax` (CUDA): row argmaxes through kestrel.sampling.argmax_triton, faster at small batch."""

    def __init__(self, triton_argmax: bool = False) -> None:
        self._argmax = _torch_argmax
        if triton_argmax:  # imported only here: triton is optional
            from kestrel.sampling.argmax_triton import argmax_rows

            self._argmax = argmax_rows

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        return self.sample(logits, batch).result()

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> PendingSample:
        """Sample one token per row of `logits` [B, V] (any float dtype; computed in float32).

        Logprobs are log_softmax of the logits after penalties, logit_bias, min_new_tokens blocking
        and the grammar mask, but before temperature and top-k/top-p/min-p: they describe the
        distribution the request asked to draw from, not the sampling filter.
        """
        logits = logits.float()
        if batch.penalties is not None:
            logits = batch.penalties.apply(logits)
        if batch.logit_bias is not None:
            logits = batch.logit_bias.apply(logits)
        if batch.blocked is not None:
            logits = logits.index_put(batch.blocked, logits.new_full((), float("-inf")))
        if batch.grammar_rows is not None:
            from kestrel.engine.grammar import apply_grammar_mask  # xgrammar: only for grammar batches

            logits = apply_grammar_mask(logits, batch.grammar_rows, batch.grammar_mask)
        greedy_ids = self._argmax(logits)
        token_ids = greedy_ids
        if not batch.all_greedy:
            token_ids = torch.where(batch.greedy, greedy_ids, self._sample(logits, batch))
        return PendingSample(token_ids, self._payload(logits, token_ids, batch), batch.logprob_asks)

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        probs = filtered_probs(logits, batch.temperatures, batch.top_ks, batch.top_ps, batch.min_ps)
        # Exponential race: argmax(p / E) with E ~ Exp(1) i.i.d. picks token i with probability
        # p_i / sum(p), so the filtered probs need no renormalization.
        return self._argmax(exponential_race(probs, uniform_noise(batch.seed_lo, batch.seed_hi, batch.positions,
                                                                  logits.shape[-1])))

    @staticmethod
    def _payload(logits: torch.Tensor, token_ids: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """What goes to the host: the token ids, then (as float32) each logprob row's chosen logprob
        and top-n ids and values."""
        if batch.logprob_rows is None:
            return token_ids
        rows = batch.logprob_rows
        lp = torch.log_softmax(logits.index_select(0, rows), dim=-1)
        chosen = lp.gather(1, token_ids.index_select(0, rows)[:, None])
        n = max(top_n for _, top_n in batch.logprob_asks)
        top_vals, top_ids = lp.topk(n, dim=-1)  # sorted descending
        per_row = torch.cat([chosen, top_ids.float(), top_vals], dim=1)  # [R, 1 + 2n]
        return torch.cat([token_ids.float(), per_row.flatten()])

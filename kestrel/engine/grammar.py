"""Structured outputs: grammars compiled by xgrammar, a matcher per request, token masks for the sampler.

A request's constraint (`SamplingParams.grammar`: JSON schema, regex, EBNF or structural tag) is
compiled once per (kind, text) against the engine's vocabulary, on a background thread (xgrammar
releases the GIL while it compiles), and kept in an LRU cache; each request gets its own
`GrammarState`, which waits for the compile (the engine does not schedule the request meanwhile) and
then holds a matcher that accepts the request's tokens as they resolve on the host. Before a grammar request is sampled, its matcher fills the row of allowed tokens into
a bitmask (int32, one bit per token of the model's vocabulary, padding ids past the tokenizer's
never allowed) that the sampler applies on the device.

A request ends ("stop") as soon as its grammar can only end, i.e. when every token it still allows
is a stop token: it does not wait for the model to sample EOS.
"""
from __future__ import annotations

import os
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kestrel.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    import xgrammar

# Compiled grammars kept; one holds the token-mask cache of its states (~KBs to a few MB at 128k vocab).
GRAMMAR_CACHE_SIZE = 256
# xgrammar's messages start with "[hh:mm:ss] /path/to/file.cc:123: "; the rest is what a user needs.
_LOCATION = re.compile(r"^\[[0-9:]+\] [^ ]+:\d+: (Check failed: .*? is false: )?")
COMPILE_THREADS = 2
# The compile threads run at a lower CPU priority than the engine loop (Linux nice values are per
# thread): on a machine with few cores a long compile then slows the running requests' steps little.
_COMPILE_NICENESS = 10


@dataclass(frozen=True)
class GrammarLimits:
    """What one grammar may cost: a longer text is refused before compiling; a request whose grammar
    has not compiled `compile_timeout` seconds after it was added fails (the compile itself goes on,
    as xgrammar cannot stop one, and its result serves later requests from the cache).

    200,000 characters hold OpenAI's own limits on a schema (120,000 characters of names and enum
    values); xgrammar's compile time grows faster than linearly with an enum's size (20,000 values,
    289 KB: 8.7 s on one core of the test machine)."""

    compile_timeout: float = 30.0
    max_length: int = 200_000


class GrammarError(ValueError):
    """The grammar of the SamplingParams field `param` does not compile; the message is the compiler's."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param} is invalid: {message}")
        self.param = param


def _compiler_message(error: Exception) -> str:
    lines = [_LOCATION.sub("", line).strip() for line in str(error).strip().splitlines()]
    return " ".join(line for line in lines if line) or type(error).__name__


class GrammarBackend:
    """Compiles grammars for one tokenizer and vocabulary; makes the per-request matchers.

    `vocab_size` is the model's (the logits' width), which may exceed the tokenizer's: ids past the
    tokenizer's vocabulary are never allowed. `stop_token_ids` are the ids a finished grammar allows.
    `pinned`: fill masks into page-locked memory (for a CUDA device). A copy of a mask (0.5 MB at
    batch 32 with a 128k vocabulary) from pageable memory waits for the work already queued on the
    stream, the forward that the fill was meant to overlap; from pinned memory it does not.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: set[int],
                 limits: GrammarLimits = GrammarLimits(), cache_size: int = GRAMMAR_CACHE_SIZE,
                 pinned: bool = False) -> None:
        import xgrammar as xgr  # here: only engines that serve a grammar request pay for the import

        self._xgr = xgr
        self.vocab_size = vocab_size
        self.limits = limits
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=sorted(stop_token_ids))
        # Our cache is the one that counts (hits are visible, size bounded); xgrammar's would be a second.
        # One xgrammar thread per compile, COMPILE_THREADS compiles at once: the cores stay the model's,
        # and a grammar that compiles for long (past its timeout even) does not hold up the others.
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self._pool = ThreadPoolExecutor(max_workers=COMPILE_THREADS, thread_name_prefix="kestrel-grammar",
                                        initializer=_lower_priority)
        self.cache_size = cache_size
        # Futures of CompiledGrammar (or of the GrammarError a bad grammar raises), done or under way:
        # a grammar asked for again while it compiles waits for the same compile.
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self.hits = 0
        self.misses = 0
        self._batch_matcher = xgr.BatchGrammarMatcher()
        stops = torch.zeros(xgr.get_bitmask_shape(1, vocab_size)[1], dtype=torch.int32)
        for t in self.info.stop_token_ids:
            stops[t // 32] |= _bit(t % 32)
        self._not_stop = ~stops  # bits of every token that is not a stop token
        self.pinned = pinned
        self._staging: torch.Tensor | None = None  # pinned rows, grown to the largest batch seen

    # ---- compiling ---------------------------------------------------------------------------
    def compile(self, kind: str, text: str) -> Future:
        """The compile of (kind, text): from the cache when it was asked for before (a grammar that
        failed to compile fails again from the cache), else started on the compile thread. The
        future's result is the CompiledGrammar; it raises GrammarError with the compiler's message.
        Raises GrammarError at once for a text over `limits.max_length`."""
        key = (kind, text)
        if key in self._cache:
            self.hits += 1
            self._cache.move_to_end(key)
            return self._cache[key]
        if len(text) > self.limits.max_length:
            raise GrammarError(kind, f"it is {len(text)} characters long; at most {self.limits.max_length} are "
                                     f"compiled (grammar_max_length)")
        self.misses += 1
        found = self._cache[key] = self._pool.submit(self._compile_or_error, kind, text)
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return found

    def _compile_or_error(self, kind: str, text: str) -> "xgrammar.CompiledGrammar":
        try:
            return self._compile(kind, text)
        except Exception as e:  # xgrammar raises RuntimeError (and pydantic/JSON errors) for bad input
            raise GrammarError(kind, _compiler_message(e)) from None

    def _compile(self, kind: str, text: str) -> "xgrammar.CompiledGrammar":
        if kind == "json_schema":
            # Any whitespace between tokens, as SGLang and vLLM allow, but never a run longer than a
            # deep indentation: a weak model can otherwise emit whitespace until max_new_tokens.
            return self.compiler.compile_json_schema(text, any_whitespace=True, max_whitespace_cnt=16)
        if kind == "regex":
            return self.compiler.compile_regex(text)
        if kind == "ebnf":
            return self.compiler.compile_grammar(text)
        if kind == "structural_tag":
            return self.compiler.compile_structural_tag(text)
        raise ValueError(f"unknown grammar kind {kind!r}")

    def state(self, params: SamplingParams) -> "GrammarState | None":
        """The request's grammar state (its matcher once compiled), or None if it has none. Raises
        GrammarError when the grammar is known to fail already (too long, or failed before)."""
        grammar = params.grammar
        if grammar is None:
            return None
        state = GrammarState(grammar[0], self.compile(*grammar), self,
                             time.monotonic() + self.limits.compile_timeout, params.grammar_after,
                             params.grammar_opener)
        state.poll()
        if state.error is not None:
            raise state.error
        return state

    def shutdown(self) -> None:
        """Forget compiles not started yet; one under way finishes on its own (xgrammar cannot stop it)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- masks ---------------------------------------------------------------------------------
    def fill(self, states: list["GrammarState"], for_device: bool = True) -> torch.Tensor:
        """[len(states), ceil(vocab / 32)] int32 host bitmask: row i has the tokens states[i] allows next.
        `for_device`: the mask is for the sampler (pinned when `pinned`), valid until the next such fill."""
        mask = self._rows(len(states), for_device)
        self._batch_matcher.batch_fill_next_token_bitmask([s.matcher for s in states], mask)
        for i, state in enumerate(states):  # a first token may also open the free part
            if state.undecided:
                mask[i, state.opener // 32] |= _bit(state.opener % 32)
        return mask

    def fill_tree(self, states: list["GrammarState"], tokens: list[list[int]], parents: list[list[int]],
                  for_device: bool = True) -> torch.Tensor:
        """[len(states) * N, ceil(vocab / 32)] int32 host bitmask for a speculative round: row i * N + j has
        the tokens states[i] allows after the path from the root to node j of request i's draft tree
        (`tokens`, `parents`: N nodes each, node 0 the root, whose token the state has taken; parents
        before children). A node under a token the grammar refuses is never accepted: its row allows
        everything, as does a row where the grammar is not active yet. The states are left as they were."""
        n = len(tokens[0]) if tokens else 0
        mask = self._rows(len(states) * n, for_device)
        for i, state in enumerate(states):
            state.fill_tree(tokens[i], parents[i], mask, i * n)
        return mask

    def _rows(self, count: int, for_device: bool) -> torch.Tensor:
        if not (self.pinned and for_device):
            return self._xgr.allocate_token_bitmask(count, self.vocab_size)
        # One buffer serves every step: the copy from it that a step queues has finished before the next
        # fill, which comes after that step's sampled tokens (queued after the copy) were read.
        if self._staging is None or self._staging.shape[0] < count:
            self._staging = self._xgr.allocate_token_bitmask(count, self.vocab_size).pin_memory()
        return self._staging[:count]

    def only_stops(self, row: torch.Tensor) -> bool:
        """Whether a filled mask row allows stop tokens at most (the grammar can only end)."""
        return not bool((row & self._not_stop).any())


def _lower_priority() -> None:
    if hasattr(os, "setpriority"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _COMPILE_NICENESS)
        except OSError:  # not allowed here: compiling at the loop's priority is still correct
            pass


def _bit(i: int) -> int:
    """Bit i of an int32 word, as the signed value torch stores (bit 31 is the sign)."""
    return (1 << i) - (1 << 32 if i == 31 else 0)


class GrammarState:
    """One request's grammar: compiling until `poll()` says it is ready (or failed: `error`), then a
    matcher that accepts exactly the request's resolved output tokens, in order. With a `trigger` (see
    SamplingParams.grammar_after) the grammar is not `active` until the output has written it: the
    tokens up to and including it are free and the matcher never sees them. With an `opener` too
    (SamplingParams.grammar_opener) the first token decides: the opener, and the trigger is awaited;
    anything else (the grammar's mask, plus the opener, constrains it), and the grammar holds from it."""

    def __init__(self, kind: str, compiled: Future, backend: GrammarBackend, deadline: float,
                 trigger: tuple[int, ...] | None = None, opener: int | None = None) -> None:
        self.kind = kind
        self.trigger = list(trigger) if trigger else None
        self.opener = opener if self.trigger is not None else None
        self.undecided = self.opener is not None  # no output token yet: opener or the grammar's first
        self._recent: list[int] = []  # the last len(trigger) output tokens, until it has appeared
        self.compiled = compiled
        self.backend = backend
        self.deadline = deadline  # time.monotonic() past which the request stops waiting for the compile
        self.matcher: "xgrammar.GrammarMatcher | None" = None
        self.error: GrammarError | None = None
        self._matched = 0  # tokens the matcher took: what a speculative walk rolls back

    @property
    def waiting(self) -> bool:
        """Still compiling: neither a matcher nor an error yet."""
        return self.matcher is None and self.error is None

    def poll(self) -> bool:
        """Whether the wait is over: the matcher is made, or `error` is set (the compile failed, or the
        deadline passed first)."""
        if not self.waiting:
            return True
        if self.compiled.done():
            try:
                self.matcher = self.backend._xgr.GrammarMatcher(self.compiled.result())
            except GrammarError as e:
                self.error = e
            return True
        if time.monotonic() > self.deadline:
            limit = self.backend.limits.compile_timeout
            self.error = GrammarError(self.kind, f"it did not compile within {limit:g} s (grammar_compile_timeout); "
                                                 f"simplify it (a long enum or deeply nested schema compiles slowly)")
            return True
        return False

    @property
    def active(self) -> bool:
        """Whether the grammar constrains the next token (its trigger, if any, is written; or the
        first token, which may also be the opener)."""
        return self.trigger is None or self.undecided

    def accept(self, token: int) -> bool:
        if self.undecided:
            self.undecided = False
            if token != self.opener:  # no free part: the answer starts here
                self.trigger = None
                return self._match(token)
        if self.trigger is not None:
            self._recent = (self._recent + [token])[-len(self.trigger):]
            if self._recent == self.trigger:
                self.trigger = None
            return True
        return self._match(token)

    def _match(self, token: int) -> bool:
        taken = self.matcher.accept_token(token)
        self._matched += taken
        return taken

    def fill_tree(self, tokens: list[int], parents: list[int], mask: torch.Tensor, base: int) -> None:
        """Rows base + j of `mask`: see GrammarBackend.fill_tree. Walks the tree depth first (a tree is a
        few levels deep), taking each node's token and rolling it back after its subtree."""
        children: list[list[int]] = [[] for _ in tokens]
        for j in range(1, len(tokens)):
            children[parents[j]].append(j)
        mask[base:base + len(tokens)] = -1  # every token: the rows the walk does not narrow

        def visit(j: int) -> None:
            if self.active:
                if self.matcher.is_terminated():  # a stop token ended the grammar: the request ends there
                    return
                self.matcher.fill_next_token_bitmask(mask, base + j)
                if self.undecided:
                    mask[base + j, self.opener // 32] |= _bit(self.opener % 32)
            for c in children[j]:
                saved = self._snapshot()
                if self.accept(tokens[c]):  # else a refused token: its subtree is never accepted
                    visit(c)
                self._restore(saved)

        visit(0)

    def _snapshot(self) -> tuple:
        return self.undecided, self.trigger, self._recent, self._matched

    def _restore(self, saved: tuple) -> None:
        undecided, trigger, recent, matched = saved
        if self._matched > matched:
            self.matcher.rollback(self._matched - matched)
        self.undecided, self.trigger, self._recent, self._matched = undecided, trigger, recent, matched

    def ended(self) -> bool:
        """True once the grammar allows nothing but a stop token (or took one); never before it is active."""
        if not self.active:
            return False
        if self.matcher.is_terminated():
            return True
        if not self.matcher.is_completed():  # an incomplete grammar always allows a non-stop token
            return False
        return self.backend.only_stops(self.backend.fill([self], for_device=False)[0])


def apply_grammar_mask(logits: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`logits` [B, V] (float32, not modified) with the tokens that mask row j disallows set to -inf
    in row rows[j]. `rows` and `mask` are on the logits' device; nothing here waits for the device."""
    import xgrammar as xgr

    sub = logits.index_select(0, rows)
    xgr.apply_token_bitmask_inplace(sub, mask, vocab_size=logits.shape[-1])
    return logits.index_copy(0, rows, sub)

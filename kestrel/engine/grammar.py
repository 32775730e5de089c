"""Structured outputs: grammars compiled by xgrammar, a matcher per request, token masks for the sampler.

A request's constraint (`SamplingParams.grammar`: JSON schema, regex, EBNF or structural tag) is
compiled once per (kind, text) against the engine's vocabulary and kept in an LRU cache; each
request gets its own `GrammarState`, a matcher that accepts the request's tokens as they resolve
on the host. Before a grammar request is sampled, its matcher fills the row of allowed tokens into
a bitmask (int32, one bit per token of the model's vocabulary, padding ids past the tokenizer's
never allowed) that the sampler applies on the device.

A request ends ("stop") as soon as its grammar can only end, i.e. when every token it still allows
is a stop token: it does not wait for the model to sample EOS.
"""
from __future__ import annotations

import re
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch

from kestrel.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    import xgrammar

# Compiled grammars kept; one holds the token-mask cache of its states (~KBs to a few MB at 128k vocab).
GRAMMAR_CACHE_SIZE = 256
# xgrammar's messages start with "[hh:mm:ss] /path/to/file.cc:123: "; the rest is what a user needs.
_LOCATION = re.compile(r"^\[[0-9:]+\] [^ ]+:\d+: (Check failed: .*? is false: )?")


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
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: set[int],
                 cache_size: int = GRAMMAR_CACHE_SIZE) -> None:
        import xgrammar as xgr  # here: only engines that serve a grammar request pay for the import

        self._xgr = xgr
        self.vocab_size = vocab_size
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=sorted(stop_token_ids))
        # Our cache is the one that counts (hits are visible, size bounded); xgrammar's would be a second.
        self.compiler = xgr.GrammarCompiler(self.info, cache_enabled=False)
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()  # CompiledGrammar or GrammarError
        self.hits = 0
        self.misses = 0
        self._batch_matcher = xgr.BatchGrammarMatcher()
        stops = torch.zeros(xgr.get_bitmask_shape(1, vocab_size)[1], dtype=torch.int32)
        for t in self.info.stop_token_ids:
            stops[t // 32] |= _bit(t % 32)
        self._not_stop = ~stops  # bits of every token that is not a stop token

    # ---- compiling ---------------------------------------------------------------------------
    def compile(self, kind: str, text: str) -> "xgrammar.CompiledGrammar":
        """The compiled grammar of (kind, text), from the cache when it was seen before (a grammar that
        failed to compile fails again from the cache). Raises GrammarError with the compiler's message."""
        key = (kind, text)
        if key in self._cache:
            self.hits += 1
            self._cache.move_to_end(key)
            found = self._cache[key]
        else:
            self.misses += 1
            try:
                found = self._compile(kind, text)
            except Exception as e:  # xgrammar raises RuntimeError (and pydantic/JSON errors) for bad input
                found = GrammarError(kind, _compiler_message(e))
            self._cache[key] = found
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        if isinstance(found, GrammarError):
            raise found
        return found

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
        """A fresh matcher for the request's grammar, or None if it has none. Raises GrammarError."""
        grammar = params.grammar
        if grammar is None:
            return None
        return GrammarState(self._xgr.GrammarMatcher(self.compile(*grammar)), self)

    # ---- masks ---------------------------------------------------------------------------------
    def fill(self, states: list["GrammarState"]) -> torch.Tensor:
        """[len(states), ceil(vocab / 32)] int32 host bitmask: row i has the tokens states[i] allows next."""
        mask = self._xgr.allocate_token_bitmask(len(states), self.vocab_size)
        self._batch_matcher.batch_fill_next_token_bitmask([s.matcher for s in states], mask)
        return mask

    def only_stops(self, row: torch.Tensor) -> bool:
        """Whether a filled mask row allows stop tokens at most (the grammar can only end)."""
        return not bool((row & self._not_stop).any())


def _bit(i: int) -> int:
    """Bit i of an int32 word, as the signed value torch stores (bit 31 is the sign)."""
    return (1 << i) - (1 << 32 if i == 31 else 0)


class GrammarState:
    """One request's matcher. It accepts exactly the request's resolved output tokens, in order."""

    def __init__(self, matcher: "xgrammar.GrammarMatcher", backend: GrammarBackend) -> None:
        self.matcher = matcher
        self.backend = backend

    def accept(self, token: int) -> bool:
        return self.matcher.accept_token(token)

    def ended(self) -> bool:
        """True once the grammar allows nothing but a stop token (or took one)."""
        if self.matcher.is_terminated():
            return True
        if not self.matcher.is_completed():  # an incomplete grammar always allows a non-stop token
            return False
        return self.backend.only_stops(self.backend.fill([self])[0])


def apply_grammar_mask(logits: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`logits` [B, V] (float32, not modified) with the tokens that mask row j disallows set to -inf
    in row rows[j]. `rows` and `mask` are on the logits' device; nothing here waits for the device."""
    import xgrammar as xgr

    sub = logits.index_select(0, rows)
    xgr.apply_token_bitmask_inplace(sub, mask, vocab_size=logits.shape[-1])
    return logits.index_copy(0, rows, sub)

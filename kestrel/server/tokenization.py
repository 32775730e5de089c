"""Prompts to token ids without stalling the event loop: inline when short, in worker processes when long.

A request whose body is at most `INLINE_BODY_BYTES` is tokenized on the event loop: that takes well
under a millisecond, less than a round trip to another process. Longer ones go to a pool of worker
processes, each holding a copy of the tokenizer. A thread would not do: the tokenizer holds the GIL
for much of a long encode (measured: the event loop stalled 0.5 s at a time while 8 MB of text was
encoded in a thread), and a process also keeps the memory a huge prompt needs while it is encoded
(about 200 bytes per character) out of the HTTP process. A prompt too long for the context comes
back as its length only, never as its ids.

A worker gives the memory of a long prompt back to the system once it is done with it: glibc keeps
freed memory for reuse otherwise (measured with the demo model: a worker went from 78 MB to 372 MB
for a refused 3.9 MB prompt and kept it; with `malloc_trim` after each job it is back to 78 MB).

Bad text is a `PromptError` (a 400 for the caller): a lone UTF-16 surrogate (JSON can spell one,
`"\\ud800"`; no tokenizer can encode it), a chat template that refuses the messages, anything else
the tokenizer raises on.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import ctypes.util
import multiprocessing as mp
import multiprocessing.connection
import os
import re
import signal
import threading
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

from kestrel.engine.tokenizer import apply_chat_template
from kestrel.server.errors import APIError
from kestrel.server.process_exit import skip_teardown_on_exit

INLINE_BODY_BYTES = 16 * 1024  # ~4k tokens of text: about 1 ms to encode on one CPU core

T = TypeVar("T")
_SURROGATE = re.compile("[\ud800-\udfff]")  # json.loads joins valid pairs, so any one left is lone


class PromptError(ValueError):
    """Text the tokenizer cannot take; the message names where it is."""


class PromptTooLong(Exception):
    """The prompt named `where` has `num_tokens` tokens, at least the limit it was encoded against."""

    def __init__(self, where: str, num_tokens: int) -> None:
        super().__init__(where, num_tokens)  # args, so the exception pickles back from a worker
        self.where = where
        self.num_tokens = num_tokens


def lone_surrogate(value: Any, where: str) -> str | None:
    """Where in a JSON value (strings, lists, dicts) a lone surrogate is, as a message; None if nowhere."""
    if isinstance(value, str):
        found = _SURROGATE.search(value)
        if found:
            return (f"{where} contains a lone UTF-16 surrogate ({found.group()!a}) at character {found.start()}; "
                    "send valid Unicode text (a surrogate only as half of a pair)")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if found := lone_surrogate(item, f"{where}[{i}]"):
                return found
    elif isinstance(value, dict):
        for key, item in value.items():
            if found := lone_surrogate(key, f"{where} key") or lone_surrogate(item, f"{where}.{key}"):
                return found
    return None


def encode_texts(tokenizer: Any, texts: list[str], limit: int, names: list[str],
                 add_special_tokens: bool = True) -> list[list[int]]:
    """The token ids of each text (errors call text i `names[i]`; the tokenizer's BOS and the like unless
    `add_special_tokens` is off); PromptTooLong for one of `limit` tokens or more."""
    out = []
    for text, where in zip(texts, names):
        if problem := lone_surrogate(text, where):
            raise PromptError(problem)
        try:
            ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
        except Exception as e:
            raise PromptError(f"{where} cannot be tokenized: {type(e).__name__}: {e}") from None
        if len(ids) >= limit:
            raise PromptTooLong(where, len(ids))
        out.append(ids)
    return out


def encode_chat(tokenizer: Any, messages: list[dict[str, Any]], limit: int, param: str,
                tools: list[dict[str, Any]] | None = None, template_kwargs: dict[str, Any] | None = None,
                add_generation_prompt: bool = True) -> list[int]:
    """The token ids of the rendered chat prompt (with the tools it may call and the template's further
    variables; opening the assistant's turn unless `add_generation_prompt` is off); PromptTooLong as above."""
    if problem := lone_surrogate(messages, param):
        raise PromptError(problem)
    try:
        ids = apply_chat_template(tokenizer, messages, add_generation_prompt, tools, template_kwargs)
    except Exception as e:  # our checks of the messages (ValueError), the template's own (jinja2 errors)
        raise PromptError(str(e) if isinstance(e, ValueError) else f"{param}: {type(e).__name__}: {e}") from None
    if len(ids) >= limit:
        raise PromptTooLong(param, len(ids))
    return ids


# ---- the worker processes -----------------------------------------------------------------------
# A pool worker's one tokenizer, set once by its initializer: per-process state is what a worker is for.
_worker_tokenizer: Any = None
# glibc's malloc_trim, or None on another C library.
_malloc_trim: Callable[[int], int] | None = None


def _find_malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # no such C library, or not glibc
        return None


def _init_worker(tokenizer: Any) -> None:
    # Ctrl-C and a service manager's SIGTERM reach the whole process group; the HTTP process decides
    # when the workers stop (it shuts the pool down).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, name="kestrel-tokenizer-orphan-check", daemon=True).start()
    skip_teardown_on_exit(0)  # the pool shuts the worker down; unloading transformers would take a second
    global _worker_tokenizer, _malloc_trim
    _worker_tokenizer = tokenizer
    _malloc_trim = _find_malloc_trim()


def _exit_with_parent() -> None:
    # Killed outright (SIGKILL, out of memory), the HTTP process cannot shut the pool down, and the
    # workers would wait forever: each holds the write end of the task queue the others read.
    mp.connection.wait([mp.parent_process().sentinel])
    os._exit(0)


def _in_worker(fn: Callable[..., T], *args: Any) -> T:
    try:
        return fn(_worker_tokenizer, *args)
    finally:
        if _malloc_trim is not None:  # ~1 ms after a short prompt, 0.1 s after 4 MB of text
            _malloc_trim(0)


def _ready() -> None:
    pass


class Tokenization:
    def __init__(self, tokenizer: Any, pool_size: int) -> None:
        self.tokenizer = tokenizer
        self._pool_size = pool_size
        self._pool = self._new_pool()

    def _new_pool(self) -> concurrent.futures.ProcessPoolExecutor:
        # spawn: the HTTP process has threads (engine sender, the pool's own), which fork would copy mid-state.
        return concurrent.futures.ProcessPoolExecutor(self._pool_size, mp_context=mp.get_context("spawn"),
                                                      initializer=_init_worker, initargs=(self.tokenizer,))

    def start(self) -> list[concurrent.futures.Future]:
        """Start every worker now (each takes ~1 s to import and unpickle the tokenizer), so that the
        first long prompt does not wait for it; wait on the returned futures."""
        return [self._pool.submit(_ready) for _ in range(self._pool_size)]

    def shutdown(self) -> None:
        # Waits for a worker busy with a huge prompt (seconds at most). Not waiting races Python 3.11's
        # exit hook against the pool's manager thread, which can end in a traceback (a closed pipe).
        self._pool.shutdown(wait=True, cancel_futures=True)

    async def encode(self, texts: list[str], limit: int, names: list[str], inline: bool,
                     add_special_tokens: bool = True) -> list[list[int]]:
        return await self._run(encode_texts, inline, texts, limit, names, add_special_tokens)

    async def chat(self, messages: list[dict[str, Any]], limit: int, param: str, inline: bool,
                   tools: list[dict[str, Any]] | None = None,
                   template_kwargs: dict[str, Any] | None = None, add_generation_prompt: bool = True) -> list[int]:
        return await self._run(encode_chat, inline, messages, limit, param, tools, template_kwargs,
                               add_generation_prompt)

    async def _run(self, fn: Callable[..., T], inline: bool, *args: Any) -> T:
        if inline:
            return fn(self.tokenizer, *args)
        pool = self._pool
        try:
            return await asyncio.wrap_future(pool.submit(_in_worker, fn, *args))
        except BrokenProcessPool:
            if self._pool is pool:  # the first request to notice replaces the pool for everyone
                pool.shutdown(wait=False, cancel_futures=True)
                self._pool = self._new_pool()
            raise APIError(500, "a tokenizer process died while encoding this request (out of memory?); it "
                                "has been replaced, so the server keeps serving", code="tokenizer_died") from None

"""The engine process: loads the model, then runs the engine loop for the HTTP process.

The loop blocks on its inbox while the engine has no work (no busy spin) and steps while it has
some, draining the inbox between steps so new requests join the next batch and aborts free KV at
once. It exits on `Shutdown` or when the HTTP process goes away (end of file on the inbox).

A group whose grammar still compiles (off the loop, see kestrel.engine.grammar) gets its `Admission`
only once every grammar of it has compiled, or a 400 if one failed or timed out: the HTTP side
answers no status (a stream sends no headers) before the request is known to run.
"""
from __future__ import annotations

import logging
import os
import signal
import time
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any

from kestrel.config import EngineConfig
from kestrel.core.outputs import StepInfo
from kestrel.core.request import Request
from kestrel.distributed.errors import RankFailedError
from kestrel.server.messages import (AbortRequests, AddRequests, Admission, EngineFailed, EngineReady, FlushCache,
                                     FlushCacheReply, LoRACommand, LoRAReply, Shutdown, StepOutput, TokenDelta)
from kestrel.server.process_exit import skip_teardown_on_exit

if TYPE_CHECKING:
    from kestrel.engine.engine import Engine

logger = logging.getLogger("kestrel.engine_process")

STATS_INTERVAL_S = 1.0  # while busy; besides, stats go out on every change between idle and busy


def engine_main(config: EngineConfig, inbox: Connection, outbox: Connection, log_level: str) -> None:
    """Entry point of the engine process (multiprocessing, spawn context). Its exit status is 0 after
    `Shutdown` or end of file on the inbox, 1 when the model did not load or the loop failed."""
    # Once the engine (and its tensor-parallel ranks) is shut down, unloading torch would take seconds.
    try:
        _run_engine(config, inbox, outbox, log_level)
    except SystemExit as e:
        skip_teardown_on_exit(e.code if isinstance(e.code, int) else 1)
        raise
    skip_teardown_on_exit(0)


def _run_engine(config: EngineConfig, inbox: Connection, outbox: Connection, log_level: str) -> None:
    # Ctrl-C (and a service manager's SIGTERM) reach the whole process group: the HTTP process lets
    # running requests finish, then sends Shutdown. If it dies instead, our inbox reads end of file.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        # Before anything imports torch: the OpenMP runtime reads its wait policy once, when it loads.
        from kestrel.engine.cpu_threads import configure_cpu_threads

        configure_cpu_threads(config)
        from kestrel.engine.engine import Engine

        engine = Engine(config=config)
    except Exception as e:  # anything that stops the model from loading is reported, then we exit
        logger.debug("model load failed", exc_info=True)
        outbox.send(EngineFailed(f"{type(e).__name__}: {e}"))
        raise SystemExit(1) from None
    outbox.send(EngineReady(pid=os.getpid(), vocab_size=engine.vocab_size, max_req_len=engine.max_req_len,
                            max_total_tokens=engine.kv_memory.allocator.size,
                            context_length=engine.config.model.context_length,
                            rank_pids=engine.ranks.pids if engine.ranks is not None else [],
                            page_size=engine.config.cache.page_size, kv_cache_dtype=engine.config.cache.kv_cache_dtype,
                            prefix_caching=not engine.config.cache.disable_radix_cache,
                            lora_adapters=engine.lora_adapters() if engine.lora is not None else None))
    EngineLoop(engine, inbox, outbox).run()


class EngineLoop:
    def __init__(self, engine: "Engine", inbox: Connection, outbox: Connection) -> None:
        self.engine = engine
        self.inbox = inbox
        self.outbox = outbox
        self.last_stats = 0.0
        self.stats_sent_idle = False
        self.compiling: dict[str, list[str]] = {}  # group -> its rids, while a grammar of it compiles
        self.rejected: list[str] = []  # aborted with their group's grammar: reported (and forgotten) next step
        self.step_prefill_tokens: list[int] = []  # of the steps since the last stats
        self.loop_turns = 0
        engine.add_step_hook(self._on_step)

    def run(self) -> None:
        try:
            self._loop()
        except (EOFError, BrokenPipeError, ConnectionResetError):
            logger.info("the HTTP process is gone; engine process exiting")
        except RankFailedError as e:  # the HTTP process fails our requests with this reason (503)
            logger.error("%s; engine process exiting", e)
            try:
                self.outbox.send(EngineFailed(str(e)))
            except OSError:
                pass
            raise SystemExit(1) from None
        except Exception:
            logger.exception("the engine loop failed; engine process exiting")
            raise SystemExit(1) from None
        finally:
            self.engine.shutdown()

    def _loop(self) -> None:
        engine = self.engine
        while True:
            idle = not engine.has_work()
            if idle and not self.stats_sent_idle:
                self._send_stats()
                self.stats_sent_idle = True
            messages = self._receive(block=idle)
            touched, self.rejected = self.rejected, []
            for msg in messages:
                if isinstance(msg, AddRequests):
                    touched += self._add(msg)
                elif isinstance(msg, AbortRequests):
                    for rid in msg.rids:
                        engine.abort(rid)
                    touched += msg.rids
                elif isinstance(msg, LoRACommand):
                    self._lora(msg)
                elif isinstance(msg, FlushCache):
                    self._flush(msg)
                elif isinstance(msg, Shutdown):
                    return
                else:
                    raise TypeError(f"unexpected message {type(msg).__name__}")
            if self.stats_sent_idle and engine.has_work():
                self._send_stats()  # busy now: replace the idle snapshot at once, not a second later
                self.stats_sent_idle = False
            if self._step(touched):
                self.stats_sent_idle = False
            self.loop_turns += 1
            if time.monotonic() - self.last_stats >= STATS_INTERVAL_S:
                self._send_stats()

    def _step(self, touched: list[str]) -> bool:
        """One engine step and its news to the HTTP process; False when there was none.

        A bug in this bookkeeping (outside the forward, which `Engine.step` guards) costs the requests it
        touched, as a failed forward does: they finish with an error and the loop goes on. When the step
        as a whole fails, which requests it reached is unknown, so every request the engine holds fails."""
        engine = self.engine
        try:
            news = engine.step_deltas(touched)
        except RankFailedError:
            raise
        except Exception as e:  # noqa: BLE001
            logger.exception("the engine step failed outside its forward; every request finishes with an error")
            news = engine.fail_all(e)
        news = self._admit_compiled(news)
        deltas = []
        for req, start in news:
            try:
                deltas.append(self._delta(req, start))
            except Exception as e:  # noqa: BLE001
                logger.exception("reporting request %s failed; it finishes with an error", req.rid)
                engine.fail_request(req, e)
                deltas.append(TokenDelta(rid=req.rid, token_ids=[], finished=True, finish_reason="error",
                                         error=req.error, prompt_tokens=len(req.prompt_ids)))
        if deltas:
            self.outbox.send(StepOutput(deltas))
        return bool(deltas)

    def _receive(self, block: bool) -> list[Any]:
        """Every message waiting in the inbox; when `block`, wait for at least one (or for a
        tensor-parallel rank to exit: RankFailedError, even while idle)."""
        ranks = self.engine.ranks
        if block and ranks is not None:
            wait([self.inbox, *ranks.sentinels])
            ranks.check()
        messages = [self.inbox.recv()] if block else []
        while self.inbox.poll(0):
            messages.append(self.inbox.recv())
        return messages

    def _add(self, msg: AddRequests) -> list[str]:
        """Queue the whole group or none of it; reply with one `Admission`."""
        added: list[str] = []
        try:
            for r in msg.reqs:
                added.append(self.engine.add_request(prompt_token_ids=r.prompt_ids, sampling_params=r.params,
                                                     rid=r.rid, lora_name=r.lora_name))
        except ValueError as e:  # an unknown LoRA adapter says 404
            error, status, param = str(e), getattr(e, "status", 400), getattr(e, "param", None)
        except Exception as e:  # a bug must not take the server down for everyone
            logger.exception("add_request failed")
            error, status, param = f"internal error while adding the request: {type(e).__name__}: {e}", 500, None
        else:
            if any(self._compiling(rid) for rid in added):
                self.compiling[msg.group] = added
            else:
                self.outbox.send(Admission(msg.group))
            return added
        for rid in added:  # aborted ones are reported and forgotten by step_deltas(touched=added)
            self.engine.abort(rid)
        self.outbox.send(Admission(msg.group, error, status, param))
        return added

    def _lora(self, msg: LoRACommand) -> None:
        """Load or unload an adapter between steps; a bad adapter fails this command alone."""
        error, status = None, 400
        try:
            if msg.path is None:
                self.engine.unload_lora_adapter(msg.name)
            else:
                self.engine.load_lora_adapter(msg.name, msg.path)
        except ValueError as e:
            error, status = str(e), getattr(e, "status", 400)
        except Exception as e:  # noqa: BLE001 - an unforeseen failure of one load must not stop serving
            logger.exception("loading LoRA adapter %r failed", msg.name)
            error, status = f"loading the adapter failed: {type(e).__name__}: {e}", 500
        self.outbox.send(LoRAReply(msg.id, self.engine.lora_adapters(), error, status))

    def _flush(self, msg: FlushCache) -> None:
        """Drop the cached prefixes, refused while requests of this batch or earlier ones run; a failure
        answers "not flushed" and the engine serves on."""
        try:
            flushed = self.engine.flush_cache()
        except Exception:  # noqa: BLE001 - a flush that fails must not stop serving
            logger.exception("flushing the prefix cache failed")
            flushed = False
        self.outbox.send(FlushCacheReply(msg.id, flushed))
        if flushed:  # the cache's share of the KV pool is free now: stats say so at once
            self.stats_sent_idle = False

    def _compiling(self, rid: str) -> bool:
        req = self.engine.request(rid)
        return req is not None and req.grammar is not None and req.grammar.waiting

    def _admit_compiled(self, news: list[tuple[Request, int]]) -> list[tuple[Request, int]]:
        """Send the Admission of every group whose grammars are over compiling: a 400 with the first
        failure's message (its other requests aborted), else admitted. Returns `news` without the
        requests of rejected groups (a rejected request never ran: the HTTP side has nothing to stream)."""
        if not self.compiling:
            return news
        finished = {req.rid: req for req, _ in news if req.finished}
        rejected: set[str] = set()
        for group, rids in list(self.compiling.items()):
            failed = [finished[rid].grammar.error for rid in rids
                      if rid in finished and finished[rid].grammar is not None and finished[rid].grammar.error]
            if failed:
                for rid in rids:
                    if self.engine.abort(rid):  # the HTTP side drops their final deltas
                        self.rejected.append(rid)
                rejected.update(rids)
                self.outbox.send(Admission(group, str(failed[0]), 400, failed[0].param))
            elif any(self._compiling(rid) for rid in rids):
                continue
            else:
                self.outbox.send(Admission(group))
            del self.compiling[group]
        return [(req, start) for req, start in news if req.rid not in rejected]

    def _delta(self, req: Request, start: int) -> TokenDelta:
        asked = req.params.logprobs is not None
        prompt = start == 0 and req.params.prompt_logprobs is not None  # complete once a token or the end came
        return TokenDelta(
            rid=req.rid, token_ids=req.output_ids[start:],
            logprobs=req.output_logprobs[start:] if asked else None,
            top_logprobs=[_finite(top) for top in req.output_top_logprobs[start:]] if asked else None,
            finished=req.finished, finish_reason=req.finish_reason, matched_stop=req.matched_stop, error=req.error,
            prompt_tokens=len(req.prompt_ids), cached_tokens=req.cached_tokens,
            spec_accept_histogram=req.spec_accept_histogram if req.finished and req.spec_accept_counts else None,
            prompt_logprobs=req.prompt_logprobs if prompt else None,
            prompt_logprob_ranks=req.prompt_logprob_ranks if prompt else None,
            prompt_top_logprobs=req.prompt_top_logprobs if prompt else None,
            pooled=req.pooled if req.finished else None,
            queue_time=req.scheduled_at - req.queued_at if start == 0 and req.scheduled_at is not None else None)

    def _send_stats(self) -> None:
        stats = self.engine.stats()
        stats.step_prefill_tokens, self.step_prefill_tokens = self.step_prefill_tokens, []
        stats.loop_turns = self.loop_turns
        self.outbox.send(stats)
        self.last_stats = time.monotonic()

    def _on_step(self, info: StepInfo) -> None:
        if info.num_prefill_tokens:
            self.step_prefill_tokens.append(info.num_prefill_tokens)


# A token a grammar's mask (or min_tokens) rules out has logprob -inf, which JSON cannot carry. It is
# reported at this floor instead, as vLLM does, so top_logprobs keep the k entries the client asked for.
LOGPROB_FLOOR = -9999.0


def _finite(top: list[tuple[int, float]] | None) -> list[tuple[int, float]] | None:
    return None if top is None else [(t, lp if lp > LOGPROB_FLOOR else LOGPROB_FLOOR) for t, lp in top]

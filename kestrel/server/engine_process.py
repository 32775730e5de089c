"""The engine process: loads the model, then runs the engine loop for the HTTP process.

The loop blocks on its inbox while the engine has no work (no busy spin) and steps while it has
some, draining the inbox between steps so new requests join the next batch and aborts free KV at
once. It exits on `Shutdown` or when the HTTP process goes away (end of file on the inbox).
"""
from __future__ import annotations

import logging
import os
import signal
import time
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any

from kestrel.config import EngineConfig
from kestrel.core.request import Request
from kestrel.distributed.errors import RankFailedError
from kestrel.server.messages import (AbortRequests, AddRequests, Admission, EngineFailed, EngineReady,
                                     Shutdown, StepOutput, TokenDelta)

if TYPE_CHECKING:
    from kestrel.engine.engine import Engine

logger = logging.getLogger("kestrel.engine_process")

STATS_INTERVAL_S = 1.0  # while busy; besides, stats go out on every change between idle and busy


def engine_main(config: EngineConfig, inbox: Connection, outbox: Connection, log_level: str) -> None:
    """Entry point of the engine process (multiprocessing, spawn context)."""
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
                            rank_pids=engine.ranks.pids if engine.ranks is not None else []))
    EngineLoop(engine, inbox, outbox).run()


class EngineLoop:
    def __init__(self, engine: "Engine", inbox: Connection, outbox: Connection) -> None:
        self.engine = engine
        self.inbox = inbox
        self.outbox = outbox
        self.last_stats = 0.0
        self.stats_sent_idle = False

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
            touched: list[str] = []
            for msg in messages:
                if isinstance(msg, AddRequests):
                    touched += self._add(msg)
                elif isinstance(msg, AbortRequests):
                    for rid in msg.rids:
                        engine.abort(rid)
                    touched += msg.rids
                elif isinstance(msg, Shutdown):
                    return
                else:
                    raise TypeError(f"unexpected message {type(msg).__name__}")
            if self.stats_sent_idle and engine.has_work():
                self._send_stats()  # busy now: replace the idle snapshot at once, not a second later
                self.stats_sent_idle = False
            news = engine.step_deltas(touched)
            if news:
                self.stats_sent_idle = False
                self.outbox.send(StepOutput([self._delta(req, start) for req, start in news]))
            if time.monotonic() - self.last_stats >= STATS_INTERVAL_S:
                self._send_stats()

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
                                                     rid=r.rid))
        except ValueError as e:
            error, status, param = str(e), 400, getattr(e, "param", None)
        except Exception as e:  # a bug must not take the server down for everyone
            logger.exception("add_request failed")
            error, status, param = f"internal error while adding the request: {type(e).__name__}: {e}", 500, None
        else:
            self.outbox.send(Admission(msg.group))
            return added
        for rid in added:  # aborted ones are reported and forgotten by step_deltas(touched=added)
            self.engine.abort(rid)
        self.outbox.send(Admission(msg.group, error, status, param))
        return added

    def _delta(self, req: Request, start: int) -> TokenDelta:
        asked = req.params.logprobs is not None
        prompt = start == 0 and req.params.prompt_logprobs is not None  # complete once a token or the end came
        return TokenDelta(
            rid=req.rid, token_ids=req.output_ids[start:],
            logprobs=req.output_logprobs[start:] if asked else None,
            top_logprobs=req.output_top_logprobs[start:] if asked else None,
            finished=req.finished, finish_reason=req.finish_reason, matched_stop=req.matched_stop, error=req.error,
            prompt_tokens=len(req.prompt_ids), cached_tokens=req.cached_tokens,
            spec_accept_histogram=req.spec_accept_histogram if req.finished and req.spec_accept_counts else None,
            prompt_logprobs=req.prompt_logprobs if prompt else None,
            prompt_top_logprobs=req.prompt_top_logprobs if prompt else None)

    def _send_stats(self) -> None:
        self.outbox.send(self.engine.stats())
        self.last_stats = time.monotonic()

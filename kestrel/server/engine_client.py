"""The HTTP process's side of the engine process: launch, send, dispatch outputs, detect death.

Sending goes through one thread, so the event loop never blocks on a full pipe (and the two
processes can never wait on each other's full pipes). Receiving is one asyncio task, woken by the
event loop when the pipe is readable, that routes every `TokenDelta` to the queue of the HTTP
request it belongs to, updating the metrics on the way. End of file on the pipe means the engine
process died: every waiting request then gets a 503, and so does every new one, until `on_dead`
(the EngineSupervisor) has put a new client in this one's place.

A message that cannot be sent (it does not pickle) fails its own request with a 500 and nothing
else. If the sending thread or the receiving task fails all the same (a bug), this client is
dead as if the engine process had died: requests get 503, /health 503, and the supervisor starts a
new engine process with new pipes, thread and task.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing as mp
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

from kestrel.config import EngineConfig, ServerConfig
from kestrel.server.engine_process import engine_main
from kestrel.server.errors import APIError
from kestrel.server.messages import (AbortRequests, AddRequests, Admission, EngineFailed, EngineReady, EngineStats,
                                     FlushCache, FlushCacheReply, LoRACommand, LoRAReply, NewRequest, Shutdown,
                                     StepOutput, TokenDelta)
from kestrel.server.metrics import ServerMetrics
from kestrel.server.metrics_dialects import FinishedRequest

logger = logging.getLogger(__name__)

# After Shutdown (or end of file on its inbox) the engine process ends within a step and exits without
# the interpreter's teardown (see process_exit); past this it is killed, so shutdown stays bounded.
ENGINE_EXIT_TIMEOUT_S = 1.5


class EngineStartError(RuntimeError):
    """The engine process could not load the model."""


class RequestGroup:
    """The engine requests of one HTTP call; their deltas arrive, in order, on one queue.

    Queue items are `(index in the group, TokenDelta)`, or an `APIError` when the engine died.
    """

    def __init__(self, rids: list[str]) -> None:
        self.id = uuid.uuid4().hex
        self.rids = rids
        self.queue: asyncio.Queue[tuple[int, TokenDelta] | APIError] = asyncio.Queue()
        self.admitted: asyncio.Future[None] = asyncio.get_running_loop().create_future()


@dataclass
class _Tracked:
    group: RequestGroup
    index: int
    arrival: float
    priority: int
    last_token: float | None = None
    first_token: float | None = None
    tokens: int = 0


class EngineLaunch:
    """An engine process loading its model: `wait()` blocks until it is ready, `kill()` gives up on it."""

    def __init__(self, config: EngineConfig, log_level: str) -> None:
        self.config = config
        ctx = mp.get_context("spawn")
        inbox_r, self.inbox = ctx.Pipe(duplex=False)
        self.outbox, outbox_w = ctx.Pipe(duplex=False)
        self.process = ctx.Process(target=engine_main, args=(config, inbox_r, outbox_w, log_level),
                                   name="kestrel-engine")
        self.process.start()
        # Only the engine process may hold these ends: then its death reads as end of file here.
        inbox_r.close()
        outbox_w.close()

    def wait(self, metrics: ServerMetrics) -> "EngineClient":
        """The client of the loaded engine. Raises EngineStartError."""
        process, model = self.process, self.config.model.model
        try:
            msg = self.outbox.recv()
        except EOFError:
            process.join()
            raise EngineStartError(f"the engine process exited (exit code {process.exitcode}) while loading "
                                   f"the model {model}; see the log above") from None
        except BaseException:  # e.g. Ctrl-C while the model loads (the engine process ignores SIGTERM)
            self.kill()
            raise
        if isinstance(msg, EngineFailed):
            process.join()
            raise EngineStartError(f"could not load the model {model}: {msg.error}")
        assert isinstance(msg, EngineReady), msg
        metrics.on_engine_ready(msg)
        return EngineClient(process, self.inbox, self.outbox, msg, metrics,
                            self.config.server.health_stall_timeout)

    def kill(self) -> None:
        self.process.kill()
        self.process.join()


class EngineClient:
    """`stall_timeout`: seconds the engine may hold requests without its loop advancing before
    `stall_error()` reports it hung (0: never); see `stalled_for`."""

    def __init__(self, process: Any, inbox: Any, outbox: Any, info: EngineReady, metrics: ServerMetrics,
                 stall_timeout: float = ServerConfig.health_stall_timeout) -> None:
        self.process = process
        self.info = info
        self.metrics = metrics
        self.stall_timeout = stall_timeout
        # The engine loop's heartbeat: when it was last seen to advance, counted from readiness (the
        # model load and CUDA graph capture came before), and its step count then.
        self._progress_at = time.monotonic()
        self._turns_seen = 0
        self.stats = EngineStats(max_total_tokens=info.max_total_tokens)
        self.dead_reason: str | None = None
        self.on_dead: Callable[[], None] | None = None  # called once, after the in-flight requests were failed
        self._inbox = inbox  # we write; the engine reads
        self._outbox = outbox  # the engine writes; we read
        self._send_queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_loop, name="kestrel-engine-sender", daemon=True)
        self._groups: dict[str, RequestGroup] = {}  # waiting for their Admission
        # --enable-lora: the loaded adapters (name -> path) as of the engine's last LoRAReply; None: off.
        self.lora_adapters: dict[str, str] | None = info.lora_adapters
        # The commands (LoRACommand, FlushCache) waiting for the engine's reply, by their id.
        self._commands: dict[str, asyncio.Future[Any]] = {}
        self._tracked: dict[str, _Tracked] = {}
        self._rid_counter = itertools.count()
        self._readable = asyncio.Event()
        self._dispatcher: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # ---- lifecycle -----------------------------------------------------------------------------
    @classmethod
    def launch(cls, config: EngineConfig, log_level: str, metrics: ServerMetrics) -> "EngineClient":
        """Start the engine process and wait until its model is loaded. Raises EngineStartError."""
        return EngineLaunch(config, log_level).wait(metrics)

    def start(self) -> None:
        """Begin sending and dispatching; call from the event loop that serves HTTP."""
        self._loop = asyncio.get_running_loop()
        self._sender.start()
        self._loop.add_reader(self._outbox.fileno(), self._readable.set)
        self._dispatcher = self._loop.create_task(self._dispatch_loop(), name="kestrel-engine-dispatcher")
        self._dispatcher.add_done_callback(self._dispatcher_done)

    async def shutdown(self, timeout: float = ENGINE_EXIT_TIMEOUT_S) -> None:
        """Ask the engine to abort what still runs and exit; kill it if it does not within `timeout`
        seconds. Idempotent."""
        if self._inbox.closed:
            return
        if self._loop is not None:
            self._loop.remove_reader(self._outbox.fileno())
        if self._dispatcher is not None:
            self._dispatcher.cancel()
        self._send_queue.put(Shutdown())
        self._send_queue.put(None)  # stops the sender thread after the Shutdown went out
        if self._sender.is_alive():
            await asyncio.to_thread(self._sender.join, timeout)
        # End of file on its inbox also stops the engine: the one way left when the sender is gone.
        self._inbox.close()  # a restarted engine gets new pipes: do not leak these
        await asyncio.to_thread(self.process.join, timeout)
        if self.process.is_alive():  # it ignores SIGTERM (see engine_main), so kill
            logger.warning("the engine process did not exit within %.1f s; killing it", timeout)
            self.process.kill()
            self.process.join()
        self._outbox.close()

    @property
    def alive(self) -> bool:
        return self.dead_reason is None and self.process.is_alive()

    def stalled_for(self) -> float:
        """Seconds the engine has held requests without its loop advancing; 0 while it holds none.

        The loop advances when a step's output or a stats message with a new step count arrives (stats
        come every second while it is busy). Work that arrives at an engine with none counts from then."""
        if not self._tracked and not self._groups:
            return 0.0
        return time.monotonic() - self._progress_at

    def stall_error(self) -> APIError | None:
        """A 503 for /health when the engine loop has not advanced for `stall_timeout` seconds while it
        has requests: a hung step (a stuck collective, a kernel that never returns) leaves the process
        alive, so only its silence tells."""
        stalled = self.stalled_for()
        if not self.stall_timeout or stalled <= self.stall_timeout:
            return None
        return APIError(503, f"the engine loop has not advanced for {stalled:.0f} s while it holds "
                             f"{len(self._tracked) + len(self._groups)} requests (--health-stall-timeout "
                             f"{self.stall_timeout:g}): it may be hung", code="engine_stalled")

    def dead_error(self) -> APIError:
        reason = self.dead_reason or f"the engine process exited (exit code {self.process.exitcode})"
        return APIError(503, f"{reason}; the server is starting a new one: retry in a little while",
                        code="engine_dead")

    # ---- requests ------------------------------------------------------------------------------
    def new_rid(self) -> str:
        return f"{uuid.uuid4().hex[:16]}-{next(self._rid_counter)}"

    async def submit(self, reqs: list[NewRequest], arrival: float) -> RequestGroup:
        """Queue the requests in the engine (all or none); raises APIError with the engine's reason."""
        if not self.alive:
            raise self.dead_error()
        group = RequestGroup([r.rid for r in reqs])
        if not self._tracked and not self._groups:  # an engine without work had nothing to advance
            self._progress_at = time.monotonic()
        self._groups[group.id] = group
        for i, r in enumerate(reqs):
            self._tracked[r.rid] = _Tracked(group, i, arrival, r.params.priority)
        self._send(AddRequests(group.id, reqs))
        try:
            await group.admitted
        except asyncio.CancelledError:  # the client left before the engine answered
            self.abort(group.rids)
            raise
        return group

    async def lora_command(self, name: str, path: str | None) -> None:
        """Load (`path`) or unload (None) a LoRA adapter in the engine; raises APIError with its reason."""
        if not self.alive:
            raise self.dead_error()
        result = await self._command(LoRACommand(uuid.uuid4().hex, name, path))
        if result.error is not None:
            raise APIError(result.status, result.error, "lora_path" if path is not None else "lora_name")

    async def flush_cache(self) -> bool:
        """Drop every cached prefix in the engine; False (nothing dropped) while requests are queued or running."""
        if not self.alive:
            raise self.dead_error()
        reply: FlushCacheReply = await self._command(FlushCache(uuid.uuid4().hex))
        return reply.flushed

    async def _command(self, command: LoRACommand | FlushCache) -> Any:
        """Send `command` and wait for the engine's reply to it (an APIError when the engine dies first)."""
        reply = self._commands[command.id] = asyncio.get_running_loop().create_future()
        self._send(command)
        return await reply

    def abort(self, rids: list[str]) -> None:
        """Abort unfinished requests; their final deltas still arrive and still count in the metrics."""
        live = [rid for rid in rids if rid in self._tracked]
        if live and self.alive:
            self._send(AbortRequests(live))

    def _send(self, msg: Any) -> None:
        self._send_queue.put(msg)

    def _send_loop(self) -> None:
        try:
            while (msg := self._send_queue.get()) is not None:
                try:
                    data = ForkingPickler.dumps(msg)  # what Connection.send does, apart from the write
                except Exception as e:  # this message only, e.g. a value nested too deep to pickle
                    self._on_loop(self._unsendable, msg, e)
                    continue
                try:
                    self._inbox.send_bytes(data)
                except OSError as e:
                    if not isinstance(msg, Shutdown):
                        self._on_loop(self._on_dead, f"the engine process is gone ({e})")
                    return
        except BaseException as e:
            logger.exception("the thread that sends requests to the engine process failed")
            self._on_loop(self._on_dead, f"the thread that sends requests to the engine process failed "
                                         f"({type(e).__name__}: {e})")

    def _on_loop(self, fn: Callable[..., None], *args: Any) -> None:
        """Call `fn(*args)` on the event loop, from the sender thread (not at all once the loop is closed)."""
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:  # the event loop is closed: the server has stopped
                pass

    def _unsendable(self, msg: Any, error: Exception) -> None:
        """`msg` could not be pickled for the engine: fail its request group, which the engine never saw."""
        logger.error("could not send %s to the engine process: %s: %s", type(msg).__name__, type(error).__name__,
                     error)
        if (reply := self._commands.pop(getattr(msg, "id", None), None)) is not None and not reply.done():
            reply.set_exception(APIError(500, f"the command could not be handed to the engine: "
                                              f"{type(error).__name__}: {error}", code="internal_error"))
            return
        if not isinstance(msg, AddRequests):
            return  # an abort: the request ends anyway, by its own finish or by the engine's shutdown
        group = self._groups.pop(msg.group, None)
        for r in msg.reqs:
            self._tracked.pop(r.rid, None)
        if group is not None and not group.admitted.done():
            group.admitted.set_exception(APIError(500, f"the request could not be handed to the engine: "
                                                       f"{type(error).__name__}: {error}", code="internal_error"))

    # ---- outputs -------------------------------------------------------------------------------
    def _dispatcher_done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and (error := task.exception()) is not None:
            logger.error("the task that reads the engine process's outputs failed", exc_info=error)
            self._on_dead(f"the task that reads the engine process's outputs failed ({type(error).__name__}: "
                          f"{error})")

    async def _dispatch_loop(self) -> None:
        while True:
            await self._readable.wait()
            self._readable.clear()
            try:
                while self._outbox.poll():
                    self._dispatch(self._outbox.recv())
            except (EOFError, OSError):
                self._loop.remove_reader(self._outbox.fileno())
                await asyncio.to_thread(self.process.join, 5.0)
                self._on_dead(f"the engine process exited (exit code {self.process.exitcode})")
                return

    def _dispatch(self, msg: Any) -> None:
        if isinstance(msg, StepOutput):
            now = self._progress_at = time.monotonic()
            for delta in msg.deltas:
                self._on_delta(delta, now)
        elif isinstance(msg, Admission):
            group = self._groups.pop(msg.group, None)
            if group is not None and not group.admitted.done():
                if msg.error is None:
                    group.admitted.set_result(None)
                else:
                    # Forget the group now: the final deltas of its already-added requests may
                    # arrive in this same read, and a rejected request is not an aborted one.
                    for rid in group.rids:
                        self._tracked.pop(rid, None)
                    group.admitted.set_exception(APIError(msg.status, msg.error, msg.param))
        elif isinstance(msg, (LoRAReply, FlushCacheReply)):
            if isinstance(msg, LoRAReply):
                self.lora_adapters = msg.adapters
            reply = self._commands.pop(msg.id, None)
            if reply is not None and not reply.done():
                reply.set_result(msg)
        elif isinstance(msg, EngineFailed):  # a tensor-parallel rank died; the engine process exits now
            self._on_dead(msg.error)
        elif isinstance(msg, EngineStats):
            if msg.loop_turns != self._turns_seen:
                self._turns_seen, self._progress_at = msg.loop_turns, time.monotonic()
            self.stats = msg
            self.metrics.on_stats(msg)
        else:
            logger.error("unexpected message from the engine process: %r", msg)

    def _on_delta(self, delta: TokenDelta, now: float) -> None:
        tracked = self._tracked.get(delta.rid)
        if tracked is None:  # a request whose group was rejected
            return
        if delta.token_ids:
            if tracked.last_token is None:
                self.metrics.on_first_tokens(delta.prompt_tokens, delta.cached_tokens, now - tracked.arrival)
                self.metrics.on_tokens(len(delta.token_ids), None)
                tracked.first_token = now
            else:
                self.metrics.on_tokens(len(delta.token_ids), now - tracked.last_token)
            tracked.last_token = now
            tracked.tokens += len(delta.token_ids)
        if delta.queue_time is not None:
            self.metrics.on_queued(delta.queue_time)
        if delta.finished:
            del self._tracked[delta.rid]
            first = tracked.first_token
            self.metrics.on_finish(FinishedRequest(
                delta.finish_reason or "abort", tracked.priority, now - tracked.arrival, delta.prompt_tokens,
                delta.cached_tokens, tracked.tokens, None if first is None else first - tracked.arrival,
                (tracked.last_token - first) / (tracked.tokens - 1) if tracked.tokens > 1 else None))
            if delta.spec_accept_histogram:
                self.metrics.on_spec_rounds(delta.spec_accept_histogram)
        tracked.group.queue.put_nowait((tracked.index, delta))

    def _on_dead(self, reason: str) -> None:
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        logger.error("%s: answering 503 to every request it had", reason)
        self.stats = EngineStats(max_total_tokens=self.info.max_total_tokens)  # nothing runs any more
        self.metrics.on_engine_dead()
        error = self.dead_error()
        for group in self._groups.values():
            if not group.admitted.done():
                group.admitted.set_exception(error)
        self._groups.clear()
        for reply in self._commands.values():
            if not reply.done():
                reply.set_exception(error)
        self._commands.clear()
        for group in {id(t.group): t.group for t in self._tracked.values()}.values():
            group.queue.put_nowait(error)
        self._tracked.clear()
        if self.on_dead is not None:
            self.on_dead()

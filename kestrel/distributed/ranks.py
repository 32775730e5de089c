"""Rank 0's side of tensor parallelism: start this node's other ranks, broadcast each step, notice a
rank that dies.

A rank that exits (killed, out of memory, a crash) cannot be replaced inside a running engine: its
shard of the weights and of the KV cache is gone. So its death is fatal to the engine, reported with
the rank's number, pid and exit status: the next step (or `check`) raises RankFailedError, the ranks
still alive are stopped, and a server's engine process exits so that the HTTP process answers 503.
A rank blocked in a collective with the dead one is released by the collective's error (gloo: its
sockets close at once; NCCL: the monitor aborts the group).
"""
from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import socket
import sys
import threading
import time
from multiprocessing.connection import wait

import torch.distributed as dist

from kestrel.config import EngineConfig
from kestrel.core.batch import ScheduledBatch
from kestrel.core.request import Request
from kestrel.distributed.errors import UNGUARDED_MAIN_EXIT_CODE, UNGUARDED_MAIN_HINT, RankFailedError
from kestrel.distributed.parallel_state import ParallelState, destroy_parallel, init_parallel
from kestrel.distributed.step_command import StepCommand
from kestrel.distributed.worker import rank_main

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 10.0
# After a collective fails, how long to wait for a rank's exit to show before blaming rank 0's own error.
DEATH_GRACE_S = 2.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rendezvous_address(config: EngineConfig) -> str:
    """host:port of rank 0's rendezvous: `dist_init_addr`, else a free local port (one node)."""
    return config.parallel.dist_init_addr or f"127.0.0.1:{free_port()}"


def spawn_ranks(config: EngineConfig, ranks: range, address: str, eos_token_ids: set[int]
                ) -> tuple[list[mp.Process], list]:
    """Start one process per rank in `ranks`; returns them and the pipe ends that keep them alive
    (closing one, or exiting, tells its rank to exit)."""
    if getattr(mp.current_process(), "_inheriting", False):
        # This process is a rank still importing the script that spawned it (multiprocessing's own flag),
        # and the script starts an engine at import time: multiprocessing would refuse with a page of text.
        print(f"kestrel: {UNGUARDED_MAIN_HINT}", file=sys.stderr)
        raise SystemExit(UNGUARDED_MAIN_EXIT_CODE)
    ctx = mp.get_context("spawn")
    level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
    procs, alive = [], []
    for rank in ranks:
        child_end, parent_end = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=rank_main, args=(config, rank, address, eos_token_ids, child_end, level),
                           name=f"kestrel-rank{rank}", daemon=True)
        proc.start()
        child_end.close()  # only the child holds its end: our exit reads as end of file there
        procs.append(proc)
        alive.append(parent_end)
    return procs, alive


class TPRanks:
    """Rank 0's handle on the group: `parallel` (its ParallelState), `step()` each batch, `stop()`."""

    def __init__(self, config: EngineConfig, eos_token_ids: set[int], device) -> None:
        par = config.parallel
        address = rendezvous_address(config)
        self.procs, self._alive = spawn_ranks(config, range(1, par.tp_size // par.nnodes), address, eos_token_ids)
        self.failure: str | None = None
        self._stopped = False
        self._lock = threading.RLock()
        self._wake_r, self._wake_w = mp.Pipe(duplex=False)
        self._monitor = threading.Thread(target=self._watch, daemon=True, name="kestrel-rank-monitor")
        self._monitor.start()
        # An Engine never shut down: stop the ranks at exit, before multiprocessing terminates them (which
        # would read as ranks dying).
        atexit.register(self.stop)
        logger.info("tensor parallelism: %d ranks (%d on this node: pids %s), rendezvous at %s", par.tp_size,
                    1 + len(self.procs), [p.pid for p in self.procs], address)
        try:
            self.parallel: ParallelState = init_parallel(0, par.tp_size, par.ep_size, address, device, self.check)
        except BaseException:
            self.stop()
            raise

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    @property
    def sentinels(self) -> list[int]:
        """Readable when a rank process exits (for a loop that waits on its inbox too)."""
        return [p.sentinel for p in self.procs]

    def step(self, batch: ScheduledBatch, sampled: list[Request], logit_rows: list[int],
             futures: list[int]) -> None:
        """Send the step to every rank; the forward that follows on rank 0 meets theirs."""
        self.check()
        self.parallel.broadcast(StepCommand.of(batch, sampled, logit_rows, futures))

    def check(self) -> None:
        """Raise RankFailedError if a rank has died (or the group was stopped)."""
        self._note_death()
        if self.failure is not None:
            raise RankFailedError(self.failure)
        if self._stopped:
            raise RankFailedError("the engine was shut down; its tensor-parallel ranks are stopped")

    def fatal(self, error: BaseException) -> RankFailedError:
        """The error that ends the engine after a step failed on rank 0: usually a dead rank broke the
        collective (named, once its exit shows), else rank 0's own error, which left the other ranks
        waiting in a collective rank 0 never reached. Stops the ranks still alive."""
        wait(self.sentinels, timeout=DEATH_GRACE_S)
        with self._lock:
            self._note_death()
            if self.failure is None:
                self.failure = (f"a tensor-parallel step failed on rank 0 ({type(error).__name__}: {error}); the "
                                "ranks are out of step and the engine stops")
        logger.error("%s", self.failure)
        self.stop()
        return RankFailedError(self.failure)

    def _note_death(self) -> bool:
        """Set `failure` to the first dead rank's story, unless set already or stopping; True if a rank died.
        A process's sentinel says it exited without reaping it; the lock keeps the main thread and the
        monitor from reaping it at once (the loser would read "still running")."""
        with self._lock:
            if self._stopped or not wait(self.sentinels, timeout=0):
                return False
            if self.failure is None:
                for rank, proc in enumerate(self.procs, start=1):
                    if proc.sentinel in wait([proc.sentinel], timeout=0):
                        proc.join()
                        self.failure = (f"tensor-parallel rank {rank} (pid {proc.pid}) exited with exit code "
                                        f"{proc.exitcode}; the engine cannot go on without its shard")
                        if proc.exitcode == UNGUARDED_MAIN_EXIT_CODE:
                            self.failure = f"tensor-parallel rank {rank} could not start: {UNGUARDED_MAIN_HINT}"
                        break
            return True

    def _watch(self) -> None:
        wait(self.sentinels + [self._wake_r])
        if not self._note_death():
            return
        logger.error("%s", self.failure)
        # NCCL waits for a dead peer until its timeout: abort the group so a blocked collective fails now.
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        if abort is not None and dist.is_initialized() and dist.get_backend() == "nccl":
            abort()

    def stop(self) -> None:
        """Stop every rank (they exit their loop, or are killed) and leave the group. Idempotent."""
        if self._stopped:
            return
        atexit.unregister(self.stop)
        healthy = not self._note_death() and self.failure is None
        self._stopped = True
        self._wake_w.send(None)
        if healthy and hasattr(self, "parallel"):
            try:
                self.parallel.broadcast(None)
            except RuntimeError:  # a rank died meanwhile: it is killed below
                pass
        deadline = time.monotonic() + (STOP_TIMEOUT_S if healthy else 0.0)
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()
        for end in self._alive:
            end.close()
        if hasattr(self, "parallel"):
            destroy_parallel(self.parallel)


def run_node_ranks(config: EngineConfig, eos_token_ids: set[int]) -> int:
    """Node `node_rank` > 0 of a multi-node group: run this node's ranks until they exit. They stop when
    rank 0 stops them (status 0) or when the group breaks; one that fails takes the others on this node
    down (status 1)."""
    par = config.parallel
    per_node = par.tp_size // par.nnodes
    ranks = range(par.node_rank * per_node, (par.node_rank + 1) * per_node)
    procs, alive = spawn_ranks(config, ranks, rendezvous_address(config), eos_token_ids)
    logger.info("node %d: tensor-parallel ranks %d-%d (pids %s), rendezvous at %s", par.node_rank, ranks[0],
                ranks[-1], [p.pid for p in procs], par.dist_init_addr)
    status = 0
    try:
        pending = list(procs)
        while pending:
            for sentinel in wait([p.sentinel for p in pending]):
                proc = next(p for p in pending if p.sentinel == sentinel)
                proc.join()
                pending.remove(proc)
                if proc.exitcode != 0 and status == 0:
                    logger.error("%s (pid %d) exited with exit code %s; stopping this node's ranks", proc.name,
                                 proc.pid, proc.exitcode)
                    status = 1
                    for other in pending:
                        other.kill()
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
        for end in alive:
            end.close()
    return status

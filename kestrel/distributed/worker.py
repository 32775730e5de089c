"""A tensor-parallel rank other than 0: build the same runner on its shard, then run rank 0's steps.

The loop receives one `StepCommand` per step (None: stop), runs the forward (its collectives meet
rank 0's) and samples the same rows into its own FutureTokens. Any failure ends the process with
status 1: rank 0 notices the exit and takes the engine down with a message naming this rank. The
rank also exits as soon as its parent (rank 0, or a node's launcher) is gone.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
from multiprocessing.connection import Connection

import torch

from kestrel.config import EngineConfig
from kestrel.distributed.parallel_state import ParallelState, destroy_parallel, init_parallel, rank_device
from kestrel.distributed.step_command import StepCommand
from kestrel.engine.cpu_threads import configure_cpu_threads
from kestrel.engine.device_step import DeviceStep
from kestrel.sampling.sampler import Sampler
from kestrel.runner.build import build_runner
from kestrel.runner.model_runner import triton_on_device

logger = logging.getLogger("kestrel.rank")


def rank_main(config: EngineConfig, tp_rank: int, address: str, eos_token_ids: set[int],
              parent_alive: Connection, log_level: str) -> None:
    """Entry point of a worker rank's process (multiprocessing, spawn context)."""
    # Ctrl-C reaches the whole process group; rank 0 decides, and this rank follows it (stop or exit).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO),
                        format=f"%(asctime)s %(levelname)s rank{tp_rank} %(name)s: %(message)s")
    threading.Thread(target=_exit_with_parent, args=(parent_alive, tp_rank), daemon=True,
                     name="kestrel-parent-watch").start()
    try:
        device = rank_device(config, tp_rank)
        # The ranks share the machine's cores (the wait policy came with the engine process's environment).
        configure_cpu_threads(config, log=False)
        par = config.parallel
        parallel = init_parallel(tp_rank, par.tp_size, par.ep_size, address, device)
        parts = build_runner(config, device, parallel)
        sampler = Sampler(triton_argmax=triton_on_device(config))
        device_step = DeviceStep(parts.runner, sampler, parts.model.config.vocab_size, eos_token_ids, device)
        RankLoop(device_step, parallel).run()
        destroy_parallel(parallel)
    except Exception:
        logger.exception("tensor-parallel rank %d failed; exiting (rank 0 stops the engine)", tp_rank)
        os._exit(1)


def _exit_with_parent(parent_alive: Connection, tp_rank: int) -> None:
    """Block until the parent's end of the pipe closes (it exited, however), then exit at once: a rank
    blocked in a collective would otherwise wait for a peer that never comes."""
    try:
        parent_alive.recv()
    except (EOFError, OSError):
        pass
    logger.error("rank %d: the process that started it exited; exiting", tp_rank)
    os._exit(1)


class RankLoop:
    def __init__(self, device_step: DeviceStep, parallel: ParallelState) -> None:
        self.device_step = device_step
        self.parallel = parallel

    def run(self) -> None:
        while (cmd := self.parallel.broadcast()) is not None:
            self.step(cmd)

    def step(self, cmd: StepCommand) -> None:
        """The device half of rank 0's step: the forward, then the sample (its SamplingRows carry every
        Request field the sampler reads)."""
        forwarded = self.device_step.forward(cmd.batch, cmd.rows, cmd.logit_rows)
        if cmd.rows:
            self.device_step.sample(forwarded, cmd.futures)

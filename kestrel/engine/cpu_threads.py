"""How many CPU threads the engine computes with, and how they wait: decided once per engine process.

On a CPU device every torch op of a step runs as an OpenMP parallel region over the compute threads,
and a region ends only when its slowest thread does. A thread sharing its core with another busy
process gets the core every few milliseconds, so a model step of a few hundred regions waits that
long hundreds of times: 38 ms per token became 1.6 s beside one busy loop. Two things avoid it:

- OMP_WAIT_POLICY=PASSIVE: a thread that finished its share sleeps instead of spinning, so it does not
  take the core from the thread it waits for (or from the server's HTTP, tokenizer and detokenizer
  work), and the scheduler wakes it promptly when it has slept. OpenMP reads the variable once, when
  it loads with torch, so it must be set before the engine process imports torch.
- fewer compute threads than usable cores where there are cores to spare: the server's other processes
  (HTTP and detokenization, tokenizer workers) then run beside the compute threads, not in their place.

The rule (`auto_threads`): all usable cores up to 3 (spare cores cost a lone request more than the
server's processes gain), one core kept for the server on 4 to 8, two above. Usable cores are those of
the process's CPU affinity (`taskset`, a container's cpuset), fewer if a cgroup CPU quota allows less.
`--cpu-threads N` overrides the count, and so does OMP_NUM_THREADS when the user set it; with tensor
parallelism on CPU the count is shared out among the ranks. No affinity is set: pinned threads could not
move away from a neighbour's busy core.
"""
from __future__ import annotations

import logging
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from kestrel import envs
from kestrel.config import EngineConfig

logger = logging.getLogger(__name__)

WAIT_POLICY = "PASSIVE"


@dataclass(frozen=True)
class CpuThreads:
    """The decision for one engine process (or one tensor-parallel rank's process)."""

    threads: int | None  # torch compute threads of this process; None: torch's default (CUDA)
    cores: int  # cores this process may use
    wait_policy: str | None  # OMP_WAIT_POLICY to set before torch loads; None: leave it as it is
    reason: str  # why, for the start-up log


def auto_threads(cores: int) -> int:
    """Compute threads for `cores` usable cores when nothing asks for a number (see the module doc)."""
    if cores <= 3:
        return cores
    return cores - 1 if cores <= 8 else cores - 2


def choose_cpu_threads(device: str, cores: int, tp_size: int = 1, requested: int | None = None,
                       env_threads: int | None = None, env_wait_policy: str | None = None) -> CpuThreads:
    """The compute threads of one rank: `requested` (--cpu-threads), else `env_threads` (the user's
    OMP_NUM_THREADS), else `auto_threads(cores)`; then divided among `tp_size` ranks. A user's
    OMP_WAIT_POLICY is kept. On CUDA, torch's defaults stay."""
    if not device.startswith("cpu"):
        return CpuThreads(None, cores, None, f"device {device}: torch's default CPU threads")
    if requested is not None:
        total, why = requested, "--cpu-threads"
    elif env_threads is not None:
        total, why = env_threads, "OMP_NUM_THREADS"
    else:
        total = auto_threads(cores)
        spare = cores - total
        why = f"auto: {spare} core{'s' * (spare != 1)} left for the server's other processes"
    threads = max(1, total // tp_size)
    if tp_size > 1:
        why += f", shared among {tp_size} tensor-parallel ranks"
    if threads > cores:
        why += f"; more threads than usable cores ({cores}): expect them to wait on each other"
    policy = None if env_wait_policy else WAIT_POLICY
    return CpuThreads(threads, cores, policy, why)


def usable_cores(cgroup_root: Path = Path("/sys/fs/cgroup")) -> int:
    """Cores of this process's affinity, fewer if the cgroup's CPU quota (v2 `cpu.max`, or v1
    `cpu.cfs_quota_us` / `cpu.cfs_period_us`) allows less time than that."""
    cores = len(os.sched_getaffinity(0))
    quota = _cgroup_quota(cgroup_root)
    return max(1, min(cores, math.ceil(quota))) if quota is not None else cores


def _cgroup_quota(root: Path) -> float | None:
    """CPU time the cgroup may use per second, in cores; None without a limit (or a readable file)."""
    try:
        v2 = root / "cpu.max"
        if v2.is_file():
            quota, period = v2.read_text().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        v1 = root / "cpu"
        quota_us = int((v1 / "cpu.cfs_quota_us").read_text())
        return None if quota_us <= 0 else quota_us / int((v1 / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None


def configure_cpu_threads(config: EngineConfig, log: bool = True) -> CpuThreads:
    """Decide and apply the compute threads of this process: first thing in the engine process and in
    each tensor-parallel rank, before torch is imported there (else the wait policy comes too late, and
    the log says so). Logs one line when `log`."""
    decision = choose_cpu_threads(config.device, usable_cores(), config.parallel.tp_size,
                                  config.parallel.cpu_threads, envs.omp_num_threads(), envs.omp_wait_policy())
    late = "torch" in sys.modules
    if decision.wait_policy is not None and not late:
        envs.set_omp_wait_policy(decision.wait_policy)
    import torch

    if decision.threads is not None:
        torch.set_num_threads(decision.threads)
    if log:
        policy = envs.omp_wait_policy() or "the OpenMP default"
        if decision.wait_policy is not None and late:
            policy += f" ({decision.wait_policy} not applied: torch was loaded before the engine chose)"
        logger.info("CPU threads: %d compute threads on %d usable cores, OpenMP wait policy %s (%s)",
                    torch.get_num_threads(), decision.cores, policy, decision.reason)
    return decision

"""The tensor-/expert-parallel state of one rank: created once per process, passed down to the layers.

No module reads a global rank: a layer that communicates is given the `ParallelState` it runs in.
At `tp_size == 1` there is no process group at all and the model is built from plain torch layers,
so a single-GPU engine runs no collective and no extra copy.

Two groups over the same ranks: `group` carries the model's collectives (NCCL on CUDA, gloo on the
CPU; torch.distributed collectives on NCCL can be captured in CUDA graphs), `cpu_group` (always
gloo) carries rank 0's per-step broadcast of the batch as plain Python data.
"""
from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

# A collective waits this long for a rank before it fails (a live rank that stopped answering); a
# rank that exited is noticed at once (its sockets close, and rank 0's monitor sees it exit).
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)


@dataclass(frozen=True)
class ParallelState:
    """This process's place: `tp_rank` of `tp_size`; the routed experts are split over `ep_size` of
    the same ranks (1: every rank holds every expert)."""

    tp_rank: int = 0
    tp_size: int = 1
    ep_size: int = 1
    group: Any = None  # torch ProcessGroup for the model's collectives; None at tp_size 1
    cpu_group: Any = None  # gloo group for plain-data broadcasts; None at tp_size 1

    @property
    def ep_rank(self) -> int:
        return self.tp_rank % self.ep_size

    @property
    def is_driver(self) -> bool:
        """Rank 0 schedules, samples for the outputs and talks to the caller."""
        return self.tp_rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place (partial sums of a row-parallel linear)."""
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[N, k] on every rank -> [N, tp_size * k], rank r's columns at r * k (vocab-parallel logits)."""
        x = x.contiguous()
        out = torch.empty((self.tp_size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        _all_gather_single(out, x, group=self.group)
        return out.view(self.tp_size, *x.shape).movedim(0, -2).reshape(*x.shape[:-1], -1)

    def broadcast(self, obj: Any = None) -> Any:
        """Rank 0's `obj` on every rank (pickled over the gloo group)."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]

    def all_min(self, value: int) -> int:
        """The smallest `value` over the ranks (e.g. the KV pool size each rank's memory allows)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())


# torch 2.13 names it all_gather_single; older releases (the GPU image's 2.11) all_gather_into_tensor.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def init_parallel(tp_rank: int, tp_size: int, ep_size: int, address: str, device: torch.device,
                  check_ranks: Callable[[], None] = lambda: None) -> ParallelState:
    """Join the process group of `tp_size` ranks as `tp_rank`; rank 0 hosts the rendezvous at `address`
    (host:port). Rank 0 first waits for every rank to check in, calling `check_ranks` (which raises if
    a rank it started has died) meanwhile, so a rank that dies while starting fails the start-up at
    once instead of leaving rank 0 waiting out the timeout."""
    if tp_size == 1:
        return ParallelState(ep_size=ep_size)
    host, port = address.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), tp_size, tp_rank == 0, COLLECTIVE_TIMEOUT, wait_for_workers=False)
    store.set(f"kestrel/joined/{tp_rank}", "1")
    if tp_rank == 0:
        keys = [f"kestrel/joined/{rank}" for rank in range(1, tp_size)]
        deadline = time.monotonic() + COLLECTIVE_TIMEOUT.total_seconds()
        while not store.check(keys):
            check_ranks()
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel ranks did not all join the rendezvous at {address} within "
                                   f"{COLLECTIVE_TIMEOUT}")
            time.sleep(0.05)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=tp_rank, world_size=tp_size, timeout=COLLECTIVE_TIMEOUT)
    group = dist.group.WORLD
    cpu_group = group if backend == "gloo" else dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)
    return ParallelState(tp_rank, tp_size, ep_size, group, cpu_group)


def destroy_parallel(state: ParallelState) -> None:
    if state.group is not None and dist.is_initialized():
        dist.destroy_process_group()


def rank_device(config, tp_rank: int) -> torch.device:
    """The device of `tp_rank` (an EngineConfig's): its node's GPU number local_rank after `cuda:N`'s N
    (0 when unnumbered); the CPU for every rank on the CPU. At tp_size 1, `config.device` as it is."""
    if config.parallel.tp_size == 1 or config.device == "cpu":
        return torch.device(config.device)
    local_rank = tp_rank % (config.parallel.tp_size // config.parallel.nnodes)
    base = torch.device(config.device).index or 0
    device = torch.device("cuda", base + local_rank)
    torch.cuda.set_device(device)
    return device

"""Programmatic dependent launch (PDL) for kestrel's Triton kernels on Hopper and later.

A decode step at small batch is a chain of short kernels (a batch-1 step of an 8B model: ~10 a layer,
each a few microseconds). Between two of them the GPU drains the first, launches the second and ramps
it up, and no weight byte moves meanwhile. Launched with PDL, a kernel's programs may start while the
kernel before it in the stream is still finishing: each waits (`gdc_wait`) before it touches anything
that kernel wrote, and lets the kernel after it launch (`gdc_launch_dependents`) as soon as all of its own
programs are running. The launch and ramp-up then overlap the previous kernel's tail. Under CUDA graph
capture the dependency is recorded as a programmatic edge.

A kernel takes part by calling `sync` with a PDL constexpr first thing, before any load, and by being
launched with `launch_options`. Waiting before any load keeps it correct whatever it reads (and before any
store, whatever the previous kernel still reads). Kernels that do not take part keep full stream order.
"""
from __future__ import annotations

from functools import lru_cache

import torch
import triton.language as tl

from kestrel import envs
from kestrel.envs import triton_jit

# On: batch-1 steps 2-8 % faster on the H100 (docs/benchmarks.md, `bash scripts/gpu.sh OUT pdl pdl-moe`); a
# benchmark sets it in its process before building a model, to compare in one process.
ENABLED = True


@lru_cache(maxsize=None)
def _supported(device_index: int) -> bool:
    """Hopper or later, and a Triton that knows griddepcontrol and the launch flag."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    cuda_ext = getattr(tl.extra, "cuda", None)
    has_gdc = cuda_ext is not None and hasattr(cuda_ext, "gdc_wait") and hasattr(cuda_ext, "gdc_launch_dependents")
    has_flag = "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})
    return has_gdc and has_flag and torch.cuda.get_device_capability(device_index)[0] >= 9


def on(device: torch.device) -> bool:
    """Whether kernels launched on `device` take part (the PDL constexpr)."""
    return ENABLED and device.type == "cuda" and not envs.triton_interpret() and _supported(device.index or 0)


def launch_options(device: torch.device) -> dict:
    """A taking-part kernel's launch keywords: its PDL constexpr, and where `on`, the flag that launches it
    with PDL."""
    return {"PDL": True, "launch_pdl": True} if on(device) else {"PDL": False}


@triton_jit
def sync(PDL: tl.constexpr):
    """First thing in a taking-part kernel: wait for the kernel before, then let the next one launch."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()

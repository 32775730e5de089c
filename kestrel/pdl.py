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

# Off until a GPU run shows the gain (`bash scripts/gpu.sh OUT pdl`); a benchmark sets it in its process
# before building a model, to compare in one process.
ENABLED = False


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


# Whether a weight-streaming GEMV that takes part also starts its first strip of weights into L2 before its
# wait (`prefetch_strip`): the weights do not depend on the kernel before, so their first bytes can move
# while that kernel finishes. Off until measured against PDL alone.
PREFETCH_WEIGHTS = False


def prefetch_line(weight: torch.Tensor, width: int) -> int:
    """The PREFETCH_LINE constexpr of a GEMV over `weight` whose strips are `width` elements wide: the
    elements of a 128-byte line (at most `width`) where the prefetch is on, else 0 (off)."""
    return min(128 // weight.element_size(), width) if PREFETCH_WEIGHTS and on(weight.device) else 0


@triton_jit
def prefetch_strip(W, rows, stride_row, col0, cols, WIDTH: tl.constexpr, LINE: tl.constexpr):
    """Prefetch W[rows, col0 : col0 + WIDTH] (columns past `cols` left out) into L2, one `prefetch.global.L2`
    per line of LINE elements (128 bytes; CUDA only). `rows` must lie inside W."""
    offs = tl.minimum(col0 + tl.arange(0, WIDTH // LINE) * LINE, cols - 1)
    ptrs = W + rows[:, None].to(tl.int64) * stride_row + offs[None, :]
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)

"""The only reader of os.environ: a few typed knobs (never read in models/ or layers/).

TRITON_INTERPRET is read once, when kestrel is first imported: whether Triton kernels can run on the
CPU (the availability check) and how every kestrel kernel is built (`triton_jit`) must agree, even if
the variable changes afterwards.
"""
from __future__ import annotations

import os

_TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_interpret() -> bool:
    """TRITON_INTERPRET=1 (set before importing kestrel) runs Triton kernels through Triton's CPU
    interpreter (tests)."""
    return _TRITON_INTERPRET


def triton_jit(fn):
    """`triton.jit`, in the mode decided at import. Triton reads the variable when it decorates, so it
    is set to that decision for the decoration and restored after."""
    import triton

    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if _TRITON_INTERPRET else "0"
    try:
        return triton.jit(fn)
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved


def allow_long_context() -> bool:
    """KESTREL_ALLOW_LONG_CONTEXT=1: accept a context_length past the checkpoint's positions when its rope
    is scaled (read at config resolution; the engine process inherits it)."""
    return os.environ.get("KESTREL_ALLOW_LONG_CONTEXT", "0").lower() in ("1", "true", "yes")


def kv_events_hash_seed() -> str:
    """PYTHONHASHSEED, the seed of the KV-event block hashes as vLLM takes it ("" when unset, so that
    replicas and the indexers that recompute the hashes agree without it)."""
    return os.environ.get("PYTHONHASHSEED", "")


def omp_num_threads() -> int | None:
    """OMP_NUM_THREADS as the user set it (a positive integer), else None. A list ("4,2": nested levels)
    counts by its first level. Raises ValueError naming the variable when it is not a number."""
    raw = os.environ.get("OMP_NUM_THREADS", "").strip()
    if not raw:
        return None
    first = raw.split(",")[0].strip()
    if not first.isdigit() or int(first) < 1:
        raise ValueError(f"OMP_NUM_THREADS must be a positive integer, got {raw!r}")
    return int(first)


def omp_wait_policy() -> str | None:
    """OMP_WAIT_POLICY as the user set it (ACTIVE or PASSIVE), else None."""
    return os.environ.get("OMP_WAIT_POLICY") or None


def set_omp_wait_policy(policy: str) -> None:
    """Set OMP_WAIT_POLICY for the OpenMP runtime this process (and its children) will load: it is read
    once, when the runtime loads (with torch), so this only works before `import torch`."""
    os.environ["OMP_WAIT_POLICY"] = policy


def cuda_visible_devices() -> list[str] | None:
    """CUDA_VISIBLE_DEVICES as a list of the GPUs it names (ids or UUIDs), else None (all GPUs visible).
    `kestrel serve --dp-size` hands each replica its share of them."""
    raw = os.environ.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return None
    return [d.strip() for d in raw.split(",") if d.strip()]

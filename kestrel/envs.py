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

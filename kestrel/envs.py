"""The only reader of os.environ: a few typed knobs, read when asked (never in models/ or layers/)."""
from __future__ import annotations

import os


def triton_interpret() -> bool:
    """TRITON_INTERPRET=1 runs Triton kernels on the CPU through Triton's interpreter (tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"

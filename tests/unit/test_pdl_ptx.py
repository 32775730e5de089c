"""The PDL-taking kernels compiled for sm_90 on the CPU (tests/hopper_ptx.py in a process of its own, Triton's
interpreter off): each compiles and waits for the kernel before ahead of any global memory access. A GPU run
is then not the first place a kernel meets the real compiler."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton.backends.nvidia.compiler")

ROOT = Path(__file__).resolve().parents[2]


def test_pdl_kernels_compile_for_hopper_and_wait_before_any_access():
    from tests.hopper_ptx import CASES

    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-m", "tests.hopper_ptx"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    lines = run.stdout.splitlines()
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert len(lines) == len(CASES) and all(line.endswith("wait") for line in lines), lines

"""Progress bars (weight loading, offline generate over many prompts) reach a terminal and nothing else."""
from __future__ import annotations

import fcntl
import io
import os
import pty
import struct
import subprocess
import sys
import termios

import pytest

from kestrel import Engine, SamplingParams
from tests.e2e.server_process import REPO


class Terminal(io.StringIO):
    """stderr as a terminal would be, recording what is written to it."""

    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("terminal", [True, False])
def test_bars_are_drawn_on_a_terminal_only_and_use_tqdm_false_hides_them(tiny_model, monkeypatch, terminal):
    stderr = Terminal() if terminal else io.StringIO()
    monkeypatch.setattr(sys, "stderr", stderr)
    with Engine(model=tiny_model("llama"), device="cpu", dtype="float32") as engine:
        loading = stderr.getvalue()
        params = SamplingParams(max_new_tokens=2, temperature=0)
        engine.generate(prompt_token_ids=[[5, 6, 7], [8, 9], [10]], sampling_params=params)
        generating = stderr.getvalue()[len(loading):]
        engine.generate(prompt_token_ids=[[5, 6, 7], [8, 9]], sampling_params=params, use_tqdm=False)
        quiet = stderr.getvalue()[len(loading) + len(generating):]
    if terminal:
        assert "Loading weights: 100%" in loading
        assert "Processed prompts: 100%" in generating and "3/3" in generating
    else:
        assert "Loading weights" not in loading and "Processed prompts" not in generating
    assert "Processed prompts" not in quiet


def test_a_real_pseudo_terminal_shows_the_bars(tiny_model):
    """The same through an actual pty (isatty from the OS, not a stand-in)."""
    code = ("from kestrel import Engine, SamplingParams\n"
            f"e = Engine(model={tiny_model('llama')!r}, device='cpu', dtype='float32')\n"
            "e.generate(prompt_token_ids=[[5, 6]] * 4, sampling_params=SamplingParams(max_new_tokens=1))\n")
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a fresh pty is 0 x 0
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=follower)
    os.close(follower)
    seen = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # EIO: every writer closed the terminal
            break
        if not chunk:
            break
        seen += chunk
    os.close(leader)
    assert proc.wait(timeout=120) == 0, seen.decode(errors="replace")[-2000:]
    text = seen.decode(errors="replace")
    assert "Loading weights: 100%" in text and "Processed prompts: 100%" in text and "4/4" in text

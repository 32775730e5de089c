"""One supervised child process of `kestrel serve --dp-size`: a replica or the gateway.

Each runs in its own session (so that what it leaves behind when it dies, such as a killed replica's
engine process, can be ended with it, by process group) and gets SIGTERM when the parent dies, however
it dies (Linux), so no GPU is left held by an orphan.
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence

logger = logging.getLogger(__name__)
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class Child:
    """A process started from `command`, ready once GET `ready_url` answers 200, restarted on demand."""

    def __init__(self, name: str, command: Sequence[str], env: dict[str, str], ready_url: str) -> None:
        self.name = name
        self.command = list(command)
        self.env = env
        self.ready_url = ready_url
        self.proc: subprocess.Popen | None = None
        self.ready = False
        self.starts = 0

    def start(self) -> None:
        self.proc = subprocess.Popen(self.command, env=self.env, start_new_session=True,
                                     preexec_fn=_die_with_parent)
        self.ready = False
        self.starts += 1

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def exited(self) -> int | None:
        """The exit status once the process has ended, else None."""
        return None if self.proc is None else self.proc.poll()

    def check_ready(self) -> bool:
        if not self.ready and self.exited() is None:
            try:
                with urllib.request.urlopen(self.ready_url, timeout=2.0) as answer:
                    self.ready = answer.status == 200
            except (urllib.error.URLError, OSError):  # not listening yet, or 503 while loading
                pass
        return self.ready

    def end_group(self) -> None:
        """Kill what is left of the process's group (its engine and tokenizer processes after it was killed)."""
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def terminate(self) -> None:
        if self.proc is not None and self.proc.poll() is None:  # started and still running
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, deadline: float) -> None:
        """Wait for the process to exit until `deadline` (time.monotonic()), then kill its group."""
        if self.proc is None:
            return
        try:
            self.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning("%s (pid %d) did not stop in time; killing it", self.name, self.proc.pid)
        self.end_group()
        self.proc.wait()

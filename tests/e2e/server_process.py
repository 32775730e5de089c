"""`kestrel serve` as a subprocess on a free loopback port, for the server tests."""
from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(model: str, port: int, *flags: str) -> list[str]:
    return [sys.executable, "-m", "kestrel.cli", "serve", "--model", model, "--device", "cpu", "--dtype", "float32",
            "--port", str(port), *flags]


class ServerProcess:
    """Starts the server and waits for its ready line; `stop()` sends SIGTERM and returns the exit code."""

    def __init__(self, model: str, *flags: str, ready_timeout: float = 120.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(serve_command(model, self.port, *flags), cwd=REPO, stdout=subprocess.PIPE,
                                     stderr=self._log, text=True)
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [lines.put(line) for line in self.proc.stdout], daemon=True).start()
        deadline = time.monotonic() + ready_timeout
        while True:
            try:
                line = lines.get(timeout=0.2)
            except queue.Empty:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.proc.kill()
                    raise RuntimeError(f"server did not start (exit code {self.proc.poll()}):\n{self.log()}")
                continue
            if line.strip() == f"ready on {self.url}":
                return

    def log(self) -> str:
        self._log.seek(0)
        return self._log.read()

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True

"""`kestrel serve` as a subprocess on a free loopback port, and what the server tests read from it."""
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

import httpx
from prometheus_client.parser import text_string_to_metric_families

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


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (Linux /proc)."""
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:  # it exited meanwhile
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry.name))
    return kids


def memory_mib(pid: int) -> dict[str, float]:
    """A process's resident memory now (VmRSS) and at its peak so far (VmHWM), in MiB."""
    with open(f"/proc/{pid}/status") as status:
        fields = dict(line.split(":", 1) for line in status)
    return {name: int(fields[name].split()[0]) / 1024 for name in ("VmRSS", "VmHWM")}


def wait_idle(http: httpx.Client, timeout: float = 30.0) -> dict:
    """Poll until the engine runs nothing and holds no KV (the pool is back to full); return its stats.

    `http` must send the API key if the server has one (/server_info needs it)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = http.get("/server_info").json()["stats"]
        if stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["num_used_tokens"] == 0:
            return stats
        assert time.monotonic() < deadline, f"engine not idle: {stats}"
        time.sleep(0.05)


def metric_samples(http: httpx.Client) -> dict[tuple[str, tuple], float]:
    text = http.get("/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def metric(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)

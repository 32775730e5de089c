"""`kestrel serve --dp-size N`: N replicas, each a whole `kestrel serve` (its own engine process, its own
GPUs), behind the SGLang model gateway with its cache-aware policy, all supervised by this process.

Ports: the gateway serves --port; replica i listens on --port + 1 + i; the gateway's Prometheus metrics
are on --port + N + 1. GPUs: replica i gets GPUs i*tp .. (i+1)*tp - 1 of those visible, through
CUDA_VISIBLE_DEVICES. A replica (or the gateway) that dies after it was ready is started again (the
gateway routes around it meanwhile); one that dies before it is ready, at start or after a restart,
stops everything with exit status 1 (the single server's rule for an engine that cannot be restarted).
SIGTERM or SIGINT stop the gateway and the replicas together: each drains within --shutdown-timeout (the
gateway keeps its listener open 5 s longer, for load balancers in front of it to notice).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
import time
from collections.abc import Sequence

from kestrel import envs
from kestrel.config import EngineConfig
from kestrel.config_resolve import resolve_config
from kestrel.deploy.child import Child
from kestrel.deploy.gateway import gateway_command
from kestrel.deploy.replica_command import replica_command
from kestrel.server.launch import url
from kestrel.server.shutdown import SHUTDOWN_MARGIN_S

logger = logging.getLogger(__name__)
POLL_S = 0.25


def replica_gpus(dp_size: int, tp_size: int, device: str, visible: list[str] | None,
                 device_count: int) -> list[str | None]:
    """Each replica's CUDA_VISIBLE_DEVICES, or None for each on the CPU. `visible`: the parent's
    CUDA_VISIBLE_DEVICES (None: every one of `device_count` GPUs)."""
    if device == "cpu":
        return [None] * dp_size
    if device.startswith("cuda:"):
        raise ValueError(f"--device {device} pins one GPU; with --dp-size {dp_size} give --device cuda (each "
                         "replica gets its own GPUs) and choose the GPUs with CUDA_VISIBLE_DEVICES")
    gpus = visible if visible is not None else [str(i) for i in range(device_count)]
    if not gpus and device == "auto":  # no GPU: every replica on the CPU, as a single server would be
        return [None] * dp_size
    if len(gpus) < dp_size * tp_size:
        raise ValueError(f"--dp-size {dp_size} x --tp-size {tp_size} needs {dp_size * tp_size} GPUs; "
                         f"{len(gpus)} are visible")
    return [",".join(gpus[i * tp_size:(i + 1) * tp_size]) for i in range(dp_size)]


def _loopback(host: str) -> str:
    """Where this machine reaches a server listening on `host` (the unspecified address: loopback)."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)


def _visible_gpu_count(device: str) -> int:
    if device == "cpu" or envs.cuda_visible_devices() is not None:
        return 0  # not needed
    import torch

    return torch.cuda.device_count()


def serve_dp(config: EngineConfig, served_model_names: Sequence[str] = ()) -> int:
    """Run the replicas and the gateway until SIGTERM/SIGINT; returns the exit status. Raises ValueError
    for options that do not fit, GatewayNotFound when smg is not installed (before anything starts)."""
    resolve_config(config)  # bad options fail here, once, not in N replicas
    dp, tp, server = config.parallel.dp_size, config.parallel.tp_size, config.server
    if server.port == 0:
        raise ValueError("--dp-size needs a fixed --port: the replicas listen on the ports after it")
    gpus = replica_gpus(dp, tp, config.device, envs.cuda_visible_devices(), _visible_gpu_count(config.device))
    near = _loopback(server.host)
    # The replicas listen on the loopback only: clients reach them through the gateway, never around it.
    loopback = "::1" if ":" in server.host else "127.0.0.1"
    local = dataclasses.replace(config, server=dataclasses.replace(server, host=loopback))
    replicas = []
    for i, visible in enumerate(gpus):
        port = server.port + 1 + i
        env = dict(os.environ) if visible is None else {**os.environ, "CUDA_VISIBLE_DEVICES": visible}
        replicas.append(Child(f"replica {i}", replica_command(local, served_model_names, port), env,
                              f"{url(loopback, port)}/health"))
    worker_urls = [r.ready_url.removesuffix("/health") for r in replicas]
    gateway = Child("gateway", gateway_command(server.host, server.port, server.port + dp + 1, worker_urls,
                                               log_level=server.log_level, shutdown_timeout=server.shutdown_timeout,
                                               api_key=server.api_key),
                    dict(os.environ), f"{url(near, server.port)}/readiness")
    return DataParallelGroup(replicas, gateway, url(server.host, server.port), server.shutdown_timeout).run()


class DataParallelGroup:
    """Starts the replicas, then the gateway; restarts whichever dies; stops them all on a signal."""

    def __init__(self, replicas: list[Child], gateway: Child, public_url: str, shutdown_timeout: float) -> None:
        self.replicas = replicas
        self.gateway = gateway
        self.public_url = public_url
        self.shutdown_timeout = shutdown_timeout
        self.stopping = threading.Event()

    @property
    def children(self) -> list[Child]:
        return [self.gateway, *self.replicas]

    def run(self) -> int:
        previous = {sig: signal.signal(sig, lambda *_: self.stopping.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            code = self._start()
            if code is None:
                print(f"ready on {self.public_url}", flush=True)
                code = self._supervise()
        finally:
            self._stop()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        logger.info("all replicas and the gateway stopped")
        return code

    def _start(self) -> int | None:
        """Start everything and wait until it is ready: None, or the exit status if something failed or
        a signal came first."""
        for group in (self.replicas, [self.gateway]):
            for child in group:
                child.start()
                logger.info("%s started (pid %d)", child.name, child.pid)
            while not all(child.check_ready() for child in group):
                for child in group:
                    if (status := child.exited()) is not None:
                        logger.error("%s exited with status %d before it was ready; stopping", child.name, status)
                        return 1
                if self.stopping.wait(POLL_S):
                    return 0
        return None

    def _supervise(self) -> int:
        while not self.stopping.wait(POLL_S):
            for child in self.children:
                status = child.exited()
                if status is None:
                    child.check_ready()
                    continue
                if not child.ready:
                    logger.error("%s exited with status %d again before it was ready; stopping", child.name, status)
                    return 1
                logger.warning("%s (pid %d) exited with status %d; starting it again", child.name, child.pid, status)
                child.end_group()
                child.start()
        return 0

    def _stop(self) -> None:
        for child in self.children:
            child.terminate()
        deadline = time.monotonic() + self.shutdown_timeout + SHUTDOWN_MARGIN_S
        for child in self.children:
            child.wait(deadline)

"""The gateway in front of data-parallel replicas: the SGLang model gateway (PyPI `smg`), its command line.

It routes each request by its cache-aware policy: to the replica whose requests shared the longest
prefix with it (a tree of the request texts it sent each one), unless that replica's load is well above
the others'; it probes the replicas' /health, retries a request on another replica when one fails, and
reads their load from /v1/loads (kestrel.server.gateway_api). Its own Prometheus metrics (the workers it
routes to, requests per worker) are served on a port of their own.
"""
from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence

GATEWAY_PACKAGE = "smg"
INSTALL_HINT = "pip install 'kestrel[gateway]' (the SGLang model gateway, PyPI package smg)"
# smg probes every worker this often; a dead replica is also dropped at once when a request to it fails.
HEALTH_CHECK_INTERVAL_S = 5
SMG_LOG_LEVELS = {"debug": "debug", "info": "info", "warning": "warn", "error": "error"}


class GatewayNotFound(RuntimeError):
    """The gateway package is not installed."""


def gateway_command(host: str, port: int, metrics_port: int, worker_urls: Sequence[str], *, log_level: str,
                    shutdown_timeout: float, api_key: str | None) -> list[str]:
    """`python -m smg launch ...` serving on host:port, its metrics on host:metrics_port, routing with the
    cache-aware policy over `worker_urls`. Raises GatewayNotFound, saying how to install it."""
    if importlib.util.find_spec(GATEWAY_PACKAGE) is None:
        raise GatewayNotFound(f"--dp-size puts the replicas behind the SGLang model gateway, which is not "
                              f"installed: {INSTALL_HINT}")
    command = [sys.executable, "-m", GATEWAY_PACKAGE, "launch", "--host", host, "--port", str(port),
               "--worker-urls", *worker_urls, "--policy", "cache_aware",
               "--prometheus-host", host, "--prometheus-port", str(metrics_port),
               "--health-check-interval-secs", str(HEALTH_CHECK_INTERVAL_S),
               "--shutdown-grace-period-secs", str(max(1, round(shutdown_timeout))),
               "--log-level", SMG_LOG_LEVELS.get(log_level.lower(), "info")]
    if api_key:
        command += ["--api-key", api_key]  # what smg sends the replicas
    return command

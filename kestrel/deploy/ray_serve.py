"""Kestrel replicas under Ray Serve: each Ray Serve replica runs one `kestrel serve` process (on the GPUs
Ray gives the replica's actor, through the CUDA_VISIBLE_DEVICES Ray sets) and passes every HTTP request to
it, streams included, so clients speak kestrel's whole API (OpenAI, Anthropic, native) through Ray's proxy.
Ray Serve scales the replicas, routes among them and restarts one whose health check fails.

    serve run kestrel.deploy.ray_serve:build model=PATH num_replicas=2 num_gpus=1 tp_size=1

Every other key=value is a `kestrel serve` flag (page_size=16, device=cpu, ...). Ray Serve LLM's own
OpenAI ingress takes its engine through Ray's internal LLMEngine protocol, configured by vLLM's options,
so this adapter stands in its place instead (docs/deployment.md).
"""
from __future__ import annotations

import dataclasses
import signal
import subprocess
import time
import httpx
from ray import serve
from ray.serve import Application
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from kestrel.config import EngineConfig
from kestrel.deploy.replica_command import replica_command
from kestrel.server.launch import bind

START_TIMEOUT_S = 1800.0  # a large checkpoint loads for minutes
_HOP_HEADERS = {"host", "content-length", "connection", "transfer-encoding"}


class KestrelReplica:
    """One `kestrel serve` on a free loopback port, its requests forwarded."""

    def __init__(self, config: EngineConfig, served_model_names: list[str] | None = None) -> None:
        sock = bind("127.0.0.1", 0)  # a free port, released for the server to take
        port = sock.getsockname()[1]
        sock.close()
        config = dataclasses.replace(config, server=dataclasses.replace(config.server, host="127.0.0.1"))
        self.proc = subprocess.Popen(replica_command(config, served_model_names or (), port))
        self.url = f"http://127.0.0.1:{port}"
        self.http = httpx.AsyncClient(base_url=self.url, timeout=None)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._healthy_now():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"kestrel serve did not start (exit status {self.proc.poll()}); see its log")
            time.sleep(0.5)

    def _healthy_now(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    async def __call__(self, request: Request) -> Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        upstream = self.http.build_request(request.method, request.url.path, params=request.query_params,
                                           headers=headers, content=await request.body())
        answer = await self.http.send(upstream, stream=True)
        headers = {k: v for k, v in answer.headers.items() if k.lower() not in _HOP_HEADERS}
        return StreamingResponse(answer.aiter_raw(), status_code=answer.status_code, headers=headers,
                                 background=_closing(answer))

    async def check_health(self) -> None:
        """Ray Serve's probe: a dead or unhealthy server (503: its engine is down or restarting) fails it,
        and Ray Serve replaces the replica."""
        if self.proc.poll() is not None:
            raise RuntimeError(f"kestrel serve exited with status {self.proc.returncode}")
        answer = await self.http.get("/health", timeout=10.0)
        if answer.status_code != 200:
            raise RuntimeError(f"kestrel serve /health answered {answer.status_code}")

    def __del__(self) -> None:
        if getattr(self, "proc", None) is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def _closing(answer: httpx.Response):
    from starlette.background import BackgroundTask

    return BackgroundTask(answer.aclose)


def deployment(config: EngineConfig, *, num_replicas: int = 1, num_gpus: float = 1.0,
               served_model_names: list[str] | None = None) -> Application:
    """The Ray Serve application: `num_replicas` kestrel servers, each given `num_gpus` GPUs (set it to
    --tp-size; 0 on the CPU)."""
    replica = serve.deployment(KestrelReplica, name="kestrel", num_replicas=num_replicas,
                               ray_actor_options={"num_gpus": num_gpus}, health_check_period_s=10)
    return replica.bind(config, served_model_names)


def build(args: dict[str, str]) -> Application:
    """`serve run kestrel.deploy.ray_serve:build key=value ...` (see the module docstring): the keys other
    than num_replicas and num_gpus are `kestrel serve` flags (true for a switch)."""
    from kestrel.cli import build_parser, config_from_args

    args = dict(args)
    num_replicas = int(args.pop("num_replicas", 1))
    num_gpus = float(args.pop("num_gpus", 1))
    argv = ["serve"]
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        argv += [flag] if value.lower() == "true" else [flag, *value.split(",")]
    parsed = build_parser().parse_args(argv)
    return deployment(config_from_args(parsed), num_replicas=num_replicas, num_gpus=num_gpus,
                      served_model_names=parsed.served_model_name)

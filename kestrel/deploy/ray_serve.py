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
import os
import time

import httpx
from ray import serve
from ray.serve import Application
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from kestrel.config import EngineConfig, cli_flag
from kestrel.deploy.child import Child
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
        self.url = f"http://127.0.0.1:{port}"
        # Its own session and SIGTERM when this actor's process dies, however it dies (Ray kills actors
        # without running finalizers): no server is left holding the GPU.
        self.server = Child("kestrel serve", replica_command(config, served_model_names or (), port),
                            dict(os.environ), f"{self.url}/health")
        self.server.start()
        self.http = httpx.AsyncClient(base_url=self.url, timeout=None)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.server.check_ready():
            if self.server.exited() is not None or time.monotonic() > deadline:
                self.server.terminate()
                raise RuntimeError(f"kestrel serve did not start (exit status {self.server.exited()}); see its log")
            time.sleep(0.5)

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
        if (status := self.server.exited()) is not None:
            raise RuntimeError(f"kestrel serve exited with status {status}")
        answer = await self.http.get("/health", timeout=10.0)
        if answer.status_code != 200:
            raise RuntimeError(f"kestrel serve /health answered {answer.status_code}")

    def __del__(self) -> None:
        if getattr(self, "server", None) is not None:
            self.server.terminate()
            self.server.wait(time.monotonic() + 60)


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
    # Only the options of several values take a comma-separated list; any other value is one argument
    # (a JSON --kv-events-config, --score-tokens yes,no).
    several = {"served_model_name"} | {name for name, (_, field) in EngineConfig.options().items()
                                       if str(field.type).startswith(("tuple", "list"))}
    argv = ["serve"]
    for key, value in args.items():
        flag = cli_flag(key)
        if value.lower() == "true":
            argv.append(flag)
        else:
            argv += [flag, *(value.split(",") if key in several else [value])]
    parsed = build_parser().parse_args(argv)
    return deployment(config_from_args(parsed), num_replicas=num_replicas, num_gpus=num_gpus,
                      served_model_names=parsed.served_model_name)

"""`kestrel serve --dp-size 2` on the CPU: two replicas of a tiny model behind the real SGLang model gateway
(PyPI smg, from the [gateway] extra). Requests that share a long prefix land on the replica holding it
(seen in each replica's prefix-cache counters); a killed replica is routed around and started again; the
gateway's metrics name both replicas; SIGTERM stops everything."""
from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from tests.e2e.server_process import ServerProcess, children, metric, metric_samples, pid_exists

pytest.importorskip("smg", reason="the gateway: pip install 'kestrel[gateway]'")

# Two distinct long prefixes (about 180 tokens each for the tiny tokenizer); the gateway matches request texts.
PREFIXES = [" ".join(f"alpha{i % 7} beta{i % 5}" for i in range(18)), " ".join(f"gamma{i % 3} delta{i % 11}"
                                                                               for i in range(18))]


@pytest.fixture(scope="module")
def group(tiny_model):
    server = ServerProcess(tiny_model("llama"), "--dp-size", "2", "--cpu-threads", "1", "--shutdown-timeout", "10",
                           "--served-model-name", "tiny")
    port = server.port
    replicas = [httpx.Client(base_url=f"http://127.0.0.1:{port + 1 + i}", timeout=30) for i in range(2)]
    yield server, replicas, httpx.Client(base_url=server.url, timeout=60), f"http://127.0.0.1:{port + 3}"
    server.stop()


def _served(replicas) -> list[tuple[float, float]]:
    """(prompt tokens, cached prompt tokens) each replica has served."""
    samples = [metric_samples(r) for r in replicas]
    return [(sum(v for (n, _), v in s.items() if n == "kestrel:prompt_tokens_total"),
             sum(v for (n, _), v in s.items() if n == "kestrel:cached_tokens_total")) for s in samples]


def _complete(gateway: httpx.Client, prompt: str) -> None:
    r = gateway.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text


def test_shared_prefix_lands_on_the_replica_holding_it(group):
    _, replicas, gateway, metrics_url = group
    for prefix in PREFIXES:
        _complete(gateway, prefix + " first")  # the replica that gets it now holds the prefix
        before = _served(replicas)
        for i in range(3):
            _complete(gateway, f"{prefix} question {i}")
        after = _served(replicas)
        prompt = [a[0] - b[0] for a, b in zip(after, before)]
        cached = [a[1] - b[1] for a, b in zip(after, before)]
        holder = max(range(2), key=lambda i: prompt[i])
        assert prompt[1 - holder] == 0, f"requests sharing a prefix were spread: prompt tokens {prompt}"
        assert cached[holder] >= 0.8 * prompt[holder], f"the prefix was not reused: {cached} of {prompt}"
    text = httpx.get(f"{metrics_url}/metrics").text
    for replica in replicas:
        assert f'worker="{replica.base_url}"'.replace("/\"", "\"") in text.replace("/\"", "\"")


def test_killed_replica_is_routed_around_and_restarted(group):
    server, replicas, gateway, _ = group
    engine_pid = replicas[1].get("/server_info").json()["engine_pid"]
    replica_pid = next(pid for pid in children(server.proc.pid) if engine_pid in children(pid))
    os.kill(replica_pid, signal.SIGKILL)
    for i in range(4):
        _complete(gateway, f"after the kill {i}")
    deadline = time.monotonic() + 40
    while True:  # a new replica on the same port, with a new engine process
        try:
            info = replicas[1].get("/server_info").json()
            if info["engine_pid"] != engine_pid and replicas[1].get("/health").status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"replica 1 was not restarted:\n{server.log()[-3000:]}"
        time.sleep(0.2)
    assert not pid_exists(engine_pid)
    while gateway.get("/readiness").json().get("healthy_workers") != 2:  # the gateway probes every 5 s
        assert time.monotonic() < deadline + 15, gateway.get("/readiness").text
        time.sleep(0.2)
    workers = gateway.get("/workers").json()["workers"]
    assert sorted(w["url"] for w in workers) == sorted(str(r.base_url).rstrip("/") for r in replicas)
    _complete(gateway, "the group serves again")


def test_sigterm_stops_the_replicas_and_the_gateway(group):
    server = group[0]
    kids = children(server.proc.pid)
    assert len(kids) == 3  # two replicas and the gateway
    started = time.monotonic()
    assert server.stop(timeout=30) == 0
    assert time.monotonic() - started < 10 + 10  # --shutdown-timeout and the gateway's 5 s settle window
    assert not any(pid_exists(pid) for pid in kids)

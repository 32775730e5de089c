"""Overload and shutdown of a live `kestrel serve`: 503 with Retry-After past --max-queued-requests;
SIGTERM stops admitting, lets short streams finish, aborts the rest cleanly, exits 0 within
--shutdown-timeout + SHUTDOWN_MARGIN_S (within IDLE_EXIT_S when idle).

Nothing here waits a fixed time for the server to get somewhere: the tests wait for its log lines,
its answers and its exit, so that a slow, loaded machine only makes them slower."""
from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from kestrel.server.shutdown import SHUTDOWN_MARGIN_S
from tests.e2e.server_process import ServerProcess, children, pid_exists, wait_idle

LONG = 8000  # tokens: many seconds of decoding for the tiny model, so a stream is still running when asked
# Half the 3 s the README promises for an idle server: measured 0.2-0.3 s on 2 busy cores, and 2-6 s
# while every process still unloaded its modules at exit.
IDLE_EXIT_S = 1.5


@pytest.fixture(scope="module")
def model(tiny_model) -> str:
    return tiny_model("llama", max_position_embeddings=LONG + 192)


class Stream(threading.Thread):
    """A streamed completion read in the background: its data events, its HTTP status, its headers."""

    def __init__(self, url: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, {**body, "stream": True}
        self.status: int | None = None
        self.events: list[str] = []
        self.first = threading.Event()
        self.stop = threading.Event()  # set: disconnect

    def run(self) -> None:
        with httpx.Client(timeout=120) as c, c.stream("POST", self.url + "/v1/completions", json=self.body) as r:
            self.status = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    self.events.append(line[len("data: "):])
                    self.first.set()
                if self.stop.is_set():
                    break
        self.first.set()

    def finish_reasons(self) -> list[str | None]:
        return [json.loads(e)["choices"][0]["finish_reason"] for e in self.events[:-1]
                if json.loads(e).get("choices")]


def long_stream(url: str, i: int) -> Stream:
    return Stream(url, {"prompt": f"story {i}", "max_tokens": LONG, "temperature": 0, "ignore_eos": True})


def wait_for_log(srv: ServerProcess, text: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in srv.log():
        assert time.monotonic() < deadline, f"{text!r} never logged:\n{srv.log()}"
        time.sleep(0.05)


def wait_for_requests(http: httpx.Client, count: int, timeout: float = 60.0) -> None:
    """Until the server holds `count` requests (admitted, in the engine or being tokenized)."""
    deadline = time.monotonic() + timeout
    while http.get("/server_info").json()["admission"]["requests"] < count:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_past_max_queued_requests_a_request_gets_503_with_retry_after(model):
    srv = ServerProcess(model, "--max-running-requests", "2", "--max-queued-requests", "1")
    streams = [long_stream(srv.url, i) for i in range(3)]  # 2 running + 1 queued: full
    try:
        for s in streams:
            s.start()
        with httpx.Client(base_url=srv.url, timeout=30) as http:
            deadline = time.monotonic() + 60
            while http.get("/server_info").json()["admission"]["engine_requests"] < 3:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            r = http.post("/v1/completions", json={"prompt": "one more", "max_tokens": 2})
            assert r.status_code == 503 and r.headers["Retry-After"] == "1", r.text
            assert r.json()["error"]["code"] == "server_overloaded"
            assert "--max-queued-requests" in r.json()["error"]["message"]
            assert http.get("/health").status_code == 200  # overloaded is not unhealthy
            r = http.post("/v1/completions", json={"prompt": "many", "n": 4, "max_tokens": 2})  # never fits
            assert r.status_code == 400 and r.json()["error"]["param"] == "n"
            for s in streams:
                s.stop.set()
            for s in streams:
                s.join(30)
            wait_idle(http)
            assert http.get("/server_info").json()["admission"]["engine_requests"] == 0
            r = http.post("/v1/completions", json={"prompt": "room again", "max_tokens": 2, "n": 3})
            assert r.status_code == 200 and len(r.json()["choices"]) == 3
            wait_idle(http)
        start = time.monotonic()  # idle now: SIGTERM ends it at once
        assert srv.stop() == 0, srv.log()
        assert time.monotonic() - start < IDLE_EXIT_S, srv.log()
    finally:
        for s in streams:
            s.stop.set()
        srv.stop()


def test_sigterm_drains_then_aborts_every_stream_cleanly_and_exits_within_its_bound(model):
    shutdown_timeout = 5
    srv = ServerProcess(model, "--shutdown-timeout", str(shutdown_timeout))
    with httpx.Client(base_url=srv.url, timeout=30) as http:
        engine_pid = http.get("/server_info").json()["engine_pid"]
    long = [long_stream(srv.url, i) for i in range(3)]
    # Finishes well within the timeout: 8 steps, under 0.1 s each even on 2 loaded cores.
    short = Stream(srv.url, {"prompt": "short", "max_tokens": 8, "ignore_eos": True})
    whole: dict = {}

    def non_streaming() -> None:
        with httpx.Client(timeout=120) as c:
            whole["r"] = c.post(srv.url + "/v1/completions",
                                json={"prompt": "whole", "max_tokens": LONG, "ignore_eos": True})

    try:
        waiter = threading.Thread(target=non_streaming, daemon=True)
        for s in long:
            s.start()
            assert s.first.wait(60)
        waiter.start()
        with httpx.Client(base_url=srv.url, timeout=30) as http:
            wait_for_requests(http, len(long) + 1)
        short.start()  # last, so that it is still running at the signal
        assert short.first.wait(60)
        start = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        wait_for_log(srv, "shutting down: waiting up to")
        with httpx.Client(base_url=srv.url, timeout=30) as http:  # still listening, no longer admitting
            r = http.post("/v1/completions", json={"prompt": "too late", "max_tokens": 2})
            assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutting_down"
            assert http.get("/health").status_code == 503 and http.get("/ping").status_code == 503
        for s in [*long, short]:
            s.join(60)
        waiter.join(60)
        assert srv.proc.wait(60) == 0
        elapsed = time.monotonic() - start
        # Waited --shutdown-timeout for the long streams (they need far longer), then ended within the
        # promised margin (measured: about 1 s past the timeout on 2 loaded cores).
        assert shutdown_timeout <= elapsed < shutdown_timeout + SHUTDOWN_MARGIN_S, (elapsed, srv.log())
    finally:
        if srv.proc.poll() is None:  # a failed check above: leave no server behind
            srv.proc.kill()
    assert short.events[-1] == "[DONE]" and short.finish_reasons()[-1] == "length"
    for s in long:  # still running at the timeout: a final chunk saying abort, then [DONE]
        assert s.events[-1] == "[DONE]", s.events[-3:]
        reasons = s.finish_reasons()
        assert reasons[-1] == "abort" and reasons.count("abort") == 1 and set(reasons[:-1]) == {None}
    choice = whole["r"].json()["choices"][0]
    assert whole["r"].status_code == 200 and choice["finish_reason"] == "abort" and choice["text"]
    log = srv.log()
    assert "Traceback" not in log and "ERROR" not in log, log
    assert not pid_exists(engine_pid)


def test_a_killed_server_leaves_no_process_behind(model):
    """SIGKILL (or the out-of-memory killer) gives the HTTP process no chance to shut anything down:
    its engine process and tokenizer workers must notice on their own and exit."""
    srv = ServerProcess(model)
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as http:  # a long prompt: the tokenizer workers work
            assert http.post("/v1/completions", json={"prompt": "word " * 3500, "max_tokens": 2}).status_code == 200
        kids = children(srv.proc.pid)
        assert len(kids) >= 3, kids  # the engine process, two tokenizer workers (and multiprocessing's tracker)
    finally:
        srv.proc.kill()
        srv.proc.wait()
    deadline = time.monotonic() + 30
    while alive := [pid for pid in kids if pid_exists(pid)]:
        assert time.monotonic() < deadline, f"still running after the server was killed: {alive}"
        time.sleep(0.1)

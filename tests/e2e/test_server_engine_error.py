"""A request the engine finished with finish_reason "error" (a failed step) is a 500-class error for the
client: an OpenAI-style 500 body, or, streaming, an error event and then [DONE].

The engine side is a fake speaking the real IPC messages over real pipes, so the HTTP process's code
(dispatcher, generation, responses) runs as in `kestrel serve` while no engine code is involved.
"""
from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import threading

import httpx

from kestrel.server.admission import AdmissionControl
from kestrel.server.app import build_app
from kestrel.server.engine_client import EngineClient
from kestrel.server.messages import (AbortRequests, AddRequests, Admission, EngineReady, Shutdown, StepOutput,
                                     TokenDelta)
from kestrel.server.metrics import ServerMetrics
from kestrel.server.state import ServerState

FAILURE = "RuntimeError: CUDA error: an illegal memory access was encountered (injected by the test)"


class _FakeProcess:
    """What EngineClient needs of its engine process, played by the fake engine's thread."""

    pid, exitcode = 4242, None

    def __init__(self, thread: threading.Thread) -> None:
        self.thread = thread

    def is_alive(self) -> bool:
        return self.thread.is_alive()

    def join(self, timeout: float | None = None) -> None:
        self.thread.join(timeout)


def _failing_engine(inbox, outbox) -> None:
    """Admits every request, gives each one token, then fails its step: finish_reason "error"."""
    while not isinstance(msg := inbox.recv(), Shutdown):
        if isinstance(msg, AddRequests):
            outbox.send(Admission(msg.group))
            outbox.send(StepOutput([TokenDelta(r.rid, [7], prompt_tokens=len(r.prompt_ids)) for r in msg.reqs]))
            outbox.send(StepOutput([TokenDelta(r.rid, [], finished=True, finish_reason="error", error=FAILURE)
                                    for r in msg.reqs]))
        else:
            assert isinstance(msg, AbortRequests), msg


async def _exchange() -> tuple[httpx.Response, httpx.Response, bytes]:
    inbox_r, inbox_w = mp.Pipe(duplex=False)
    outbox_r, outbox_w = mp.Pipe(duplex=False)
    engine = threading.Thread(target=_failing_engine, args=(inbox_r, outbox_w), daemon=True)
    engine.start()
    metrics = ServerMetrics("fake")
    info = EngineReady(pid=4242, vocab_size=100, max_req_len=64, max_total_tokens=1000, context_length=64)
    client = EngineClient(_FakeProcess(engine), inbox_w, outbox_r, info, metrics)
    state = ServerState(client, None, "fake", "/nowhere", metrics, AdmissionControl(8))
    client.start()
    try:
        transport = httpx.ASGITransport(app=build_app(state, 2**20, 30.0))
        async with httpx.AsyncClient(transport=transport, base_url="http://kestrel") as http:
            body = {"prompt": [1, 2, 3], "max_tokens": 5}
            whole = await http.post("/v1/completions", json=body)
            streamed = await http.post("/v1/completions", json={**body, "stream": True})
            return whole, streamed, metrics.render()
    finally:
        await client.shutdown(timeout=5)  # sends Shutdown: the fake engine's thread ends


def test_a_failed_engine_step_is_a_500_or_an_error_event_then_done():
    whole, streamed, metrics = asyncio.run(_exchange())
    assert whole.status_code == 500, whole.text
    error = whole.json()["error"]
    assert error["code"] == "engine_error" and error["type"] == "internal_server_error"
    assert FAILURE in error["message"]

    assert streamed.status_code == 200  # the stream had started; its end says what happened
    events = [line[len("data: "):] for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "engine_error" and FAILURE in error["message"]
    assert all("choices" in json.loads(e) and json.loads(e)["choices"][0]["finish_reason"] is None
               for e in events[:-2])  # no chunk claims the choice ended normally
    assert b'kestrel:num_requests_total{finish_reason="error",model_name="fake"} 2.0' in metrics

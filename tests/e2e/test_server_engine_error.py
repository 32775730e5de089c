"""A request the engine finished with finish_reason "error" (a failed step) is a 500-class error for the
client: an OpenAI-style 500 body, or, streaming, an error event and then [DONE].

The engine side is a fake speaking the real IPC messages over real pipes (`fake_engine_app`), so the
HTTP process's code (dispatcher, generation, responses) runs as in `kestrel serve` while no engine code
is involved.
"""
from __future__ import annotations

import asyncio
import json

import httpx

from kestrel.server.messages import AbortRequests, AddRequests, Admission, Shutdown, StepOutput, TokenDelta
from tests.e2e.conftest import fake_engine_app

FAILURE = "RuntimeError: CUDA error: an illegal memory access was encountered (injected by the test)"


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
    async with fake_engine_app(_failing_engine) as (client, http):
        body = {"prompt": [1, 2, 3], "max_tokens": 5}
        whole = await http.post("/v1/completions", json=body)
        streamed = await http.post("/v1/completions", json={**body, "stream": True})
        return whole, streamed, client.metrics.render()

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

"""What one request cannot do to the HTTP process's shared machinery, and what happens if that
machinery fails anyway: a request that cannot be handed to the engine fails alone; a dead sender
thread or dispatcher task is an engine death (503s, /health 503, the supervisor called), never a
server that hangs every request behind a green /health.

The engine side is a fake speaking the real IPC messages over real pipes (`fake_engine_app`), so the
faults are injected where they would happen.
"""
from __future__ import annotations

import asyncio

import httpx
import pytest

from kestrel.core.sampling_params import SamplingParams
from kestrel.server.engine_client import EngineClient
from kestrel.server.errors import APIError
from kestrel.server.messages import (AbortRequests, AddRequests, Admission, NewRequest, Shutdown, StepOutput,
                                     TokenDelta)
from tests.e2e.conftest import fake_engine_app

TIMEOUT_S = 20  # a request the old code left hanging forever fails the test after this


def _echo_engine(inbox, outbox) -> None:
    """Admits every request and finishes it with one token."""
    while True:
        try:
            msg = inbox.recv()
        except EOFError:  # the client closed its end: what a real engine process exits on too
            return
        if isinstance(msg, Shutdown):
            return
        if isinstance(msg, AddRequests):
            outbox.send(Admission(msg.group))
            outbox.send(StepOutput([TokenDelta(r.rid, [7], finished=True, finish_reason="length",
                                               prompt_tokens=len(r.prompt_ids)) for r in msg.reqs]))
        else:
            assert isinstance(msg, AbortRequests), msg


class _TooDeep:
    """Pickles as a schema nested past the recursion limit did."""

    def __reduce__(self):
        raise RecursionError("maximum recursion depth exceeded while pickling an object")


class _Killed(BaseException):
    """A failure no `except Exception` catches: the sender thread dies of it."""


class _DyingPipe:
    """The client's end of the engine's inbox, failing on the next send."""

    def __init__(self, conn) -> None:
        self._conn = conn

    def send(self, _msg) -> None:
        raise _Killed("injected by the test")

    send_bytes = send

    def __getattr__(self, name):
        return getattr(self._conn, name)


async def _with_server(scenario) -> None:
    async with fake_engine_app(_echo_engine) as (client, http):
        deaths: list[str] = []
        client.on_dead = lambda: deaths.append(client.dead_reason)  # what the EngineSupervisor hooks
        await asyncio.wait_for(scenario(client, http, deaths), TIMEOUT_S)

async def _complete(http: httpx.AsyncClient) -> httpx.Response:
    return await http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1})


def test_a_request_that_cannot_be_handed_to_the_engine_fails_alone():
    async def scenario(client, http, deaths):
        unsendable = NewRequest(client.new_rid(), [1, 2, 3], SamplingParams(json_schema={"deep": _TooDeep()}))
        with pytest.raises(APIError) as failed:
            await client.submit([unsendable], 0.0)
        assert failed.value.status == 500 and "RecursionError" in failed.value.message
        for _ in range(3):  # the sender still sends: later requests are served
            r = await _complete(http)
            assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text
        assert (await http.get("/health")).status_code == 200
        assert (await http.head("/health")).status_code == 200  # probes that send HEAD
        assert deaths == [] and client.alive

    asyncio.run(_with_server(scenario))


def _kill_sender(client: EngineClient) -> None:
    client._inbox = _DyingPipe(client._inbox)


def _kill_dispatcher(client: EngineClient) -> None:
    def broken(msg) -> None:
        raise RuntimeError("injected by the test")

    client._dispatch = broken


@pytest.mark.parametrize("inject", [_kill_sender, _kill_dispatcher], ids=["sender thread", "dispatcher task"])
def test_a_dead_internal_thread_or_task_turns_health_to_503_and_calls_the_supervisor(inject):
    async def scenario(client, http, deaths):
        assert (await _complete(http)).status_code == 200
        inject(client)
        r = await _complete(http)  # its message kills the sender, or its Admission the dispatcher
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead", r.text
        assert "injected by the test" in r.json()["error"]["message"]
        health = await http.get("/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
        assert (await http.head("/health")).status_code == 503
        assert (await _complete(http)).status_code == 503  # until the supervisor's new engine takes over
        assert len(deaths) == 1 and "injected by the test" in deaths[0]
        assert b'kestrel:engine_alive{model_name="fake"} 0.0' in client.metrics.render()

    asyncio.run(_with_server(scenario))

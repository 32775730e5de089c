"""The server under speculative decoding (the bundled demo, with its EAGLE head and with NGRAM): requests
that finish in their first rounds (max_tokens 1..6, an early stop string), all in flight together, get
200s with plain greedy's text, and every stream ends with a finish chunk and [DONE]."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from kestrel import Engine, SamplingParams
from tests.e2e.server_process import ServerProcess, wait_idle

PROMPT = "def fibonacci(n):"
MAX_TOKENS = range(1, 7)
FLAGS = {"EAGLE": ("--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", "demo-eagle"),
         "NGRAM": ("--speculative-algorithm", "NGRAM")}


@pytest.fixture(scope="module")
def plain() -> list[str]:
    """The oracle: plain greedy text of PROMPT, for each max_tokens."""
    with Engine(model="demo", device="cpu", dtype="float32") as engine:
        params = [SamplingParams(max_new_tokens=n, temperature=0.0) for n in MAX_TOKENS]
        return [o.text for o in engine.generate([PROMPT] * len(params), params, use_tqdm=False)]


def completion(http: httpx.Client, body: dict) -> httpx.Response:
    return http.post("/v1/completions", json={"prompt": PROMPT, "temperature": 0, **body})


def streamed_chat(http: httpx.Client, max_tokens: int) -> tuple[int, list[str]]:
    body = {"messages": [{"role": "user", "content": "Write a Python function."}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        return response.status_code, [line[6:] for line in response.iter_lines() if line.startswith("data: ")]


@pytest.mark.parametrize("algorithm", list(FLAGS))
def test_requests_that_finish_in_their_first_rounds(algorithm, plain):
    server = ServerProcess("demo", *FLAGS[algorithm])
    try:
        with httpx.Client(base_url=server.url, timeout=120) as http, ThreadPoolExecutor(16) as pool:
            completions = [pool.submit(completion, http, {"max_tokens": n}) for n in MAX_TOKENS]
            stopped = pool.submit(completion, http, {"max_tokens": 32, "stop": ['"""', "\n"]})
            chats = [pool.submit(streamed_chat, http, n) for n in MAX_TOKENS]
            for n, future in zip(MAX_TOKENS, completions):
                response = future.result()
                assert response.status_code == 200, response.text
                choice = response.json()["choices"][0]
                assert (choice["text"], choice["finish_reason"]) == (plain[n - 1], "length")
            response = stopped.result()
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")
            for n, future in zip(MAX_TOKENS, chats):
                status, events = future.result()
                assert status == 200 and events[-1] == "[DONE]", events
                chunks = [json.loads(e) for e in events[:-1]]
                assert all("error" not in c for c in chunks), chunks
                assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
            wait_idle(http)  # every request's KV came back
            assert http.get("/health").status_code == 200
    finally:
        server.stop()
    # "the HTTP process is gone" is how a stopped server's engine says goodbye; a crash says otherwise
    log = server.log()
    assert "the engine loop failed" not in log and "Traceback" not in log, log

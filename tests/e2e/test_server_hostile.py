"""Hostile and oversized input against a live `kestrel serve`: every one a 4xx naming the field, the
event loop never blocked, the HTTP process's memory bounded, the connection reusable; stalled
connections closed."""
from __future__ import annotations

from http.client import HTTPConnection
import itertools
import json
import socket
import threading
import time

import httpx
import pytest

from kestrel.server.request_limits import MAX_GRAMMAR_BYTES, MAX_NESTING
from tests.e2e.server_process import ServerProcess, children, memory_mib, wait_idle

KEY = "sk-hostile"
AUTH = {"Authorization": f"Bearer {KEY}"}
CONTEXT = 1024
LIMIT = 4 * 2**20  # the default --max-request-bytes
READ_TIMEOUT = 3  # --request-read-timeout, seconds


@pytest.fixture(scope="module")
def server(tiny_model):
    srv = ServerProcess(tiny_model("llama", max_position_embeddings=CONTEXT), "--api-key", KEY,
                        "--tool-call-parser", "hermes", "--request-read-timeout", str(READ_TIMEOUT))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as c:
        yield c


def raw_json(body: object) -> bytes:
    # ensure_ascii spells a lone surrogate as the JSON escape "\\ud800", which is valid JSON.
    return json.dumps(body, ensure_ascii=True).encode()


class KeepAlive:
    """One HTTP/1.1 connection, kept: a request after a reset one fails instead of reconnecting."""

    def __init__(self, server: ServerProcess) -> None:
        self.conn = HTTPConnection("127.0.0.1", server.port, timeout=60)
        self.conn.connect()
        self.sock = self.conn.sock

    def post(self, path: str, body: bytes) -> tuple[int, dict]:
        self.conn.request("POST", path, body=body, headers={**AUTH, "Content-Type": "application/json"})
        response = self.conn.getresponse()
        payload = json.loads(response.read())
        assert self.conn.sock is self.sock, "the server closed the connection"
        return response.status, payload

    def close(self) -> None:
        self.conn.close()


# ---- size ---------------------------------------------------------------------------------------
def test_a_body_over_the_limit_gets_413_before_it_is_read(server, http):
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        # Only the headers: the server must answer without waiting for the 50 MB it announces.
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                  f"Content-Type: application/json\r\nContent-Length: {50 * 2**20}\r\n\r\n".encode())
        answer = b""
        while b"--max-request-bytes" not in answer and (chunk := s.recv(65536)):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 413"), answer
    assert b"--max-request-bytes" in answer and str(LIMIT).encode() in answer

    big = raw_json({"prompt": "x" * (LIMIT + 10)})
    r = http.post("/v1/completions", content=big, headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: counted as it arrives
        for _ in range(LIMIT // 2**16 + 2):
            yield b" " * 2**16

    r = http.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert http.get("/health").status_code == 200


def test_a_huge_prompt_never_stalls_health_or_other_requests_and_memory_comes_back(server, http):
    """Just under the body limit, a prompt far longer than the context: tokenizing it takes seconds.
    Meanwhile /health answers within ~100 ms, a short completion goes through, the HTTP process
    neither holds the tokenizer's memory nor keeps what it needed, and the tokenizer worker that
    encoded it gives that memory back."""
    http.post("/v1/completions", json={"prompt": "warm up", "max_tokens": 1})
    before = memory_mib(server.proc.pid)
    workers = tokenizer_workers(server, http)
    workers_before = {pid: memory_mib(pid)["VmRSS"] for pid in workers}
    body = raw_json({"prompt": ("hello world " * (LIMIT // 12))[:LIMIT - 100], "max_tokens": 4})
    assert LIMIT - 200 < len(body) <= LIMIT
    result: dict = {}

    def send() -> None:
        with httpx.Client(base_url=server.url, headers=AUTH, timeout=300) as c:
            result["response"] = c.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})

    sender = threading.Thread(target=send)
    sender.start()
    health, short = [], []
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as probe:
        while sender.is_alive():
            start = time.perf_counter()
            assert probe.get("/health").status_code == 200
            health.append(time.perf_counter() - start)
            if len(health) % 20 == 5:
                start = time.perf_counter()
                r = probe.post("/v1/completions", json={"prompt": "meanwhile", "max_tokens": 4, "ignore_eos": True})
                assert r.json()["usage"]["completion_tokens"] == 4
                short.append(time.perf_counter() - start)
            time.sleep(0.02)
    sender.join()
    after = memory_mib(server.proc.pid)
    health.sort()
    assert health[len(health) // 2] < 0.05 and health[-1] < 0.2, health  # ~100 ms, with room for a busy CI box
    assert len(health) >= 10, "the huge prompt should take a while to tokenize"
    assert short and max(short) < 2.0, short
    assert after["VmHWM"] - before["VmHWM"] < 150, (before, after)  # inline: +500 MB for this prompt
    assert after["VmRSS"] - before["VmRSS"] < 64, (before, after)
    workers_after = {pid: memory_mib(pid)["VmRSS"] for pid in workers}
    # Without giving it back, the worker that encoded the prompt kept about +300 MB.
    assert all(workers_after[pid] - workers_before[pid] < 100 for pid in workers), (workers_before, workers_after)
    r = result["response"]
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert f"maximum context length is {CONTEXT} tokens" in r.json()["error"]["message"]


def tokenizer_workers(server: ServerProcess, http: httpx.Client) -> list[int]:
    """The server's children other than its engine process and multiprocessing's resource tracker."""
    engine = http.get("/server_info").json()["engine_pid"]
    kids = [pid for pid in children(server.proc.pid) if pid != engine]
    workers = [pid for pid in kids if b"resource_tracker" not in open(f"/proc/{pid}/cmdline", "rb").read()]
    assert len(workers) == 2, workers  # --tokenizer-pool-size
    return workers


# ---- text the tokenizer cannot take -------------------------------------------------------------------
LONE_SURROGATE = [
    ("/v1/completions", {"prompt": "abc\ud800def"}, "prompt"),
    ("/v1/completions", {"prompt": ["fine", "abc\udfffdef"]}, "prompt"),
    ("/v1/completions", {"prompt": "x", "stop": ["\ud83d"]}, "stop"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "abc\ud800def"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]},
     "messages"),
    ("/generate", {"text": "abc\ud800def"}, "text"),
    ("/generate", {"text": "x", "sampling_params": {"stop": "\ud800"}}, "stop"),
    # Fields the Responses API echoes back in its answer.
    ("/v1/responses", {"input": "hi", "user": "\ud800"}, "user"),
    ("/v1/responses", {"input": "hi", "metadata": {"k": "\udc00"}}, "metadata"),
]


def test_lone_surrogates_are_400_naming_the_field_and_the_connection_stays_usable(server, http):
    conn = KeepAlive(server)
    try:
        for path, body, param in LONE_SURROGATE:
            status, payload = conn.post(path, raw_json({**body, "max_tokens": 2}))
            assert status == 400, (body, payload)
            assert payload["error"]["param"] == param and "surrogate" in payload["error"]["message"], payload
            status, payload = conn.post("/v1/completions", raw_json({"prompt": "next", "max_tokens": 2}))
            assert status == 200 and payload["usage"]["completion_tokens"] <= 2
        # A surrogate *pair* is a valid character (here an emoji) and is served.
        status, payload = conn.post("/v1/completions", raw_json({"prompt": "hi \ud83d\ude00", "max_tokens": 2}))
        assert status == 200, payload
    finally:
        conn.close()


def test_fuzzed_corners_are_4xx_in_the_route_s_format(server, http):
    """Corners a fuzzing campaign found: each a 4xx in its API's error format, never a 500."""
    r = http.post("/tokenize", json={"messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    string_args = [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "w"}], "max_tokens": 4,
                                                "tools": string_args, "tool_choice": "required"})
    assert r.status_code == 400 and "type 'object'" in r.json()["error"]["message"], r.text
    r = http.post("/v1/messages", json={"max_tokens": 4, "messages": [{"role": "user", "content": "w"}],
                                        "tools": [{"name": "f", "input_schema": {"anyOf": []}}]})
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    r = http.request("PATCH", "/v1/messages")
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error", r.text
    # The Authorization scheme is case-insensitive; the key is not.
    assert httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"bearer {KEY}"}).status_code == 200
    assert httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"bearer {KEY.upper()}"}).status_code == 401


def test_non_finite_numbers_are_400_naming_the_field(server):
    conn = KeepAlive(server)
    try:
        for path, body, param in [
                ("/v1/completions", b'{"prompt": "x", "temperature": 1e400}', "temperature"),
                ("/v1/completions", b'{"prompt": "x", "top_p": -1e400}', "top_p"),
                ("/v1/completions", b'{"prompt": "x", "repetition_penalty": 1e999}', "repetition_penalty"),
                ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "temperature": 1e400}',
                 "temperature"),
                ("/generate", b'{"text": "x", "sampling_params": {"temperature": 1e400}}', "temperature"),
                ("/generate", b'{"text": "x", "sampling_params": {"repetition_penalty": -1e400}}',
                 "repetition_penalty")]:
            status, payload = conn.post(path, body)
            assert status == 400 and payload["error"]["param"] == param, (body, payload)
    finally:
        conn.close()


# ---- output constraints: nesting and size ---------------------------------------------------------
def nested_schema(levels: int) -> dict:
    """A JSON schema of objects nested `levels` deep: 2 levels of JSON each, plus the innermost one."""
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


DEEP = nested_schema(150)  # 301 levels of JSON, 13 KB: it killed the thread that sends work to the engine
CHAT = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4}


def tools(parameters: dict) -> dict:
    return {"tools": [{"type": "function", "function": {"name": "f", "parameters": parameters}}],
            "tool_choice": "required"}


def response_format(schema: dict) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}


def sampling(**fields) -> dict:
    return {"text": "x", "sampling_params": {"max_new_tokens": 4, **fields}}


TOO_BIG = "a" * (MAX_GRAMMAR_BYTES + 1)
WIDE = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "d" * 100} for i in range(10**4)}}
REFUSED_CONSTRAINTS = [
    ("/generate", sampling(json_schema=DEEP), "json_schema"),
    ("/generate", sampling(json_schema=json.dumps(DEEP)), "json_schema"),
    ("/generate", sampling(structural_tag=json.dumps({"type": "structural_tag",
                                                      "format": {"type": "json_schema", "json_schema": DEEP}})),
     "structural_tag"),
    ("/generate", sampling(regex=TOO_BIG), "regex"),
    ("/generate", sampling(ebnf=f'root ::= "{TOO_BIG}"'), "ebnf"),
    ("/v1/chat/completions", {**CHAT, **response_format(DEEP)}, "response_format"),
    ("/v1/chat/completions", {**CHAT, **response_format(WIDE)}, "response_format"),
    ("/v1/chat/completions", {**CHAT, "json_schema": DEEP}, "json_schema"),
    ("/v1/chat/completions", {**CHAT, **tools(DEEP)}, "tools"),
    ("/v1/chat/completions", {**CHAT, **tools(WIDE)}, "tools"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 4, **response_format(DEEP)}, "response_format"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 4, "regex": TOO_BIG}, "regex"),
]


@pytest.mark.parametrize("path,body,param", REFUSED_CONSTRAINTS,
                         ids=[f"{path} {param} {i}" for i, (path, _, param) in enumerate(REFUSED_CONSTRAINTS)])
def test_a_too_deep_or_too_large_constraint_is_400_naming_the_field_and_the_server_serves_on(server, path, body,
                                                                                            param):
    conn = KeepAlive(server)
    try:
        status, payload = conn.post(path, raw_json(body))
        assert status == 400 and payload["error"]["param"] == param, payload
        message = payload["error"]["message"]
        assert f"at most {MAX_NESTING} " in message or f"at most {MAX_GRAMMAR_BYTES} bytes" in message, message
        for next_path, next_body in [("/v1/completions", {"prompt": "after", "max_tokens": 2}),
                                     ("/generate", sampling()), ("/v1/chat/completions", CHAT)]:
            status, payload = conn.post(next_path, raw_json(next_body))  # the same connection: still usable
            assert status == 200, (next_path, payload)
    finally:
        conn.close()


def test_a_schema_within_the_nesting_limit_is_served(http):
    r = http.post("/generate", json=sampling(json_schema=nested_schema((MAX_NESTING - 2) // 2)))  # 63 levels
    assert r.status_code == 200 and r.json()["text"].startswith("{"), r.text
    r = http.post("/v1/chat/completions", json={**CHAT, **response_format(nested_schema(4))})
    assert r.status_code == 200, r.text


# ---- connections that stall ----------------------------------------------------------------------------
def test_a_connection_that_stalls_before_its_headers_end_or_in_its_body_is_closed(server):
    """Connections that send nothing, half their headers, or headers and part of the body: closed after
    --request-read-timeout (the last with a 408), not held forever."""
    headers = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
    sends = {"nothing": b"", "half the headers": headers.encode(),
             "part of the body": (headers + "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
                                  '{"prompt": ').encode()}
    conns = {name: socket.create_connection(("127.0.0.1", server.port), timeout=10 * READ_TIMEOUT)
             for name in sends}
    answers = {}
    try:
        for name, data in sends.items():
            conns[name].sendall(data)
        for name, conn in conns.items():
            answer = b""
            while chunk := conn.recv(65536):  # until the server closes the connection
                answer += chunk
            answers[name] = answer
    finally:
        for conn in conns.values():
            conn.close()
    assert answers["nothing"] == b"" and answers["half the headers"] == b"", answers
    body = answers["part of the body"]
    assert body.startswith(b"HTTP/1.1 408") and b"--request-read-timeout" in body and b"request_timeout" in body, body


# ---- the context -------------------------------------------------------------------------------------
def test_prompt_plus_max_tokens_beyond_the_context_is_400_with_both_numbers(http):
    prompt = [5 + i % 300 for i in range(1000)]
    r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    message = r.json()["error"]["message"]
    assert f"{CONTEXT} tokens" in message and "2000 tokens" in message and "1000 in prompt" in message, message

    chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hello " * 50}],
                                                   "max_completion_tokens": 1000})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "max_completion_tokens"
    native = http.post("/generate", json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 100}})
    assert native.status_code == 400 and native.json()["error"]["param"] == "max_new_tokens"
    too_long = http.post("/v1/completions", json={"prompt": prompt * 2, "max_tokens": 1})
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "prompt"
    assert "has 2000 tokens" in too_long.json()["error"]["message"]

    # A missing max_tokens never fails: its default (16 for completions) is cut to the room left.
    near = http.post("/v1/completions", json={"prompt": prompt + prompt[:20], "ignore_eos": True})
    assert near.status_code == 200 and near.json()["usage"]["completion_tokens"] == 4
    fits = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 24, "ignore_eos": True})
    assert fits.status_code == 200 and fits.json()["usage"]["completion_tokens"] == 24
    wait_idle(http)


# ---- everything else: a small generated fuzz run ---------------------------------------------------------
HOSTILE = [None, True, -1, 2**63, 10**30, 1e308, -1e308, 0.5, "", "\ud800", [], [[]], [2**40], {"\ud800": 1}]
COMPLETION_FIELDS = ["prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "stop", "seed", "logprobs",
                     "repetition_penalty", "min_tokens", "stop_token_ids", "logit_bias", "echo", "model",
                     "stream_options"]
NATIVE_FIELDS = ["max_new_tokens", "min_new_tokens", "temperature", "top_k", "seed", "stop", "stop_token_ids",
                 "ignore_eos", "logprobs", "n"]


def fuzz_cases():
    """(path, body) pairs; never max_tokens=None, which means "the whole context" for chat: slow, not hostile."""
    for field, value in itertools.product(COMPLETION_FIELDS, HOSTILE[1:]):
        yield "/v1/completions", {"prompt": "fuzz", "max_tokens": 1, field: value}
    for field, value in itertools.product(["messages", "max_tokens", "temperature", "top_logprobs"], HOSTILE[1:]):
        yield "/v1/chat/completions", {"messages": [{"role": "user", "content": "fuzz"}], "max_tokens": 1,
                                       field: value}
    for value in HOSTILE:
        yield "/v1/chat/completions", {"messages": [{"role": "user", "content": value}], "max_tokens": 1}
        yield "/v1/chat/completions", {"messages": [{"role": value, "content": "x"}], "max_tokens": 1}
        yield "/generate", {"text": value, "sampling_params": {"max_new_tokens": 1}}
        yield "/generate", {"input_ids": value, "sampling_params": {"max_new_tokens": 1}}
    for field, value in itertools.product(NATIVE_FIELDS, HOSTILE):
        yield "/generate", {"text": "fuzz", "sampling_params": {"max_new_tokens": 1, field: value}}


def test_generated_hostile_bodies_are_never_a_5xx_and_the_connection_survives(server, http):
    conn = KeepAlive(server)
    try:
        count = 0
        for path, body in fuzz_cases():
            status, payload = conn.post(path, raw_json(body))
            count += 1
            # 404 only for a model name we do not serve (OpenAI's model_not_found)
            assert status in (200, 400) or (status == 404 and body.get("model") is not None), (path, body, status)
            if status in (400, 404):
                assert set(payload["error"]) == {"message", "type", "param", "code"}, payload
                assert payload["error"]["message"], payload
    finally:
        conn.close()
    assert count > 400
    assert http.get("/health").status_code == 200
    wait_idle(http)

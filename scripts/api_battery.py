"""One battery of HTTP requests sent to an OpenAI-compatible server, recorded as shapes: each answer's
status code and the keys and JSON types of its body (values left out), streamed answers as the shapes of
their events. Run against kestrel and vLLM serving the same folder, the two recordings compare what
clients depend on: routes, status codes on bad input, response keys and the error format.

    python scripts/api_battery.py http://127.0.0.1:8000 demo > shapes.json
    python scripts/api_battery.py http://127.0.0.1:8000 demo --compare tests/e2e/data/vllm_shapes.json

`--pooling` sends the embeddings, rerank and score battery instead, to a server of an embedding model
(vLLM's `--runner pooling`). The battery asks both servers for the same things;
tests/e2e/test_api_conformance.py replays both against kestrel and compares with vLLM's recordings
(tests/e2e/data/vllm_shapes.json, tests/e2e/data/vllm_pooling_shapes.json).
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import httpx

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CHAT = [{"role": "user", "content": "Say hello."}]


def battery(model: str) -> list[tuple[str, str, str, Any]]:
    """(name, method, path, body: a dict sent as JSON, bytes sent as they are, or None)."""
    cmp = {"model": model, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}
    chat = {"model": model, "messages": CHAT, "max_tokens": 4, "temperature": 0}
    return [
        ("models", "GET", "/v1/models", None),
        ("completion", "POST", "/v1/completions", cmp),
        ("completion_batch_n", "POST", "/v1/completions", {**cmp, "prompt": ["a", "b"], "n": 2, "temperature": 1}),
        ("completion_logprobs", "POST", "/v1/completions", {**cmp, "logprobs": 2}),
        ("completion_echo", "POST", "/v1/completions", {**cmp, "echo": True}),
        ("completion_token_ids", "POST", "/v1/completions", {**cmp, "prompt": [1, 2, 3]}),
        ("completion_stream", "POST", "/v1/completions", {**cmp, "stream": True}),
        ("chat", "POST", "/v1/chat/completions", chat),
        ("chat_logprobs", "POST", "/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 2}),
        ("chat_stream", "POST", "/v1/chat/completions", {**chat, "stream": True,
                                                        "stream_options": {"include_usage": True}}),
        ("chat_tools", "POST", "/v1/chat/completions", {**chat, "tools": [TOOL], "tool_choice": "auto"}),
        ("chat_json_object", "POST", "/v1/chat/completions", {**chat, "response_format": {"type": "json_object"}}),
        ("chat_json_schema", "POST", "/v1/chat/completions", {**chat, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}}),
        ("tokenize", "POST", "/tokenize", {"model": model, "prompt": "Hello world"}),
        ("tokenize_chat", "POST", "/tokenize", {"model": model, "messages": CHAT}),
        ("detokenize", "POST", "/detokenize", {"model": model, "tokens": [1, 2, 3]}),
        # bad input
        ("missing_messages", "POST", "/v1/chat/completions", {"model": model}),
        ("missing_prompt", "POST", "/v1/completions", {"model": model}),
        ("wrong_type_max_tokens", "POST", "/v1/completions", {**cmp, "max_tokens": "four"}),
        ("wrong_type_messages", "POST", "/v1/chat/completions", {**chat, "messages": "hi"}),
        ("temperature_negative", "POST", "/v1/completions", {**cmp, "temperature": -1}),
        ("max_tokens_negative", "POST", "/v1/completions", {**cmp, "max_tokens": -1}),
        ("n_zero", "POST", "/v1/completions", {**cmp, "n": 0}),
        ("top_logprobs_too_many", "POST", "/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 50}),
        ("unknown_model", "POST", "/v1/completions", {**cmp, "model": "no-such-model"}),
        ("prompt_too_long", "POST", "/v1/completions", {**cmp, "prompt": [5] * 4000}),
        ("max_tokens_too_large", "POST", "/v1/completions", {**cmp, "max_tokens": 100_000}),
        ("bad_json", "POST", "/v1/chat/completions", b'{"model": "x", "messages": ['),
        ("wrong_method", "GET", "/v1/chat/completions", None),
        ("unknown_route", "POST", "/v1/nothing", {}),
        ("detokenize_out_of_vocab", "POST", "/detokenize", {"model": model, "tokens": [10**9]}),
    ]


def pooling_battery(model: str) -> list[tuple[str, str, str, Any]]:
    """The embeddings, rerank and score requests, in `battery`'s form."""
    emb = {"model": model, "input": ["Hello world", "the quick brown fox"]}
    docs = ["the quick brown fox", "a lazy dog", "hello"]
    return [
        ("embeddings", "POST", "/v1/embeddings", emb),
        ("embeddings_base64", "POST", "/v1/embeddings", {**emb, "encoding_format": "base64"}),
        ("embeddings_token_ids", "POST", "/v1/embeddings", {**emb, "input": [[5, 6, 7], [8, 9]]}),
        ("embeddings_dimensions", "POST", "/v1/embeddings", {**emb, "dimensions": 16}),
        ("rerank", "POST", "/v1/rerank", {"model": model, "query": "quick fox", "documents": docs, "top_n": 2}),
        ("rerank_unversioned", "POST", "/rerank", {"model": model, "query": "quick fox", "documents": docs}),
        ("score", "POST", "/v1/score", {"model": model, "text_1": "quick fox", "text_2": docs}),
        ("score_unversioned", "POST", "/score", {"model": model, "text_1": "quick fox", "text_2": docs[0]}),
        # bad input
        ("embeddings_dimensions_too_large", "POST", "/v1/embeddings", {**emb, "dimensions": 10_000}),
        ("embeddings_dimensions_zero", "POST", "/v1/embeddings", {**emb, "dimensions": 0}),
        ("embeddings_bad_encoding", "POST", "/v1/embeddings", {**emb, "encoding_format": "hex"}),
        ("embeddings_missing_input", "POST", "/v1/embeddings", {"model": model}),
        ("embeddings_float_input", "POST", "/v1/embeddings", {**emb, "input": [1.5]}),
        ("embeddings_unknown_model", "POST", "/v1/embeddings", {**emb, "model": "no-such-model"}),
        ("rerank_missing_documents", "POST", "/v1/rerank", {"model": model, "query": "quick fox"}),
        ("score_lengths_differ", "POST", "/v1/score", {"model": model, "text_1": ["a", "b"], "text_2": docs}),
    ]


def shape(value: Any) -> Any:
    """The JSON types of `value`: objects keep their keys, lists the shape of their first item."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    return "null" if value is None else "str"


def record(base_url: str, model: str, pooling: bool = False) -> dict[str, Any]:
    out = {}
    with httpx.Client(base_url=base_url, timeout=120) as http:
        for name, method, path, body in (pooling_battery if pooling else battery)(model):
            kwargs = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
                else {"json": body} if body is not None else {}
            r = http.request(method, path, **kwargs)
            entry: dict[str, Any] = {"status": r.status_code}
            if r.headers.get("content-type", "").startswith("text/event-stream"):
                events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
                entry["events"] = [shape(json.loads(e)) if e != "[DONE]" else "[DONE]" for e in events]
                entry["events"] = [entry["events"][0], entry["events"][-2], entry["events"][-1]]  # first, last, end
            else:
                try:
                    entry["body"] = shape(r.json())
                except ValueError:
                    entry["body"] = "not JSON"
            out[name] = entry
    return out


def differences(ours: Any, theirs: Any, where: str = "") -> list[str]:
    """Where kestrel's shape lacks or contradicts vLLM's. A null on either side matches any type (a value,
    not a shape), a key vLLM sends as null may be absent (clients read both as None), and keys only
    kestrel sends (SGLang's extensions) are allowed."""
    if ours == theirs or "null" in (ours, theirs):
        return []
    if isinstance(ours, dict) and isinstance(theirs, dict):
        out = [f"{where}.{k}: only in vLLM" for k in theirs.keys() - ours.keys() if theirs[k] != "null"]
        for k in ours.keys() & theirs.keys():
            out += differences(ours[k], theirs[k], f"{where}.{k}")
        return out
    if isinstance(ours, list) and isinstance(theirs, list):
        return [] if not ours or not theirs else differences(ours[0], theirs[0], where + "[]")
    return [f"{where}: kestrel {json.dumps(ours)[:80]}, vLLM {json.dumps(theirs)[:80]}"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base_url")
    parser.add_argument("model", help="the served model name")
    parser.add_argument("--compare", help="a recording (JSON) to compare with instead of printing ours")
    parser.add_argument("--label", default="", help="recorded as `server` (e.g. 'vllm 0.32.0')")
    parser.add_argument("--pooling", action="store_true", help="the embeddings, rerank and score battery")
    args = parser.parse_args()
    shapes = record(args.base_url, args.model, args.pooling)
    if not args.compare:
        json.dump({"server": args.label, "cases": shapes}, sys.stdout, indent=1, sort_keys=True)
        return 0
    theirs = json.load(open(args.compare))["cases"]
    found = [f"{name}{d}" for name in shapes for d in differences(shapes[name], theirs.get(name))]
    print("\n".join(found) or "no differences")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())

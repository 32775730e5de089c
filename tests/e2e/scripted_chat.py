"""A fake engine that answers chats with scripted text, for the API tests (Anthropic's Messages, OpenAI's
Responses): deterministic answers, one token per step as a model's would come, stop strings honoured as the
engine honours them, over the tiny test tokenizer and its `<|role|>content<|eos|>` chat template.

The answer depends on the rendered prompt: the last rule whose key is in it wins.
"""
from __future__ import annotations

import asyncio

from kestrel.server.messages import AbortRequests, AddRequests, Admission, Shutdown, StepOutput, TokenDelta
from kestrel.server.reasoning_parsers import reasoning_parser
from kestrel.server.tool_parsers import tool_parser
from tests.e2e.conftest import fake_engine_app

WEATHER_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
RULES = [
    ("", "Hello there, how can I help?"),
    ("count", "one two three four five"),
    ("think", "<think>A short question.</think>Paris is the capital."),
    ("weather", "<think>Call the tool.</think>" + WEATHER_CALL),
    ("<|tool|>", "It is sunny in Oslo."),
    ("abort", "Cut short by the server"),  # finishes "abort" after ABORT_AFTER tokens (a server shutting down)
]
ABORT_AFTER = 2


def answer_for(prompt: str) -> str:
    return [text for key, text in RULES if key in prompt][-1]


def scripted_engine(tokenizer, seen: list):
    """The engine side; records (prompt text, SamplingParams) of each request in `seen`."""
    def engine(inbox, outbox) -> None:
        while True:
            try:
                msg = inbox.recv()
            except EOFError:
                return
            if isinstance(msg, Shutdown):
                return
            if isinstance(msg, AbortRequests):
                continue
            assert isinstance(msg, AddRequests), msg
            outbox.send(Admission(msg.group))
            for r in msg.reqs:
                prompt = tokenizer.decode(r.prompt_ids, skip_special_tokens=False)
                seen.append((prompt, r.params))
                ids = tokenizer.encode(answer_for(prompt), add_special_tokens=False)[:r.params.max_new_tokens]
                aborted = "abort" in prompt
                ids = ids[:ABORT_AFTER] if aborted else ids
                for i, token in enumerate(ids):
                    text = tokenizer.decode(ids[:i + 1])
                    stop = next((s for s in r.params.stop_strs if s in text), None)
                    last = i == len(ids) - 1 or stop is not None
                    finish = None if not last else "abort" if aborted else \
                        "stop" if stop or len(ids) < r.params.max_new_tokens else "length"
                    outbox.send(StepOutput([TokenDelta(r.rid, [token], finished=last, finish_reason=finish,
                                                       matched_stop=stop, prompt_tokens=len(r.prompt_ids))]))
                    if last:
                        break
    return engine


def serve(tokenizer, scenario, http_module=None, **state_fields) -> list:
    """Run `await scenario(http)` against the app (hermes tool calls, qwen3 reasoning unless
    `state_fields` say otherwise) with a client of `http_module` (default httpx); returns what the engine
    saw."""
    seen: list = []
    fields = {"tool_parser": tool_parser("hermes"), "reasoning_parser": reasoning_parser("qwen3"), **state_fields}

    async def run() -> None:
        async with fake_engine_app(scripted_engine(tokenizer, seen), tokenizer, http_module, **fields) as (_, http):
            await asyncio.wait_for(scenario(http), 30)

    asyncio.run(run())
    return seen

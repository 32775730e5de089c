"""SGLang's native `POST /generate`: `text` or `input_ids` (one or a batch), `sampling_params`, `stream`.

The answer is one object per prompt × n, or a list of them for a batch or n > 1. Each has `text`,
`output_ids` and `meta_info` (id, prompt/completion/cached tokens, finish_reason, e2e_latency, and
`output_token_logprobs` / `output_top_logprobs` as (logprob, token id, None) when `return_logprob`;
with `logprob_start_len` >= 0 also `input_token_logprobs` / `input_top_logprobs` of the prompt tokens
from that position on, the first prompt token's logprob and top list being None).
Streaming sends the same objects, with the text and ids so far, as server-sent events.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from kestrel.server.errors import bad_request
from kestrel.server.generation import Choice, Generation
from kestrel.server.protocol import GenerateRequest, expand_choices, native_sampling_params, validated
from kestrel.server.sse import sse_stream
from kestrel.server.state import ServerState, parse_body, prompt_name, respond


def _finish_reason(c: Choice) -> dict[str, Any] | None:
    if c.finish_reason is None:
        return None
    if c.finish_reason == "stop":
        return {"type": "stop", "matched": c.matched_stop}
    if c.finish_reason == "length":
        return {"type": "length", "length": len(c.token_ids)}
    return {"type": c.finish_reason}


def _output(gen: Generation, c: Choice, index: int | None, logprob_start_len: int) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": c.rid, "prompt_tokens": len(c.prompt_ids), "completion_tokens": len(c.token_ids),
        "cached_tokens": c.cached_tokens, "finish_reason": _finish_reason(c),
        "e2e_latency": time.monotonic() - gen.arrival}
    if c.spec_accept_histogram:
        rounds = sum(c.spec_accept_histogram)
        meta.update(spec_verify_ct=rounds, spec_accept_histogram=c.spec_accept_histogram,
                    spec_accept_length=sum(k * n for k, n in enumerate(c.spec_accept_histogram)) / rounds)
    if c.params.logprobs is not None:
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(c.logprobs, c.token_ids)]
        meta["output_top_logprobs"] = [[[lp, t, None] for t, lp in top] for top in c.top_logprobs]
    if c.prompt_logprobs is not None:  # asked through logprob_start_len, or as the prompt_logprobs sampling parameter
        start = max(logprob_start_len, 0)
        meta["input_token_logprobs"] = [[lp, t, None] for lp, t in
                                        zip([None, *c.prompt_logprobs], c.prompt_ids)][start:]
        meta["input_top_logprobs"] = [None if top is None else [[lp, t, None] for t, lp in top] for top in
                                      [None, *(c.prompt_top_logprobs or [])]][start:]
    out = {"text": c.text, "output_ids": list(c.token_ids), "meta_info": meta}
    if index is not None:
        out["index"] = index
    return out


async def generate(state: ServerState, request: Request) -> Response:
    body, body_bytes = await parse_body(request, GenerateRequest)
    if (body.text is None) == (body.input_ids is None):
        raise bad_request("give exactly one of text or input_ids", "text")
    param = "text" if body.text is not None else "input_ids"
    if body.text is not None:
        batch = isinstance(body.text, list)
        given: list = body.text if batch else [body.text]
    else:
        batch = bool(body.input_ids) and isinstance(body.input_ids[0], list)
        given = body.input_ids if batch else [body.input_ids]
    if not given:
        raise bad_request("the batch of prompts is empty", param)
    params, n, asked = native_sampling_params(body.sampling_params,
                                              body.top_logprobs_num if body.return_logprob else None)
    if body.logprob_start_len < -1:
        raise bad_request(f"logprob_start_len must be -1 (no prompt logprobs) or a prompt position >= 0, got "
                          f"{body.logprob_start_len}", "logprob_start_len")
    names = {"logprobs": "top_logprobs_num"} if body.return_logprob else {}  # the counts top_logprobs_num set
    if body.return_logprob and body.logprob_start_len >= 0:
        params = dataclasses.replace(params, prompt_logprobs=body.top_logprobs_num)
        names["prompt_logprobs"] = "top_logprobs_num"
    if body.priority is not None:  # SGLang's place for it, beside sampling_params (which may hold it too)
        params = dataclasses.replace(params, priority=body.priority)
    base = validated(params, state.client.info.vocab_size, names)
    if body.lora_path is not None:
        state.check_lora(body.lora_path, "lora_path")
    ticket = state.admit(len(given) * n, "sampling_params" if n > 1 else param)
    with ticket.released_on_error():
        prompts = await state.prompt_ids(ticket, given, param, body_bytes)
        if body.return_logprob and body.logprob_start_len >= 0:
            for i, prompt in enumerate(prompts):
                if body.logprob_start_len >= len(prompt):
                    raise bad_request(f"logprob_start_len {body.logprob_start_len} is past the end of "
                                      f"{prompt_name(param, i, len(prompts))}, which has {len(prompt)} tokens; "
                                      f"give a position in [0, {len(prompt) - 1}], or -1 for no prompt logprobs",
                                      "logprob_start_len")
        # Without max_new_tokens: SamplingParams' default (128, as SGLang's), cut to fit the context.
        params_list = state.params_for(base, prompts, asked, base.max_new_tokens, param, "max_new_tokens", {})
        gen = Generation(state.client, state.tokenizer, *expand_choices(prompts, params_list, n), ticket,
                         prompt_param=param, api_names={"prompt_logprobs": "logprob_start_len"},
                         lora_name=body.lora_path)
    many = batch or n > 1

    async def outputs() -> AsyncIterator[dict[str, Any]]:
        async for u in gen.updates():
            yield _output(gen, gen.choices[u.index], u.index if many else None, body.logprob_start_len)

    def events() -> AsyncIterator[bytes]:
        return sse_stream(outputs())

    def whole() -> Any:
        outs = [_output(gen, c, None, body.logprob_start_len) for c in gen.choices]
        return outs if many else outs[0]

    return await respond(request, gen, body.stream, events, whole)

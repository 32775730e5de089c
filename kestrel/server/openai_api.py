"""`POST /v1/completions` and `POST /v1/chat/completions`, as the official `openai` client expects them."""
from __future__ import annotations

import dataclasses
import itertools
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from kestrel.server.chat import prepare_chat
from kestrel.server.generation import Choice, ChoiceUpdate, Generation
from kestrel.server.protocol import ChatCompletionRequest, CompletionRequest, expand_choices, prompt_list, validated
from kestrel.server.sse import sse_stream
from kestrel.server.state import ServerState, parse_body, respond

_API_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "prompt_logprobs": "logprobs"}
# OpenAI's default for /v1/completions; cut to the room the context leaves, as chat's default (all of
# that room) is. Only an explicit max_tokens that does not fit is an error.
COMPLETION_DEFAULT_MAX_TOKENS = 16


async def _events(gen: Generation, head: dict[str, Any], chunk_choice: Callable[[ChoiceUpdate], dict | None],
                  include_usage: bool, n: int, first: list[dict] | None = None) -> AsyncIterator[dict]:
    """Chunk payloads: `first` choices (chat's role), one chunk per update worth sending, usage."""
    for choice in first or []:
        yield {**head, "choices": [choice]}
    async for update in gen.updates():
        choice = chunk_choice(update)
        if choice is not None:
            yield {**head, "choices": [choice]}
    if include_usage:
        yield {**head, "choices": [], "usage": gen.usage(n)}


def _worth_sending(update: ChoiceUpdate) -> bool:
    """Skip chunks with nothing in them (a character split across tokens), unless they carry logprobs."""
    return bool(update.text) or update.finish_reason is not None or update.logprobs is not None


TokenName = Callable[[int], str]


def _token_name(state: ServerState, as_ids: bool | None) -> TokenName:
    """How logprobs name a token: its text, or vLLM's "token_id:N" (return_tokens_as_token_ids), which
    tells apart tokens whose texts are equal or not valid UTF-8 alone."""
    return (lambda t: f"token_id:{t}") if as_ids else state.token_text


def _prompt_logprobs(state: ServerState, c: Choice) -> list[dict[int, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: None for the first prompt token, then per token a dict from token id to
    {logprob, rank, decoded_token}: the prompt token's first, then the top params.prompt_logprobs."""
    def entry(token_id: int, logprob: float, rank: int) -> dict[str, Any]:
        return {"logprob": logprob, "rank": rank, "decoded_token": state.token_text(token_id)}

    out: list[dict[int, dict[str, Any]] | None] = [None]
    for token, logprob, rank, top in zip(c.prompt_ids[1:], c.prompt_logprobs or [], c.prompt_logprob_ranks or [],
                                         c.prompt_top_logprobs or []):
        position = {token: entry(token, logprob, rank)}
        for i, (top_id, top_logprob) in enumerate(top[:c.params.prompt_logprobs]):
            position.setdefault(top_id, entry(top_id, top_logprob, i + 1))
        out.append(position)
    return out


# ---- /v1/completions ----------------------------------------------------------------------------
def _completion_logprobs(name: TokenName, ids: list[int], logprobs: list[float | None],
                         tops: list[list[tuple[int, float]] | None], offset: int) -> dict[str, Any]:
    """OpenAI's legacy logprobs: top_logprobs maps token text to logprob, the chosen token included (so
    up to logprobs + 1 entries, as OpenAI documents); the first prompt token has None for both."""
    tokens = [name(t) for t in ids]
    top_logprobs: list[dict[str, float] | None] = []
    for token, chosen, top in zip(tokens, logprobs, tops):
        entries = None if top is None else {name(t): lp for t, lp in top}
        if entries is not None and chosen is not None:
            entries.setdefault(token, chosen)
        top_logprobs.append(entries)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": top_logprobs,
            "text_offset": list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=offset))[:len(tokens)]}


def _joined(first: dict[str, Any] | None, then: dict[str, Any] | None) -> dict[str, Any] | None:
    """Logprobs of the echoed prompt followed by those of the completion (either may be None)."""
    if first is None or then is None:
        return first or then
    return {key: first[key] + then[key] for key in first}


async def completions(state: ServerState, request: Request) -> Response:
    body, body_bytes = await parse_body(request, CompletionRequest)
    model = state.check_model(body.model)
    body.check()
    texts, _ = prompt_list(body.prompt)
    max_tokens = COMPLETION_DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    # Every range check before the (maybe long) tokenization; max_tokens again once prompt lengths are known.
    # echo with logprobs scores the prompt too (what evaluation harnesses read), from the prefill; the
    # engine computes as many top logprobs as the larger of that and prompt_logprobs asks for.
    echo_logprobs_num = body.logprobs if body.echo else None
    asked = [k for k in (echo_logprobs_num, body.prompt_logprobs) if k is not None]
    base = dataclasses.replace(body.sampling_params(max_tokens, body.logprobs),
                               prompt_logprobs=max(asked, default=None))
    base = validated(base, state.client.info.vocab_size, _API_NAMES)
    ticket = state.admit(len(texts) * body.n, "n" if body.n > 1 else "prompt")
    with ticket.released_on_error():
        prompts = await state.prompt_ids(ticket, texts, "prompt", body_bytes)
        params = state.params_for(base, prompts, body.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS, "prompt",
                                  "max_tokens", _API_NAMES)
        echoes = [(p if isinstance(p, str) else state.decode(p)) if body.echo else "" for p in texts]
        gen = Generation(state.client, state.tokenizer, *expand_choices(prompts, params, body.n), ticket,
                         grammar_param=body.grammar_param(), api_names=_API_NAMES, lora_name=state.lora_of(model))
    echo_of = [echoes[i // body.n] for i in range(len(gen.choices))]
    head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": gen.created, "model": model,
            "system_fingerprint": state.system_fingerprint}
    name = _token_name(state, body.return_tokens_as_token_ids)
    offsets = [len(e) for e in echo_of]  # text_offset of the next token, per choice
    unechoed = set(range(len(echo_of)))  # streaming: the echo goes out with a choice's first update

    def logprobs_of(index: int, ids: list[int], lps: list[float] | None, tops: list | None) -> dict | None:
        if lps is None:
            return None
        out = _completion_logprobs(name, ids, lps, tops or [], offsets[index])
        offsets[index] += sum(len(t) for t in out["tokens"])
        return out

    def echo_logprobs(c: Choice) -> dict | None:
        """The prompt tokens' logprobs; the completion's text offsets then continue after their text (as
        vLLM counts them: the tokens' texts, a BOS included, need not spell the echoed prompt)."""
        if echo_logprobs_num is None or c.prompt_logprobs is None:
            return None
        tops = [top[:echo_logprobs_num] for top in c.prompt_top_logprobs or []]
        out = _completion_logprobs(name, c.prompt_ids, [None, *c.prompt_logprobs], [None, *tops], 0)
        offsets[c.index] = sum(len(t) for t in out["tokens"])
        return out

    def chunk_choice(u: ChoiceUpdate) -> dict | None:
        first = u.index in unechoed
        unechoed.discard(u.index)
        echo = echo_of[u.index] if first else ""
        prompt_lps = echo_logprobs(gen.choices[u.index]) if first and body.echo else None
        if not echo and prompt_lps is None and not _worth_sending(u):
            return None
        lps = _joined(prompt_lps, logprobs_of(u.index, u.token_ids, u.logprobs, u.top_logprobs))
        c = gen.choices[u.index]
        return {"index": u.index, "text": echo + u.text, "finish_reason": u.finish_reason, "logprobs": lps,
                "stop_reason": c.stop_reason, "matched_stop": c.matched_stop if u.finish_reason else None}

    def events() -> AsyncIterator[bytes]:
        return sse_stream(_events(gen, head, chunk_choice, body.include_usage(), body.n))

    def final(c: Choice) -> dict[str, Any]:
        prompt_lps = echo_logprobs(c) if body.echo else None
        lps = logprobs_of(c.index, c.token_ids, c.logprobs if c.params.logprobs is not None else None, c.top_logprobs)
        out = {"index": c.index, "text": echo_of[c.index] + c.text, "finish_reason": c.finish_reason,
               "logprobs": _joined(prompt_lps, lps), "stop_reason": c.stop_reason, "matched_stop": c.matched_stop}
        return out | ({"prompt_logprobs": _prompt_logprobs(state, c)} if body.prompt_logprobs is not None else {})

    return await respond(request, gen, body.stream, events,
                         lambda: {**head, "choices": [final(c) for c in gen.choices], "usage": gen.usage(body.n)})


# ---- /v1/chat/completions -----------------------------------------------------------------------
def _reasoning_fields(text: str | None) -> dict[str, str | None]:
    """The reasoning under both names clients read: `reasoning_content` (SGLang, DeepSeek's API, vLLM
    before 0.11) and `reasoning` (vLLM since)."""
    return {"reasoning_content": text, "reasoning": text}


def _chat_logprobs(name: TokenName, ids: list[int], logprobs: list[float],
                   tops: list[list[tuple[int, float]]]) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = name(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(t, lp), "top_logprobs": [entry(tt, tlp) for tt, tlp in top]}
                        for t, lp, top in zip(ids, logprobs, tops or [[]] * len(ids))]}


async def chat_completions(state: ServerState, request: Request) -> Response:
    body, body_bytes = await parse_body(request, ChatCompletionRequest)
    model = state.check_model(body.model)
    body.check()
    asked = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    names = {**_API_NAMES, "max_new_tokens": name, "logprobs": "top_logprobs"}
    turn = await prepare_chat(state, body, body_bytes, asked, name, names)
    gen = turn.gen
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk", "created": gen.created,
            "model": model, "system_fingerprint": state.system_fingerprint}
    token_name = _token_name(state, body.return_tokens_as_token_ids)

    def logprobs_of(ids: list[int], lps: list[float] | None, tops: list | None) -> dict | None:
        return None if lps is None else _chat_logprobs(token_name, ids, lps, tops or [])

    def chunk_choice(u: ChoiceUpdate) -> dict | None:
        got = turn.delta(u)
        delta = {**(_reasoning_fields(got.reasoning) if got.reasoning else {}),
                 **({"content": got.content} if got.content else {}),
                 **({"tool_calls": got.tool_calls} if got.tool_calls else {})}
        finish = turn.finish_reason(u.index, u.finish_reason)
        if not delta and finish is None and u.logprobs is None:
            return None
        c = gen.choices[u.index]
        return {"index": u.index, "delta": delta, "logprobs": logprobs_of(u.token_ids, u.logprobs, u.top_logprobs),
                "finish_reason": finish, "stop_reason": c.stop_reason, "matched_stop": c.matched_stop if finish else None}

    def events() -> AsyncIterator[bytes]:
        first = [{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None, "stop_reason": None} for c in gen.choices]
        return sse_stream(_events(gen, head, chunk_choice, body.include_usage(), body.n, first))

    def final(c: Choice) -> dict[str, Any]:
        lps = c.logprobs if c.params.logprobs is not None else None
        answer = turn.answer(c)
        message: dict[str, Any] = {"role": "assistant", "content": answer.content}
        if turn.reasoning:
            message.update(_reasoning_fields(answer.reasoning))
        if turn.readers is not None:
            message["content"] = answer.content or (None if answer.calls else "")
        if answer.calls:
            message["tool_calls"] = [call.openai() for call in answer.calls]
        return {"index": c.index, "message": message, "logprobs": logprobs_of(c.token_ids, lps, c.top_logprobs),
                "finish_reason": answer.finish_reason, "stop_reason": c.stop_reason, "matched_stop": c.matched_stop}

    def whole() -> dict[str, Any]:
        out = {**head, "object": "chat.completion", "choices": [final(c) for c in gen.choices],
               "usage": gen.usage(body.n)}
        # vLLM puts them beside the choices: every choice has the same prompt.
        return out | ({"prompt_logprobs": _prompt_logprobs(state, gen.choices[0])}
                      if body.prompt_logprobs is not None else {})

    return await respond(request, gen, body.stream, events, whole)


def models(state: ServerState) -> dict[str, Any]:
    info = state.client.info
    return {"object": "list", "data": [{
        "id": name, "object": "model", "created": int(time.time()), "owned_by": "kestrel",
        "root": state.model_path, "max_model_len": info.context_length} for name in state.served_model_names]
        # vLLM's listing: each LoRA adapter a model of its own, its parent the base model.
        + [{"id": name, "object": "model", "created": int(time.time()), "owned_by": "kestrel", "root": path,
            "parent": state.served_model_name, "max_model_len": info.context_length}
           for name, path in (state.client.lora_adapters or {}).items()]}

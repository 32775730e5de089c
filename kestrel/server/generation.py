"""One HTTP call's generation: its engine requests, their text (detokenized here), their end.

Every endpoint (completions, chat, native /generate) runs through `Generation`: it submits one
engine request per choice, turns the engine's token deltas into text deltas with its own
`OutputText` per choice (incremental detokenization and stop strings, the same code the engine uses
to stop), and aborts whatever is unfinished when it is closed early. It owns its request's admission
`Ticket`: closing gives it back, and the server aborting the ticket (shutdown) aborts the choices.

A choice the engine finished with finish_reason "error" (a step failed) fails the whole call with a
500: there is no partial answer worth sending as if it were whole.
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from kestrel.core.sampling_params import GRAMMAR_KINDS, SamplingParams
from kestrel.engine.detokenizer import OutputText
from kestrel.server.admission import Ticket, shutting_down
from kestrel.server.engine_client import EngineClient, RequestGroup
from kestrel.server.errors import APIError
from kestrel.server.messages import NewRequest


@dataclass
class ChoiceUpdate:
    index: int
    text: str  # new text
    token_ids: list[int]  # new tokens
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None
    finish_reason: str | None  # set on the choice's last update


@dataclass
class Choice:
    index: int
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    matched_stop: int | str | None = None
    cached_tokens: int = 0
    spec_accept_histogram: list[int] | None = None
    prompt_logprobs: list[float] | None = None  # params.prompt_logprobs: set with the choice's first update
    prompt_logprob_ranks: list[int] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    pooled: list[float] | None = None  # a pooling request's result (SamplingParams.pooling), once finished

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def stop_reason(self) -> int | str | None:
        """vLLM's `stop_reason`: the stop string, or the `stop_token_ids` id, that ended the choice; None
        when EOS, the end of its grammar or a length limit did (`matched_stop` also names an EOS id)."""
        if isinstance(self.matched_stop, str) or self.matched_stop in (self.params.stop_token_ids or ()):
            return self.matched_stop
        return None


class Generation:
    def __init__(self, client: EngineClient, tokenizer, prompts: list[list[int]], params: list[SamplingParams],
                 ticket: Ticket, prompt_param: str = "prompt", grammar_param: str | None = None,
                 api_names: dict[str, str] | None = None,
                 on_update: Callable[[ChoiceUpdate], None] | None = None, lora_name: str | None = None) -> None:
        """One choice per (prompt ids, params) pair, in that order. Engine rejections of the prompt
        (too long, empty, ids out of range) are reported against the field `prompt_param`, those of
        the grammar against `grammar_param` (default: the SamplingParams field, e.g. json_schema), those
        of another SamplingParams field (a penalty under speculative decoding) against its name in
        `api_names` (SamplingParams field -> request field; default: the same name). `on_update` sees
        every update before it is yielded, streamed or not (it may `stop` a choice). `lora_name`: the LoRA
        adapter every choice runs with (None: the base model)."""
        self.lora_name = lora_name
        self.client = client
        self.ticket = ticket
        self.tokenizer = tokenizer
        self.prompt_param = prompt_param
        self.grammar_param = grammar_param
        self.api_names = api_names or {}
        self.on_update = on_update
        self._stopped: set[int] = set()
        self.arrival = time.monotonic()
        self.created = int(time.time())
        self.choices = [Choice(i, client.new_rid(), ids, p) for i, (ids, p) in enumerate(zip(prompts, params))]
        self._texts = [OutputText(tokenizer, c.prompt_ids, c.params) if tokenizer is not None else None
                       for c in self.choices]
        self._group: RequestGroup | None = None

    async def start(self) -> None:
        """Queue the choices in the engine; raises APIError (400 for a prompt the engine rejects)."""
        if self.ticket.aborted.is_set():  # shutdown aborted the request while it was being tokenized
            raise shutting_down()
        self.ticket.on_abort = self._abort_unfinished  # from now on, even while the engine admits them
        reqs = [NewRequest(c.rid, c.prompt_ids, c.params, self.lora_name) for c in self.choices]
        try:
            self._group = await self.client.submit(reqs, self.arrival)
        except APIError as e:
            if e.status == 400:
                e.param = self._request_field(e.param)
            raise

    def _request_field(self, param: str | None) -> str:
        """The request field behind an engine rejection of SamplingParams field `param` (None: the prompt)."""
        if param is None:
            return self.prompt_param
        if param in GRAMMAR_KINDS:
            return self.grammar_param or param
        return self.api_names.get(param, param)

    async def updates(self) -> AsyncIterator[ChoiceUpdate]:
        """Text and tokens as they come, until every choice finished; raises APIError if the engine dies."""
        assert self._group is not None, "start() first"
        unfinished = sum(not c.finished for c in self.choices)
        while unfinished:
            item = await self._group.queue.get()
            if isinstance(item, APIError):
                raise item
            index, delta = item
            if delta.finish_reason == "error":
                raise APIError(500, f"the engine failed while generating choice {index}: "
                                    f"{delta.error or 'no reason given'}", code="engine_error")
            choice, text = self.choices[index], self._texts[index]
            new_text = text.add(delta.token_ids)[0] if text is not None else ""
            if delta.finished:
                new_text += text.finish() if text is not None else ""
                choice.finish_reason, choice.matched_stop = delta.finish_reason or "abort", delta.matched_stop
                unfinished -= 1
            choice.text += new_text
            choice.token_ids += delta.token_ids
            choice.cached_tokens = delta.cached_tokens
            choice.pooled = delta.pooled if delta.pooled is not None else choice.pooled
            choice.spec_accept_histogram = delta.spec_accept_histogram or choice.spec_accept_histogram
            if delta.prompt_logprobs is not None:
                choice.prompt_logprobs, choice.prompt_top_logprobs = delta.prompt_logprobs, delta.prompt_top_logprobs
                choice.prompt_logprob_ranks = delta.prompt_logprob_ranks
            if delta.logprobs is not None:
                choice.logprobs += delta.logprobs
                choice.top_logprobs += delta.top_logprobs or []
            update = ChoiceUpdate(index, new_text, delta.token_ids, delta.logprobs, delta.top_logprobs,
                                  choice.finish_reason)
            if self.on_update is not None:
                self.on_update(update)
            yield update

    async def run(self) -> list[Choice]:
        """Run to the end (non-streaming)."""
        async for _ in self.updates():
            pass
        return self.choices

    def stop(self, index: int) -> None:
        """End choice `index` early, at the caller's wish: the engine aborts it, its finish_reason
        becomes "abort" and the tokens already on their way still come."""
        if not self.choices[index].finished and index not in self._stopped:
            self._stopped.add(index)
            self.client.abort([self.choices[index].rid])

    def _abort_unfinished(self) -> None:
        self.client.abort([c.rid for c in self.choices if not c.finished])

    def close(self) -> None:
        """Abort the unfinished choices (client gone, error) and give the ticket back. Safe to call
        more than once."""
        if self.ticket.on_abort is not None:  # start() got as far as submitting
            self._abort_unfinished()
        self.ticket.release()

    # ---- usage ---------------------------------------------------------------------------------
    def usage(self, n: int = 1) -> dict:
        """OpenAI usage; with n choices per prompt, each prompt counts once (its first choice)."""
        firsts = self.choices[::n]
        prompt = sum(len(c.prompt_ids) for c in firsts)
        completion = sum(len(c.token_ids) for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(c.cached_tokens for c in firsts)}}

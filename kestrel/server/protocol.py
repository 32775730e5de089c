"""Request bodies (pydantic) and their translation into engine `SamplingParams`.

Types are checked strictly ("0.5" is not a number); value ranges are checked once, by
`SamplingParams.validate`, and its errors are renamed to the API's field names. Unknown fields are
ignored, as SGLang and vLLM do; fields that ask for something kestrel does not do are rejected.
"""
from __future__ import annotations

import dataclasses
import random
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from kestrel.core.sampling_params import SamplingParams
from kestrel.server.errors import bad_request

MAX_N = 128  # OpenAI's limit on choices per request


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class _OpenAISampling(_Body):
    """Fields shared by /v1/completions and /v1/chat/completions (with SGLang/vLLM extensions)."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    def _reject_unsupported(self) -> None:
        if self.logit_bias:
            raise bad_request("logit_bias is not supported", "logit_bias")

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, max_tokens: int, top_logprobs: int | None) -> SamplingParams:
        """The engine's parameters; None fields take OpenAI's defaults."""
        def pick(value: Any, default: Any) -> Any:
            return default if value is None else value

        return SamplingParams(
            max_new_tokens=max_tokens, min_new_tokens=self.min_tokens, temperature=pick(self.temperature, 1.0),
            top_p=pick(self.top_p, 1.0), top_k=-1 if self.top_k in (None, 0) else self.top_k,  # vLLM: 0 = off
            min_p=pick(self.min_p, 0.0),
            frequency_penalty=pick(self.frequency_penalty, 0.0), presence_penalty=pick(self.presence_penalty, 0.0),
            repetition_penalty=pick(self.repetition_penalty, 1.0), seed=self.seed, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens, logprobs=top_logprobs)


class CompletionRequest(_OpenAISampling):
    prompt: Any  # str | list[str] | list[int] | list[list[int]], checked by prompt_list()
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None

    def reject_unsupported(self) -> None:
        self._reject_unsupported()
        if self.suffix:
            raise bad_request("suffix is not supported", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of is not supported (it may only equal n)", "best_of")
        if self.echo and self.logprobs is not None:
            raise bad_request("echo with logprobs needs prompt logprobs, which kestrel does not compute; "
                              "drop one of them", "echo")


class ChatCompletionRequest(_OpenAISampling):
    messages: list[dict[str, Any]]
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None

    def reject_unsupported(self) -> None:
        self._reject_unsupported()
        if self.tools:
            raise bad_request("tools are not supported", "tools")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise bad_request("response_format other than {'type': 'text'} is not supported", "response_format")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")

    def engine_top_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class GenerateRequest(_Body):
    """SGLang's native `/generate`."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | None = None
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0


# ---- prompts ------------------------------------------------------------------------------------
def prompt_list(prompt: Any) -> tuple[list[str | list[int]], bool]:
    """A completions `prompt` as a list of prompts (text or token ids), and whether it was a batch."""
    def is_ids(p: Any) -> bool:
        return isinstance(p, list) and bool(p) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)

    if isinstance(prompt, str):
        return [prompt], False
    if is_ids(prompt):
        return [prompt], False
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) or is_ids(p) for p in prompt):
        return list(prompt), True
    raise bad_request("prompt must be a string, a list of strings, a list of token ids, or a list of lists of "
                      "token ids (none of them empty)", "prompt")


# ---- sampling parameters ------------------------------------------------------------------------
ENGINE_PARAM_NAMES = [f.name for f in dataclasses.fields(SamplingParams) if f.init]


def validated(params: SamplingParams, vocab_size: int, api_names: dict[str, str]) -> SamplingParams:
    """`params` after `SamplingParams.validate`; its error renamed to the API's field (`api_names`)."""
    try:
        params.validate(vocab_size)
    except ValueError as e:
        message = str(e)
        field = message.split(" ", 1)[0]
        name = api_names.get(field, field)
        raise bad_request(name + message[len(field):], name) from None
    return params


def native_sampling_params(raw: dict[str, Any] | None, logprobs: int | None) -> tuple[SamplingParams, int]:
    """SGLang-style `sampling_params` dict → (SamplingParams, n)."""
    raw = dict(raw or {})
    n = raw.pop("n", 1)
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_N:
        raise bad_request(f"sampling_params.n must be an integer in [1, {MAX_N}], got {n!r}", "sampling_params")
    unknown = sorted(set(raw) - set(ENGINE_PARAM_NAMES))
    if unknown:
        raise bad_request(f"unknown sampling parameter(s) {', '.join(unknown)}; valid ones: "
                          f"{', '.join(ENGINE_PARAM_NAMES)}, n", "sampling_params")
    if logprobs is not None:
        raw["logprobs"] = logprobs
    return SamplingParams(**raw), n


def expand_choices(prompts: list[list[int]], params: SamplingParams,
                   n: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """n choices per prompt, prompt-major (choice index = prompt index * n + j), as OpenAI orders them.

    Choice 0 of a prompt keeps the seed, so n=1 and n>1 agree on it; the others get seeds derived
    from (seed, index). Without a seed the engine draws one per request."""
    if params.seed is None:
        per_prompt = [params] * n
    else:
        per_prompt = [params] + [dataclasses.replace(params, seed=random.Random(f"{params.seed}:{i}").getrandbits(63))
                                 for i in range(1, n)]
    return [ids for ids in prompts for _ in range(n)], per_prompt * len(prompts)

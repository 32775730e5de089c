"""Request bodies (pydantic) and their translation into engine `SamplingParams`.

Types are checked strictly ("0.5" is not a number, 1e400 is not a finite one); value ranges are
checked once, by `SamplingParams.validate`, and its errors are renamed to the API's field names.
Unknown fields are ignored, as SGLang and vLLM do; fields that ask for something kestrel does not do
are rejected. `fit_max_tokens` checks prompt + max_tokens against the context, as vLLM does.
"""
from __future__ import annotations

import dataclasses
import random
import typing
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from kestrel.core.sampling_params import SamplingParams
from kestrel.engine.tokenizer import TEMPLATE_ARGUMENTS
from kestrel.server.errors import APIError, bad_request, from_validation_error
from kestrel.server.request_limits import check_grammar
from kestrel.server.structured import GRAMMAR_FIELDS, response_format_grammar, structured_outputs_grammar
from kestrel.server.tokenization import lone_surrogate

MAX_N = 128  # OpenAI's limit on choices per request
OPENAI_MAX_TEMPERATURE = 2.0  # OpenAI's and vLLM's; the native /generate keeps SGLang's (any >= 0)


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


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
    priority: int = 0  # vLLM's: a lower value is scheduled first (docs/scheduling.md)
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs, or SGLang's extra fields
    # (at most one of them all).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    json_schema: str | dict[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = None
    # vLLM's extras: the prompt tokens' logprobs (and this many top ones at each position), and logprob
    # tokens named "token_id:N" rather than by their text.
    prompt_logprobs: int | None = None
    return_tokens_as_token_ids: bool | None = None

    def _check(self) -> None:
        if self.temperature is not None and not 0 <= self.temperature <= OPENAI_MAX_TEMPERATURE:
            raise bad_request(f"temperature must be a number in [0, {OPENAI_MAX_TEMPERATURE:g}], got "
                              f"{self.temperature!r}", "temperature")
        check_grammar(self.response_format, "response_format", "response_format")
        check_grammar(self.structured_outputs, "structured_outputs", "structured_outputs")
        if isinstance(self.structured_outputs, dict):
            check_grammar(self.structured_outputs.get("json"), "structured_outputs.json", "structured_outputs",
                          json_text=True)
        for name in GRAMMAR_FIELDS:
            check_grammar(getattr(self, name), name, name, json_text=name == "json_schema")
        for name in ("stop", "response_format", "structured_outputs", *GRAMMAR_FIELDS):
            if problem := lone_surrogate(getattr(self, name), name):
                raise bad_request(problem, name)
        if self.prompt_logprobs is not None:
            validated(SamplingParams(prompt_logprobs=self.prompt_logprobs), None, {})
            if self.stream:  # as vLLM: they would come with no chunk of their own
                raise bad_request("prompt_logprobs are not available with stream=true", "prompt_logprobs")

    def _grammars(self) -> dict[str, dict[str, Any]]:
        """Each field that constrains the output -> the SamplingParams grammar field it asks for."""
        out = {name: grammar for name, grammar in (
            ("response_format", response_format_grammar(self.response_format)),
            ("structured_outputs", structured_outputs_grammar(self.structured_outputs))) if grammar}
        return out | {name: {name: value} for name in GRAMMAR_FIELDS if (value := getattr(self, name)) is not None}

    def grammar(self) -> dict[str, Any]:
        """The SamplingParams grammar field the request asks for ({} for none); 400 for two of them."""
        given = self._grammars()
        if len(given) > 1:
            first, second = list(given)[:2]
            raise bad_request(f"{first} and {second} both constrain the output; give one", first)
        return next(iter(given.values()), {})

    def grammar_param(self) -> str | None:
        """The field that an engine error about the grammar should name: response_format or
        structured_outputs when it set the grammar; None: the SamplingParams field itself (regex, ...)."""
        return next((name for name in self._grammars() if name not in GRAMMAR_FIELDS), None)

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, max_tokens: int, top_logprobs: int | None,
                        grammar: dict[str, Any] | None = None) -> SamplingParams:
        """The engine's parameters; None fields take OpenAI's defaults. `grammar`: the output constraint
        (a SamplingParams grammar field), by default the request's own (`grammar()`)."""
        def pick(value: Any, default: Any) -> Any:
            return default if value is None else value

        return SamplingParams(
            max_new_tokens=max_tokens, min_new_tokens=self.min_tokens, temperature=pick(self.temperature, 1.0),
            top_p=pick(self.top_p, 1.0), top_k=-1 if self.top_k in (None, 0) else self.top_k,  # vLLM: 0 = off
            min_p=pick(self.min_p, 0.0),
            frequency_penalty=pick(self.frequency_penalty, 0.0), presence_penalty=pick(self.presence_penalty, 0.0),
            repetition_penalty=pick(self.repetition_penalty, 1.0), logit_bias=logit_bias_ids(self.logit_bias),
            seed=self.seed, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens, logprobs=top_logprobs, prompt_logprobs=self.prompt_logprobs,
            priority=self.priority, **(self.grammar() if grammar is None else grammar))


class CompletionRequest(_OpenAISampling):
    prompt: Any  # str | list[str] | list[int] | list[list[int]], checked by prompt_list()
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None

    def check(self) -> None:
        """What the field types cannot say: unsupported combinations, text no tokenizer can take."""
        self._check()
        if self.suffix:
            raise bad_request("suffix is not supported", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of is not supported (it may only equal n)", "best_of")


class ToolFunction(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema; None: no parameters
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: ToolFunction


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(_OpenAISampling):
    messages: list[dict[str, Any]] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # Given to the chat template (as vLLM and SGLang do): gpt-oss's reads reasoning_effort, Qwen3's
    # enable_thinking.
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def check(self) -> None:
        """What the field types cannot say: unsupported combinations, text no tokenizer can take."""
        self._check()
        if self.chat_template_kwargs is not None:
            if reserved := sorted(set(self.chat_template_kwargs) & TEMPLATE_ARGUMENTS):
                raise bad_request(f"chat_template_kwargs may not set {', '.join(reserved)}: the server sets them "
                                  "(send messages and tools as their own fields)", "chat_template_kwargs")
            if self.reasoning_effort is not None and "reasoning_effort" in self.chat_template_kwargs:
                raise bad_request("reasoning_effort is given twice, as a field and in chat_template_kwargs; give "
                                  "one", "reasoning_effort")
            if problem := lone_surrogate(self.chat_template_kwargs, "chat_template_kwargs"):
                raise bad_request(problem, "chat_template_kwargs")
        check_grammar([t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None, "tools", "tools")
        if problem := lone_surrogate([t.model_dump() for t in self.tools or []], "tools"):
            raise bad_request(problem, "tools")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")

    def engine_top_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_kwargs(self) -> dict[str, Any]:
        """The chat template's extra variables."""
        effort = {"reasoning_effort": self.reasoning_effort} if self.reasoning_effort is not None else {}
        return {**(self.chat_template_kwargs or {}), **effort}


class GenerateRequest(_Body):
    """SGLang's native `/generate`: exactly one of `text` and `input_ids` (the schema says so too)."""

    model_config = ConfigDict(json_schema_extra={"oneOf": [
        {"required": [name], "properties": {name: {"not": {"type": "null"}}}} for name in ("text", "input_ids")]})

    nested_fields: ClassVar[tuple[str, ...]] = ("sampling_params",)  # its fields are the client's values

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | None = None
    stream: bool = False
    lora_path: str | None = None  # SGLang's field: the name of a loaded LoRA adapter (None: the base model)
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1  # with return_logprob, >= 0: the prompt's logprobs from this position on
    priority: int | None = None  # SGLang's place for it; sampling_params.priority is the same field


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
def logit_bias_ids(raw: dict[str, float] | None) -> dict[int, float] | None:
    """A JSON logit_bias (token ids as the object's keys, so strings) with int keys; 400 for a key that is
    not a token id written in decimal. Ranges are SamplingParams.validate's."""
    if raw is None:
        return None
    for key in raw:  # decimal digits, no leading zero, short enough for an int64 (and for int())
        if not (key.isascii() and key.isdigit() and len(key) <= 18 and (key == "0" or key[0] != "0")):
            raise bad_request(f"logit_bias keys must be token ids in decimal (\"50256\"), got {key[:40]!r}",
                              "logit_bias")
    return {int(key): bias for key, bias in raw.items()}


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


def _native_sampling_body() -> type[BaseModel]:
    """SGLang's `sampling_params` as a strict body model, built from SamplingParams' own fields and
    types (so the two cannot drift apart), plus n."""
    hints = typing.get_type_hints(SamplingParams)
    # pooling is not a sampling parameter a client sets: the embeddings and scoring routes set it.
    fields: dict[str, Any] = {f.name: (hints[f.name], f.default) for f in dataclasses.fields(SamplingParams)
                              if f.init and f.name != "pooling"}
    fields["logit_bias"] = (dict[str, float] | None, None)  # JSON object keys are strings: logit_bias_ids
    return create_model("SamplingParamsBody", __base__=_Body, n=(int, Field(1, ge=1, le=MAX_N)), **fields)


NativeSamplingParams = _native_sampling_body()


def native_sampling_params(raw: dict[str, Any] | None,
                           logprobs: int | None) -> tuple[SamplingParams, int, int | None]:
    """SGLang-style `sampling_params` dict → (SamplingParams, n, max_new_tokens as given or None)."""
    raw = raw or {}
    unknown = sorted(set(raw) - set(NativeSamplingParams.model_fields))
    if unknown:
        raise bad_request(f"unknown sampling parameter(s) {', '.join(unknown)}; valid ones: "
                          f"{', '.join(ENGINE_PARAM_NAMES)}, n", "sampling_params")
    try:
        body = NativeSamplingParams.model_validate(raw)
    except ValidationError as e:
        raise from_validation_error(e) from None
    for name in (*GRAMMAR_FIELDS, "structural_tag"):
        check_grammar(getattr(body, name), f"sampling_params.{name}", name,
                      json_text=name in ("json_schema", "structural_tag"))
    for name in ("stop", *GRAMMAR_FIELDS, "structural_tag"):
        if problem := lone_surrogate(getattr(body, name), f"sampling_params.{name}"):
            raise bad_request(problem, name)
    fields = body.model_dump(exclude={"n"})
    fields["logit_bias"] = logit_bias_ids(body.logit_bias)
    if logprobs is not None:
        fields["logprobs"] = logprobs
    return SamplingParams(**fields), body.n, raw.get("max_new_tokens")


def _context(limit: int, context_length: int) -> str:
    if limit == context_length:
        return f"this model's maximum context length is {limit} tokens"
    return f"this server's maximum context length is {limit} tokens (its KV pool; the model's is {context_length})"


def prompt_too_long(prompt_len: int, limit: int, context_length: int, prompt_name: str, param: str) -> APIError:
    return bad_request(f"{_context(limit, context_length)}, but {prompt_name} has {prompt_len} tokens, leaving no "
                       f"room for a completion; shorten {prompt_name}", param)


def fit_max_tokens(prompt_len: int, asked: Any, default: int | None, limit: int, context_length: int,
                   prompt_name: str, prompt_param: str, param: str) -> Any:
    """max_new_tokens for a prompt of `prompt_len` tokens when prompt + output may hold `limit` tokens.

    An explicit `asked` that does not fit is a 400 giving both numbers, as vLLM answers (never a
    silent cut); a missing one (None) takes `default` (None: all the room left), cut to fit."""
    room = limit - prompt_len
    if room < 1:
        raise prompt_too_long(prompt_len, limit, context_length, prompt_name, prompt_param)
    if asked is None:
        return room if default is None else min(default, room)
    if isinstance(asked, int) and asked > room:  # other types: SamplingParams.validate names the error
        raise bad_request(f"{_context(limit, context_length)}; however you requested {prompt_len + asked} tokens "
                          f"({prompt_len} in {prompt_name}, {asked} for the completion); reduce {prompt_name} or "
                          f"{param}", param)
    return asked


def expand_choices(prompts: list[list[int]], params: list[SamplingParams],
                   n: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """n choices per prompt (`params[i]` for prompt i), prompt-major (choice index = prompt index * n + j),
    as OpenAI orders them.

    Choice 0 of a prompt keeps the seed, so n=1 and n>1 agree on it; the others get seeds derived
    from (seed, index). Without a seed the engine draws one per request."""
    def choice(p: SamplingParams, i: int) -> SamplingParams:
        if p.seed is None or i == 0:
            return p
        return dataclasses.replace(p, seed=random.Random(f"{p.seed}:{i}").getrandbits(63))

    return ([ids for ids in prompts for _ in range(n)],
            [choice(p, i) for p in params for i in range(n)])


class LoadLoRARequest(_Body):
    """vLLM's `POST /v1/load_lora_adapter`."""

    lora_name: str
    lora_path: str


class UnloadLoRARequest(_Body):
    """vLLM's `POST /v1/unload_lora_adapter` (`lora_int_id` is vLLM's internal id: ignored)."""

    lora_name: str

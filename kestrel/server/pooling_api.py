"""`POST /v1/embeddings` (OpenAI's), `POST /v1/rerank` (Cohere's and Jina's, as vLLM serves it) and
`POST /v1/score` (vLLM's): prefill-only engine requests whose answer is a pooled hidden state or a score
(SamplingParams.pooling; kestrel.engine.pooling), scheduled, batched and cached like any prefill.

How the model embeds and scores comes from its folder (kestrel.server.pooling_model). A rerank or score
request puts each (query, document) pair in the scoring template and reads the probability of the
template's "yes" token against its "no" token at the end.
"""
from __future__ import annotations

import base64
import struct
import time
import uuid
from typing import Any

from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kestrel.core.sampling_params import SamplingParams
from kestrel.server.admission import shutting_down
from kestrel.server.errors import APIError, bad_request
from kestrel.server.generation import Choice, Generation
from kestrel.server.protocol import _Body, prompt_list, validated
from kestrel.server.state import ServerState, parse_body, prompt_name
from kestrel.server.sse import ClientGone, until_disconnect


class EmbeddingRequest(_Body):
    model: str | None = None
    input: Any  # str | list[str] | list[int] | list[list[int]], checked by prompt_list()
    encoding_format: str = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None
    priority: int = 0


class RerankRequest(_Body):
    model: str | None = None
    query: str
    documents: list[str | dict[str, Any]]
    top_n: int | None = Field(None, ge=0)
    return_documents: bool = True
    priority: int = 0


class ScoreRequest(_Body):
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    priority: int = 0


async def embeddings(state: ServerState, request: Request) -> Response:
    body, body_bytes = await parse_body(request, EmbeddingRequest)
    model = state.check_model(body.model)
    if body.encoding_format not in ("float", "base64"):
        raise bad_request(f"encoding_format must be 'float' or 'base64', got {body.encoding_format!r}",
                          "encoding_format")
    embedder = state.embedder
    if embedder is None:
        raise bad_request("this model does not serve embeddings", "model")
    if body.dimensions is not None and (why := embedder.check_dimensions(body.dimensions)) is not None:
        raise bad_request(why, "dimensions")
    try:
        inputs, _ = prompt_list(body.input)
    except APIError:  # prompt_list names `prompt`; this API's field is `input`
        raise bad_request("input must be a string, a list of strings, a list of token ids, or a list of lists of "
                          "token ids (none of them empty)", "input") from None
    if any(isinstance(p, str) and not p for p in inputs):
        raise bad_request("input must not contain empty strings", "input")
    params = SamplingParams(max_new_tokens=0, priority=body.priority, pooling=embedder.params(body.dimensions))
    choices = await _run(state, request, inputs, params, "input", body_bytes, state.lora_of(body.model))
    data = [{"object": "embedding", "index": c.index, "embedding": _encoded(c.pooled, body.encoding_format)}
            for c in choices]
    tokens = sum(len(c.prompt_ids) for c in choices)
    return JSONResponse({"id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                         "model": model, "data": data,
                         "usage": _usage(tokens)})


async def rerank(state: ServerState, request: Request) -> Response:
    body, body_bytes = await parse_body(request, RerankRequest)
    model = state.check_model(body.model)
    texts = [_document_text(d, i) for i, d in enumerate(body.documents)]
    scores, tokens = await _scores(state, request, [body.query] * len(texts), texts, "documents", body_bytes,
                                   body.priority, state.lora_of(body.model))
    order = sorted(range(len(texts)), key=lambda i: -scores[i])
    top = order if body.top_n is None or body.top_n == 0 else order[:body.top_n]
    results = [{"index": i, "relevance_score": scores[i]} | ({"document": {"text": texts[i]}}
                                                              if body.return_documents else {}) for i in top]
    return JSONResponse({"id": f"rerank-{uuid.uuid4().hex}", "model": model, "results": results,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


async def score(state: ServerState, request: Request) -> Response:
    body, body_bytes = await parse_body(request, ScoreRequest)
    model = state.check_model(body.model)
    queries = [body.text_1] if isinstance(body.text_1, str) else body.text_1
    documents = [body.text_2] if isinstance(body.text_2, str) else body.text_2
    if not queries or not documents:
        raise bad_request("text_1 and text_2 must not be empty lists", "text_1" if not queries else "text_2")
    if len(queries) == 1:  # one query against each document
        queries = queries * len(documents)
    elif len(queries) != len(documents):
        raise bad_request(f"text_1 has {len(queries)} texts and text_2 {len(documents)}: give one text_1, or as "
                          "many as text_2 (scored in pairs)", "text_2")
    scores, tokens = await _scores(state, request, queries, documents, "text_2", body_bytes, body.priority,
                                   state.lora_of(body.model))
    return JSONResponse({"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                         "model": model, "data": [{"index": i, "object": "score", "score": s}
                                                  for i, s in enumerate(scores)],
                         "usage": _usage(tokens)})


# ---- helpers ----------------------------------------------------------------------------------
def _usage(prompt_tokens: int) -> dict[str, int]:
    """vLLM's usage of an answer without generated tokens (its completion_tokens is 0)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": 0, "total_tokens": prompt_tokens}


async def _scores(state: ServerState, request: Request, queries: list[str], documents: list[str], param: str,
                  body_bytes: int, priority: int, lora_name: str | None) -> tuple[list[float], int]:
    """The probability of the "yes" token for each (query, document) pair, and the prompt tokens read (with
    the LoRA adapter `lora_name`, None: the base model)."""
    scorer = state.scorer
    if scorer is None or scorer.token_ids is None:
        raise bad_request(scorer.unavailable if scorer is not None else "this model does not serve scores", "model")
    if not documents:
        raise bad_request("documents must not be empty", param)
    prompts: list[str | list[int]] = [scorer.prompt(q, d) for q, d in zip(queries, documents)]
    params = SamplingParams(max_new_tokens=0, priority=priority, pooling=scorer.params())
    choices = await _run(state, request, prompts, params, param, body_bytes, lora_name)
    return [c.pooled[0] for c in choices], sum(len(c.prompt_ids) for c in choices)


async def _run(state: ServerState, request: Request, inputs: list[str | list[int]], params: SamplingParams,
               param: str, body_bytes: int, lora_name: str | None = None) -> list[Choice]:
    """One prefill-only engine request per input (with the LoRA adapter `lora_name`), run to the end; their
    choices carry `pooled`."""
    params = validated(params, state.client.info.vocab_size, {})
    ticket = state.admit(len(inputs), param)
    with ticket.released_on_error():
        prompts = await state.prompt_ids(ticket, inputs, param, body_bytes)
        if (bad := next((i for i, p in enumerate(prompts) if not p), None)) is not None:
            raise bad_request(f"{prompt_name(param, bad, len(prompts))} has no tokens", param)
        gen = Generation(state.client, None, prompts, [params] * len(prompts), ticket, prompt_param=param,
                         lora_name=lora_name)
    try:
        await gen.start()
        await until_disconnect(request.receive, gen.run())
    except ClientGone:
        raise APIError(499, "the client closed the request") from None  # nobody reads it
    finally:
        gen.close()
    if any(c.pooled is None for c in gen.choices):  # aborted by the shutdown before its prefill ended
        raise shutting_down()
    return gen.choices


def _document_text(document: str | dict[str, Any], index: int) -> str:
    if isinstance(document, str):
        return document
    text = document.get("text")
    if not isinstance(text, str):
        raise bad_request(f"documents[{index}] must be a string or an object with a string 'text'", "documents")
    return text


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    """base64: the little-endian float32 bytes, as OpenAI sends them (its SDK decodes them with numpy)."""
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()

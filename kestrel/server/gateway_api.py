"""What a gateway in front of several replicas reads of each one, in SGLang's shapes: its load and its model;
and what it asks of each: to flush its prefix cache.

The SGLang model gateway (`smg`, docs/deployment.md) polls `/v1/loads` for the load-aware parts of its
policies (cache-aware routing falls back to the least loaded replica when loads drift apart) and reads
`/model_info` when it registers a worker. `/get_load` and `/get_model_info` are the older names SGLang
still answers. One engine per server: one data-parallel rank in every answer. Its `POST /flush_cache`
posts `/flush_cache` to every worker and counts a 200 as flushed.
"""
from __future__ import annotations

from datetime import datetime, timezone

from fastapi import FastAPI
from starlette.responses import JSONResponse, PlainTextResponse, Response

from kestrel.server.errors import APIError
from kestrel.server.state import ServerState


def loads(state: ServerState) -> dict:
    stats = state.client.stats
    return {
        "timestamp": datetime.now(timezone.utc).isoformat(),
        "dp_rank_count": 1,
        "loads": [{
            "dp_rank": 0,
            "num_running_reqs": stats.num_running,
            "num_waiting_reqs": stats.num_waiting,
            "num_total_reqs": stats.num_running + stats.num_waiting,
            "num_used_tokens": stats.num_used_tokens,
            "max_total_num_tokens": stats.max_total_tokens,
            "token_usage": stats.token_usage,
        }],
    }


def model_info(state: ServerState) -> dict:
    return {"model_path": state.model_path, "tokenizer_path": state.model_path if state.tokenizer is not None else None,
            "is_generation": True, "served_model_name": state.served_model_name}


def install(app: FastAPI, state: ServerState) -> None:
    @app.get("/v1/loads")
    async def v1_loads() -> Response:
        return JSONResponse(loads(state))

    @app.get("/get_load")
    async def get_load() -> Response:
        rank = loads(state)["loads"][0]
        return JSONResponse([{"dp_rank": 0, "num_reqs": rank["num_total_reqs"],
                              "num_waiting_reqs": rank["num_waiting_reqs"], "num_tokens": rank["num_used_tokens"]}])

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def get_model_info() -> Response:
        return JSONResponse(model_info(state))

    @app.get("/flush_cache", response_class=PlainTextResponse)
    @app.post("/flush_cache", response_class=PlainTextResponse)
    async def flush_cache() -> Response:
        """SGLang's answers: 200 with a line of text once flushed, 400 while requests run (a flush then would
        pull pages from under them, so the engine refuses it and nothing is dropped)."""
        state.check_alive()
        if not await state.client.flush_cache():
            raise APIError(400, "the cache was not flushed: requests are queued or running; retry when the server "
                                "is idle", code="requests_running")
        return PlainTextResponse("Cache flushed.\n")

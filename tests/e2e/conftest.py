"""Tiny checkpoints shared by the end-to-end tests (built once per session), the transformers oracle, the
pool check, and the HTTP app served in process over a fake engine."""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import threading
from collections.abc import AsyncIterator, Callable

import pytest
import torch

from tests.tiny_models import make_tiny_model

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """tiny_model(arch, **overrides) -> folder of a random tiny checkpoint with a tokenizer."""
    cache: dict[tuple[str, str], str] = {}

    def build(arch: str = "llama", **overrides) -> str:
        key = (arch, repr(sorted(overrides.items())))
        if key not in cache:
            path = tmp_path_factory.mktemp(f"{arch}-model")
            cache[key] = str(make_tiny_model(arch, path, with_tokenizer=True, **overrides))
        return cache[key]

    return build


def hf_greedy(model_path: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """The oracle: transformers generate(do_sample=False), one prompt at a time, never stopping at eos."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    # generate() merges the model's own generation config into ours; drop its eos so it never stops.
    model.generation_config.eos_token_id = None
    gen = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=0,
                           eos_token_id=None, pad_token_id=0)
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen)
            outs.append(out[0, len(p):].tolist())
    return outs


def assert_pool_full(engine) -> None:
    """Every KV slot is free or held by an unlocked radix node, and eviction gives all back."""
    alloc, radix = engine.kv_memory.allocator, engine.radix
    alloc.check()
    assert radix.protected_size() == 0
    assert alloc.available_size() + radix.evictable_size() == alloc.size
    radix.evict(alloc.size)
    assert alloc.available_size() == alloc.size
    alloc.check()


class _FakeProcess:
    """What EngineClient needs of its engine process, played by the fake engine's thread."""

    pid, exitcode = 4242, None

    def __init__(self, thread: threading.Thread) -> None:
        self.thread = thread

    def is_alive(self) -> bool:
        return self.thread.is_alive()

    def join(self, timeout: float | None = None) -> None:
        self.thread.join(timeout)


@contextlib.asynccontextmanager
async def fake_engine_app(engine: Callable, tokenizer=None, http_module=None, **state_fields) -> AsyncIterator:
    """(EngineClient, httpx.AsyncClient) of the HTTP app served in process, its engine side played by
    `engine(inbox, outbox)` on a thread: a fake speaking the real IPC messages over real pipes, so the HTTP
    process's code (dispatcher, generation, responses) runs as in `kestrel serve` with no engine code.
    With a `tokenizer`, text prompts and chat messages are served too; `state_fields` are further
    ServerState fields (tool_parser, reasoning_parser). `http_module`: the HTTP client's package when
    not httpx (the anthropic client takes only httpx2's)."""
    # Imported here: the server's modules take a second and a half to import, which the other e2e
    # tests would pay for nothing.
    import httpx
    http_module = http_module or httpx

    from kestrel.server.admission import AdmissionControl
    from kestrel.server.app import build_app
    from kestrel.server.engine_client import EngineClient
    from kestrel.server.messages import EngineReady
    from kestrel.server.metrics import ServerMetrics
    from kestrel.server.state import ServerState
    from kestrel.server.tokenization import Tokenization

    inbox_r, inbox_w = mp.Pipe(duplex=False)
    outbox_r, outbox_w = mp.Pipe(duplex=False)
    thread = threading.Thread(target=engine, args=(inbox_r, outbox_w), daemon=True)
    thread.start()
    metrics = ServerMetrics("fake")
    context = 64 if tokenizer is None else 1024  # room for a chat template's prompt
    info = EngineReady(pid=4242, vocab_size=100 if tokenizer is None else len(tokenizer), max_req_len=context,
                       max_total_tokens=1000, context_length=context)
    client = EngineClient(_FakeProcess(thread), inbox_w, outbox_r, info, metrics)
    # Prompts this short are tokenized inline: the pool never starts a process.
    tokenization = Tokenization(tokenizer, 1) if tokenizer is not None else None
    state = ServerState(client, tokenization, "fake", "/nowhere", metrics, AdmissionControl(8), **state_fields)
    client.start()
    try:
        transport = http_module.ASGITransport(app=build_app(state, 2**20, 30.0))
        async with http_module.AsyncClient(transport=transport, base_url="http://kestrel") as http:
            yield client, http
    finally:
        await client.shutdown(timeout=5)  # sends Shutdown: the fake engine's thread ends
        if tokenization is not None:
            tokenization.shutdown()

"""Tiny checkpoints shared by the end-to-end tests (built once per session)."""
from __future__ import annotations

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

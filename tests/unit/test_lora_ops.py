"""The segmented LoRA matmul: the torch reference against a per-token loop, and the Triton kernels (under
the interpreter on CPU) against the reference, over tokens of mixed slots, slot -1 and merged parts."""
from __future__ import annotations

import pytest
import torch

from kestrel import envs
from kestrel.lora.ops import lora_delta_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PARTS = {"qkv": (24, 8, 8), "gate_up": (40, 40), "single": (32,)}


def _case(parts: tuple[int, ...], slots: list[int], seed: int = 0, rank: int = 4, k: int = 48, num_slots: int = 3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(len(slots), k, generator=g)
    a = torch.randn(num_slots, len(parts) * rank, k, generator=g)
    b = torch.randn(num_slots, sum(parts), rank, generator=g)
    return x, torch.tensor(slots), a, b


def _loop(x, slots, a, b, parts):
    """Per token: its slot's A and B, part by part."""
    r = a.shape[1] // len(parts)
    out = torch.zeros(x.shape[0], sum(parts))
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        start = 0
        for i, size in enumerate(parts):
            out[t, start:start + size] = (x[t] @ a[s, i * r:(i + 1) * r].t()) @ b[s, start:start + size].t()
            start += size
    return out


@pytest.mark.parametrize("kind", sorted(PARTS))
def test_reference_equals_per_token_loop(kind: str) -> None:
    parts = PARTS[kind]
    x, slots, a, b = _case(parts, [0, 2, -1, 1, 1, 0, -1, 2])
    torch.testing.assert_close(lora_delta_reference(x, slots, a, b, parts), _loop(x, slots, a, b, parts))


@pytest.mark.skipif(DEVICE == "cpu" and not envs.triton_interpret(), reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("kind", sorted(PARTS))
@pytest.mark.parametrize("rank", [4, 5])
def test_triton_kernels_equal_the_reference(kind: str, rank: int) -> None:
    from kestrel.lora.triton_ops import lora_shrink_expand

    parts = PARTS[kind]
    x, slots, a, b = (t.to(DEVICE) for t in _case(parts, [1, -1, 0, 2, 2, -1, 0], rank=rank, k=200))
    y = torch.randn(x.shape[0], sum(parts), device=DEVICE)
    want = y + lora_delta_reference(x, slots, a, b, parts)
    got = lora_shrink_expand(y.clone(), x, slots, a, b, parts)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)

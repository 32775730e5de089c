"""Fused Triton elementwise kernels == the torch path (interpreter on CPU, CUDA when present)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from kestrel.layers.activation import SiluAndMul  # noqa: E402
from kestrel.layers.norm import RMSNorm  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16] if DEVICE == "cuda" else [torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96])
def test_add_rmsnorm_equals_torch(dtype, hidden):
    gen = torch.Generator().manual_seed(hidden)
    torch_norm, fused = RMSNorm(hidden, 1e-5), RMSNorm(hidden, 1e-5, use_triton=True)
    weight = torch.randn(hidden, generator=gen)
    torch_norm.weight.data, fused.weight.data = weight.clone(), weight.clone()
    torch_norm, fused = torch_norm.to(DEVICE, dtype), fused.to(DEVICE, dtype)
    x = torch.randn(7, hidden, generator=gen).to(DEVICE, dtype)
    residual = torch.randn(7, hidden, generator=gen).to(DEVICE, dtype)
    torch.testing.assert_close(fused(x), torch_norm(x))
    out, new_residual = fused(x, residual.clone())
    ref_out, ref_residual = torch_norm(x, residual.clone())
    torch.testing.assert_close(new_residual, ref_residual)
    torch.testing.assert_close(out, ref_out)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_equals_torch(dtype):
    x = torch.randn(5, 2 * 1500, generator=torch.Generator().manual_seed(0)).to(DEVICE, dtype)
    torch.testing.assert_close(SiluAndMul(use_triton=True)(x), SiluAndMul()(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 40])
def test_head_rmsnorm_equals_the_two_torch_norms(dtype, head_dim):
    """Qwen3's q and k norms in one launch, on the q | k part of a fused qkv output (strided rows)."""
    from kestrel.layers.fused_triton import head_rmsnorm

    gen = torch.Generator().manual_seed(head_dim)
    q_heads, k_heads, rows = 4, 2, 5
    q_norm, k_norm = RMSNorm(head_dim, 1e-6), RMSNorm(head_dim, 1e-6)
    q_norm.weight.data, k_norm.weight.data = torch.randn(head_dim, generator=gen), torch.randn(head_dim, generator=gen)
    q_norm, k_norm = q_norm.to(DEVICE, dtype), k_norm.to(DEVICE, dtype)
    qkv = (3 * torch.randn(rows, (q_heads + 2 * k_heads) * head_dim, generator=gen)).to(DEVICE, dtype)
    qk = qkv[:, :(q_heads + k_heads) * head_dim]
    q, k = qk.split([q_heads * head_dim, k_heads * head_dim], dim=-1)
    want = torch.cat([q_norm(q.reshape(rows, -1, head_dim)).flatten(1),
                      k_norm(k.reshape(rows, -1, head_dim)).flatten(1)], -1)
    got = head_rmsnorm(qk, q_norm.weight, k_norm.weight, q_heads, 1e-6)
    torch.testing.assert_close(got, want)
    swapped = head_rmsnorm(qk, k_norm.weight, q_norm.weight, q_heads, 1e-6)
    assert not torch.equal(got[:, :head_dim], swapped[:, :head_dim])  # the weights are told apart


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 40])
def test_head_rmsnorm_with_rope_equals_the_norm_then_the_rotation(dtype, head_dim):
    """The head norm's launch rotating too, against head_rmsnorm then rope on the torch path, at scattered
    positions, on the q | k part of a fused qkv output (strided rows)."""
    from kestrel.layers.fused_triton import head_rmsnorm
    from kestrel.layers.rotary import RopeConfig, RotaryEmbedding

    gen = torch.Generator().manual_seed(head_dim + 1)
    q_heads, k_heads, rows = 4, 2, 5
    rotary = RotaryEmbedding(head_dim, 128, RopeConfig(theta=10000.0)).to(DEVICE)
    q_w, k_w = (torch.randn(head_dim, generator=gen).to(DEVICE, dtype) for _ in range(2))
    qkv = (3 * torch.randn(rows, (q_heads + 2 * k_heads) * head_dim, generator=gen)).to(DEVICE, dtype)
    qk = qkv[:, :(q_heads + k_heads) * head_dim]
    positions = torch.tensor([0, 7, 3, 100, 127], device=DEVICE)
    want = rotary(positions, head_rmsnorm(qk, q_w, k_w, q_heads, 1e-6))
    got = head_rmsnorm(qk, q_w, k_w, q_heads, 1e-6, positions, rotary.cos_sin_cache)
    torch.testing.assert_close(got, want)
    assert not torch.equal(got, head_rmsnorm(qk, q_w, k_w, q_heads, 1e-6))  # rotated: position 0 is not all


def test_qwen3_attention_takes_the_fused_head_norm_with_triton_elementwise():
    from kestrel.layers.kernels import Kernels
    from kestrel.layers.rotary import RotaryEmbedding
    from kestrel.models.arch_config import parse_arch_config
    from kestrel.models.llama import LlamaAttention

    cfg = parse_arch_config({"architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
                             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
                             "num_hidden_layers": 1, "vocab_size": 100, "rms_norm_eps": 1e-6,
                             "max_position_embeddings": 64})
    assert cfg.qk_norm
    torch.manual_seed(0)
    rotary = RotaryEmbedding(cfg.head_dim, 64, cfg.rope)
    plain = LlamaAttention(cfg, 0, rotary)
    fused = LlamaAttention(cfg, 0, rotary, kernels=Kernels(triton_elementwise=True))
    for module in (plain, fused):
        for param in module.parameters():
            param.data = torch.randn(param.shape, generator=torch.Generator().manual_seed(param.numel()))
    assert fused.fused_qk_norm is not None and plain.fused_qk_norm is None
    assert not fused.rope_in_qk_norm  # rope on the torch path: the norm alone is fused
    # With rope in Triton too, the norm and the rotation are one launch.
    fused_rope = LlamaAttention(cfg, 0, RotaryEmbedding(cfg.head_dim, 64, cfg.rope, use_triton=True),
                                kernels=Kernels(triton_elementwise=True))
    fused_rope.load_state_dict(fused.state_dict())
    assert fused_rope.rope_in_qk_norm
    plain, fused, fused_rope = plain.to(DEVICE), fused.to(DEVICE), fused_rope.to(DEVICE)
    hidden, positions = torch.randn(3, 64).to(DEVICE), torch.tensor([0, 5, 9], device=DEVICE)
    want = plain.qkv(positions, hidden)
    for module in (fused, fused_rope):
        for got, expected in zip(module.qkv(positions, hidden), want):
            torch.testing.assert_close(got, expected)

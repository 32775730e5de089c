"""Batch-1 decode's float linears through the Triton GEMV (interpreter): the same outputs as F.linear at one
row, F.linear itself at more rows, quantized layers left alone."""
import pytest
import torch
from torch import nn

from kestrel.layers.linear import MergedLinear
from kestrel.layers.one_row_gemv import route_one_row_linears


def test_one_row_linears_take_the_gemv_and_match_f_linear():
    pytest.importorskip("triton")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(96, 40, bias=True), MergedLinear(40, [24, 8], bias=False),
                          nn.Linear(32, 700, bias=False)).to(torch.bfloat16)
    frozen = nn.Linear(96, 8).float()  # float32: not a bf16 / fp16 weight, keeps F.linear
    xs = [torch.randn(rows, 96, dtype=torch.bfloat16) for rows in (1, 3)]
    with torch.no_grad():
        want = [model(x).float() for x in xs]
        assert route_one_row_linears(model) == 3 and route_one_row_linears(nn.Sequential(frozen)) == 0
        got = [model(x).float() for x in xs]
    torch.testing.assert_close(got[0], want[0], atol=3e-2, rtol=2e-2)  # bf16 outputs, float32 sums either way
    assert torch.equal(got[1], want[1])  # three rows: F.linear, untouched
    assert "forward" in vars(model[0]) and "forward" not in vars(frozen)


@pytest.mark.parametrize("fp8", [False, True])
def test_gated_down_equals_the_activation_then_the_linear(fp8, monkeypatch):
    """A gated MLP's down projection at one row with silu(gate) * up inside the GEMV: the values of the
    activation kernel then the linear's own one-row path, bit for bit; no fused path elsewhere, nor when off."""
    pytest.importorskip("triton")
    from kestrel.layers import one_row_gemv
    from kestrel.layers.fp8_linear import Fp8Linear
    from kestrel.layers.fused_triton import silu_and_mul
    from kestrel.layers.one_row_gemv import gated_down

    monkeypatch.setattr(one_row_gemv, "GATED_DOWN", True)

    torch.manual_seed(1)
    linear = nn.Linear(256, 40, bias=True).to(torch.bfloat16)
    if fp8:
        linear = Fp8Linear.from_linear(linear, use_triton=True)
    else:
        assert route_one_row_linears(nn.Sequential(linear)) == 1
    h = 2 * torch.randn(1, 512, dtype=torch.bfloat16)
    with torch.no_grad():
        want = linear(silu_and_mul(h))
        got = gated_down(linear, h)
        assert torch.equal(got, want) and got.isfinite().all()
        assert gated_down(linear, torch.cat([h, h])) is None  # two rows: the caller's two launches
    assert gated_down(nn.Linear(256, 40).to(torch.bfloat16), h) is None  # not routed: F.linear's, untouched
    monkeypatch.setattr(one_row_gemv, "GATED_DOWN", False)
    assert gated_down(linear, h) is None


def test_a_llama_mlp_at_one_row_takes_the_gated_down_gemv(monkeypatch):
    pytest.importorskip("triton")
    from kestrel.layers import one_row_gemv

    monkeypatch.setattr(one_row_gemv, "GATED_DOWN", True)
    from kestrel.layers.kernels import Kernels
    from kestrel.models.arch_config import parse_arch_config
    from kestrel.models.llama import LlamaMLP

    cfg = parse_arch_config({"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 384,
                             "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1,
                             "vocab_size": 100, "rms_norm_eps": 1e-6, "max_position_embeddings": 64})
    torch.manual_seed(2)
    mlp = LlamaMLP(cfg, Kernels(triton_elementwise=True)).to(torch.float16)
    for param in mlp.parameters():
        param.data = 0.1 * torch.randn(param.shape, dtype=torch.float16)
    assert route_one_row_linears(mlp) == 2
    calls = []
    fused = mlp.gated_down
    mlp.gated_down = lambda linear, h: calls.append(h.shape) or fused(linear, h)
    x = torch.randn(1, 64, dtype=torch.float16)
    with torch.no_grad():
        got = mlp(x)
        mlp.gated_down = None
        want = mlp(x)
    assert calls == [torch.Size([1, 768])] and torch.equal(got, want) and got.isfinite().all()

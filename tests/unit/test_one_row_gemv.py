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

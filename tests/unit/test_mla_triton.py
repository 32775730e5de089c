"""The Triton backend's MLA form under the interpreter against torch_native (and the dense reference):
the absorbed split-K decode kernel (fused store, merge), extend after a cached prefix, mixed lengths,
a verify tree, page sizes 1 and 4, FP8 entries; extends in both forms (the MHA form over up-projected
keys and values, and the absorbed form it leaves to contexts past MHA_EXTEND_MAX)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from kestrel import envs  # noqa: E402
from kestrel.attention.mla.torch_native import TorchNativeMLABackend  # noqa: E402
from kestrel.attention.mla import triton_backend  # noqa: E402
from kestrel.attention.mla.triton_backend import TritonMLABackend  # noqa: E402
from kestrel.core.forward_mode import ForwardMode  # noqa: E402
from tests.unit.mla_cases import make_case, reference, run  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(DEVICE == "cpu" and not envs.triton_interpret(),
                                reason="Triton kernels need CUDA or TRITON_INTERPRET=1")


@pytest.fixture(params=["mha", "absorbed"])
def extend_form(request, monkeypatch):
    """Which form an extend takes: the MHA form within MHA_EXTEND_MAX, the absorbed form past it."""
    if request.param == "absorbed":
        monkeypatch.setattr(triton_backend, "MHA_EXTEND_MAX", 0)
    return request.param


def both(prefix, extend, page_size, **kw):
    """(triton output, torch_native output, dense reference, the case Triton ran on)."""
    native = make_case(prefix, extend, page_size, device=DEVICE, **kw)
    case = make_case(prefix, extend, page_size, device=DEVICE, **kw)
    upcast = DEVICE == "cpu"
    out = run(TritonMLABackend(case.pools, case.req_to_token, upcast=upcast), case)
    expected = run(TorchNativeMLABackend(native.pools, native.req_to_token, name="torch_native"), native)
    return out, expected, reference(case), case


@pytest.mark.parametrize("page_size", [1, 4])
def test_decode_kernel_matches_torch_native(page_size):
    # 2 splits (the interpreter's cap) over lengths 1..40: empty chunks, the merge, the fused store.
    out, expected, ref, case = both([39, 17, 0, 6], [1, 1, 1, 1], page_size, seed=1, heads=20)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(out.double().cpu(), ref.cpu(), atol=2e-5, rtol=2e-5)
    stored = case.pools.layer(0).latent[case.batch.out_cache_loc]
    torch.testing.assert_close(stored, torch.cat([case.latent, case.k_rope], dim=-1))


@pytest.mark.parametrize("page_size", [1, 4])
def test_extend_after_prefix_and_mixed_lengths_match_torch_native(page_size, extend_form):
    out, expected, ref, _ = both([0, 9, 20], [7, 1, 3], page_size, seed=2, mode=ForwardMode.MIXED)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(out.double().cpu(), ref.cpu(), atol=2e-5, rtol=2e-5)


def test_fp8_entries_decode_and_extend(extend_form):
    for prefix, extend in (([12, 5], [1, 1]), ([4, 0], [3, 5])):
        out, expected, _, case = both(prefix, extend, 4, seed=3, pool_dtype=torch.float8_e4m3fn)
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
        assert case.pools.layer(0).latent.dtype == torch.float8_e4m3fn


def test_verify_tree_reaches_the_extend_kernel(extend_form):
    """A tree in which the second draft token does not see the first: differs from causal, equals torch_native."""
    cases = [make_case([5], [3], 1, device=DEVICE, mode=ForwardMode.TARGET_VERIFY, seed=4) for _ in range(2)]
    tree = torch.tensor([[1, 0, 0], [0, 1, 0], [1, 1, 1]], dtype=torch.bool, device=DEVICE).flatten()
    for case in cases:
        case.batch.tree_mask, case.batch.tree_mask_starts = tree, torch.tensor([0], device=DEVICE)
    out = run(TritonMLABackend(cases[0].pools, cases[0].req_to_token, upcast=DEVICE == "cpu"), cases[0])
    expected = run(TorchNativeMLABackend(cases[1].pools, cases[1].req_to_token, name="torch_native"), cases[1])
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    assert not torch.allclose(out.double().cpu(), reference(cases[0]).cpu(), atol=1e-3)

"""DeepSeek-V4's decode kernels (through Triton's interpreter) against the torch paths they replace, after
one decode step, for both kinds of step plan (host lengths; the static-sizes plan of a CUDA-graph decode):

- the compressor's (`triton_ops.compress_decode`): the state rings and the stored entries, ratio 4 with
  overlap (the attention's and the indexer's compressors) and ratio 128, requests that close a block
  (block 0, without a predecessor, and later ones) beside requests that do not;
- the indexer's block scores (`triton_ops.index_scores`): the blocks each query picks."""
from __future__ import annotations

import pytest
import torch

from kestrel import envs
from kestrel.bench.dsv4_layers import LayerContext
from kestrel.core.forward_batch import ForwardBatch
from kestrel.core.forward_mode import ForwardMode
from kestrel.layers.kernels import Kernels
from kestrel.models.deepseek_v4.config import parse_v4_config
from kestrel.models.deepseek_v4.model import DeepseekV4ForCausalLM
from tests.model import dsv4_reference as ref

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(DEVICE.type == "cpu" and not envs.triton_interpret(),
                                reason="the kernels run on CUDA, or on CPU through TRITON_INTERPRET=1")

# Positions of this step's tokens: 3 closes ratio-4 block 0; 255 closes ratio-4 block 63 and ratio-128
# block 1; 6 and 129 close none; 383 closes ratio-128 block 2 and ratio-4 block 95.
POSITIONS = [3, 6, 255, 129, 383]


def step(ctx: LayerContext, host_lengths: bool) -> ForwardBatch:
    rows = ctx.rows[:len(POSITIONS)]
    table = ctx.memory.req_to_token.table
    prefix = torch.tensor(POSITIONS, device=DEVICE)
    n = len(POSITIONS)
    return ForwardBatch(
        forward_mode=ForwardMode.DECODE, input_ids=torch.zeros(n, dtype=torch.int64, device=DEVICE),
        positions=prefix.clone(), out_cache_loc=table[rows, prefix], req_pool_indices=torch.tensor(rows, device=DEVICE),
        seq_lens=prefix + 1, prefix_lens=prefix.clone(), extend_lens=torch.ones(n, dtype=torch.int64, device=DEVICE),
        seq_lens_cpu=(prefix + 1).tolist() if host_lengths else None,
        prefix_lens_cpu=POSITIONS if host_lengths else None, extend_lens_cpu=[1] * n if host_lengths else None,
        max_extend=1, logits_indices=torch.arange(n, device=DEVICE), attn_backend=ctx.backend)


def fused_model(dtype: torch.dtype, **config) -> DeepseekV4ForCausalLM:
    model = DeepseekV4ForCausalLM(parse_v4_config(ref.RefConfig(**config).native_config()),
                                  Kernels(triton_elementwise=True))
    for name, p in model.named_parameters():  # ape and the norms' weights are 0 / 1 at init: make them count
        if "compressor" in name:
            p.data.normal_(0, 0.5)
    model.to(dtype)
    for layer in model.layers:  # the compressor's projections and ape stay float32, as loading keeps them
        for module in (getattr(layer.attn, "compressor", None), getattr(getattr(layer.attn, "indexer", None),
                                                                         "compressor", None)):
            if module is not None:
                module.wkv.float(), module.wgate.float()
                module.ape.data = module.ape.data.float()
    return model.to(DEVICE)


@pytest.mark.parametrize("host_lengths", [True, False], ids=["host-plan", "graph-plan"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_compressor_step_equals_the_torch_path(host_lengths, dtype) -> None:
    torch.manual_seed(0)
    model = fused_model(dtype)
    ctx = LayerContext(model, len(POSITIONS), 512, 128, DEVICE, dtype)
    cfg = model.config
    compressors = []
    for ratio in (4, 128):
        attn = model.layers[cfg.compress_ratios.index(ratio)].attn
        compressors.append((attn.layer_id, attn.compressor))
        if ratio == 4:
            compressors.append((attn.layer_id, attn.indexer.compressor))
    for layer_id, comp in compressors:
        layer = ctx.backend.pools.layer(layer_id)
        names = (*comp.state, comp.entries)
        for n in names:  # earlier steps' rows in the rings, earlier blocks' entries in the buffer
            getattr(layer, n).copy_(torch.randn(getattr(layer, n).shape, device=DEVICE))
        before = {n: getattr(layer, n).clone() for n in names}
        x = torch.randn(len(POSITIONS), cfg.hidden_size, device=DEVICE).to(dtype)
        fb = step(ctx, host_lengths)
        after = {}
        for fused in (False, True):
            for n in names:
                getattr(layer, n).copy_(before[n])
            ctx.backend.init_forward_metadata(fb)
            comp.fused = fused
            with torch.inference_mode():
                comp(x, fb.positions, ctx.backend, layer_id)
            after[fused] = {n: getattr(layer, n).clone() for n in names}
        comp.fused = True
        for n in comp.state:
            assert torch.equal(after[True][n], after[False][n]), (layer_id, n)
        torch_entries, fused_entries = after[False][comp.entries], after[True][comp.entries]
        # The closed blocks' entries written, every other slot but BLOCK slot 0 (the requests that close
        # none write there) left as it was.
        table = ctx.memory.req_to_token.table
        closed = [int(table[r, (p // comp.ratio) * comp.ratio]) // comp.ratio
                  for r, p in zip(ctx.rows, POSITIONS) if (p + 1) % comp.ratio == 0]
        written = (fused_entries != before[comp.entries]).flatten(1).any(1).nonzero().flatten().tolist()
        assert closed and set(written) - {0} == set(closed)
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(fused_entries[1:].float(), torch_entries[1:].float(), **tol)


@pytest.mark.parametrize("host_lengths", [True, False], ids=["host-plan", "graph-plan"])
def test_fused_index_scores_pick_the_torch_path_s_blocks(host_lengths) -> None:
    """float32, 16 indexer heads (an exact tie among random scores is then improbable); the top-k of 8
    among 1 to 96 visible blocks, padded with -1 where fewer are visible."""
    torch.manual_seed(1)
    model = fused_model(torch.float32, index_n_heads=16)
    ctx = LayerContext(model, len(POSITIONS), 512, 128, DEVICE, torch.float32)
    attn = model.layers[model.config.compress_ratios.index(4)].attn
    layer = ctx.backend.pools.layer(attn.layer_id)
    layer.idx_k.copy_(torch.randn(layer.idx_k.shape, device=DEVICE))
    fb = step(ctx, host_lengths)
    x = torch.randn(len(POSITIONS), model.config.hidden_size, device=DEVICE)
    c_q = torch.randn(len(POSITIONS), model.config.q_lora_rank, device=DEVICE)
    picks = {}
    for fused in (False, True):
        ctx.backend.init_forward_metadata(fb)
        attn.indexer.fused = fused
        with torch.inference_mode():
            # The indexer's compressor writes the block a token closes before the scores read it: the same
            # entries on both paths (the test above).
            picks[fused] = attn.indexer(x, c_q, fb.positions, ctx.backend, attn.layer_id)
    assert picks[True].shape == picks[False].shape == (len(POSITIONS), 8)
    assert (picks[True] == -1).sum() == 2 * 7  # positions 3 and 6 see one block each
    for want, got in zip(picks[False].tolist(), picks[True].tolist()):
        assert sorted(got) == sorted(want)


def test_index_scores_round_as_the_torch_products_in_bfloat16() -> None:
    from kestrel.models.deepseek_v4.triton_ops import index_scores

    torch.manual_seed(2)
    B, heads, dim, n, slots_total = 3, 20, 48, 70, 300
    q = torch.randn(B, heads, dim, device=DEVICE).bfloat16()
    w = torch.randn(B, heads, device=DEVICE).bfloat16()
    keys = torch.randn(slots_total, dim, device=DEVICE).bfloat16()
    slots = torch.randint(0, slots_total, (B, n), device=DEVICE)
    visible = torch.tensor([0, 33, 70], device=DEVICE)
    got = index_scores(q, w, 0.125, keys, slots, visible)
    weights = (w.float() * 0.125).bfloat16()[:, None, :]
    want = torch.bmm(weights, torch.bmm(q, keys[slots].transpose(1, 2)).relu()).squeeze(1).float()
    want = want.masked_fill(torch.arange(n, device=DEVICE)[None, :] >= visible[:, None], float("-inf"))
    assert torch.equal(got.isinf(), want.isinf())
    # Scores are O(10); one bfloat16 rounding of a sum taken in another order is O(0.05).
    torch.testing.assert_close(got, want, atol=0.1, rtol=1 / 64)

"""DeepSeek-V4 through its incremental path (KV memory from its layout, dsv4 backend) against the
independent reference in `dsv4_reference.py`, on the tier-A tiny config of docs/design/deepseek-v4.md §7 in float32.

One change from that config: 16 indexer heads instead of 4. An indexer score is exactly 0 when every
head's ReLU is 0 (1/16 of the blocks with 4 random heads), and top-k among exact ties is arbitrary, so
two correct implementations would pick different blocks; with 16 heads that is 1 in 65536.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from kestrel.models.deepseek_v4.config import parse_v4_config
from kestrel.models.deepseek_v4.kv_layout import mtp_kv_layout
from kestrel.models.deepseek_v4.mhc import hc_pre
from kestrel.models.deepseek_v4.model import DeepseekV4ForCausalLM
from kestrel.quant.kv_entries import RopeEntryFP8, ScaledKeyFP8
from tests.model import dsv4_reference as ref
from tests.model.dsv4_harness import V4Harness, reference_model

CFG = ref.RefConfig(index_n_heads=16)
ATOL = 5e-4  # logits are O(1..5); fp32 rope angles and op order differ from the float64-angle reference


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor]:
    return ref.random_weights(CFG, seed=0)


@pytest.fixture(scope="module")
def model(weights) -> DeepseekV4ForCausalLM:
    return reference_model(CFG, weights)


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def long_seq(weights):
    ids = _ids(300, seed=1)
    return ids, ref.forward(ids, weights, CFG)


def test_full_prefill_matches_reference(model, long_seq) -> None:
    ids, expected = long_seq
    got = V4Harness(model, 1).logits([ids])[0]
    torch.testing.assert_close(got, expected.logits, atol=ATOL, rtol=0)


def test_decode_after_prefill_equals_one_long_prefill(model, weights) -> None:
    """Prefill 250, then decode one token at a time to 262: C4 blocks complete at p = 251, 255, 259 and
    C128 block 1 at p = 255, all during decode."""
    ids = _ids(262, seed=2)
    expected = ref.forward(ids, weights, CFG).logits
    h = V4Harness(model, 1)
    got = [h.logits([ids[:250]])[0]]
    for p in range(250, 262):
        got.append(h.logits([[ids[p]]])[0])
    torch.testing.assert_close(torch.cat(got), expected, atol=ATOL, rtol=0)


def test_chunked_prefill_at_unaligned_splits(model, long_seq) -> None:
    ids, expected = long_seq
    h = V4Harness(model, 1)
    bounds = [0, 37, 131, 133, 258, 300]  # chunks of 37, 94, 2, 125, 42: none aligned to 4, 16 or 128
    got = torch.cat([h.logits([ids[a:b]])[0] for a, b in zip(bounds, bounds[1:])])
    torch.testing.assert_close(got, expected.logits, atol=ATOL, rtol=0)


def test_batch_of_different_lengths_then_mixed_step(model, weights) -> None:
    """Four requests prefilled in one forward, then one step where three decode and one extends."""
    lens = (300, 137, 9, 261)
    seqs = [_ids(n + 5, seed=10 + i) for i, n in enumerate(lens)]
    expected = [ref.forward(s, weights, CFG).logits for s in seqs]
    h = V4Harness(model, len(lens))
    first = h.logits([s[:n] for s, n in zip(seqs, lens)])
    second = h.logits([[seqs[0][300]], seqs[1][137:142], [seqs[2][9]], [seqs[3][261]]])
    for i, n in enumerate(lens):
        torch.testing.assert_close(first[i], expected[i][:n], atol=ATOL, rtol=0)
    extend = [1, 5, 1, 1]
    for i, n in enumerate(lens):
        torch.testing.assert_close(second[i], expected[i][n:n + extend[i]], atol=ATOL, rtol=0)


@pytest.mark.parametrize("changed", [3, 127, 255])
def test_causality(model, long_seq, changed: int) -> None:
    """Changing the token at `changed` (the last token of a C4 block, of C128 block 0, of C128 block 1)
    leaves every earlier position's logits as they were and changes that position's."""
    ids, _ = long_seq
    other = list(ids)
    other[changed] = (ids[changed] + 1) % CFG.vocab_size
    a = V4Harness(model, 1).logits([ids[:changed + 2]])[0]
    b = V4Harness(model, 1).logits([other[:changed + 2]])[0]
    # Not bitwise: an expert's GEMM sees a different set of rows, so its rounding may move by ~1e-6.
    torch.testing.assert_close(a[:changed], b[:changed], atol=1e-4, rtol=0)
    assert (a[changed] - b[changed]).abs().max() > 1e-2


def test_compressed_block_invisible_before_its_last_token(model) -> None:
    """A C128 layer alone: inputs differing only at position 200 (block 1 = positions 128..255) give
    the same output at 220..254, beyond the 16-token window, and a different one from 255 on, the step
    at which block 1 is emitted."""
    attn = model.layers[2].attn
    assert attn.ratio == 128
    table = torch.randn(CFG.vocab_size, CFG.hidden_size, generator=torch.Generator().manual_seed(3))
    ids = _ids(260, seed=4)
    other = list(ids)
    other[200] = (ids[200] + 1) % CFG.vocab_size
    outs = [V4Harness(model, 1).run(lambda i, p, b: attn(table[i], p, b), [seq])[0] for seq in (ids, other)]
    torch.testing.assert_close(outs[0][217:255], outs[1][217:255], atol=1e-5, rtol=0)
    assert (outs[0][255:] - outs[1][255:]).abs().amax(-1).min() > 1e-4


def test_hash_layers_route_by_tid2eid_and_learned_layers_match_reference(model, weights, long_seq) -> None:
    ids, expected = long_seq
    routed = {}
    for i, layer in enumerate(model.layers):
        layer.ffn.gate.register_forward_hook(lambda m, a, out, i=i: routed.__setitem__(i, out[0]))
    try:
        V4Harness(model, 1).logits([ids])
    finally:
        for layer in model.layers:
            layer.ffn.gate._forward_hooks.clear()
    assert torch.equal(routed[0], weights["layers.0.ffn.gate.tid2eid"][torch.tensor(ids)])
    for i in range(CFG.num_hash_layers, CFG.num_hidden_layers):
        assert torch.equal(routed[i].sort(-1).values, expected.trace[f"layers.{i}.experts"].sort(-1).values)


def test_indexer_picks_the_reference_blocks(model, long_seq) -> None:
    ids, expected = long_seq
    chosen = {}
    for i in (1, 3):
        model.layers[i].attn.indexer.register_forward_hook(lambda m, a, out, i=i: chosen.__setitem__(i, out))
    try:
        V4Harness(model, 1).logits([ids])
    finally:
        for i in (1, 3):
            model.layers[i].attn.indexer._forward_hooks.clear()
    for i in (1, 3):
        got = [sorted(b for b in row.tolist() if b >= 0) for row in chosen[i]]  # [T, k] block ordinals, -1 = none
        assert got == expected.trace[f"layers.{i}.chosen"]
    assert max(len(c) for c in got) == CFG.index_topk < len(ids) // 4  # the top-k really selected


def test_mhc_comb_is_doubly_stochastic_and_matches_reference(model, weights) -> None:
    X = torch.randn(7, CFG.hc_mult, CFG.hidden_size, generator=torch.Generator().manual_seed(5))
    layer = model.layers[1]
    x_in, post, comb = hc_pre(X, layer.hc_ffn_fn, layer.hc_ffn_base, layer.hc_ffn_scale, model.config)
    ones = torch.ones(7, CFG.hc_mult)
    # Sinkhorn ends on a column normalisation: columns sum to 1 up to eps, rows after 20 iterations nearly.
    torch.testing.assert_close(comb.sum(-2), ones, atol=1e-5, rtol=0)
    torch.testing.assert_close(comb.sum(-1), ones, atol=5e-3, rtol=0)
    r_in, r_post, r_comb = ref.hc_pre(X, weights["layers.1.hc_ffn_fn"], weights["layers.1.hc_ffn_base"],
                                      weights["layers.1.hc_ffn_scale"], CFG)
    torch.testing.assert_close(comb, r_comb, atol=1e-6, rtol=0)
    torch.testing.assert_close(post, r_post, atol=1e-6, rtol=0)
    torch.testing.assert_close(x_in, r_in, atol=1e-5, rtol=0)
    assert not torch.allclose(comb, torch.full_like(comb, 1 / CFG.hc_mult), atol=1e-2)  # not trivially uniform


def test_mtp_draft_logits_prefill_and_decode(model, weights) -> None:
    """Draft logits from the target's pre-hc_head streams and the next tokens, first for a prefill of
    40 positions, then a draft step at a time (the MTP layer's per-slot window store in its own pools)."""
    ids = _ids(61, seed=6)
    target = ref.forward(ids[:60], weights, CFG)
    expected = ref.mtp_forward(target.residual, ids[1:61], weights, CFG)
    h = V4Harness(model, 1, with_mtp=True)
    streams = torch.cat(h.run(model.forward_streams, [ids[:60]]))
    h.lens[0] = 0  # the MTP layer runs over the same positions (and slots), with its own pools
    next_ids = torch.tensor(ids[1:61])

    def draft(start: int, end: int) -> torch.Tensor:
        return torch.cat(h.run(lambda i, p, b: model.draft_forward(streams[start:end], next_ids[start:end], p, b)[0],
                               [ids[start + 1:end + 1]], mtp=True))

    got = torch.cat([draft(0, 40)] + [draft(p, p + 1) for p in range(40, 60)])
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_kv_layout_accounting() -> None:
    cfg = parse_v4_config(CFG.native_config())
    layout = DeepseekV4ForCausalLM(cfg).kv_layout(torch.float32)
    D, cI, f32 = CFG.head_dim, CFG.index_head_dim, 4
    # Per token: C4 layers 1 and 3 keep (D + cI) floats per 4 tokens, the C128 layer 2 D per 128.
    assert layout.bytes_per_token == f32 * (2 * (D + cI) / 4 + D / 128)
    # Per request: 4 window rings (the MTP layer's KV is a NEXTN draft's); per C4 layer kv and score rows
    # of 8 positions for both compressors (2x wide: overlap); for the C128 layer kv and score rows of 128.
    rings = 4 * CFG.sliding_window * D
    c4_state = 2 * (2 * 8 * 2 * D + 2 * 8 * 2 * cI)
    c128_state = 2 * 128 * D
    assert layout.bytes_per_request == f32 * (rings + c4_state + c128_state)
    assert layout.page_multiple == 128 and "per-request state" in layout.prefix_cache_unsupported
    # A verify of 4 tokens makes every ring 3 rows longer; the MTP layer keeps one entry per slot.
    spec = DeepseekV4ForCausalLM(cfg).kv_layout(torch.float32, speculative_tokens=4)
    assert spec.bytes_per_request == f32 * (4 * (CFG.sliding_window + 3) * D + 2 * (2 * 11 * 2 * D + 2 * 11 * 2 * cI)
                                            + 2 * 131 * D)
    assert mtp_kv_layout(cfg, torch.float32).bytes_per_token == f32 * D


def _checkpoint(cfg: ref.RefConfig, weights: dict[str, torch.Tensor], folder) -> str:
    import json

    from safetensors.torch import save_file

    (folder / "config.json").write_text(json.dumps(cfg.native_config()))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(folder / "model.safetensors"))
    return str(folder)


def test_engine_greedy_equals_the_reference(weights, tmp_path) -> None:
    """Through the Engine (KV memory built from the model's layout, pages of 128 chosen by default, prefix
    caching off):
    greedy tokens of two prompts of different lengths equal the reference's argmax, recomputed in full."""
    from kestrel import Engine, SamplingParams

    _checkpoint(CFG, weights, tmp_path)
    prompts = [_ids(130, seed=3), _ids(61, seed=4)]
    params = SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True)
    with Engine(model=str(tmp_path), device="cpu", dtype="float32", max_total_tokens=2048,
                chunked_prefill_size=100) as engine:
        assert engine.radix.disabled and engine.kv_memory.allocator.page_size == 128
        outs = [o.token_ids for o in engine.generate(prompt_token_ids=prompts, sampling_params=params)]
        assert engine.kv_memory.allocator.available_size() == engine.kv_memory.allocator.size
    for prompt, out in zip(prompts, outs):
        seq = list(prompt)
        for _ in range(5):
            seq.append(int(ref.forward(seq, weights, CFG).logits[-1].argmax()))
        assert out == seq[len(prompt):]


# ---- FP8 KV entries (--kv-cache-dtype fp8_e4m3) ---------------------------------------------------------
# The oracle is the reference reading every K=V entry and indexer key as the FP8 cache gives it back
# (the codec's round trip, itself checked against the e4m3 bound in tests/unit/test_dsv4_kv_fp8.py).
# FP8 moves logits by up to ~1.3 on these random weights (scale ~5), so greedy tokens with and without
# it differ at a few percent of positions: "FP8 = auto" would not be an honest check. The indexer picks
# every visible block here (index_topk >= blocks): FP8 moves its scores, and a top-k among near-ties
# would otherwise pick other blocks than the reference, a difference of choice, not of storage.
CFG_FP8 = dataclasses.replace(CFG, index_topk=80)
# kestrel's fp32 rope angles differ from the reference's float64 ones by ~1e-6, which flips a few bf16 /
# e4m3 roundings of stored entries (each up to 1/16 of a value): up to 2.1e-3 seen over 262 positions.
FP8_ATOL = 5e-3


def _stored_as_fp8(cfg: ref.RefConfig) -> ref.RefConfig:
    entry, key = RopeEntryFP8(cfg.head_dim, cfg.qk_rope_head_dim), ScaledKeyFP8(cfg.index_head_dim)
    return dataclasses.replace(cfg, kv_store=lambda x: entry.decode(entry.encode(x), x.dtype),
                               index_key_store=lambda x: key.decode(key.encode(x), x.dtype))


def test_fp8_kv_equals_the_reference_reading_fp8_entries(weights) -> None:
    """Prefill 250, then decode to 262 (ratio-4 blocks and the ratio-128 block at 255 completed by
    decodes) with packed FP8 pools = the reference over the same stored values; and FP8 does change
    the logits (far more than the tolerance), so the check is not one that unquantized storage passes."""
    model = reference_model(CFG_FP8, weights)
    ids = _ids(262, seed=1)
    h = V4Harness(model, 1, kv_dtype=torch.float8_e4m3fn)
    got = torch.cat(h.logits([ids[:250]]) + [h.logits([ids[p:p + 1]])[0] for p in range(250, 262)])
    torch.testing.assert_close(got, ref.forward(ids, weights, _stored_as_fp8(CFG_FP8)).logits,
                               atol=FP8_ATOL, rtol=0)
    assert (got - ref.forward(ids, weights, CFG_FP8).logits).abs().max() > 20 * FP8_ATOL


def test_engine_fp8_kv_greedy_and_bytes(weights, tmp_path) -> None:
    """`--kv-cache-dtype fp8_e4m3` through the Engine: greedy tokens of prompts of 124 and 61 tokens,
    decoded across ratio-4 boundaries and the ratio-128 boundary (position 127), = the FP8-reading
    reference's argmax; the KV memory's tensors hold exactly the layout's declared bytes (the packed
    entries': under a third of the fp32 entries' bytes per token here, ~0.55x bf16's at Flash widths)."""
    from kestrel import Engine, SamplingParams

    folder = _checkpoint(CFG_FP8, weights, tmp_path)
    prompts = [_ids(124, seed=3), _ids(61, seed=4)]
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    with Engine(model=folder, device="cpu", dtype="float32", max_total_tokens=2048, chunked_prefill_size=100,
                kv_cache_dtype="fp8_e4m3") as engine:
        outs = [o.token_ids for o in engine.generate(prompt_token_ids=prompts, sampling_params=params)]
        memory = engine.kv_memory
        assert memory.allocator.available_size() == memory.allocator.size
        pools = memory.pools[0]
        layout = pools.layout
        held = sum(getattr(pools.layer(layer), b.name).nbytes for g in layout.groups for layer in g.layer_ids
                   for b in g.buffers)
        auto = engine.runner.model.kv_layout(torch.float32)
    num_slots = (memory.allocator.num_pages + 1) * memory.allocator.page_size
    assert held == num_slots * layout.bytes_per_token + memory.req_to_token.table.shape[0] * layout.bytes_per_request
    # Per token: (82 B entry + 36 B key) / 4 for each ratio-4 layer, 82 B / 128 for the ratio-128 one.
    assert layout.bytes_per_token == 2 * (82 + 36) / 4 + 82 / 128 == memory.bytes_per_token
    assert layout.bytes_per_token / auto.bytes_per_token == pytest.approx((82 + 36) / (4 * (64 + 32)), rel=0.01)
    reference = _stored_as_fp8(CFG_FP8)
    for prompt, out in zip(prompts, outs):
        seq = list(prompt)
        for _ in range(8):
            seq.append(int(ref.forward(seq, weights, reference).logits[-1].argmax()))
        assert out == seq[len(prompt):]


# ---- other shapes -------------------------------------------------------------------------------------
# Shapes and layer patterns unlike tier A's, so nothing in the engine leans on its sizes: odd windows,
# 1-3 streams, head dims that are not powers of two, ratio-128 first, no hash layer or every layer hashed.
OTHER_SHAPES = {
    "c128-first": dataclasses.replace(
        CFG, vocab_size=300, hidden_size=96, num_hidden_layers=3, compress_ratios=(128, 4, 0, 0),
        num_attention_heads=3, head_dim=48, qk_rope_head_dim=8, q_lora_rank=48, o_groups=3, o_lora_rank=24,
        sliding_window=13, index_head_dim=16, index_topk=3, hc_mult=2, n_routed_experts=5, num_experts_per_tok=2,
        num_hash_layers=0),
    "all-c4-hashed": dataclasses.replace(
        CFG, vocab_size=97, hidden_size=160, num_hidden_layers=2, compress_ratios=(4, 4, 0), num_attention_heads=6,
        head_dim=32, q_lora_rank=32, o_groups=1, o_lora_rank=16, sliding_window=4, index_topk=5, hc_mult=3,
        n_routed_experts=3, num_experts_per_tok=3, num_hash_layers=2, routed_scaling_factor=2.5),
}


@pytest.mark.parametrize("name", sorted(OTHER_SHAPES))
def test_engine_on_other_shapes_equals_the_reference(name, tmp_path) -> None:
    """Through the Engine, three prompts (one past a ratio-128 block) prefilled in chunks of 50 and decoded
    together: greedy tokens = the reference's; and the incremental path's logits = the reference's."""
    from kestrel import Engine, SamplingParams

    cfg = OTHER_SHAPES[name]
    weights = ref.random_weights(cfg, seed=7)
    _checkpoint(cfg, weights, tmp_path)
    gen = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in (150, 41, 9)]
    params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    with Engine(model=str(tmp_path), device="cpu", dtype="float32", max_total_tokens=2048,
                chunked_prefill_size=50) as engine:
        outs = [o.token_ids for o in engine.generate(prompt_token_ids=prompts, sampling_params=params)]
    seqs = []
    for prompt, out in zip(prompts, outs):
        seqs.append(list(prompt))
        for _ in range(4):
            seqs[-1].append(int(ref.forward(seqs[-1], weights, cfg).logits[-1].argmax()))
        assert out == seqs[-1][len(prompt):]
    got = V4Harness(reference_model(cfg, weights), 1).logits([seqs[0]])[0]
    torch.testing.assert_close(got, ref.forward(seqs[0], weights, cfg).logits, atol=ATOL, rtol=0)


def test_fused_triton_kernels_give_the_torch_forward(model, weights) -> None:
    """The model with V4's fused kernels (the Triton RMSNorm, rope and head norm that CUDA runs; here
    through Triton's interpreter) = the torch forward: a prefill, then decode steps."""
    from kestrel import envs
    from kestrel.layers.kernels import Kernels

    if not envs.triton_interpret():
        pytest.skip("the fused kernels run on CPU through TRITON_INTERPRET=1")
    fused = DeepseekV4ForCausalLM(parse_v4_config(CFG.native_config()), Kernels(triton_elementwise=True))
    fused.load_checkpoint(weights.items(), "reference weights")
    fused.eval()
    assert fused.layers[0].attn.rope.triton and fused.layers[0].attn_norm.triton_kernel is not None
    ids = _ids(134, seed=5)  # blocks of both ratios complete in the prefill, C4 ones during decode too
    logits = []
    for m in (fused, model):
        h = V4Harness(m, 1)
        logits.append(torch.cat([h.logits([ids[:128]])[0]] + [h.logits([[t]])[0] for t in ids[128:]]))
    torch.testing.assert_close(logits[0], logits[1], atol=1e-4, rtol=0)

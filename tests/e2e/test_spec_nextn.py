"""NEXTN: a DeepSeek-V4 target drafting with its own MTP layer, through the engine, on the tier-A tiny
config in float32 (tests/model/dsv4_reference.py).

Oracles: plain greedy decoding (token for token), and the naive reference's MTP logits for every
position a DRAFT_EXTEND scores (so the draft is the real MTP layer over the target's streams, with its
window KV right across chunks, verify rounds and the window). Random weights make the MTP layer a poor
guesser (nearly every draft is rejected), so a second test swaps in drafts that agree with the target
at chosen depths: verify rounds then accept 0..num_steps drafts and the rollback of every per-request
ring is exercised. Nothing here says anything about acceptance with real weights.
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from kestrel import Engine, SamplingParams
from tests.e2e.conftest import assert_pool_full
from tests.model import dsv4_reference as ref

# 16 indexer heads, as tests/model/test_deepseek_v4.py explains; window 16, layers of ratio 0, 4, 128, 4.
CFG = ref.RefConfig(index_n_heads=16)
ATOL = 5e-4
COMMON = dict(device="cpu", dtype="float32", page_size=128, max_total_tokens=2048, chunked_prefill_size=50)
# A 120-token prompt decodes across position 127 (the ratio-128 layer's first block); all of them cross
# ratio-4 blocks and the 16-token window; 60 is chunked at 50.
PROMPT_LENS = (120, 5, 37, 60)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor]:
    return ref.random_weights(CFG, seed=0)


@pytest.fixture(scope="module")
def checkpoint(weights, tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("dsv4-nextn")
    (path / "config.json").write_text(json.dumps(CFG.native_config()))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"))
    return str(path)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(2, CFG.vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENS]


def greedy(max_new_tokens: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def plain(checkpoint) -> list[list[int]]:
    """Plain greedy, 24 tokens per prompt (tests take a prefix of it)."""
    with Engine(model=checkpoint, **COMMON) as engine:
        return [o.token_ids for o in engine.generate(prompt_token_ids=prompts(), sampling_params=greedy(24))]


def record_draft_extends(engine) -> list:
    """Wrap the draft runner's forward (DRAFT_EXTEND only: the lanes call `execute`) to keep each batch
    and its logits."""
    runner, records = engine.spec_worker.runner, []
    forward = runner.forward

    def recording(batch, inputs=None):
        out = forward(batch, inputs)
        records.append((batch, out.logits.clone()))
        return out

    runner.forward = recording
    return records


def check_draft_logits(records, finals: dict[str, list[int]], weights) -> None:
    """Every real (not padding) row a DRAFT_EXTEND scored equals the reference MTP layer's logits at that
    position of the request's final sequence, given the reference target's streams; the row's input
    token (when on the host) is the next token there. Each prompt's last position (the first draft token) is among them."""
    expected = {}
    for rid, seq in finals.items():
        target = ref.forward(seq[:-1], weights, CFG)
        expected[rid] = ref.mtp_forward(target.residual, seq[1:], weights, CFG)
    checked: dict[str, set[int]] = {rid: set() for rid in finals}
    for batch, logits in records:
        tokens = []  # (rid, position, slot) of each new token
        k = 0
        for req, p, e in zip(batch.reqs, batch.prefix_lens, batch.extend_lens):
            tokens += [(req.rid, p + t, int(batch.out_cache_loc[k + t])) for t in range(e)]
            k += e
        for row, index in enumerate(batch.logit_rows()):
            rid, pos, slot = tokens[index]
            seq = finals[rid]
            if slot == 0 or pos + 1 >= len(seq):  # padding, or committed past a stop and dropped
                continue
            token = batch.input_ids[index]
            assert token == seq[pos + 1] or token < 0  # < 0: sampled by the step just launched, on the device
            torch.testing.assert_close(logits[row], expected[rid][pos], atol=ATOL, rtol=0)
            checked[rid].add(pos)
    for rid, n in zip(finals, PROMPT_LENS):
        assert n - 1 in checked[rid] and len(checked[rid]) > 3


@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_equals_plain_greedy_and_the_draft_is_the_mtp_layer(checkpoint, weights, plain, batch):
    """SGLang's default chain for MTP (3 steps, topk 1, 4 tokens); decode crosses the window, ratio-4
    blocks and (for the 120-token prompt) the ratio-128 block boundary. At batch 4, speculation is off
    above 2 running requests: plain decode steps (each followed by a DRAFT_EXTEND) until some finish."""
    off_above = 2 if batch > 1 else 32
    with Engine(model=checkpoint, speculative_algorithm="NEXTN", max_running_requests=batch,
                speculative_disable_batch_size=off_above, **COMMON) as engine:
        spec = engine.config.speculative
        assert (spec.speculative_num_steps, spec.speculative_eagle_topk, spec.speculative_num_draft_tokens) == (3, 1, 4)
        assert spec.speculative_draft_model_path == checkpoint
        records = record_draft_extends(engine)
        modes = []
        engine.add_step_hook(lambda info: modes.append(info.mode))
        new_tokens = (16, 6, 10, 16)  # requests finish at different steps: verify rounds resume at batch 4
        outs = engine.generate(prompt_token_ids=prompts(), sampling_params=[greedy(n) for n in new_tokens])
        assert [o.token_ids for o in outs] == [p[:n] for p, n in zip(plain, new_tokens)]
        assert "target_verify" in modes and ("decode" in modes) == (batch > 1)
        assert_pool_full(engine)
    check_draft_logits(records, {o.meta["id"]: p + o.token_ids for o, p in zip(outs, prompts())}, weights)


def test_verify_rollback_with_drafts_that_are_partly_right(checkpoint, plain, monkeypatch):
    """Drafts replaced by the plain greedy continuation, wrong wherever (position % 3 == 0): verify
    rounds accept 0..5 drafts, so the target's rings, compressor state and blocks, and the draft's
    KV, are rolled back at every depth; tokens still equal plain greedy."""
    want = {tuple(p): p + out for p, out in zip(prompts(), plain)}
    shape = dict(speculative_num_steps=5, speculative_eagle_topk=1, speculative_num_draft_tokens=6)
    with Engine(model=checkpoint, speculative_algorithm="NEXTN", **shape, **COMMON) as engine:
        lanes = engine.spec_worker.lanes
        draft = lanes.draft

        def oracle_draft(rows, prefix_host, roots):
            tree = draft(rows, prefix_host, roots)
            running = {r.req_pool_idx: r for r in engine.scheduler.running}
            for b, (row, p) in enumerate(zip(rows.tolist(), prefix_host)):
                seq = want[tuple(running[row].prompt_ids)]
                for depth in range(1, tree.tokens.shape[1]):
                    pos = p + depth
                    right = seq[pos] if pos < len(seq) else 0
                    tree.tokens[b, depth] = right if pos % 3 else (right + 1) % CFG.vocab_size
            return tree

        monkeypatch.setattr(lanes, "draft", oracle_draft)
        outs = engine.generate(prompt_token_ids=prompts(), sampling_params=greedy(24))
        assert [o.token_ids for o in outs] == plain
        assert {1, 2, 3}.issubset(set(engine.spec_worker.accept_lengths))
        assert_pool_full(engine)


def test_aborts_mid_round_leak_nothing(checkpoint, plain):
    """Half the requests aborted after a few rounds: the others' tokens are unchanged, every row and
    slot comes back."""
    with Engine(model=checkpoint, speculative_algorithm="NEXTN", **COMMON) as engine:
        rids = [engine.add_request(prompt_token_ids=p, sampling_params=greedy(24)) for p in prompts()]
        for _ in range(6):
            engine.step()
        assert any(engine.request(r).output_ids for r in rids)
        for rid in rids[::2]:
            engine.abort(rid)
        while engine.has_work():
            engine.step()
        assert all(engine.request(r).finished for r in rids)
        assert [engine.request(r).output_ids for r in rids[1::2]] == plain[1::2]
        assert engine.kv_memory.req_to_token.available() == engine.kv_memory.req_to_token.max_requests
        assert_pool_full(engine)


def test_fp8_kv_greedy_equals_plain_fp8_greedy(checkpoint):
    """`--kv-cache-dtype fp8_e4m3`: the draft's window KV is packed like the target's (SGLang's MTP ring is
    FP8 too), and greedy NEXTN = plain greedy over the same FP8 KV, for the 120-token prompt (across
    position 127) and the 37-token one at batch 2."""
    chosen = [prompts()[0], prompts()[2]]
    fp8 = dict(COMMON, kv_cache_dtype="fp8_e4m3", max_running_requests=2)
    with Engine(model=checkpoint, **fp8) as engine:
        expected = [o.token_ids for o in engine.generate(prompt_token_ids=chosen, sampling_params=greedy(12))]
    with Engine(model=checkpoint, speculative_algorithm="NEXTN", **fp8) as engine:
        draft_layer = engine.kv_memory.pools[1].layer(CFG.num_hidden_layers)
        assert draft_layer.win_kv.dtype == torch.uint8 and draft_layer.win_kv_codec is not None
        modes = []
        engine.add_step_hook(lambda info: modes.append(info.mode))
        outs = engine.generate(prompt_token_ids=chosen, sampling_params=greedy(12))
        assert [o.token_ids for o in outs] == expected and "target_verify" in modes
        assert_pool_full(engine)

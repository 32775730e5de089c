"""Multi-token steps (a speculative verify without a draft), KV rollback, a shared draft/target slot
space, and a step that raises: the seams speculative decoding stands on."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from kestrel import Engine, SamplingParams
from kestrel.cache.kv_layout import KVLayout
from kestrel.cache.kv_memory import KVMemory
from kestrel.cache.radix import RadixCache
from kestrel.config import SchedulerConfig
from kestrel.core.request import Request
from kestrel.engine.scheduler import Scheduler
from tests.e2e.conftest import assert_pool_full

PROMPT = [5, 9, 3, 17, 22, 8, 41, 7, 30, 12, 19]
STEPS = 6  # new tokens per verify step


def engine_for(model: str, backend: str, page_size: int) -> Engine:
    return Engine(model=model, device="cpu", dtype="float32", attention_backend=backend, page_size=page_size,
                  max_total_tokens=512, disable_overlap_schedule=True)


def record_logits(engine: Engine) -> list[torch.Tensor]:
    """Every forward's logits, as the engine's sampler sees them."""
    seen, forward = [], engine.runner.forward

    def recording(batch):
        out = forward(batch)
        seen.append(out.logits.clone())
        return out

    engine.runner.forward = recording
    return seen


def one_token_reference(engine: Engine, rid: str, n: int) -> tuple[list[torch.Tensor], list[int]]:
    """Logits of n one-token decode steps after the prefill, and the greedy tokens (first one included)."""
    seen = record_logits(engine)
    for _ in range(n):
        engine.step()
    return [row[0] for row in seen], list(engine.request(rid).output_ids)


def state(engine: Engine, rid: str) -> tuple:
    """What must equal plain decoding's after a rollback. The slots themselves may differ: with page size
    1 a tree's kept nodes are re-pointed, not moved, so they keep the slots they were verified in."""
    req = engine.request(rid)
    row = engine.kv_memory.req_to_token.table[req.req_pool_idx, :req.kv_len].tolist()
    assert row == req.slots, "req_to_token and the host copy of the row disagree"
    return req.kv_len, len(req.slots), engine.kv_memory.allocator.available_size(), list(req.output_ids)


# Chain: new tokens [g0, g1, ..., g5], causal. Tree: node 0 = g0 (root); 1 = g1, 2 = wrong (children
# of 0); 3 = g2 (child of 1), 4 = wrong (child of 2), 5 = g3 (child of 3). The accepted path is 0, 1, 3, 5.
TREE_PARENTS = [-1, 0, 0, 1, 2, 3]
TREE_PATH = [0, 1, 3, 5]


def tree_mask(parents: list[int]) -> torch.Tensor:
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for node in range(n):
        a = node
        while a != -1:
            mask[node, a] = True
            a = parents[a]
    return mask


@pytest.mark.parametrize("backend", ["torch_native", "triton"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_multi_token_step_equals_one_token_steps_and_rolls_back(tiny_model, backend, page_size, shape):
    model = tiny_model("llama")
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    ref_engine, engine = engine_for(model, backend, page_size), engine_for(model, backend, page_size)
    with ref_engine, engine:
        for e in (ref_engine, engine):
            e.add_request(prompt_token_ids=PROMPT, sampling_params=params, rid="r")
            e.step()  # prefill: g0 sampled
        ref_logits, greedy = one_token_reference(ref_engine, "r", STEPS)
        g = greedy  # g[0] from the prefill, g[j] the argmax of ref_logits[j - 1]

        if shape == "chain":
            tokens, depth, mask, path = g[:STEPS], list(range(STEPS)), None, [0, 1, 2]
        else:
            wrong = [(g[1] + 1) % 256, (g[2] + 2) % 256]
            tokens, mask, path = [g[0], g[1], wrong[0], g[2], wrong[1], g[3]], tree_mask(TREE_PARENTS), TREE_PATH
            depth = [0, 1, 1, 2, 2, 3]
        sched = engine.scheduler
        batch = sched.schedule(decode_tokens=STEPS)
        assert batch.mode.name == "TARGET_VERIFY" and batch.extend_lens == [STEPS]
        start = batch.prefix_lens[0]
        batch.input_ids[:] = tokens
        batch.positions[:] = [start + d for d in depth]
        batch.tree_mask = None if mask is None else mask.flatten()
        batch.logits_at_all_tokens = True
        out = engine.runner.forward(batch)
        assert out.logits.shape[0] == STEPS
        for node in path:  # the logits at every node on the right path are the one-token logits
            torch.testing.assert_close(out.logits[node], ref_logits[depth[node]], atol=1e-4, rtol=1e-4)

        # Keep only the path: the bonus token is the argmax at its last node.
        req = engine.request("r")
        sched.commit(batch, [], [])
        sched.keep_new_slots(req, STEPS, path)
        accepted = [tokens[n] for n in path[1:]] + [int(out.logits[path[-1]].argmax())]
        sched.resolve([req], [accepted])
        assert accepted == g[1:len(path) + 1]
        assert req.kv_len == len(PROMPT) + len(path) and len(req.slots) == req.kv_len


def test_rollback_leaves_exactly_the_one_token_state_and_the_rest_of_the_run(tiny_model):
    """After a tree verify and rollback, allocator, slots and req_to_token are those of plain decoding,
    and the run continues to the same tokens (page size 16: the kept KV was moved into place)."""
    model = tiny_model("llama")
    params = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)
    for page_size in (1, 16):
        with engine_for(model, "torch_native", page_size) as plain, engine_for(model, "torch_native", page_size) as e:
            plain_out = plain.generate(prompt_token_ids=[PROMPT], sampling_params=params)[0].token_ids
            e.add_request(prompt_token_ids=PROMPT, sampling_params=params, rid="r")
            e.step()
            g = plain_out
            tokens = [g[0], g[1], (g[1] + 1) % 256, g[2], (g[2] + 2) % 256, g[3]]
            batch = e.scheduler.schedule(decode_tokens=len(tokens))
            start = batch.prefix_lens[0]
            batch.input_ids[:] = tokens
            batch.positions[:] = [start + d for d in (0, 1, 1, 2, 2, 3)]
            batch.tree_mask = tree_mask(TREE_PARENTS).flatten()
            batch.logits_at_all_tokens = True
            out = e.runner.forward(batch)
            req = e.request("r")
            e.scheduler.commit(batch, [], [])
            e.scheduler.keep_new_slots(req, len(tokens), TREE_PATH)
            e.scheduler.resolve([req], [[g[1], g[2], g[3], int(out.logits[5].argmax())]])
            # The same state as decoding those 4 tokens one by one, once the next step has sent the
            # rollback's row writes (and KV moves) to the device.
            e.step()
            with engine_for(model, "torch_native", page_size) as ref:
                ref.add_request(prompt_token_ids=PROMPT, sampling_params=params, rid="r")
                for _ in range(6):
                    ref.step()
                assert state(e, "r") == state(ref, "r")
            while e.has_work():
                e.step()
            assert e.output(e.pop("r")).token_ids == plain_out
            assert_pool_full(e)


def test_draft_and_target_pools_share_one_slot_space_under_abort_and_retraction():
    """Two layouts over one allocator: every live request's KV is where its slots say in both pools,
    through admissions, a tiny pool's retractions and aborts; the pool is full at the end."""
    target = KVLayout.full_attention(2, 2, 4, torch.float32)
    draft = KVLayout.full_attention(1, 1, 8, torch.float32)
    memory = KVMemory([target, draft], 96, 1, 8, 64, "cpu")
    radix = RadixCache(memory.allocator, 1)
    sched = Scheduler(SchedulerConfig(max_running_requests=8, chunked_prefill_size=32, schedule_conservativeness=0),
                      memory.allocator, radix, memory.req_to_token, set(), 64)
    params = SamplingParams(max_new_tokens=30, stop_token_ids=[1])
    reqs = [Request(f"r{i}", [10 + i] * (6 + i), params, seed=0, arrival=i) for i in range(8)]
    for r in reqs:
        sched.add(r)
    table = memory.req_to_token.table

    def mark(slots: torch.Tensor, req: Request, positions: list[int]) -> None:
        value = torch.tensor([1000.0 * (1 + int(req.rid[1:])) + p for p in positions])
        memory.pools[0].layer(1).k[slots] = value[:, None, None]
        memory.pools[1].layer(0).v[slots] = value[:, None, None]

    step = 0
    while sched.has_work():
        step += 1
        batch = sched.schedule()
        memory.req_to_token.table[batch.table_writes[0], batch.table_writes[1]] = batch.table_writes[2]
        start = 0
        for req, n, p in zip(batch.reqs, batch.extend_lens, batch.prefix_lens):
            mark(batch.out_cache_loc[start:start + n], req, list(range(p, p + n)))
            start += n
        sampled = [batch.reqs[i] for i in sched.sampling_rows(batch)]
        sched.commit(batch, sampled, [[0]] * len(sampled))
        sched.resolve(sampled, [[3]] * len(sampled), [[0]] * len(sampled))
        if step == 12:
            sched.abort("r2")
        for req in sched.running:  # both pools hold each position's value at the slot req_to_token names
            slots = table[req.req_pool_idx, :req.kv_len]
            assert slots.tolist() == req.slots[:req.kv_len]
            want = torch.tensor([1000.0 * (1 + int(req.rid[1:])) + p for p in range(req.kv_len)])
            if req.cached_len == 0:
                assert torch.equal(memory.pools[0].layer(1).k[slots, 0, 0], want)
                assert torch.equal(memory.pools[1].layer(0).v[slots, 0, 0], want)
        memory.allocator.check()
    assert sched.num_retractions > 0
    assert all(r.finished for r in reqs) and reqs[2].finish_reason == "abort"
    assert radix.protected_size() == 0
    radix.evict(memory.allocator.size)
    assert memory.allocator.available_size() == memory.allocator.size


def test_a_forward_that_raises_costs_only_its_own_requests(tiny_model):
    """A step that fails once: alone, its request finishes with an error; with two, each runs again
    alone and both get the tokens of a clean run. The engine goes on and every slot comes back."""
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    with Engine(model=tiny_model("llama"), device="cpu", dtype="float32", max_total_tokens=256) as engine:
        good = [o.token_ids for o in engine.generate(prompt_token_ids=[PROMPT, PROMPT[:5]], sampling_params=params)]
        forward, calls = engine.runner.forward, []

        def failing(batch):
            calls.append(batch)
            if len(calls) == 3:
                raise RuntimeError("injected failure")
            return forward(batch)

        engine.runner.forward = failing
        bad = engine.generate(prompt_token_ids=[PROMPT], sampling_params=params)
        assert bad[0].meta["finish_reason"] == "error" and "injected failure" in bad[0].meta["error"]
        assert_pool_full(engine)
        calls.clear()  # the third forward is a decode step of both requests
        assert [o.token_ids for o in engine.generate(prompt_token_ids=[PROMPT, PROMPT[:5]],
                                                     sampling_params=params)] == good
        assert not engine.scheduler.suspects
        assert_pool_full(engine)
        engine.add_request(prompt_token_ids=PROMPT, sampling_params=params)
        engine.step()
    # shutdown (the context manager) worked with a request in flight.


POISON = 499  # a token id the fake fault below refuses


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize("fault", ["token", "position"])
def test_a_fault_in_one_requests_data_fails_only_that_request(tiny_model, fault, overlap):
    """A forward that raises on one request's data (a token id in its prompt; a position only its long
    prompt reaches while decoding, as an index past a rope table would): that request finishes with an
    error, the other requests of its batches get exactly the tokens of a clean run."""
    prompts = [PROMPT, PROMPT[:5], [11, 12, 13] * 12, PROMPT[3:], [POISON] + PROMPT[:4]]
    culprit = 4 if fault == "token" else 2  # prompt 2 reaches position 40 with its 5th decode step
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    # No radix cache: the clean run's prefixes would spare the second run's prefills.
    options = dict(device="cpu", dtype="float32", max_total_tokens=512, disable_radix_cache=True,
                   disable_overlap_schedule=not overlap)
    with Engine(model=tiny_model("llama"), **options) as engine:
        clean = [o.token_ids for o in engine.generate(prompt_token_ids=prompts, sampling_params=params)]
        forward = engine.runner.forward

        def faulty(batch, *args):
            # The poison token at position 0: only the culprit's prompt (a generated 499 is not at 0).
            if (POISON, 0) in zip(batch.input_ids, batch.positions) if fault == "token" else max(batch.positions) >= 40:
                raise IndexError("injected: index 40 is out of bounds")
            return forward(batch, *args)

        engine.runner.forward = faulty
        outs = engine.generate(prompt_token_ids=prompts, sampling_params=params)
        assert [o.meta["finish_reason"] for o in outs] == ["error" if i == culprit else "length"
                                                           for i in range(len(prompts))]
        assert "injected" in outs[culprit].meta["error"]
        assert [o.token_ids for i, o in enumerate(outs) if i != culprit] == \
            [t for i, t in enumerate(clean) if i != culprit]
        assert not engine.scheduler.suspects
        assert_pool_full(engine)


def test_triton_interpret_is_decided_once_at_import(tiny_model):
    """Setting TRITON_INTERPRET after importing kestrel does not make the triton backend half-work on the
    CPU: it is refused at start-up, with what to do."""
    code = f"""
import os, kestrel
os.environ["TRITON_INTERPRET"] = "1"
from kestrel import Engine
try:
    Engine(model={tiny_model("llama")!r}, device="cpu", attention_backend="triton")
except ValueError as e:
    print("REFUSED", e)
"""
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert "REFUSED" in out.stdout and "TRITON_INTERPRET=1" in out.stdout, out.stdout + out.stderr

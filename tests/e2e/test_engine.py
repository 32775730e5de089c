"""Engine end to end on CPU against transformers and against itself under other schedules."""
from __future__ import annotations

import random

import pytest

from kestrel import Engine, SamplingParams
from tests.e2e.conftest import ARCHS, assert_pool_full, hf_greedy

GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)


def prompts_with_shared_prefixes(n: int, vocab: int = 512, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    base = [rng.randrange(3, vocab) for _ in range(40)]
    out = []
    for i in range(n):
        shared = base[: rng.randrange(0, 40)] if i % 2 else []
        out.append(shared + [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 30))])
    return out


def run(model: str, prompts: list[list[int]], params: SamplingParams = GREEDY, **options) -> list[list[int]]:
    with Engine(model=model, device="cpu", dtype="float32", **options) as engine:
        outs = engine.generate(prompt_token_ids=prompts, sampling_params=params)
        assert_pool_full(engine)
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(tiny_model, arch):
    model = tiny_model(arch)
    prompts = prompts_with_shared_prefixes(6)
    assert run(model, prompts) == hf_greedy(model, prompts, GREEDY.max_new_tokens)


def test_rope_scaling_and_tied_embeddings_match_transformers(tiny_model):
    model = tiny_model("llama", tie=True, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16})
    prompts = prompts_with_shared_prefixes(3, seed=1)
    assert run(model, prompts) == hf_greedy(model, prompts, GREEDY.max_new_tokens)


def test_chunked_prefill_and_mixed_batches_equal_whole_prefill(tiny_model):
    model = tiny_model("qwen3")
    prompts = prompts_with_shared_prefixes(5, seed=2)
    whole = run(model, prompts, chunked_prefill_size=-1)
    assert run(model, prompts, chunked_prefill_size=7) == whole
    assert run(model, prompts, chunked_prefill_size=5, enable_mixed_chunk=True) == whole
    assert run(model, prompts, page_size=4, chunked_prefill_size=6) == whole


def test_radix_hit_equals_cold_run_and_reports_cached_tokens(tiny_model):
    model = tiny_model("llama")
    first = list(range(10, 60))
    follow = [first + [7, 8, 9], first[:30] + [5]]
    cold = run(model, follow, disable_radix_cache=True)
    with Engine(model=model, device="cpu", dtype="float32") as engine:
        engine.generate(prompt_token_ids=[first], sampling_params=GREEDY)
        outs = engine.generate(prompt_token_ids=follow, sampling_params=GREEDY)
        assert [o.token_ids for o in outs] == cold
        assert outs[0].meta["cached_tokens"] == len(first)
        assert outs[1].meta["cached_tokens"] == 30
        assert_pool_full(engine)


def test_tiny_kv_budget_retracts_and_still_gives_same_tokens(tiny_model):
    model = tiny_model("qwen2")
    prompts = prompts_with_shared_prefixes(8, seed=3)
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    roomy = run(model, prompts, params)
    # No admission reserve: these requests' lengths are known, and with one nothing would be retracted.
    with Engine(model=model, device="cpu", dtype="float32", max_total_tokens=96,
                schedule_conservativeness=0) as engine:
        outs = engine.generate(prompt_token_ids=prompts, sampling_params=params)
        assert engine.scheduler.num_retractions > 0
        assert_pool_full(engine)
    assert [o.token_ids for o in outs] == roomy


def test_new_token_reserve_avoids_retractions(tiny_model):
    model = tiny_model("llama")
    prompts = [[7 + i] * 20 for i in range(8)]
    params = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    roomy = run(model, prompts, params)
    retractions = {}
    for conservativeness in (0.0, 1.0):
        with Engine(model=model, device="cpu", dtype="float32", max_total_tokens=200,
                    schedule_conservativeness=conservativeness) as engine:
            outs = engine.generate(prompt_token_ids=prompts, sampling_params=params)
            assert [o.token_ids for o in outs] == roomy
            assert_pool_full(engine)
            retractions[conservativeness] = engine.scheduler.num_retractions
    # Without a reserve all 8 prompts (160 tokens) are admitted at once and the pool overflows.
    assert retractions[0.0] >= 3 and retractions[1.0] < retractions[0.0]


def test_known_lengths_share_a_tight_pool_without_retraction(tiny_model):
    """ignore_eos requests without stop conditions run to max_new_tokens: admission keeps room for the
    peak they really reach, so none is retracted (a ratio estimate let 4 in here and retracted 2) and
    the pool still holds as many as fit."""
    model = tiny_model("llama")
    prompts = [[7 + i] * 16 for i in range(12)]
    params = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True)
    roomy = run(model, prompts, params)
    with Engine(model=model, device="cpu", dtype="float32", max_total_tokens=160) as engine:
        rids = [engine.add_request(prompt_token_ids=p, sampling_params=params) for p in prompts]
        most_running = 0
        while engine.has_work():
            engine.step()
            most_running = max(most_running, len(engine.scheduler.running))
        assert [engine.output(engine.pop(rid)).token_ids for rid in rids] == roomy
        assert engine.scheduler.num_retractions == 0
        assert most_running == 160 // (16 + 32)
        assert_pool_full(engine)


def test_same_seed_same_tokens_alone_or_batched(tiny_model):
    model = tiny_model("mistral")
    params = SamplingParams(max_new_tokens=16, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    other = SamplingParams(max_new_tokens=20, temperature=0.8, seed=7, ignore_eos=True)
    target = [11, 22, 33, 44]
    with Engine(model=model, device="cpu", dtype="float32") as engine:
        alone = engine.generate(prompt_token_ids=[target], sampling_params=params)[0].token_ids
        mixed = engine.generate(prompt_token_ids=[[5, 6, 7, 8, 9, 10], target, [3] * 20],
                                sampling_params=[other, params, other])
        assert mixed[1].token_ids == alone
        reseeded = SamplingParams(max_new_tokens=16, temperature=1.0, top_p=0.9, seed=99, ignore_eos=True)
        assert engine.generate(prompt_token_ids=[target], sampling_params=reseeded)[0].token_ids != alone
    # Retraction must not change sampled tokens either (no admission reserve, so that the pool overflows).
    assert run(model, [[5] * 30, target, [9] * 30], [other, params, other], max_total_tokens=64,
               schedule_conservativeness=0)[1] == alone


def test_abort_frees_kv_and_others_finish(tiny_model):
    model = tiny_model("llama")
    with Engine(model=model, device="cpu", dtype="float32") as engine:
        params = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)
        rids = [engine.add_request(prompt_token_ids=[i + 3] * (5 + i), sampling_params=params) for i in range(4)]
        for _ in range(3):
            engine.step()
        assert engine.abort(rids[1])
        assert not engine.abort("no-such-request")
        while engine.has_work():
            engine.step()
        outs = {rid: engine.output(engine.pop(rid)) for rid in rids}
        assert outs[rids[1]].meta["finish_reason"] == "abort"
        assert all(len(outs[r].token_ids) == 20 for r in rids if r != rids[1])
        assert_pool_full(engine)


@pytest.mark.parametrize("bad", [
    {"temperature": -1.0}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": 0}, {"max_new_tokens": -1},
    {"min_p": 2.0}, {"logprobs": 50},
])
def test_invalid_sampling_params_raise_value_error_and_engine_keeps_serving(tiny_model, bad):
    model = tiny_model("llama")
    with Engine(model=model, device="cpu", dtype="float32") as engine:
        field = next(iter(bad))
        with pytest.raises(ValueError, match=field):
            engine.generate(prompt_token_ids=[[1, 2, 3], [4, 5]],
                            sampling_params=[GREEDY, SamplingParams(**bad)])
        assert len(engine.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=GREEDY)[0].token_ids) == 12
        assert_pool_full(engine)


def test_prompt_too_long_and_bad_token_ids_raise(tiny_model):
    model = tiny_model("llama")
    with Engine(model=model, device="cpu", dtype="float32", context_length=64) as engine:
        with pytest.raises(ValueError, match="context length"):
            engine.generate(prompt_token_ids=[[1] * 64], sampling_params=GREEDY)
        with pytest.raises(ValueError, match="prompt_token_ids"):
            engine.generate(prompt_token_ids=[[1, 10**6]], sampling_params=GREEDY)
        with pytest.raises(ValueError, match="empty"):
            engine.generate(prompt_token_ids=[[]], sampling_params=GREEDY)
        with pytest.raises(ValueError, match="prompt_token_ids"):
            engine.generate(prompt_token_ids=[[1, True]], sampling_params=GREEDY)
        # numpy and torch integers are accepted as token ids.
        import numpy as np
        import torch
        same = engine.generate(prompt_token_ids=[list(np.array([5, 6, 7])), torch.tensor([5, 6, 7]).tolist()],
                               sampling_params=GREEDY)
        assert same[0].token_ids == same[1].token_ids
        # Running into the context length ends the request with "length".
        out = engine.generate(prompt_token_ids=[[1] * 60],
                              sampling_params=SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True))[0]
        assert len(out.token_ids) == 4 and out.meta["finish_reason"] == "length"


def test_text_prompts_stop_strings_and_logprobs(tiny_model):
    model = tiny_model("llama")
    with Engine(model=model, device="cpu", dtype="float32") as engine:
        params = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True, logprobs=3)
        out = engine.generate("def hello(name):", params)[0]
        assert out.text == engine.tokenizer.decode(out.token_ids, skip_special_tokens=True,
                                                   clean_up_tokenization_spaces=False)
        assert out.meta["finish_reason"] == "length" and out.meta["prompt_tokens"] > 0
        assert len(out.meta["output_top_logprobs"]) == 16
        assert all(len(top) == 3 for top in out.meta["output_top_logprobs"])
        # Greedy picks the top token, so its logprob is the first of the top-n.
        assert all(abs(lp - top[0][1]) < 1e-5 for (lp, _), top in
                   zip(out.meta["output_token_logprobs"], out.meta["output_top_logprobs"]))
        stop = out.text[len(out.text) // 2:][:3]
        if stop.strip():
            stopped = engine.generate("def hello(name):", SamplingParams(
                max_new_tokens=16, temperature=0.0, ignore_eos=True, stop=stop))[0]
            assert stopped.meta["finish_reason"] == "stop" and stopped.meta["matched_stop"] == stop
            assert stopped.text == out.text[:out.text.index(stop)]
        # A stop token id ends the request and is reported.
        stop_id = out.token_ids[5]
        stopped = engine.generate("def hello(name):", SamplingParams(
            max_new_tokens=16, temperature=0.0, stop_token_ids=[stop_id]))[0]
        assert stopped.token_ids == out.token_ids[:out.token_ids.index(stop_id) + 1]
        assert stopped.meta["matched_stop"] == stop_id
        assert_pool_full(engine)


def test_overlap_schedule_gives_the_same_outputs_as_the_synchronous_loop(tiny_model):
    """Overlap launches step N+1 before step N's tokens reach the host; every output must match the
    synchronous loop: stop tokens (the overlapped extra token is dropped), penalties (which turn the
    overlap off while they run), logprobs, seeds, min_new_tokens, retraction, chunking."""
    model = tiny_model("llama")
    prompts = prompts_with_shared_prefixes(8, seed=5)
    # A stop token the model really produces: the 3rd greedy token of the first prompt.
    stop_at = run(model, prompts[:1], SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True))[0][2]
    params = [
        SamplingParams(max_new_tokens=10, temperature=0.0, stop_token_ids=[stop_at], ignore_eos=True),
        SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True),
        SamplingParams(max_new_tokens=14, temperature=0.9, top_k=20, seed=3, ignore_eos=True),
        SamplingParams(max_new_tokens=9, temperature=0.0, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(max_new_tokens=12, temperature=0.0, logprobs=2, ignore_eos=True),
        SamplingParams(max_new_tokens=8, temperature=0.7, frequency_penalty=0.5, seed=4, min_new_tokens=6),
        SamplingParams(max_new_tokens=16, temperature=0.0, min_new_tokens=4),
        SamplingParams(max_new_tokens=11, temperature=1.0, min_p=0.05, seed=9, ignore_eos=True),
    ]

    def outputs(**options):
        with Engine(model=model, device="cpu", dtype="float32", **options) as engine:
            outs = engine.generate(prompt_token_ids=prompts, sampling_params=params)
            assert_pool_full(engine)
            retractions = engine.scheduler.num_retractions
        return [(o.token_ids, o.meta["finish_reason"], o.meta.get("output_token_logprobs")) for o in outs], \
            retractions

    # No admission reserve in the tight run, so that requests with pending tokens get retracted.
    # Mixed chunks: a request with a penalty joins the decodes while others are still prefilling.
    for options in ({}, {"max_total_tokens": 120, "chunked_prefill_size": 9, "schedule_conservativeness": 0},
                    {"chunked_prefill_size": 16, "enable_mixed_chunk": True}):
        sync, _ = outputs(disable_overlap_schedule=True, **options)
        overlapped, retractions = outputs(**options)
        assert [o[:2] for o in overlapped] == [o[:2] for o in sync]
        # Logprobs may differ in the last bits: a batch's composition changes the float sums.
        for (_, _, got), (_, _, want) in zip(overlapped, sync):
            assert (got is None) == (want is None)
            if got is not None:
                assert [t for _, t in got] == [t for _, t in want]
                assert [lp for lp, _ in got] == pytest.approx([lp for lp, _ in want], abs=1e-4)
        assert retractions > 0 or "max_total_tokens" not in options
    assert sync[0][0][-1] == stop_at and sync[0][1] == "stop" and len(sync[0][0]) == 3
    assert len(sync[1][0]) == 1


def test_overlap_schedule_really_launches_ahead(tiny_model):
    model = tiny_model("llama")
    params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    for disable, got_first in ((True, 1), (False, 0)):
        with Engine(model=model, device="cpu", dtype="float32", disable_overlap_schedule=disable) as engine:
            rid = engine.add_request(prompt_token_ids=[5, 6, 7], sampling_params=params)
            engine.step()  # the prefill: with overlap its token is still pending after the step
            req = engine.request(rid)
            assert len(req.output_ids) == got_first and len(req.pending) == 1 - got_first
            steps = 1
            while engine.has_work():
                engine.step()
                steps += 1
            assert len(req.output_ids) == 4 and not req.pending
            # Length-limited requests are not scheduled past their last token, so overlap costs
            # exactly one extra step (the one that resolves the last launch).
            assert steps == 4 + (not disable)


def test_under_an_itl_target_a_prefilling_step_launches_after_the_tokens_in_flight(tiny_model):
    """A step that prefills keeps the host for its launch: under an ITL target the batch in flight gives
    its tokens to the streams first. Without a target the launch goes first (overlap); outputs are alike."""
    model = tiny_model("llama")
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    outputs = []
    for target, first in ((None, "launch"), (1e6, "resolve")):
        with Engine(model=model, device="cpu", dtype="float32", enable_mixed_chunk=True,
                    itl_target_ms=target) as engine:
            calls = []
            for name in ("_launch", "_resolve"):
                method = getattr(engine.loop, name)
                setattr(engine.loop, name, lambda *a, _m=method, _n=name: calls.append(_n[1:]) or _m(*a))
            a = engine.add_request(prompt_token_ids=[5, 6, 7], sampling_params=params)
            engine.step()
            engine.step()  # a decodes, its token in flight
            b = engine.add_request(prompt_token_ids=[9, 8, 7, 6], sampling_params=params)
            calls.clear()
            engine.step()  # b's prefill joins a's decode
            assert calls == [first, "launch" if first == "resolve" else "resolve"]
            while engine.has_work():
                engine.step()
            outputs.append([engine.output(engine.pop(r)).token_ids for r in (a, b)])
    assert outputs[0] == outputs[1]


def test_a_request_held_back_by_memory_does_not_cost_the_running_ones_their_overlap(tiny_model):
    """Under an ITL target a waiting request makes the next step resolve first only while it may be
    admitted: once a step leaves it waiting and prefills nothing, the steps overlap again."""
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    with Engine(model=tiny_model("llama"), device="cpu", dtype="float32", itl_target_ms=1e6,
                max_total_tokens=64, schedule_conservativeness=1.0) as engine:
        calls = []
        for name in ("_launch", "_resolve"):
            method = getattr(engine.loop, name)
            setattr(engine.loop, name, lambda *a, _m=method, _n=name: calls.append(_n[1:]) or _m(*a))
        a = engine.add_request(prompt_token_ids=list(range(5, 15)), sampling_params=params)
        engine.step()
        engine.step()
        b = engine.add_request(prompt_token_ids=list(range(20, 50)), sampling_params=params)  # does not fit yet
        orders = []
        while engine.scheduler.waiting:
            calls.clear()
            engine.step()
            orders.append(tuple(calls))
        assert orders[0] == ("resolve", "launch")  # b may fit: its step resolves first, then holds b back
        assert len(orders) > 10 and all(o == ("launch", "resolve") for o in orders[1:-1])
        while engine.has_work():
            engine.step()
        assert len(engine.output(engine.pop(b)).token_ids) == 24


def test_a_prompt_in_progress_is_not_stalled_by_a_shorter_newcomer_at_the_request_limit():
    """max_running_requests 1: a short prompt arriving while a long one is between chunks is ranked first
    but cannot be admitted; the long one still gets its chunks (this used to stall both for good)."""
    params = SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True)
    with Engine(model="demo", device="cpu", dtype="float32", chunked_prefill_size=16, max_running_requests=1) as e:
        long = e.add_request(prompt_token_ids=list(range(100, 150)), sampling_params=params)
        e.step()  # its first chunk
        short = e.add_request(prompt_token_ids=[5, 6, 7], sampling_params=params)
        for _ in range(50):
            if not e.has_work():
                break
            e.step()
        assert not e.has_work()
        assert [len(e.output(e.pop(r)).token_ids) for r in (long, short)] == [2, 2]


def test_a_stop_string_before_min_new_tokens_does_not_count():
    """The demo model's greedy answer repeats " module"; with min_new_tokens past its first occurrence the
    request stops at the first one completed at or after the minimum (it ran to max_new_tokens, reporting
    "stop" with its text cut at the first). The text ends where a stop string begins in the tokens' text;
    which occurrence depends on where the detokenizer's held-back text falls, one token either way."""
    prompt, stop = "The cat sat on", "module"
    with Engine(model="demo", device="cpu", dtype="float32") as e:
        free = e.generate(prompts=[prompt], sampling_params=SamplingParams(
            max_new_tokens=30, temperature=0.0, ignore_eos=True))[0]
        ends = [i + 1 for i in range(len(free.token_ids)) if e.tokenizer.decode(free.token_ids[:i + 1]).count(stop)
                > e.tokenizer.decode(free.token_ids[:i]).count(stop)]  # tokens at which an occurrence completes
        assert len(ends) >= 2, free.text
        minimum = ends[0] + 1
        want = next(n for n in ends if n >= minimum)
        out = e.generate(prompts=[prompt], sampling_params=SamplingParams(
            max_new_tokens=30, min_new_tokens=minimum, temperature=0.0, ignore_eos=True, stop=stop))[0]
    assert out.meta["finish_reason"] == "stop" and len(out.token_ids) == want
    full = e.tokenizer.decode(out.token_ids)
    assert full.startswith(out.text) and full[len(out.text):].startswith(stop)


def test_a_steps_host_phases_add_up_to_its_time(tiny_model):
    """StepInfo.phases splits each step's wall time into STEP_PHASES, in order, without gaps."""
    from kestrel.core.outputs import STEP_PHASES

    infos = []
    with Engine(model=tiny_model("llama"), device="cpu", dtype="float32", enable_mixed_chunk=True) as engine:
        engine.add_step_hook(infos.append)
        engine.generate(prompt_token_ids=[[5, 6, 7], [9, 8, 7, 6, 5]],
                        sampling_params=SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True))
    assert infos and all(len(i.phases) == len(STEP_PHASES) for i in infos)
    for info in infos:
        assert min(info.phases) >= 0 and sum(info.phases) == pytest.approx(info.seconds, abs=1e-9)
    # Overlapped, a step launches its batch and then resolves the one in flight; the forward runs at launch.
    assert all(i.phases[2] > i.phases[3] for i in infos if i.mode == "extend")


def test_abort_reaches_a_request_whose_last_token_is_in_flight(tiny_model):
    model = tiny_model("llama")
    with Engine(model=model, device="cpu", dtype="float32") as engine:
        rid = engine.add_request(prompt_token_ids=[5, 6, 7],
                                 sampling_params=SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True))
        engine.step()  # prefill launched
        engine.step()  # last decode launched, first token resolved: the request is finishing
        assert engine.scheduler.finishing and not engine.scheduler.running
        assert engine.abort(rid)
        while engine.has_work():
            engine.step()
        out = engine.output(engine.pop(rid))
        assert out.meta["finish_reason"] == "abort" and len(out.token_ids) == 1
        assert not engine.scheduler.finishing
        assert_pool_full(engine)


def test_one_call_decode_equals_the_per_request_loop(tiny_model, monkeypatch):
    """torch_native serves a decode batch in one SDPA call (keys padded to the longest, GQA in the call);
    the per-request loop it replaces is the oracle, on requests of different lengths."""
    import kestrel.attention.torch_native as torch_native

    model = tiny_model("llama")  # 4 query heads over 2 KV heads
    prompts = prompts_with_shared_prefixes(5, seed=3)
    params = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True, logprobs=0)

    def logprobs() -> list[list[tuple[float, int]]]:
        with Engine(model=model, device="cpu", dtype="float32") as engine:
            outs = engine.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        return [o.meta["output_token_logprobs"] for o in outs]

    calls = []
    one_call = torch_native.TorchNativeBackend._decode
    monkeypatch.setattr(torch_native.TorchNativeBackend, "_decode",
                        lambda self, *a: calls.append(1) or one_call(self, *a))
    batched = logprobs()
    assert calls, "the decode batches did not take the one-call path"
    monkeypatch.setattr(torch_native, "_one_call_decode", lambda batch, layer: False)
    for got, want in zip(batched, logprobs()):
        assert [t for _, t in got] == [t for _, t in want]
        assert max(abs(a - b) for (a, _), (b, _) in zip(got, want)) < 1e-4


@pytest.mark.parametrize("itl_target_ms", [None, 500.0], ids=["no-target", "target"])
def test_the_step_cost_model_learns_only_for_an_itl_target(tiny_model, itl_target_ms):
    """With --itl-target-ms each step's shape and time feed the step-cost model; without one the decode
    loop records nothing (no host work for a model nobody reads)."""
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    with Engine(model=tiny_model(), device="cpu", dtype="float32", itl_target_ms=itl_target_ms) as engine:
        engine.generate(prompt_token_ids=[[5, 6, 7, 8], [9, 10, 11]], sampling_params=params, use_tqdm=False)
        seen = engine.scheduler.cost.observations
    assert (seen > 10) if itl_target_ms is not None else seen == 0


def test_sampling_params_as_sglang_s_dict(tiny_model):
    """engine.generate takes SGLang's dict form too: the same tokens as the SamplingParams; an unknown key
    is a ValueError naming it, and the engine keeps serving."""
    with Engine(model=tiny_model("llama"), device="cpu", dtype="float32") as engine:
        want = engine.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=SamplingParams(max_new_tokens=5,
                                                                                            temperature=0.0))
        got = engine.generate(prompt_token_ids=[[1, 2, 3]], sampling_params={"max_new_tokens": 5, "temperature": 0})
        assert got[0].token_ids == want[0].token_ids and len(got[0].token_ids) == 5
        with pytest.raises(ValueError, match="max_tokenz"):
            engine.generate(prompt_token_ids=[[1, 2, 3]], sampling_params={"max_tokenz": 5})
        assert len(engine.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=GREEDY)[0].token_ids) == 12
        assert_pool_full(engine)


def test_shutdown_frees_the_model_and_the_kv_pool_while_the_engine_is_still_referenced(tiny_model):
    """A `with` block's name outlives the block, and the engine's parts reference one another: the device
    memory must go back at shutdown, not at Python's next full collection."""
    import weakref

    with Engine(model=tiny_model("llama"), device="cpu", dtype="float32", max_total_tokens=512) as engine:
        engine.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=GREEDY)
        held = [*engine.kv_memory.pools[0].token_buffers(), *engine.runner.model.parameters()]
        refs = [weakref.ref(t) for t in held]
        del held
    assert engine is not None  # still bound
    assert not [r for r in refs if r() is not None], "a shut-down engine still holds its KV pool or weights"
    engine.shutdown()  # a second shutdown is harmless
    with pytest.raises(RuntimeError, match="shut down"):
        engine.generate(prompt_token_ids=[[5, 6]], sampling_params=GREEDY)

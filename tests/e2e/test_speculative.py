"""Speculative decoding with a draft model through the engine (EAGLE, EAGLE-3, STANDALONE; NGRAM has
test_spec_ngram.py): greedy tokens equal non-speculative greedy token for token (the oracle), with
chunked prefill, radix hits, pages, retraction, stop strings mid-path, aborts mid-round and both
attention backends; sampling keeps the target's distribution and is reproducible; the KV pool is
full again after every run."""
from __future__ import annotations

import pytest
import torch

from kestrel import Engine, SamplingParams
from tests.e2e.conftest import assert_pool_full
from tests.model.test_llama_eagle import make_eagle, make_eagle3
from tests.tiny_models import make_tiny_model

CHAIN = dict(speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4)
TREE = dict(speculative_num_steps=3, speculative_eagle_topk=4, speculative_num_draft_tokens=8)
COMMON = dict(device="cpu", dtype="float32", max_total_tokens=2048)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    make_eagle(root / "eagle")
    make_eagle3(root / "eagle3")
    return {"target": str(make_tiny_model("llama", root / "target")), "EAGLE": str(root / "eagle"),
            "EAGLE3": str(root / "eagle3"),
            "STANDALONE": str(make_tiny_model("llama", root / "draft", seed=5, num_hidden_layers=1))}


def prompts() -> list[list[int]]:
    """Eight prompts of different lengths; the last three share a 20-token prefix (radix hits)."""
    shared = [(11 * i) % 500 + 3 for i in range(20)]
    return [[(7 * i + j) % 500 + 3 for i in range(5 + 6 * j)] for j in range(5)] + \
        [shared + [100 + j] * (j + 1) for j in range(3)]


def plain_greedy(model: str, prompt_lists, max_new_tokens: int = 16, **options) -> list[list[int]]:
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    with Engine(model=model, **{**COMMON, **options}) as engine:
        return [o.token_ids for o in engine.generate(prompt_token_ids=prompt_lists, sampling_params=params)]


def spec_engine(models, algorithm: str, shape: dict, **options) -> Engine:
    return Engine(model=models["target"], speculative_algorithm=algorithm,
                  speculative_draft_model_path=models[algorithm], **shape, **{**COMMON, **options})


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["topk1", "topk4"])
@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3", "STANDALONE"])
def test_greedy_equals_plain_greedy(models, algorithm, shape, batch):
    options = dict(max_running_requests=batch, chunked_prefill_size=16)
    want = plain_greedy(models["target"], prompts(), **options)
    params = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    with spec_engine(models, algorithm, shape, **options) as engine:
        for attempt in range(2):  # the second pass reuses cached prefixes (target and draft KV)
            outs = engine.generate(prompt_token_ids=prompts(), sampling_params=params)
            assert [o.token_ids for o in outs] == want
            assert all(o.meta["spec_verify_ct"] > 0 and o.meta["spec_accept_length"] >= 1 for o in outs)
        assert sum(o.meta["cached_tokens"] for o in outs) > 0
        assert_pool_full(engine)


@pytest.mark.parametrize("algorithm,shape", [("EAGLE", TREE), ("EAGLE3", CHAIN), ("STANDALONE", TREE)])
def test_greedy_on_the_triton_backend(models, algorithm, shape):
    options = dict(attention_backend="triton", page_size=4)
    want = plain_greedy(models["target"], prompts()[:4], max_new_tokens=10, **options)
    params = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
    with spec_engine(models, algorithm, shape, **options) as engine:
        assert [o.token_ids for o in engine.generate(prompt_token_ids=prompts()[:4], sampling_params=params)] == want
        assert_pool_full(engine)


def test_the_target_as_its_own_draft_gets_every_draft_accepted(models):
    """A draft equal to the target proposes exactly the target's greedy chain, so every round commits
    num_steps + 1 tokens."""
    models = {**models, "STANDALONE": models["target"]}
    params = SamplingParams(max_new_tokens=13, temperature=0.0, ignore_eos=True)
    with spec_engine(models, "STANDALONE", CHAIN, page_size=2) as engine:
        outs = engine.generate(prompt_token_ids=prompts(), sampling_params=params)
        assert set(engine.spec_worker.accept_lengths) == {4}
        assert [o.token_ids for o in outs] == plain_greedy(models["target"], prompts(), max_new_tokens=13)
        assert_pool_full(engine)


def test_tree_lanes_draft_what_the_target_predicts(models, monkeypatch):
    """With the target as its own draft, every drafted node is one of the top-k tokens of the target's
    distribution at its parent, as the verify forward (tree mask, another code path) computes it:
    each lane attended to exactly its own path."""
    import kestrel.speculative.draft_worker as worker_module

    rounds = []

    def recording_verify(*args, **kwargs):
        verified = worker_module.verify_tree.__wrapped__(*args, **kwargs)
        rounds.append((args[2], verified.target.logits))
        return verified

    recording_verify.__wrapped__ = worker_module.verify_tree
    monkeypatch.setattr(worker_module, "verify_tree", recording_verify)
    models = {**models, "STANDALONE": models["target"]}
    # Every candidate of every step in the tree (3 + 3 * 9): the deepest lanes, which continue other
    # lanes' paths, are checked too.
    shape = dict(speculative_num_steps=4, speculative_eagle_topk=3, speculative_num_draft_tokens=31)
    with spec_engine(models, "STANDALONE", shape) as engine:
        engine.generate(prompt_token_ids=prompts(), sampling_params=SamplingParams(max_new_tokens=9, temperature=0))
    assert rounds
    for tree, logits in rounds:
        b, n = tree.tokens.shape
        top = logits.view(b, n, -1).topk(3, dim=-1).indices  # [B, N, 3]
        parent_top = top.gather(1, tree.parents.clamp(min=0)[..., None].expand(-1, -1, 3))
        drafted = (parent_top == tree.tokens[..., None]).any(-1)[:, 1:]
        assert drafted.all() and (tree.depths.max(1).values == 4).all()


def test_retraction_and_the_context_limit_under_a_tiny_pool(models):
    options = dict(max_total_tokens=160, context_length=40, schedule_conservativeness=0, page_size=2)
    want = plain_greedy(models["target"], prompts(), max_new_tokens=30, **options)
    params = SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True)
    with spec_engine(models, "EAGLE", TREE, **options) as engine:
        assert [o.token_ids for o in engine.generate(prompt_token_ids=prompts(), sampling_params=params)] == want
        assert engine.scheduler.num_retractions > 0
        assert_pool_full(engine)


def test_aborts_mid_round_leak_nothing(models):
    params = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    with spec_engine(models, "EAGLE", TREE) as engine:
        rids = [engine.add_request(prompt_token_ids=p, sampling_params=params) for p in prompts()]
        for _ in range(6):
            engine.step()
        assert any(engine.request(r).output_ids for r in rids)
        for rid in rids[::2]:
            engine.abort(rid)
        while engine.has_work():
            engine.step()
        assert all(engine.request(r).finished for r in rids)
        assert engine.kv_memory.req_to_token.available() == engine.kv_memory.req_to_token.max_requests
        assert_pool_full(engine)


def test_logprobs_of_committed_tokens_match_plain_decoding(models):
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3)
    with Engine(model=models["target"], **COMMON) as plain:
        want = plain.generate(prompt_token_ids=prompts()[:3], sampling_params=params)
    with spec_engine(models, "EAGLE3", TREE) as engine:
        got = engine.generate(prompt_token_ids=prompts()[:3], sampling_params=params)
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids
        (wl, wt), (gl, gt) = zip(*w.meta["output_token_logprobs"]), zip(*g.meta["output_token_logprobs"])
        assert gt == wt
        torch.testing.assert_close(torch.tensor(gl), torch.tensor(wl), atol=1e-4, rtol=0)
        assert [[t for t, _ in top] for top in g.meta["output_top_logprobs"]] == \
            [[t for t, _ in top] for top in w.meta["output_top_logprobs"]]


def test_sampling_is_reproducible(models):
    params = [SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.95, seed=s, ignore_eos=True) for s in range(4)]
    with spec_engine(models, "STANDALONE", TREE) as engine:
        first = [o.token_ids for o in engine.generate(prompt_token_ids=prompts()[:4], sampling_params=params)]
        again = [o.token_ids for o in engine.generate(prompt_token_ids=prompts()[:4], sampling_params=params)]
        assert first == again and len({tuple(t) for t in first}) > 1
        assert_pool_full(engine)


PENALIZED = [dict(repetition_penalty=1.3), dict(frequency_penalty=0.7), dict(presence_penalty=1.1),
             dict(frequency_penalty=-0.4, presence_penalty=0.3, repetition_penalty=0.8),
             dict(min_new_tokens=12, stop_token_ids=[7, 9, 11, 40, 99]), dict(min_new_tokens=5)]


@pytest.mark.parametrize("algorithm,shape", [("EAGLE", TREE), ("STANDALONE", CHAIN), ("STANDALONE", TREE)],
                         ids=["eagle-tree", "standalone-chain", "standalone-tree"])
def test_penalties_and_min_new_tokens_apply_per_node(models, algorithm, shape):
    """Penalties and min_new_tokens depend on the tokens before each node: applied per node of the tree, so
    greedy output equals the plain engine's with the same parameters (which differs from the unpenalized
    output), logprobs included; the target as its own draft still gets most drafts accepted."""
    batch = prompts()[:6]
    params = [SamplingParams(max_new_tokens=20, temperature=0.0, logprobs=1, **fields) for fields in PENALIZED]
    unpenalized = plain_greedy(models["target"], batch, max_new_tokens=20)
    with Engine(model=models["target"], **COMMON) as plain:
        want = plain.generate(prompt_token_ids=batch, sampling_params=params)
    assert sum(w.token_ids != u for w, u in zip(want, unpenalized)) >= 4
    drafts = [models[algorithm]] + ([models["target"]] if algorithm == "STANDALONE" else [])
    for draft in drafts:
        with Engine(model=models["target"], speculative_algorithm=algorithm, speculative_draft_model_path=draft,
                    **shape, **COMMON) as engine:
            got = engine.generate(prompt_token_ids=batch, sampling_params=params)
            assert [g.token_ids for g in got] == [w.token_ids for w in want]
            for w, g in zip(want, got):
                torch.testing.assert_close(torch.tensor([lp for lp, _ in g.meta["output_token_logprobs"]]),
                                           torch.tensor([lp for lp, _ in w.meta["output_token_logprobs"]]),
                                           atol=1e-4, rtol=0)
            assert_pool_full(engine)
    if algorithm == "STANDALONE":  # the last engine drafted with the target itself
        assert sum(g.meta["spec_accept_length"] for g in got) / len(got) > 2


def _chi_square_p(a: torch.Tensor, b: torch.Tensor) -> float:
    """p-value of a two-sample chi-square test that counts `a` and `b` come from one distribution."""
    keep = (a + b) > 0
    a, b = a[keep].double(), b[keep].double()
    na, nb = a.sum(), b.sum()
    stat = (((a * (nb / na).sqrt() - b * (na / nb).sqrt()) ** 2) / (a + b)).sum()
    dof = keep.sum() - 1
    return float(torch.special.gammaincc(dof / 2.0, stat / 2.0))


def test_speculative_sampling_keeps_the_target_distribution(tmp_path):
    """Tokens 2 and 3 (drawn by acceptance) of 600 seeded samples, with and without speculation (other
    seeds), on a 16-token vocabulary: a two-sample chi-square test does not tell them apart. The draft
    is another random model, so drafts are often rejected and the residual path is used."""
    target = str(make_tiny_model("llama", tmp_path / "t", vocab_size=16, seed=3, initializer_range=0.3))
    draft = str(make_tiny_model("llama", tmp_path / "d", vocab_size=16, seed=4, num_hidden_layers=1,
                                initializer_range=0.3))
    n = 600
    counts = []
    for first_seed, spec in ((0, {}), (n, dict(speculative_algorithm="STANDALONE",
                                               speculative_draft_model_path=draft, **TREE))):
        params = [SamplingParams(max_new_tokens=3, temperature=1.0, seed=first_seed + s, ignore_eos=True)
                  for s in range(n)]
        with Engine(model=target, **COMMON, **spec) as engine:
            outs = engine.generate(prompt_token_ids=[[3, 5, 7, 9]] * n, sampling_params=params)
            counts.append([torch.bincount(torch.tensor([o.token_ids[i] for o in outs]), minlength=16)
                           for i in (1, 2)])
            if spec:
                lengths = engine.spec_worker.accept_lengths
                assert 1 < sum(lengths) / len(lengths) < 3
    for plain, speculative in zip(*counts):
        assert _chi_square_p(plain, speculative) > 1e-3


def test_server_reports_accept_lengths_in_meta_and_metrics(models):
    import httpx

    from tests.e2e.server_process import ServerProcess, metric, metric_samples, wait_idle

    server = ServerProcess(models["target"], "--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path",
                           models["target"], "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
                           "--speculative-num-draft-tokens", "4", "--served-model-name", "spec")
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            body = {"input_ids": prompts()[0], "sampling_params": {"max_new_tokens": 9, "temperature": 0,
                                                                   "ignore_eos": True}}
            meta = http.post("/generate", json=body).json()["meta_info"]
            assert meta["spec_verify_ct"] == 2 and meta["spec_accept_length"] == 4.0  # the target drafts itself
            assert meta["spec_accept_histogram"] == [0, 0, 0, 0, 2]
            wait_idle(http)
            samples = metric_samples(http)
            assert metric(samples, "kestrel:spec_accept_length", model_name="spec") == 4.0
            assert metric(samples, "kestrel:spec_accept_length_per_round_count", model_name="spec") == 2
    finally:
        server.stop()


def test_speculation_stops_above_the_disable_batch_size_and_resumes_below(models):
    """Eight requests with speculation off above three running: plain decode steps first (the draft
    still extends over their tokens), verify rounds once requests finish; tokens unchanged."""
    params = [SamplingParams(max_new_tokens=6 + 4 * i, temperature=0.0, ignore_eos=True) for i in range(8)]
    with Engine(model=models["target"], **COMMON) as plain:
        want = [o.token_ids for o in plain.generate(prompt_token_ids=prompts(), sampling_params=params)]
    with spec_engine(models, "EAGLE", CHAIN, speculative_disable_batch_size=3) as engine:
        modes = []
        engine.add_step_hook(lambda info: modes.append((info.mode, info.num_reqs)))
        assert [o.token_ids for o in engine.generate(prompt_token_ids=prompts(), sampling_params=params)] == want
        assert ("decode", 8) in modes and all(n <= 3 for mode, n in modes if mode == "target_verify")
        assert any(mode == "target_verify" for mode, _ in modes)
        assert_pool_full(engine)

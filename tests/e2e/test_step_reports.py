"""What `Engine.step()` reports, for every algorithm (plain decoding, EAGLE, EAGLE3, STANDALONE, NGRAM,
NEXTN), with and without overlap, alone and at batch 8: each request at most once per step, its finish
exactly once and never after, tokens equal to plain greedy (the oracle), the KV pool full afterwards.

The hard cases are requests that finish inside a speculative round: max_new_tokens 1..12 and stop
strings (and stop token ids) matching at each output position. So that rounds commit several tokens at
fixed depths (a random tiny draft is nearly always rejected), the drafts are replaced by the oracle's
continuation before the verify: every round then commits num_steps + 1 tokens (output positions 2-5,
6-9, 10-13 with the chain below), and a limit or a stop lands at every depth of the first rounds.
"""
from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from safetensors.torch import save_file

import kestrel.speculative.draft_worker
import kestrel.speculative.ngram_worker
from kestrel import Engine, SamplingParams
from kestrel.speculative.tree import DraftTree, ancestor_mask
from tests.e2e.conftest import assert_pool_full
from tests.model import dsv4_reference as ref
from tests.model.test_llama_eagle import make_eagle, make_eagle3
from tests.tiny_models import make_tiny_model
from tests.tiny_tokenizer import build_tokenizer

COMMON = dict(device="cpu", dtype="float32", max_total_tokens=2048, max_running_requests=8)
CHAIN = dict(speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4)
TREE = dict(speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=6)
# (target, algorithm, shape)
SETUPS = {"plain": ("llama", None, {}), "EAGLE": ("llama", "EAGLE", TREE), "EAGLE3": ("llama", "EAGLE3", CHAIN),
          "STANDALONE": ("llama", "STANDALONE", CHAIN), "NGRAM": ("llama", "NGRAM", CHAIN),
          "NEXTN": ("dsv4", "NEXTN", CHAIN)}
MAX_NEW = range(1, 13)
STOP_AT = range(1, 9)  # output positions where a stop string / stop token first matches
ORACLE_LEN = 24

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # thousands of tiny ops: a second thread only spins


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("step-reports")
    make_eagle(root / "EAGLE")
    make_eagle3(root / "EAGLE3")
    dsv4 = root / "dsv4"
    dsv4.mkdir()
    cfg = ref.RefConfig(index_n_heads=16)
    (dsv4 / "config.json").write_text(json.dumps(cfg.native_config()))
    save_file({k: v.contiguous() for k, v in ref.random_weights(cfg, seed=0).items()}, str(dsv4 / "model.safetensors"))
    build_tokenizer(dsv4, cfg.vocab_size)  # stop strings need text
    return {"llama": str(make_tiny_model("llama", root / "llama", with_tokenizer=True)), "dsv4": str(dsv4),
            "EAGLE": str(root / "EAGLE"), "EAGLE3": str(root / "EAGLE3"),
            "STANDALONE": str(make_tiny_model("llama", root / "draft", seed=5, num_hidden_layers=1))}


def prompts() -> list[list[int]]:
    return [[(7 * i + 5 * j) % 400 + 20 for i in range(4 + 9 * j)] for j in range(3)]


@pytest.fixture(scope="module")
def oracle(folders):
    """Per target: each prompt's plain greedy continuation, and its text up to each output position."""
    out = {}
    for target in ("llama", "dsv4"):
        with Engine(model=folders[target], **COMMON) as engine:
            params = SamplingParams(max_new_tokens=ORACLE_LEN, temperature=0.0, ignore_eos=True)
            conts = [o.token_ids for o in engine.generate(prompt_token_ids=prompts(), sampling_params=params,
                                                          use_tqdm=False)]
            out[target] = (conts, engine.tokenizer)
    return out


def cases(conts, tokenizer) -> list[tuple[int, SamplingParams]]:
    """(prompt index, params): every max_new_tokens, then stop strings and stop tokens at each position."""
    greedy = dict(temperature=0.0, ignore_eos=True)
    out = [(n % 3, SamplingParams(max_new_tokens=n, **greedy)) for n in MAX_NEW]
    for k in STOP_AT:
        p = k % 3
        cont = conts[p]
        text, before = tokenizer.decode(cont[:k]), tokenizer.decode(cont[:k - 1])
        # The shortest end of the text so far that is not in it one token earlier: it first matches at k.
        stop = next((text[-n:] for n in range(1, len(text) + 1) if text[-n:] not in before), None)
        if stop is not None and "\ufffd" not in stop:
            out.append((p, SamplingParams(max_new_tokens=12, stop=[stop], **greedy)))
        if cont[k - 1] not in cont[:k - 1]:
            out.append((p, SamplingParams(max_new_tokens=12, stop_token_ids=[cont[k - 1]], **greedy)))
    return out


def use_oracle_drafts(monkeypatch, continuations: dict[tuple[int, ...], list[int]]) -> None:
    """Every drafted node gets the oracle's token at its position (a tree keeps its shape; NGRAM's
    tree, padded at depth 1 where nothing matches, becomes a full chain), so every draft is accepted."""
    def patch(module):
        verify_tree = module.verify_tree

        def oracle_verify(runner, batch, tree, *args, **kwargs):
            tokens, parents, depths = tree.tokens.clone(), tree.parents, tree.depths
            if module is kestrel.speculative.ngram_worker:
                n = tokens.shape[1]
                parents = torch.arange(-1, n - 1).expand_as(tokens).clone()
                depths = torch.arange(n).expand_as(tokens).clone()
            for b, (req, prefix) in enumerate(zip(batch.reqs, batch.prefix_lens)):
                seq = list(req.prompt_ids) + continuations[tuple(req.prompt_ids)]
                for node in range(1, tokens.shape[1]):
                    pos = prefix + int(depths[b, node])
                    tokens[b, node] = seq[pos] if pos < len(seq) else 0
            depth = int(depths.max())
            tree = DraftTree(tokens, parents, depths, ancestor_mask(parents, depth), depth)
            return verify_tree(runner, batch, tree, *args, **kwargs)

        monkeypatch.setattr(module, "verify_tree", oracle_verify)

    patch(kestrel.speculative.draft_worker)
    patch(kestrel.speculative.ngram_worker)


def drive(engine: Engine, requests: list[tuple[int, SamplingParams]], batch: int) -> list[tuple[list[int], str]]:
    """Run the requests through `step()`, `batch` at a time, checking what each step reports; returns each
    request's (tokens, finish_reason)."""
    finished: dict[str, tuple[list[int], str]] = {}
    rids = []
    for first in range(0, len(requests), batch):
        group = [engine.add_request(prompt_token_ids=prompts()[p], sampling_params=params)
                 for p, params in requests[first:first + batch]]
        rids += group
        finishes = Counter()
        while engine.has_work():
            reported = engine.step()
            names = [r.rid for r in reported]
            assert len(names) == len(set(names)), f"a request reported twice in one step: {names}"
            for req in reported:
                assert req.rid not in finished, f"{req.rid} reported after its finish"
                if req.finished:
                    finishes[req.rid] += 1
                    finished[req.rid] = (list(req.output_ids), req.finish_reason)
                    engine.pop(req.rid)  # as the server does: a second report would find it gone
        assert finishes == Counter(group), "each request finishes exactly once"
    assert_pool_full(engine)
    return [finished[rid] for rid in rids]


@pytest.fixture(scope="module")
def engines(folders):
    made: dict[tuple[str, bool], Engine] = {}

    def get(setup: str, overlap: bool) -> Engine:
        if (setup, overlap) not in made:
            target, algorithm, shape = SETUPS[setup]
            spec = {} if algorithm is None else dict(speculative_algorithm=algorithm, **shape)
            if algorithm in ("EAGLE", "EAGLE3", "STANDALONE"):
                spec["speculative_draft_model_path"] = folders[algorithm]
            made[(setup, overlap)] = Engine(model=folders[target], disable_overlap_schedule=not overlap,
                                            **spec, **COMMON)
        return made[(setup, overlap)]

    yield get
    for engine in made.values():
        engine.shutdown()


# NEXTN, the slowest tiny model, at batch 8 only: its rounds go through the same draft worker as EAGLE's.
RUNS = [(setup, overlap, batch) for setup in SETUPS for overlap in (True, False) for batch in (1, 8)
        if (setup, batch) != ("NEXTN", 1)]


@pytest.mark.parametrize("setup,overlap,batch", RUNS,
                         ids=[f"{s}-{'overlap' if o else 'no-overlap'}-{b}" for s, o, b in RUNS])
def test_each_request_is_reported_once_per_step_and_finishes_once(engines, oracle, monkeypatch, setup, overlap,
                                                                    batch):
    target = SETUPS[setup][0]
    conts, tokenizer = oracle[target]
    use_oracle_drafts(monkeypatch, {tuple(p): c for p, c in zip(prompts(), conts)})
    requests = cases(conts, tokenizer)
    assert len(requests) > len(MAX_NEW) + len(STOP_AT)  # most positions got a stop string and a stop token
    engine = engines(setup, overlap)
    got = drive(engine, requests, batch)
    # The oracle: plain greedy cut at the first stop condition, as the plain engine applies them.
    with_stop = [(conts[p][:params.max_new_tokens], params) for p, params in requests]
    for (tokens, reason), (cont, params) in zip(got, with_stop):
        if params.stop_token_ids:
            end = cont.index(params.stop_token_ids[0]) + 1
            assert (tokens, reason) == (cont[:end], "stop")
        elif params.stop_strs:
            assert reason == "stop" and tokens == cont[:len(tokens)]
            text = tokenizer.decode(tokens)
            assert params.stop_strs[0] in text and params.stop_strs[0] not in tokenizer.decode(tokens[:-1])
        else:
            assert (tokens, reason) == (cont, "length")
    if SETUPS[setup][1] is not None:
        assert max(engine.spec_worker.accept_lengths) == 4  # full rounds ran

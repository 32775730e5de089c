"""Speculative decoding on CUDA, with the verify and draft-decode CUDA graphs: greedy equals plain greedy
(float32), and the graphs were really replayed."""
from __future__ import annotations

import pytest

from kestrel import Engine, SamplingParams
from kestrel.core.forward_mode import ForwardMode
from tests.e2e.conftest import assert_pool_full
from tests.e2e.test_demo_eagle import TEXT

PROMPTS = [TEXT[:160], TEXT[80:300], "import os\n\n\ndef main():\n", "class Counter:\n    def __init__(self"]
PARAMS = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
COMMON = dict(model="demo", device="cuda", dtype="float32", max_total_tokens=8192, cuda_graph_max_bs=8)


@pytest.mark.parametrize("spec", [
    dict(speculative_algorithm="EAGLE", speculative_draft_model_path="demo-eagle"),
    dict(speculative_algorithm="STANDALONE", speculative_draft_model_path="demo-draft", speculative_num_steps=3,
         speculative_eagle_topk=2, speculative_num_draft_tokens=6),
    dict(speculative_algorithm="NGRAM"),
], ids=["eagle", "standalone", "ngram"])
def test_cuda_speculative_greedy_equals_plain_greedy(spec):
    with Engine(**COMMON) as plain:
        want = [o.token_ids for o in plain.generate(PROMPTS, PARAMS)]
    with Engine(**COMMON, **spec) as engine:
        n = engine.spec_worker.num_draft
        verify_graph = engine.runner.cuda_graphs[(ForwardMode.TARGET_VERIFY, n)]
        replays = []
        original = verify_graph.replay
        verify_graph.replay = lambda fb: replays.append(fb.batch_size) or original(fb)
        got = [o.token_ids for o in engine.generate(PROMPTS, PARAMS)]
        assert got == want
        assert replays
        if engine.spec_worker.has_draft_kv:
            assert engine.spec_worker.lanes.graphs is not None and engine.spec_worker.greedy_graphs is not None
        assert_pool_full(engine)

"""lm-eval (the PyPI package) runs its `local-completions` model against `kestrel serve` on two tiny tasks
of our own, from local JSONL files: a loglikelihood task (multiple choice, from the prompt logprobs of
echo + logprobs requests) and a generate-until task. The numbers it prints must be the ones computed
directly from the offline engine's logprobs and greedy outputs."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from kestrel import Engine, SamplingParams
from kestrel.assets import resolve_model_path
from tests.e2e.server_process import REPO, ServerProcess

pytest.importorskip("lm_eval")

DEMO = resolve_model_path("demo")
MC_DOCS = [  # the demo model knows Python's standard library
    {"question": "def add(a, b):\n    return a", "choices": ["+ b", "- b", "* 2"], "answer": 0},
    {"question": "import os\nimport", "choices": ["sys", "banana", "os.path"], "answer": 0},
    {"question": "for i in range(10):\n   ", "choices": ["print(i)", "return", "pass"], "answer": 2},
    {"question": "class Foo(object):\n    def __init__(self", "choices": ["):", ", x):", "]:"], "answer": 1},
]
GEN_PROMPTS = ["def fibonacci(n):\n", "class Foo:\n    def __init__(self", "import os\nimport", "if __name__ =="]
MAX_GEN_TOKENS = 8

TASKS = {
    "kestrel_mc": """task: kestrel_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
  - metric: acc_norm
""",
    "kestrel_gen": """task: kestrel_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: %d
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
""" % MAX_GEN_TOKENS,
}

# lm-eval's own evaluator and table, with only our tasks indexed (its CLI first indexes the thousands it
# ships: ~20 s here); what it prints is what `lm_eval --model local-completions ...` prints.
DRIVER = """
import json, sys
from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager
from lm_eval.utils import make_table
include, url, tokenizer, out = sys.argv[1:]
results = simple_evaluate(
    model="local-completions", tasks=["kestrel_mc", "kestrel_gen"], log_samples=True,
    task_manager=TaskManager(include_path=include, include_defaults=False),
    model_args={"base_url": url, "tokenizer": tokenizer, "tokenizer_backend": "huggingface",
                "tokenized_requests": True, "max_length": 1024, "batch_size": 4})
print(make_table(results))
json.dump(results["samples"], open(out, "w"), default=str)
"""


def printed_metrics(table: str) -> dict[tuple[str, str], float]:
    """(task, metric) -> value from lm-eval's markdown table (a blank task cell continues the row above)."""
    values, task = {}, None
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 7 or cells[0] in ("Tasks",) or set(cells[0]) <= {"-", ":"} and cells[0]:
            continue
        task = cells[0] or task
        values[(task, cells[4])] = float(cells[6])
    return values


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """How lm-eval splits a loglikelihood request into tokens: the context's, then the rest of the whole's
    (its TemplateLM moves trailing spaces of the context to the continuation first)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    ctx = tokenizer.encode(context, add_special_tokens=False)
    return ctx, whole[len(ctx):]


@pytest.fixture(scope="module")
def engine():
    with Engine(model="demo", device="cpu", dtype="float32") as e:
        yield e


def direct_multiple_choice(engine) -> tuple[list[list[tuple[float, bool]]], dict[str, float]]:
    """Per doc, (loglikelihood, is greedy) of each choice from the engine's prompt logprobs; acc, acc_norm."""
    pairs = [encode_pair(engine.tokenizer, d["question"], " " + c) for d in MC_DOCS for c in d["choices"]]
    outs = engine.generate(prompt_token_ids=[ctx + cont for ctx, cont in pairs],
                           sampling_params=SamplingParams(max_new_tokens=0, prompt_logprobs=1))
    scored = []
    for (ctx, cont), out in zip(pairs, outs):
        at = range(len(ctx), len(ctx) + len(cont))
        lps, tops = out.meta["prompt_token_logprobs"], out.meta["prompt_top_logprobs"]
        scored.append((sum(lps[i][0] for i in at), all(tops[i][0][0] == lps[i][1] for i in at)))
    per_doc, acc, acc_norm, k = [], [], [], 0
    for d in MC_DOCS:
        doc = scored[k:k + len(d["choices"])]
        k += len(d["choices"])
        lls = np.array([ll for ll, _ in doc])
        per_doc.append(doc)
        acc.append(float(np.argmax(lls) == d["answer"]))
        acc_norm.append(float(np.argmax(lls / np.array([len(c) for c in d["choices"]])) == d["answer"]))
    return per_doc, {"acc": float(np.mean(acc)), "acc_norm": float(np.mean(acc_norm))}


def greedy_texts(engine) -> list[str]:
    """What generate_until asks for: greedy, at most MAX_GEN_TOKENS, until a newline or the eos text."""
    params = SamplingParams(max_new_tokens=MAX_GEN_TOKENS, temperature=0, stop=["\n", engine.tokenizer.eos_token])
    ids = [engine.tokenizer.encode(p, add_special_tokens=False) for p in GEN_PROMPTS]
    return [o.text for o in engine.generate(prompt_token_ids=ids, sampling_params=params)]


def test_lm_eval_local_completions_prints_what_the_engine_computes(engine, tmp_path):
    texts = greedy_texts(engine)
    # Half the targets are the engine's own answer, half miss it by a character: exact_match must read 0.5.
    gen_docs = [{"prompt": p, "target": t if i % 2 == 0 else t + "#"} for i, (p, t) in enumerate(zip(GEN_PROMPTS, texts))]
    for name, docs in (("kestrel_mc", MC_DOCS), ("kestrel_gen", gen_docs)):
        data = tmp_path / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        (tmp_path / f"{name}.yaml").write_text(TASKS[name].format(data=data))
    per_doc, mc_metrics = direct_multiple_choice(engine)

    server = ServerProcess("demo")
    try:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "HF_DATASETS_CACHE": str(tmp_path / "datasets"), "TOKENIZERS_PARALLELISM": "false"}
        run = subprocess.run([sys.executable, "-c", DRIVER, str(tmp_path), server.url + "/v1/completions", DEMO,
                              str(tmp_path / "samples.json")], cwd=REPO, env=env, capture_output=True, text=True,
                             timeout=300)
    finally:
        assert server.stop() == 0
    assert run.returncode == 0, run.stderr[-4000:]
    printed = printed_metrics(run.stdout)
    assert printed[("kestrel_mc", "acc")] == pytest.approx(mc_metrics["acc"], abs=1e-4)
    assert printed[("kestrel_mc", "acc_norm")] == pytest.approx(mc_metrics["acc_norm"], abs=1e-4)
    assert printed[("kestrel_gen", "exact_match")] == 0.5

    samples = json.loads((tmp_path / "samples.json").read_text())
    for sample in samples["kestrel_mc"]:  # every choice's loglikelihood and greediness, as lm-eval logged them
        logged = [(float(ll), str(greedy) == "True") for ll, greedy in sample["filtered_resps"]]
        expected = per_doc[sample["doc_id"]]
        assert [ll for ll, _ in logged] == pytest.approx([ll for ll, _ in expected], abs=1e-4)
        assert [g for _, g in logged] == [g for _, g in expected]
    answers = {s["doc_id"]: s["filtered_resps"][0] for s in samples["kestrel_gen"]}
    assert [answers[i] for i in range(len(GEN_PROMPTS))] == texts

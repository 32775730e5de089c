"""`kestrel serve` end to end: a real server subprocess, the official `openai` client, CPU only."""
from __future__ import annotations

import asyncio
import importlib.metadata
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time

import httpx
import openai
import pytest
import torch

from kestrel import Engine, SamplingParams
from kestrel.engine.tokenizer import apply_chat_template
from kestrel.server.app import needs_api_key
from tests.e2e import server_process
from tests.e2e.server_process import REPO, ServerProcess, free_port, metric_samples, pid_exists, serve_command, wait_idle

NAME = "tiny"
ALIAS = "tiny-alias"  # a second --served-model-name
KEY = "sk-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
IGNORE_EOS = {"ignore_eos": True}  # the random model may pick eos at any point; counts must be exact
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello in French."}]


@pytest.fixture(scope="module")
def model(tiny_model) -> str:
    return tiny_model("llama", max_position_embeddings=1024)


@pytest.fixture(scope="module")
def server(model):
    srv = ServerProcess(model, "--served-model-name", NAME, ALIAS, "--api-key", KEY)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def offline(model):
    with Engine(model=model, device="cpu", dtype="float32") as engine:
        yield engine


def greedy(max_tokens: int) -> dict:
    return dict(model=NAME, max_tokens=max_tokens, temperature=0, extra_body=IGNORE_EOS)


def metric(samples: dict, name: str, **labels: str) -> float:
    return server_process.metric(samples, name, model_name=NAME, **labels)


# ---- completions and chat -----------------------------------------------------------------------
def test_completion_greedy_equals_offline_engine_with_usage(client, offline):
    prompt = "def fibonacci(n):"
    out = client.completions.create(prompt=prompt, **greedy(12))
    expected = offline.generate(prompt, SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True))[0]
    assert out.choices[0].text == expected.text
    assert out.choices[0].finish_reason == "length"
    n_prompt = len(offline.tokenizer.encode(prompt))
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (n_prompt, 12, n_prompt + 12)
    again = client.completions.create(prompt=prompt, **greedy(12))
    assert again.choices[0].text == expected.text
    assert again.usage.prompt_tokens_details.cached_tokens == n_prompt - 1  # the radix cache kept the prompt


def test_chat_greedy_equals_offline_engine_streamed_or_not(client, offline):
    whole = client.chat.completions.create(messages=MESSAGES, **greedy(10))
    ids = apply_chat_template(offline.tokenizer, MESSAGES)
    expected = offline.generate(prompt_token_ids=ids,
                                sampling_params=SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True))[0]
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == expected.text
    assert whole.choices[0].finish_reason == "length"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(ids), 10)

    chunks = list(client.chat.completions.create(messages=MESSAGES, stream=True,
                                                 stream_options={"include_usage": True}, **greedy(10)))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    # OpenAI's system_fingerprint: one per server configuration, on every answer and chunk.
    fingerprint = whole.system_fingerprint
    assert fingerprint.startswith("kestrel-") and {c.system_fingerprint for c in chunks} == {fingerprint}
    assert client.completions.create(prompt="x", **greedy(1)).system_fingerprint == fingerprint


def test_sampled_stream_equals_non_stream_for_the_same_seed(client):
    args = dict(model=NAME, prompt="Once upon a time", max_tokens=10, temperature=0.9, seed=5, extra_body=IGNORE_EOS)
    whole = client.completions.create(**args)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **args))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 10


def test_n2_and_prompt_lists_give_one_choice_each(client):
    args = dict(model=NAME, prompt="Bonjour", max_tokens=8, temperature=1.0, seed=3, extra_body=IGNORE_EOS)
    two = client.completions.create(n=2, **args)
    one = client.completions.create(**args)
    assert [c.index for c in two.choices] == [0, 1]
    assert two.choices[0].text == one.choices[0].text  # choice 0 keeps the seed; choice 1 derives its own
    assert two.choices[1].text != two.choices[0].text
    assert (two.usage.prompt_tokens, two.usage.completion_tokens) == (one.usage.prompt_tokens, 16)

    streamed = list(client.chat.completions.create(messages=MESSAGES, n=2, stream=True, **greedy(4)))
    finished = {c.choices[0].index: c.choices[0].finish_reason for c in streamed if c.choices[0].finish_reason}
    assert finished == {0: "length", 1: "length"}

    prompts = ["Hello", [5, 6, 7, 8]]
    both = client.completions.create(prompt=prompts, **greedy(5))
    singles = [client.completions.create(prompt=p, **greedy(5)).choices[0].text for p in prompts]
    assert [c.text for c in both.choices] == singles


def test_stop_string_cuts_the_text_streamed_or_not(client):
    args = dict(prompt="The quick brown fox", **greedy(24))
    text = client.completions.create(**args).choices[0].text
    k = next(i for i in range(3, len(text) - 1) if text[i:i + 2].isascii() and text[i:i + 2].isprintable())
    stop = text[k:k + 2]
    expected = text[:text.index(stop)]
    out = client.completions.create(stop=[stop, "never-there"], **args)
    assert out.choices[0].text == expected
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].model_extra["matched_stop"] == out.choices[0].model_extra["stop_reason"] == stop
    chunks = list(client.completions.create(stop=stop, stream=True, **args))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert [c.choices[0].model_extra["stop_reason"] for c in chunks] == [None] * (len(chunks) - 1) + [stop]


def test_stop_reason_is_the_stop_token_id_and_null_at_the_length_limit(client, offline):
    """vLLM's stop_reason on every choice, streamed or not: the stop_token_ids id that ended it, else null."""
    def stop_at_a_new_token(prompt_ids: list[int]) -> tuple[int, int]:
        """(index, id) of the first greedy token that does not come earlier in the output."""
        ids = offline.generate(prompt_token_ids=[prompt_ids], sampling_params=SamplingParams(
            max_new_tokens=8, temperature=0, ignore_eos=True))[0].token_ids
        return next((i, ids[i]) for i in range(1, 8) if ids[i] not in ids[:i])

    at, token = stop_at_a_new_token(offline.tokenizer.encode("def fibonacci(n):"))
    stop = {"stop_token_ids": [token], "ignore_eos": True}
    out = client.completions.create(model=NAME, prompt="def fibonacci(n):", max_tokens=8, temperature=0,
                                    extra_body=stop)
    assert (out.choices[0].finish_reason, out.choices[0].model_extra["stop_reason"]) == ("stop", token)
    assert out.usage.completion_tokens == at + 1
    chunks = list(client.completions.create(model=NAME, prompt="def fibonacci(n):", max_tokens=8, temperature=0,
                                            stream=True, extra_body=stop))
    assert [c.choices[0].model_extra["stop_reason"] for c in chunks] == [None] * (len(chunks) - 1) + [token]

    _, token = stop_at_a_new_token(apply_chat_template(offline.tokenizer, MESSAGES))
    args = dict(model=NAME, messages=MESSAGES, max_tokens=8, temperature=0,
                extra_body={"stop_token_ids": [token], "ignore_eos": True})
    assert client.chat.completions.create(**args).choices[0].model_extra["stop_reason"] == token
    chunks = list(client.chat.completions.create(stream=True, **args))
    assert [c.choices[0].model_extra["stop_reason"] for c in chunks] == [None] * (len(chunks) - 1) + [token]
    chunks = list(client.chat.completions.create(messages=MESSAGES, stream=True, **greedy(6)))
    assert [c.choices[0].model_extra["stop_reason"] for c in chunks] == [None] * len(chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_reason_is_null_for_eos_and_a_grammars_end():
    """matched_stop names an EOS id too (SGLang); stop_reason only a stop string or a stop_token_ids id."""
    from kestrel.server.generation import Choice

    def reason(matched, stop_token_ids=None):
        choice = Choice(0, "r", [1], SamplingParams(stop_token_ids=stop_token_ids), finish_reason="stop")
        choice.matched_stop = matched
        return choice.stop_reason

    assert reason(2) is None and reason(None) is None  # EOS id 2; a grammar that ended
    assert reason(2, [2, 9]) == 2 and reason("###") == "###"


def test_unknown_model_is_a_404_the_sdk_raises_as_not_found(client, http):
    for create in (lambda: client.completions.create(model="gpt-4", prompt="x"),
                   lambda: client.chat.completions.create(model="gpt-4", messages=MESSAGES)):
        with pytest.raises(openai.NotFoundError) as e:
            create()
        assert (e.value.body["code"], e.value.body["param"]) == ("model_not_found", "model")
    # Every served name is accepted and reported back; no name: the first one.
    assert client.completions.create(prompt="x", **{**greedy(2), "model": ALIAS}).model == ALIAS
    assert http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2}).json()["model"] == NAME


def test_prompt_logprobs_in_vllms_shape_equal_transformers(client, http, offline, model):
    """/v1/completions: on each choice; chat: beside the choices. None first, then token id -> {logprob,
    rank, decoded_token} for the prompt token and the top k."""
    from transformers import AutoModelForCausalLM

    ids = offline.tokenizer.encode("def fibonacci(n): return n")
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        oracle = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    out = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 1, "prompt_logprobs": 2}).json()
    got = out["choices"][0]["prompt_logprobs"]
    assert len(got) == len(ids) and got[0] is None
    for i, position in enumerate(got[1:], start=1):
        row = oracle[i - 1]
        want = {ids[i]: row[ids[i]].item(), **{t: v for v, t in zip(*[x.tolist() for x in row.topk(2)])}}
        assert {int(t): e["logprob"] for t, e in position.items()} == pytest.approx(want, abs=1e-4)
        assert list(position)[0] == str(ids[i])  # the prompt token first
        for t, e in position.items():  # ranks within float noise of the oracle's
            above = lambda margin: 1 + int((row > row[int(t)] + margin).sum())
            assert above(1e-4) <= e["rank"] <= above(-1e-4) and e["decoded_token"] == offline.tokenizer.decode([int(t)])

    chat = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1, "n": 2, "prompt_logprobs": 0,
                                                   "temperature": 0}).json()
    prompt = apply_chat_template(offline.tokenizer, MESSAGES)
    same = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"] == same["choices"][0]["prompt_logprobs"]
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert all("prompt_logprobs" not in c for c in chat["choices"])


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(client, http, offline):
    prompt = "import torch"
    prompt_ids = offline.tokenizer.encode(prompt)
    want = offline.generate(prompt, SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True))[0].token_ids
    as_ids = {"return_tokens_as_token_ids": True, "ignore_eos": True}
    out = client.completions.create(model=NAME, prompt=prompt, max_tokens=4, temperature=0, logprobs=2, echo=True,
                                    extra_body=as_ids)
    lp = out.choices[0].logprobs
    assert lp.tokens == [f"token_id:{t}" for t in prompt_ids + want]
    assert all(re.fullmatch(r"token_id:\d+", t) for top in lp.top_logprobs[1:] for t in top)
    chat = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True,
                                          top_logprobs=1, extra_body=as_ids)
    chat_want = offline.generate(prompt_token_ids=[apply_chat_template(offline.tokenizer, MESSAGES)],
                                 sampling_params=SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True))
    assert [t.token for t in chat.choices[0].logprobs.content] == [f"token_id:{t}" for t in chat_want[0].token_ids]


def test_logprobs_and_echo(client):
    out = client.completions.create(prompt="Hello", logprobs=3, **greedy(5))
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3 and chosen <= 0
        assert chosen == pytest.approx(max(top.values()))  # greedy takes the most likely token
    assert "".join(lp.tokens) == out.choices[0].text

    chat = client.chat.completions.create(messages=MESSAGES, logprobs=True, top_logprobs=2, **greedy(4))
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.logprob == pytest.approx(t.top_logprobs[0].logprob) for t in content)

    echoed = client.completions.create(prompt="Hello", echo=True, **greedy(4))
    plain = client.completions.create(prompt="Hello", **greedy(4))
    assert echoed.choices[0].text == "Hello" + plain.choices[0].text
    chunks = list(client.completions.create(prompt="Hello", echo=True, stream=True, **greedy(4)))
    assert chunks[0].choices[0].text.startswith("Hello")  # the echo rides on the first chunk
    assert "".join(c.choices[0].text for c in chunks) == echoed.choices[0].text


def test_echo_with_logprobs_scores_the_prompt_as_the_offline_engine(client, http, offline):
    """What evaluation harnesses (lm-eval's local-completions) send: echo, logprobs and max_tokens 0 or 1;
    the prompt's logprobs come from the prefill, even for a prompt the radix cache holds."""
    prompt = "def fibonacci(n):"
    ids = offline.tokenizer.encode(prompt)
    (expected,) = offline.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(max_new_tokens=0,
                                                                                           prompt_logprobs=2))
    want = [lp for lp, _ in expected.meta["prompt_token_logprobs"][1:]]
    best = [top[0][1] for top in expected.meta["prompt_top_logprobs"][1:]]
    client.completions.create(prompt=prompt, **greedy(2))  # now in the radix cache
    for max_tokens in (0, 3):
        out = client.completions.create(prompt=prompt, echo=True, logprobs=2, **greedy(max_tokens))
        choice, lp = out.choices[0], out.choices[0].logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids) + max_tokens
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[1:len(ids)] == pytest.approx(want, abs=1e-4)
        for token, chosen, top, top1 in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:], best):
            assert top[token] == chosen and len(top) <= 3 and max(top.values()) == pytest.approx(top1, abs=1e-4)
        assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
        assert choice.text.startswith(prompt) and choice.finish_reason == "length"
        assert out.usage.completion_tokens == max_tokens and out.usage.prompt_tokens_details.cached_tokens == 0
    chunks = list(client.completions.create(prompt=prompt, echo=True, logprobs=2, stream=True, **greedy(3)))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert sum((s.token_logprobs for s in streamed), []) == lp.token_logprobs
    assert sum((s.text_offset for s in streamed), []) == lp.text_offset
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    # lm-eval's own request: token ids in a batch of one, max_tokens 1; it sums token_logprobs[ctxlen:-1].
    harness = http.post("/v1/completions", json={"model": NAME, "prompt": [ids], "max_tokens": 1, "echo": True,
                                                 "logprobs": 1, "temperature": 0}).json()
    assert harness["choices"][0]["logprobs"]["token_logprobs"][1:-1] == pytest.approx(want, abs=1e-4)
    # SGLang's native spelling: logprob_start_len picks where the prompt's logprobs start.
    native = http.post("/generate", json={"input_ids": ids, "return_logprob": True, "logprob_start_len": 2,
                                          "top_logprobs_num": 1, "sampling_params": {"max_new_tokens": 0}}).json()
    entries = native["meta_info"]["input_token_logprobs"]
    assert [t for _, t, _ in entries] == ids[2:] and [lp for lp, _, _ in entries] == pytest.approx(want[1:], abs=1e-4)
    assert [len(top) for top in native["meta_info"]["input_top_logprobs"]] == [1] * (len(ids) - 2)
    bad = http.post("/generate", json={"input_ids": ids, "return_logprob": True, "logprob_start_len": -2})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "logprob_start_len"


def test_logit_bias_forces_and_bans_tokens_against_the_unbiased_greedy_run(client, http, offline):
    prompt = "def fibonacci(n):"

    def native(bias: dict | None, max_new_tokens: int = 5) -> dict:
        sampling = {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True, "logit_bias": bias}
        return http.post("/generate", json={"text": prompt, "sampling_params": sampling, "return_logprob": True,
                                            "top_logprobs_num": 2}).json()

    unbiased = native(None)
    ids = unbiased["output_ids"]
    runner_up = unbiased["meta_info"]["output_top_logprobs"][0][1][1]
    forced = next(t for t in offline.tokenizer.encode(" return a + b") if t not in ids and t != runner_up)
    # +100: every token is the forced one, on all three routes (greedy included).
    assert native({str(forced): 100})["output_ids"] == [forced] * 5
    text = http.post("/generate", json={"text": "x", "sampling_params": {
        "max_new_tokens": 5, "temperature": 0, "ignore_eos": True, "logit_bias": {str(forced): 100}}}).json()["text"]
    out = client.completions.create(prompt=prompt, logit_bias={str(forced): 100}, **greedy(5))
    assert out.choices[0].text == text
    chat = client.chat.completions.create(messages=MESSAGES, logit_bias={str(forced): 100}, **greedy(5))
    assert chat.choices[0].message.content == text
    sampled = client.completions.create(prompt=prompt, model=NAME, max_tokens=5, temperature=1.0, seed=1,
                                        logit_bias={str(forced): 100}, extra_body=IGNORE_EOS)
    assert sampled.choices[0].text == text
    # -100 on the greedy token: the runner-up of the unbiased run comes first; logprobs are the biased ones.
    banned = native({str(ids[0]): -100})
    assert banned["output_ids"][0] == runner_up and ids[0] not in banned["output_ids"]
    top = banned["meta_info"]["output_top_logprobs"][0]
    assert top[0][1] == runner_up and top[0][0] > unbiased["meta_info"]["output_top_logprobs"][0][1][0]
    out = client.completions.create(prompt=prompt, logit_bias={str(ids[0]): -100}, **greedy(5))
    assert out.choices[0].text == banned["text"] != unbiased["text"]


def test_extreme_sampling_values_are_greedy_or_a_400(client, http):
    prompt = "import torch"
    want = client.completions.create(prompt=prompt, **greedy(6)).choices[0].text
    for extreme in (dict(temperature=1e-38), dict(temperature=1e-320), dict(temperature=5e-324),
                    dict(top_p=1e-50, temperature=1.0, seed=3), dict(top_p=5e-324, temperature=2.0, seed=4)):
        out = client.completions.create(prompt=prompt, model=NAME, max_tokens=6, extra_body=IGNORE_EOS, **extreme)
        assert out.choices[0].text == want, extreme
    native = http.post("/generate", json={"text": prompt, "sampling_params": {
        "max_new_tokens": 6, "temperature": 1e-38, "ignore_eos": True}}).json()
    assert native["text"] == want
    # /generate keeps SGLang's rule (any temperature >= 0): 5 and 1e308 sample valid tokens.
    for temperature in (5, 1e308):
        out = http.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params": {
            "max_new_tokens": 6, "temperature": temperature, "seed": 2, "ignore_eos": True}}).json()
        assert len(out["output_ids"]) == 6 and all(0 <= t < 512 for t in out["output_ids"]), out
    chat = {"messages": MESSAGES, "max_tokens": 2}
    for body, param in [({"temperature": 5}, "temperature"), ({"temperature": 2.000001}, "temperature"),
                        ({"repetition_penalty": 1e-40}, "repetition_penalty"),
                        ({"repetition_penalty": 0}, "repetition_penalty"),
                        ({"repetition_penalty": 2.5}, "repetition_penalty"),
                        ({"logit_bias": {"512": 1}}, "logit_bias"), ({"logit_bias": {"7": 100.5}}, "logit_bias"),
                        ({"logit_bias": {"seven": 1}}, "logit_bias"), ({"logit_bias": {"07": 1}}, "logit_bias")]:
        for path, base in (("/v1/completions", {"prompt": prompt, "max_tokens": 2}), ("/v1/chat/completions", chat)):
            r = http.post(path, json={**base, **body})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, body, r.text)
        if "temperature" not in body:
            r = http.post("/generate", json={"text": prompt, "sampling_params": body})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    assert client.completions.create(prompt=prompt, **{**greedy(2), "temperature": 2}).usage.completion_tokens == 2


def test_models_health_and_native_generate(client, http, offline):
    assert [m.id for m in client.models.list().data] == [NAME, ALIAS]
    assert http.get("/health").status_code == 200
    assert http.get("/ping").status_code == 200 and http.post("/ping").status_code == 200
    assert http.get("/version").json() == {"version": importlib.metadata.version("kestrel")}

    prompt = "import torch"
    expected = offline.generate(prompt, SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True))[0]
    sampling = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    out = http.post("/generate", json={"text": prompt, "sampling_params": sampling}).json()
    assert out["text"] == expected.text and out["output_ids"] == expected.token_ids
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    assert out["meta_info"]["completion_tokens"] == 6

    ids = offline.tokenizer.encode(prompt)
    batch = http.post("/generate", json={"input_ids": [ids, ids], "sampling_params": sampling}).json()
    assert [b["output_ids"] for b in batch] == [expected.token_ids] * 2

    with http.stream("POST", "/generate", json={"text": prompt, "sampling_params": sampling, "stream": True}) as r:
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["text"] == expected.text  # each event carries the text so far


# ---- load, bad input, disconnects, auth, metrics --------------------------------------------------
def test_32_concurrent_streams_all_complete_with_exact_token_counts(server, http):
    async def one(aclient: openai.AsyncOpenAI, i: int) -> tuple[int, int, str | None]:
        stream = await aclient.completions.create(
            model=NAME, prompt=f"Request {i}: tell me about number {i}", max_tokens=4 + i % 9, temperature=0.8,
            seed=i, stream=True, stream_options={"include_usage": True}, extra_body=IGNORE_EOS)
        usage, reason = None, None
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].finish_reason:
                reason = chunk.choices[0].finish_reason
            usage = chunk.usage or usage
        return 4 + i % 9, usage.completion_tokens, reason

    async def main() -> list:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120) as c:
            return await asyncio.gather(*(one(c, i) for i in range(32)))

    results = asyncio.run(main())
    assert all(asked == got and reason == "length" for asked, got, reason in results), results
    wait_idle(http)


BAD_INPUTS = [
    # (path, body: dict, or bytes sent as is, the `param` the error should name)
    ("/v1/completions", b"{not json", None),
    ("/v1/completions", b"[1, 2]", None),
    ("/v1/completions", b'{"prompt": "x", "temperature": NaN}', None),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs"),  # vLLM's "all": not served
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"choise": ["a"]}}, "structured_outputs"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"choice": []}}, "structured_outputs"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"json_object": True, "whitespace_pattern": " "}},
     "structured_outputs"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "a"}, "regex": "b"}, "structured_outputs"),
    ("/v1/completions", {"model": NAME}, "prompt"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 1.5}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "x", "logprobs": 50}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "frequency_penalty": 3}, "frequency_penalty"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, "stop"),
    ("/v1/completions", {"prompt": "x", "stop": 7}, "stop"),
    ("/v1/completions", {"prompt": "x", "seed": "abc"}, "seed"),
    ("/v1/completions", {"prompt": "x", "echo": True, "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "hello world " * 600}, "prompt"),  # longer than the 1024-token context
    ("/v1/completions", {"prompt": [3, 4, 100000]}, "prompt"),  # token id outside the vocabulary
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": "", "max_tokens": 3}, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10**7}, "max_tokens"),  # more than the context
    ("/v1/chat/completions", {"model": NAME}, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": MESSAGES, "prompt_logprobs": 30}, "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "messages"),
    ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 30}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": -2}, "max_completion_tokens"),
    ("/generate", {"text": "x", "input_ids": [1]}, "text"),
    ("/generate", {"text": "x", "sampling_params": {"bogus": 1}}, "sampling_params"),
    ("/generate", {"text": "x", "sampling_params": {"temperature": -1}}, "temperature"),
    ("/generate", {"input_ids": []}, "input_ids"),
    ("/generate", {"text": "x", "return_logprob": True, "top_logprobs_num": 21}, "top_logprobs_num"),
    ("/generate", {"input_ids": [5, 6, 7], "return_logprob": True, "logprob_start_len": 3}, "logprob_start_len"),
]


def test_bad_input_gets_an_openai_style_400_and_the_server_keeps_serving(client, http):
    for path, body, param in BAD_INPUTS:
        if isinstance(body, bytes):
            r = http.post(path, content=body, headers={"Content-Type": "application/json"})
        else:
            r = http.post(path, json=body)
        assert r.status_code == 400, (path, body, r.text)
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], error
        assert error["type"] == "invalid_request_error" and error["param"] == param, (body, error)
    assert http.get("/v1/nothing-here").json()["error"]["type"] == "not_found_error"
    r = http.delete("/v1/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST" and "POST" in r.json()["error"]["message"]
    assert client.completions.create(prompt="still fine", **greedy(3)).usage.completion_tokens == 3
    wait_idle(http)


def test_disconnect_aborts_the_request_and_frees_its_kv(http):
    aborted = metric(metric_samples(http), "kestrel:num_requests_total", finish_reason="abort")
    body = {"prompt": "a long story", "max_tokens": 900, "temperature": 0, "ignore_eos": True}
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i == 4:
                break  # leaving the block closes the connection mid-stream
    with pytest.raises(httpx.ReadTimeout):  # a non-streaming client that gives up is noticed too
        http.post("/v1/completions", json=body, timeout=0.5)
    wait_idle(http)
    assert metric(metric_samples(http), "kestrel:num_requests_total", finish_reason="abort") == aborted + 2


def test_api_key_is_enforced_on_v1_generate_and_server_info(server, http):
    with httpx.Client(base_url=server.url, timeout=30) as anon:
        for method, path in [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                             ("POST", "/generate"), ("GET", "/server_info"), ("POST", "/flush_cache")]:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
                r = anon.request(method, path, headers=headers, json={})
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, headers)
        assert anon.get("/health").status_code == 200
        assert anon.get("/metrics").status_code == 200
        assert anon.get("/openapi.json").status_code == 200  # the schema has no secrets
    assert http.get("/server_info").json()["engine_pid"] > 0
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_openapi_schema_describes_every_endpoint_and_its_body(http):
    schema = http.get("/openapi.json").json()
    assert schema["openapi"].startswith("3.")
    paths = schema["paths"]
    for path in ["/health", "/metrics", "/server_info", "/v1/models"]:
        assert "get" in paths[path], path
    components = schema["components"]["schemas"]
    for path, model, field in [("/v1/completions", "CompletionRequest", "max_tokens"),
                               ("/v1/chat/completions", "ChatCompletionRequest", "messages"),
                               ("/generate", "GenerateRequest", "sampling_params")]:
        ref = paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref == f"#/components/schemas/{model}"
        assert field in components[model]["properties"], (model, field)
    stream_options = components["CompletionRequest"]["properties"]["stream_options"]
    refs = [option.get("$ref") for option in stream_options.get("anyOf", [stream_options])]
    assert "#/components/schemas/StreamOptions" in refs and "StreamOptions" in components  # nested models resolve
    # The error answers, in the error shape every one of them has; /metrics is text; the bodies say what is
    # accepted (non-empty messages, one of text / input_ids).
    error = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
    for path, method, statuses in [("/v1/completions", "post", "400 401 404 413 503"),
                                   ("/v1/chat/completions", "post", "400 401 404 413 503"),
                                   ("/generate", "post", "400 401 413 503"), ("/v1/models", "get", "401"),
                                   ("/health", "get", "503"), ("/ping", "get", "503")]:
        responses = paths[path][method]["responses"]
        assert sorted(responses) == sorted(["200", *statuses.split()]), (path, responses)
        assert all(responses[s]["content"] == error for s in statuses.split())
    r = http.post("/v1/completions", json={"model": "nope", "prompt": "x"}).json()
    assert set(r["error"]) == set(components["ErrorResponse"]["properties"]["error"]["required"])
    assert list(paths["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    assert components["ChatCompletionRequest"]["properties"]["messages"]["minItems"] == 1
    one_of = components["GenerateRequest"]["oneOf"]
    assert [branch["required"] for branch in one_of] == [["text"], ["input_ids"]]
    # The routes added beside generation: their bodies, errors, and the text SGLang's and vLLM's admin routes answer.
    for path, model, field in [("/v1/embeddings", "EmbeddingRequest", "dimensions"),
                               ("/v1/rerank", "RerankRequest", "documents"), ("/rerank", "RerankRequest", "top_n"),
                               ("/v2/rerank", "RerankRequest", "query"), ("/v1/score", "ScoreRequest", "text_2"),
                               ("/score", "ScoreRequest", "text_1"),
                               ("/v1/load_lora_adapter", "LoadLoRARequest", "lora_path"),
                               ("/v1/unload_lora_adapter", "UnloadLoRARequest", "lora_name")]:
        ref = paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref == f"#/components/schemas/{model}" and field in components[model]["properties"], path
    for path, method, statuses in [("/v1/embeddings", "post", "400 401 404 413 503"),
                                   ("/score", "post", "400 401 404 413 503"),
                                   ("/v1/unload_lora_adapter", "post", "400 401 404 413 503"),
                                   ("/flush_cache", "post", "400 401 503"), ("/flush_cache", "get", "400 401 503"),
                                   ("/v1/loads", "get", "401"), ("/get_load", "get", "401"),
                                   ("/model_info", "get", "401"), ("/get_model_info", "get", "401")]:
        assert sorted(paths[path][method]["responses"]) == sorted(["200", *statuses.split()]), path
    assert list(paths["/flush_cache"]["post"]["responses"]["200"]["content"]) == ["text/plain"]
    # No route drifts out of the schema: every POST but the probes declares its body, every protected route its 401.
    for path, operations in paths.items():
        for method, operation in operations.items():
            assert method != "post" or "requestBody" in operation or path in ("/ping", "/flush_cache"), path
            assert not needs_api_key(path) or "401" in operation["responses"], (path, method)


def test_metrics_parse_and_count_tokens(client, http):
    before = metric_samples(http)
    client.completions.create(prompt="count me", **greedy(7))
    wait_idle(http)
    after = metric_samples(http)
    for name in ["kestrel:num_running_reqs", "kestrel:num_queue_reqs", "kestrel:token_usage",
                 "kestrel:cache_hit_rate", "kestrel:time_to_first_token_seconds_count",
                 "kestrel:inter_token_latency_seconds_count", "kestrel:e2e_request_latency_seconds_count"]:
        assert (name, (("model_name", NAME),)) in after, name
    assert metric(after, "kestrel:generation_tokens_total") - metric(before, "kestrel:generation_tokens_total") == 7
    assert metric(after, "kestrel:prompt_tokens_total") > metric(before, "kestrel:prompt_tokens_total")
    assert metric(after, "kestrel:num_requests_total", finish_reason="length") == \
        metric(before, "kestrel:num_requests_total", finish_reason="length") + 1
    assert metric(after, "kestrel:time_to_first_token_seconds_count") == \
        metric(before, "kestrel:time_to_first_token_seconds_count") + 1
    assert metric(after, "kestrel:inter_token_latency_seconds_count") == \
        metric(before, "kestrel:inter_token_latency_seconds_count") + 6
    assert metric(after, "kestrel:num_running_reqs") == 0 and metric(after, "kestrel:token_usage") == 0
    assert 0 < metric(after, "kestrel:cache_hit_rate") < 1


def test_sigterm_lets_running_streams_finish_then_stops_the_engine(server, http, client):
    """Last test of the module server: it stops it."""
    engine_pid = http.get("/server_info").json()["engine_pid"]
    stream = client.completions.create(prompt="last words", stream=True, **greedy(40))
    first = next(iter(stream))
    server.proc.send_signal(signal.SIGTERM)
    rest = list(stream)
    assert [c.choices[0].finish_reason for c in [first, *rest]][-1] == "length"
    assert server.proc.wait(30) == 0
    assert not pid_exists(engine_pid)


# ---- start-up failures and a dead engine ------------------------------------------------------------
def test_taken_port_fails_before_loading_the_model(model):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = subprocess.run(serve_command(model, port), cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in run.stderr
    assert "KV pool" not in run.stderr  # the model was never loaded


def test_unloadable_model_exits_nonzero_with_the_reason(model, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(model, broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    run = subprocess.run(serve_command(str(broken), free_port()), cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 1
    assert "could not load the model" in run.stderr, run.stderr


def test_dead_engine_gives_503_then_the_server_restarts_it(model):
    """A killed engine: in-flight streams get an error event and [DONE], new requests 503, /metrics says
    engine_alive 0 with the engine's gauges zeroed (not their last values); then a new engine process
    loads the model and the server serves again."""
    srv = ServerProcess(model, "--served-model-name", NAME)
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as http:
            engine_pid = http.get("/server_info").json()["engine_pid"]
            body = {"prompt": "a long story", "max_tokens": 900, "ignore_eos": True, "stream": True}
            with http.stream("POST", "/v1/completions", json=body) as r:
                lines = r.iter_lines()
                next(line for line in lines if line.startswith("data: "))
                deadline = time.monotonic() + 20
                while metric(metric_samples(http), "kestrel:num_running_reqs") != 1:  # the gauge is live
                    assert time.monotonic() < deadline
                    time.sleep(0.05)
                os.kill(engine_pid, signal.SIGKILL)
                events = [line[len("data: "):] for line in lines if line.startswith("data: ")]
            assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "engine_dead"
            r = http.get("/health")
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
            assert http.get("/ping").status_code == 503  # SageMaker's probe follows /health
            samples = metric_samples(http)
            assert metric(samples, "kestrel:engine_alive") == 0
            assert metric(samples, "kestrel:num_running_reqs") == 0 and metric(samples, "kestrel:token_usage") == 0
            r = http.post("/v1/completions", json={"prompt": "anyone?", "max_tokens": 2})
            assert r.status_code == 503 and "engine process" in r.json()["error"]["message"]
            c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
            with pytest.raises(openai.InternalServerError):
                c.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=2)

            deadline = time.monotonic() + 90
            while http.get("/health").status_code != 200:  # the new engine process loads the model
                assert time.monotonic() < deadline, srv.log()
                time.sleep(0.2)
            assert http.get("/server_info").json()["engine_pid"] not in (engine_pid, None)
            samples = metric_samples(http)
            assert metric(samples, "kestrel:engine_alive") == 1
            assert metric(samples, "kestrel:engine_restarts_total") == 1
            assert c.completions.create(prompt="back again", **greedy(3)).usage.completion_tokens == 3
        assert not pid_exists(engine_pid)
    finally:
        assert srv.stop() == 0, srv.log()

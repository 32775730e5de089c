"""/v1/embeddings through the openai client, /v1/rerank and /v1/score over HTTP, against
sentence-transformers and transformers on a tiny sentence-transformers folder served by `kestrel serve`."""
from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch

from kestrel.server.pooling_model import QWEN3_RERANKER_TEMPLATE, read_embedder, read_scorer
from tests.e2e.server_process import ServerProcess
from tests.e2e.test_pooling import TEXTS, sentence_transformers_folder, st_embeddings

TEMPLATE = "<|user|>{query}<|system|>{document}<|assistant|>"
TOKENS = ("<|user|>", "<|eos|>")  # two tokens of the tiny vocabulary standing for "yes" and "no"


@pytest.fixture(scope="module")
def folder(tiny_model, tmp_path_factory):
    path = sentence_transformers_folder(tiny_model("qwen3"), tmp_path_factory.mktemp("st") / "m", "mean", True)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "is_matryoshka": True}))
    return path


@pytest.fixture(scope="module")
def server(folder):
    server = ServerProcess(str(folder), "--score-template", TEMPLATE, "--score-tokens", ",".join(TOKENS))
    yield server
    server.stop()


def test_embeddings_through_the_openai_client(server, folder):
    client = openai.OpenAI(api_key="none", base_url=server.url + "/v1", max_retries=0)
    expected = st_embeddings(folder, TEXTS)
    out = client.embeddings.create(model=str(folder), input=TEXTS)  # the SDK asks for base64 and decodes it
    assert [d.index for d in out.data] == [0, 1, 2, 3] and out.usage.prompt_tokens == out.usage.total_tokens > 0
    for d, want in zip(out.data, expected):
        assert torch.tensor(d.embedding) == pytest.approx(want, abs=1e-4)
    floats = client.embeddings.create(model=str(folder), input=TEXTS[0], encoding_format="float")
    assert floats.data[0].embedding == pytest.approx(out.data[0].embedding, abs=1e-6)
    ids = client.embeddings.create(model=str(folder), input=[[5, 6, 7], [8, 9]], dimensions=16)
    assert [len(d.embedding) for d in ids.data] == [16, 16] and ids.usage.prompt_tokens == 5
    assert sum(x * x for x in ids.data[0].embedding) == pytest.approx(1, abs=1e-5)

    for kwargs, param in [({"input": TEXTS[0], "encoding_format": "hex"}, "encoding_format"),
                          ({"input": [1.5]}, "input"), ({"input": TEXTS[0], "dimensions": 0}, "dimensions"),
                          ({"input": TEXTS[0], "dimensions": 10_000}, "dimensions")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.embeddings.create(model=str(folder), **kwargs)
        assert e.value.body["param"] == param
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="other", input="x")


def test_rerank_and_score_are_the_yes_probability(server, folder):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    yes, no = tok.convert_tokens_to_ids(list(TOKENS))
    query, docs = "quick fox", TEXTS[1:]

    def oracle(doc: str) -> float:
        ids = torch.tensor([tok(TEMPLATE.format(query=query, document=doc))["input_ids"]])
        with torch.no_grad():
            return torch.softmax(hf(ids).logits[0, -1, [yes, no]], dim=0)[0].item()

    expected = [oracle(d) for d in docs]
    with httpx.Client(base_url=server.url, timeout=60) as http:
        out = http.post("/v1/rerank", json={"query": query, "documents": docs, "top_n": 2}).json()
        order = sorted(range(3), key=lambda i: -expected[i])[:2]
        assert [r["index"] for r in out["results"]] == order and out["usage"]["total_tokens"] > 0
        for r in out["results"]:
            assert r["relevance_score"] == pytest.approx(expected[r["index"]], abs=1e-4)
            assert r["document"] == {"text": docs[r["index"]]}
        score = http.post("/v1/score", json={"text_1": query, "text_2": docs}).json()
        assert [d["index"] for d in score["data"]] == [0, 1, 2]
        assert [d["score"] for d in score["data"]] == pytest.approx(expected, abs=1e-4)
        bad = http.post("/v1/score", json={"text_1": [query, query], "text_2": docs})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "text_2"
        bad = http.post("/v1/rerank", json={"query": query})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "documents"
        assert http.get("/health").status_code == 200  # still serving


def test_pooling_and_scoring_config_from_the_folder(folder, tmp_path):
    embedder = read_embedder(str(folder))
    assert (embedder.method, embedder.normalize, embedder.matryoshka) == ("mean", True, True)
    assert "not a Matryoshka" in read_embedder(str(tmp_path)).check_dimensions(8)  # a plain causal LM
    assert (read_embedder(str(tmp_path)).method, read_embedder(str(tmp_path)).normalize) == ("last", True)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    scorer = read_scorer(None, "yes,no", tok)  # the tiny vocabulary has no "yes" token
    assert scorer.token_ids is None and "not tokens of its vocabulary" in scorer.unavailable
    assert scorer.template == QWEN3_RERANKER_TEMPLATE

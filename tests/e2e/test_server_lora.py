"""LoRA adapters through the server: /v1/models lists them (vLLM's shape), the openai SDK picks one by
`model` (its name or `base:adapter`), /generate by `lora_path`; adapters load and unload at run time; an
unknown adapter is a 404 naming the loaded ones and a broken one a 400, after which the server serves on."""
from __future__ import annotations

import httpx
import openai
import pytest
import torch

from tests.e2e.server_process import ServerProcess
from tests.lora_adapters import make_adapters, peft_model
from tests.tiny_models import make_tiny_model

BASE = "tiny"
PROMPT = [11, 22, 33, 44, 55, 66]


def _greedy(model: torch.nn.Module, n: int) -> list[int]:
    ids = list(PROMPT)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(PROMPT):]


def test_adapters_served_loaded_and_refused(tmp_path) -> None:
    base = make_tiny_model("llama", tmp_path / "base", with_tokenizer=True)
    adapters = make_adapters(base, tmp_path, ("sql", "poet"))
    srv = ServerProcess(str(base), "--served-model-name", BASE, "--enable-lora", "--lora-paths",
                        f"sql={adapters['sql']}", "--max-lora-rank", "8", "--max-loras-per-batch", "2")
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0)
        listed = {m.id: m for m in client.models.list().data}
        assert set(listed) == {BASE, "sql"} and listed["sql"].parent == BASE

        def tokens(model: str) -> list[int]:
            out = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0,
                                            logprobs=0, extra_body={"return_tokens_as_token_ids": True,
                                                                    "ignore_eos": True})
            return [int(t.removeprefix("token_id:")) for t in out.choices[0].logprobs.tokens]

        want_sql = _greedy(peft_model(base, adapters["sql"]), 4)
        assert tokens("sql") == want_sql == tokens(f"{BASE}:sql")
        assert tokens(BASE) == _greedy(peft_model(base, None), 4) != want_sql
        native = httpx.post(f"{srv.url}/generate", json={"input_ids": PROMPT, "lora_path": "sql",
                                                          "sampling_params": {"max_new_tokens": 4, "temperature": 0,
                                                                              "ignore_eos": True}}, timeout=30)
        assert native.status_code == 200, native.text
        assert native.json()["output_ids"] == want_sql

        # The pooling routes serve the adapter a request names too: the last position's final-normed hidden
        # state, normalised, as peft's model computes it.
        for name, adapter in ((BASE, None), ("sql", adapters["sql"])):
            got = torch.tensor(client.embeddings.create(model=name, input=[PROMPT]).data[0].embedding)
            with torch.no_grad():
                hidden = peft_model(base, adapter)(input_ids=torch.tensor([PROMPT]), output_hidden_states=True)
            want = torch.nn.functional.normalize(hidden.hidden_states[-1][0, -1].float(), dim=0)
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)

        with pytest.raises(openai.NotFoundError, match=r"'poet'.*'sql'"):
            tokens("poet")
        r = httpx.post(f"{srv.url}/generate", json={"input_ids": PROMPT, "lora_path": "poet"}, timeout=30)
        assert r.status_code == 404 and "'sql'" in r.json()["error"]["message"]

        load = httpx.post(f"{srv.url}/v1/load_lora_adapter", json={"lora_name": "poet",
                                                                   "lora_path": str(adapters["poet"])}, timeout=30)
        assert load.status_code == 200, load.text
        assert tokens("poet") == _greedy(peft_model(base, adapters["poet"]), 4)

        for bad in ({"lora_name": "gone", "lora_path": str(tmp_path / "nowhere")},
                    {"lora_name": "again", "lora_path": str(base)}):  # a model folder is no adapter
            r = httpx.post(f"{srv.url}/v1/load_lora_adapter", json=bad, timeout=30)
            assert r.status_code == 400 and "adapter_config.json" in r.json()["error"]["message"], r.text
        r = httpx.post(f"{srv.url}/v1/unload_lora_adapter", json={"lora_name": "poet"}, timeout=30)
        assert r.status_code == 200, r.text
        r = httpx.post(f"{srv.url}/v1/unload_lora_adapter", json={"lora_name": "poet"}, timeout=30)
        assert r.status_code == 404
        assert {m.id for m in client.models.list().data} == {BASE, "sql"}
        assert tokens("sql") == want_sql  # still serving
    finally:
        srv.stop()

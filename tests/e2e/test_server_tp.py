"""`kestrel serve --tp-size 2` on CPU: it answers like one rank does, its ranks share the compute threads,
and a killed rank ends the engine (every rank of it) with a 503 naming the rank, within seconds, not a hang."""
from __future__ import annotations

import os
import signal
import time

import httpx
import openai

from kestrel import Engine, SamplingParams
from kestrel.engine.tokenizer import apply_chat_template
from tests.e2e.server_process import ServerProcess, pid_exists

MESSAGES = [{"role": "user", "content": "Say hello in French."}]


def test_tp2_server_chat_equals_one_rank_then_a_killed_rank_is_a_503(tiny_model, monkeypatch):
    model = tiny_model("llama", max_position_embeddings=1024)
    with Engine(model=model, device="cpu", dtype="float32") as offline:
        ids = apply_chat_template(offline.tokenizer, MESSAGES)
        expected = offline.generate(prompt_token_ids=ids, sampling_params=SamplingParams(
            max_new_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)[0].text
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    srv = ServerProcess(model, "--served-model-name", "tiny", "--tp-size", "2", "--cpu-threads", "2")
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
        out = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0,
                                             extra_body={"ignore_eos": True})
        assert out.choices[0].message.content == expected
        with httpx.Client(base_url=srv.url, timeout=30) as http:
            info = http.get("/server_info").json()
            engine_pid, (rank_pid,) = info["engine_pid"], info["tp_rank_pids"]
            # The engine process chose before torch loaded: rank 1, which it started, inherits the wait policy.
            assert b"OMP_WAIT_POLICY=PASSIVE" in open(f"/proc/{rank_pid}/environ", "rb").read().split(b"\0")
            assert "CPU threads: 1 compute threads on " in srv.log()
            assert "OpenMP wait policy PASSIVE (--cpu-threads, shared among 2 tensor-parallel ranks)" in srv.log()
            os.kill(rank_pid, signal.SIGKILL)
            killed = time.monotonic()
            while (r := http.get("/health")).status_code != 503:
                assert time.monotonic() - killed < 10, f"no 503 within 10 s of killing rank 1:\n{srv.log()}"
                time.sleep(0.05)
            assert r.json()["error"]["code"] == "engine_dead"
            assert "tensor-parallel rank 1" in r.json()["error"]["message"], r.json()
            deadline = time.monotonic() + 10
            while pid_exists(engine_pid):  # rank 0 (the engine process) ended with its rank
                assert time.monotonic() < deadline, "the engine process outlived its killed rank"
                time.sleep(0.05)
        assert "tensor-parallel rank 1 (pid" in srv.log()
    finally:
        srv.stop()

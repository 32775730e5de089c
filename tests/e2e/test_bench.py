"""The benchmarks run end to end at toy size, so they cannot rot (figures come from the H200)."""
from __future__ import annotations

import json

from kestrel.bench.common import random_lengths
from kestrel.cli import main
from tests.e2e.server_process import ServerProcess


def test_random_dataset_lengths_follow_sglang_semantics():
    import random

    rng = random.Random(0)
    assert set(random_lengths(200, 10, 1.0, rng)) == {10}
    lens = random_lengths(2000, 10, 0.0, rng)
    assert min(lens) == 1 and max(lens) == 10
    assert min(random_lengths(2000, 100, 0.5, rng)) >= 50


def test_one_batch_and_offline_benchmarks(tiny_model, tmp_path, capsys):
    model = tiny_model("llama")
    flags = ["--model", model, "--device", "cpu", "--dtype", "float32"]
    assert main(["bench", "one-batch", *flags, "--batch-size", "2", "--input-len", "12", "--output-len", "5",
                 "--json", str(tmp_path / "one.json")]) == 0
    one = json.loads((tmp_path / "one.json").read_text())
    assert one["batch_size"] == 2 and one["decode_step_median_s"] > 0 and one["prefill_latency_s"] > 0
    assert main(["bench", "offline", *flags, "--num-prompts", "5", "--random-input-len", "20",
                 "--random-output-len", "6", "--transformers-batch-size", "2", "--transformers-prompts", "2",
                 "--json", str(tmp_path / "offline.json")]) == 0
    offline = json.loads((tmp_path / "offline.json").read_text())
    assert offline["kestrel"]["output_tokens"] > 0 and offline["transformers"]["output_tokens"] > 0
    steps = offline["kestrel"]["steps"]  # the per-mode breakdown accounts for every token
    assert sum(s["tokens"] for s in steps.values()) == offline["kestrel"]["input_tokens"] + \
        offline["kestrel"]["output_tokens"] - 5  # the last token of each of the 5 prompts is never fed back
    assert "kestrel / transformers" in capsys.readouterr().out


def test_serving_benchmark_against_a_live_server_learns_its_vocabulary(tiny_model, tmp_path, capsys):
    """No --vocab-size: the benchmark reads it from the server (the tiny model has 512 tokens, far
    below the 32000 it used to assume)."""
    server = ServerProcess(tiny_model("llama"), "--api-key", "sk-bench")
    try:
        assert main(["bench", "serving", "--base-url", server.url, "--api-key", "sk-bench", "--num-prompts", "6",
                     "--max-concurrency", "3", "--random-input-len", "20", "--random-output-len", "5",
                     "--json", str(tmp_path / "serving.json")]) == 0
        assert main(["bench", "serving", "--base-url", server.url, "--num-prompts", "2"]) == 2  # no key
        assert "pass --vocab-size, or --api-key" in capsys.readouterr().err
    finally:
        assert server.stop() == 0
    result = json.loads((tmp_path / "serving.json").read_text())
    assert result["output_tokens"] > 0 and result["itl_median_ms"] > 0 and result["ttft_p99_ms"] > 0

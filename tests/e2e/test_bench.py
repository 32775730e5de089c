"""The benchmarks run end to end at toy size, so they cannot rot (figures come from the H200)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kestrel.bench.common import random_lengths
from kestrel.cli import main
from tests.e2e.server_process import ServerProcess


def assert_png(path, panels: int) -> None:
    """A PNG that decodes, as wide as its panels, and not blank."""
    from PIL import Image

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(path) as image:
        image.verify()
    with Image.open(path) as image:
        assert image.format == "PNG" and image.width >= 400 * panels and image.height >= 300
        assert len(image.convert("L").getcolors(maxcolors=1 << 16) or range(1 << 16)) > 16


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
    config = json.loads((Path(model) / "config.json").read_text())
    table = config["vocab_size"] * config["hidden_size"] * 4  # float32
    assert not config["tie_word_embeddings"] and one["decode_read_bytes"] == one["weight_bytes"] - table
    assert main(["bench", "offline", *flags, "--num-prompts", "5", "--random-input-len", "20",
                 "--random-output-len", "6", "--transformers-batch-size", "2", "--transformers-prompts", "2",
                 "--json", str(tmp_path / "offline.json")]) == 0
    offline = json.loads((tmp_path / "offline.json").read_text())
    assert offline["kestrel"]["output_tokens"] > 0 and offline["transformers"]["output_tokens"] > 0
    steps = offline["kestrel"]["steps"]  # the per-mode breakdown accounts for every token
    assert sum(s["tokens"] for s in steps.values()) == offline["kestrel"]["input_tokens"] + \
        offline["kestrel"]["output_tokens"] - 5  # the last token of each of the 5 prompts is never fed back
    assert "kestrel / transformers" in capsys.readouterr().out
    # A sweep of batch sizes: one run each in the JSON, and their plot.
    assert main(["bench", "one-batch", *flags, "--batch-size", "1", "3", "--input-len", "8", "--output-len", "4",
                 "--json", str(tmp_path / "sweep.json"), "--plot", str(tmp_path / "one.png")]) == 0
    sweep = json.loads((tmp_path / "sweep.json").read_text())["runs"]
    assert [r["batch_size"] for r in sweep] == [1, 3] and all(r["decode_tok_per_s"] > 0 for r in sweep)
    assert_png(tmp_path / "one.png", panels=2)


def test_a_tied_embedding_is_read_whole_by_a_decode_step(tiny_model):
    from kestrel import Engine
    from kestrel.bench.common import decode_read_bytes, weight_bytes

    with Engine(model=tiny_model("llama", tie=True), device="cpu", dtype="float32") as engine:
        model = engine.runner.model
        assert model.lm_head is None and decode_read_bytes(model) == weight_bytes(model)


def test_a_moe_decode_step_reads_the_experts_it_is_expected_to_hit(tiny_model):
    """Non-expert weights whole; each layer's routed experts by the fraction of them T tokens hit when each
    picks k of E uniformly: 1 - (1 - k/E)^T."""
    from kestrel import Engine
    from kestrel.bench.common import decode_read_bytes, weight_bytes

    from transformers import AutoConfig

    path = tiny_model("qwen3_moe")
    config = AutoConfig.from_pretrained(path)
    with Engine(model=path, device="cpu", dtype="float32") as engine:
        model = engine.runner.model
        experts = sum(p.numel() * 4 for n, p in model.named_parameters() if ".experts." in n)
        table = model.model.embed_tokens.weight.numel() * 4
        E, k = config.num_experts, config.num_experts_per_tok
        for tokens in (1, 3, 1000):
            hit = 1 - (1 - k / E) ** tokens
            expected = weight_bytes(model) - table - experts + experts * hit
            assert abs(decode_read_bytes(model, tokens) - expected) <= 8, tokens
        assert decode_read_bytes(model, 1) < decode_read_bytes(model, 3) < decode_read_bytes(model, 1000)


def test_offline_decode_floor_counts_each_decoded_tokens_kv(tiny_model):
    """The offline floor's KV term: token t (t >= 1) of a request reads its prompt and t tokens."""
    from kestrel import Engine, SamplingParams
    from kestrel.bench.common import StepRecorder
    from kestrel.bench.offline import decode_floor

    prompts, out_lens = [[1, 2, 3], [4, 5, 6, 7, 8]], [4, 6]
    with Engine(model=tiny_model("llama"), device="cpu", dtype="float32") as engine:
        recorder = StepRecorder(engine)
        engine.generate(prompt_token_ids=prompts,
                        sampling_params=[SamplingParams(max_new_tokens=m, ignore_eos=True) for m in out_lens])
        floor = decode_floor(engine, recorder, prompts, out_lens, bandwidth=1e9)
        reads = sum(len(p) + t for p, m in zip(prompts, out_lens) for t in range(1, m))
        assert floor["kv_bytes_read"] == reads * engine.kv_memory.bytes_per_token
        decode_steps = [s for s in recorder.steps if s[0] == "DECODE"]
        assert len(decode_steps) == max(out_lens) - 1 and floor["weight_bytes_read"] > 0
        assert floor["floor_s"] == pytest.approx((floor["kv_bytes_read"] + floor["weight_bytes_read"]) / 1e9)


def test_closed_loop_benchmark_times_every_token(tiny_model, tmp_path):
    flags = ["--model", tiny_model("llama"), "--device", "cpu", "--dtype", "float32"]
    assert main(["bench", "closed-loop", *flags, "--num-prompts", "6", "--max-concurrency", "2",
                 "--random-input-len", "16", "--random-output-len", "5", "--random-range-ratio", "1",
                 "--chunked-prefill-size", "8", "--json", str(tmp_path / "closed.json")]) == 0
    result = json.loads((tmp_path / "closed.json").read_text())["kestrel"]
    # every request's first token is a TTFT, every later one a gap (range ratio 1: exactly 5 tokens each)
    assert result["requests_timed"] == 6 and result["gaps_timed"] == 6 * (5 - 1)
    assert result["ttft_p99_ms"] >= result["ttft_median_ms"] > 0 and result["itl_p99_ms"] >= result["itl_median_ms"]
    assert result["steps"] >= 6 * 4 // 2 and result["gpu_forward_ms_by_kind"] == {}  # no CUDA events on a CPU
    assert {s["mode"] for s in result["slowest_1pct"]} <= {"EXTEND", "DECODE", "MIXED"}


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
        assert main(["bench", "serving", "--base-url", server.url, "--api-key", "sk-bench", "--num-prompts", "4",
                     "--max-concurrency", "1", "4", "--random-input-len", "10", "--random-output-len", "4",
                     "--json", str(tmp_path / "sweep.json"), "--plot", str(tmp_path / "serving.png")]) == 0
        # The CPU benchmark goes through /v1/completions, as it does for any OpenAI-compatible server.
        assert main(["bench", "cpu-serving", "--base-url", server.url, "--api-key", "sk-bench", "--vocab-size", "512",
                     "--batch1-requests", "1", "--num-prompts", "3", "--max-concurrency", "2",
                     "--random-input-len", "10", "--random-output-len", "4", "--json", str(tmp_path / "cpu.json")]) == 0
    finally:
        assert server.stop() == 0
    result = json.loads((tmp_path / "serving.json").read_text())
    assert result["output_tokens"] > 0 and result["itl_median_ms"] > 0 and result["ttft_p99_ms"] > 0
    sweep = json.loads((tmp_path / "sweep.json").read_text())["runs"]
    assert [r["max_concurrency"] for r in sweep] == [1, 4] and all(r["output_tok_per_s"] > 0 for r in sweep)
    assert_png(tmp_path / "serving.png", panels=4)
    cpu = json.loads((tmp_path / "cpu.json").read_text())
    assert cpu["batch1"]["output_tokens"] == 4 and cpu["batch1"]["max_concurrency"] == 1
    assert cpu["concurrency_2"]["output_tokens"] == 12 and cpu["batch1"]["itl_median_ms"] > 0


def test_plot_without_matplotlib_fails_before_the_benchmark_runs(monkeypatch, capsys):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else
                        find_spec(name, *a))
    assert main(["bench", "serving", "--base-url", "http://127.0.0.1:9", "--plot", "x.png"]) == 2
    assert "--plot needs matplotlib: pip install 'kestrel[plot]'" in capsys.readouterr().err


def test_one_batch_profile_writes_a_table_per_engine_step(tiny_model, tmp_path):
    flags = ["--model", tiny_model("llama"), "--device", "cpu", "--dtype", "float32", "--batch-size", "2",
             "--input-len", "8", "--output-len", "4"]
    assert main(["bench", "one-batch", *flags, "--profile", str(tmp_path / "decode.txt")]) == 0
    table = (tmp_path / "decode.txt").read_text().splitlines()
    assert re.fullmatch(r"CPU operators, self time, per engine step \(mean of [1-9]\d* steps\)", table[0])
    assert any("aten::" in line for line in table[2:-1]) and table[-1].split()[2] == "all"


def test_profile_suffix_picks_a_trace_or_host_stats(tmp_path):
    """`*.json`: a torch.profiler trace; `*.prof`: cProfile's stats; both count the block's engine steps."""
    import pstats
    import types

    import torch

    from kestrel.bench.profile import profiled

    hooks = []
    engine = types.SimpleNamespace(device=torch.device("cpu"), add_step_hook=hooks.append,
                                   remove_step_hook=hooks.remove)

    def steps():
        for _ in range(3):
            torch.ones(64, 64).matmul(torch.ones(64, 64))
            hooks[0](None)

    for name in ("trace.json", "host.prof"):
        with profiled(str(tmp_path / name), engine):
            steps()
        assert hooks == []  # the step hook is gone with the block
    trace = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert any(e.get("name") == "aten::matmul" for e in trace)
    assert any(name == "steps" for _, _, name in pstats.Stats(str(tmp_path / "host.prof")).stats)


def test_spec_bench_takes_its_part_defaults_unless_a_flag_is_given(monkeypatch):
    from kestrel.bench import spec

    seen = []
    monkeypatch.setitem(spec.PARTS, "llama8b", lambda args: seen.append(args) or [{"batch": 1}])
    monkeypatch.setitem(spec.PARTS, "demo", lambda args: seen.append(args) or [{"batch": 1}])
    assert main(["bench", "spec", "llama8b", "--max-running-requests", "8", "--rounds", "4"]) == 0
    assert main(["bench", "spec", "--smoke", "--dtype", "bfloat16"]) == 0
    llama, smoke = seen
    assert (llama.model, llama.load_format, llama.device) == ("kestrel/assets/configs/llama-3.1-8b", "dummy", "cuda")
    assert llama.max_running_requests == 8 and llama.rounds == 4 and llama.batch_sizes == [1, 8, 32]
    assert (smoke.part, smoke.model, smoke.device, smoke.dtype) == ("demo", "demo", "cpu", "bfloat16")
    assert smoke.batch_sizes == [1, 2] and smoke.output_len == 8 and smoke.disable_radix_cache


def test_engine_from_args_builds_the_flags_engine_with_overrides(tiny_model):
    import argparse

    from kestrel.bench.common import engine_from_args
    from kestrel.cli import add_engine_flags

    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    args = parser.parse_args(["--model", tiny_model("llama"), "--device", "cpu", "--max-running-requests", "5"])
    with engine_from_args(args, dtype="float32", max_running_requests=3) as engine:
        assert engine.config.scheduler.max_running_requests == 3 and engine.config.model.dtype == "float32"
    assert args.max_running_requests == 5  # the flags themselves are left as given


@pytest.mark.parametrize("bench, result", [("moe_paths", "moe_paths_smoke.json"), ("mla_decode", "mla_decode_smoke.json"),
                                           ("int4_gemm", "int4_gemm_smoke.json")])
def test_kernel_benchmarks_run_their_smoke_mode_on_the_cpu(bench, result, tmp_path, monkeypatch):
    """The GPU stages' kernel benchmarks, at toy widths through Triton's interpreter: every case timed and
    each kernel's output against its reference."""
    import importlib

    monkeypatch.setenv("OUT", str(tmp_path))
    assert importlib.import_module(f"kestrel.bench.kernels.{bench}").main(["--smoke"]) == 0
    res = json.loads((tmp_path / result).read_text())
    if bench == "int4_gemm":
        rows = res["rows"]
        assert rows and all("ms" in r and r["maxdiff"] < 1e-4 for r in rows)
        assert {(b["shape"], b["M"]) for b in res["best"]} == {(r["shape"], r["M"]) for r in rows}
    else:
        cases = res["cases"].values()
        assert cases and all(isinstance(c, dict) and c["maxdiff"] < 1e-4 for c in cases)
    if bench == "moe_paths":
        assert all(c["faster_graphed"] in ("every", "fused", "gemv") and c["gemv_ms"] > 0 and c["loop_ms"] > 0
                   for c in cases)
        assert res["families"]["gpt-oss-20b"]["activation"] == "gpt_oss" and res["families"]["gpt-oss-20b"]["expert_bias"]
        # The whole layer at decode sizes, today's route against the fused decode route (both families' routers).
        assert all(c["layer_ms"] > 0 and c["decode_route_ms"] > 0 and c["decode_route_maxdiff"] < 1e-4 for c in cases)


def test_spec_bench_chat_part_times_a_head_on_chat_prompts(tmp_path):
    """The chat part on the demo model and demo-eagle, CPU: plain, chain and tree rows per batch size, the
    speculative answers equal plain greedy's, and the prompts come from a head's training_info.json."""
    import argparse

    from kestrel.bench import spec

    info = tmp_path / "training_info.json"
    info.write_text(json.dumps({"held_out_prompts": ["Explain recursion.", "What is a list?"]}))
    out = tmp_path / "chat.json"
    assert main(["bench", "spec", "chat", "--model", "demo", "--speculative-algorithm", "EAGLE",
                 "--speculative-draft-model-path", "demo-eagle", "--prompts-file", str(info), "--device", "cpu",
                 "--dtype", "float32", "--batch-sizes", "1", "3", "--output-len", "8", "--repeats", "1",
                 "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["variant"], r["batch"]) for r in rows] == [(v, b) for v in ("plain", "EAGLE chain 3/1/4",
                                                                           "EAGLE tree 5/4/8") for b in (1, 3)]
    assert all(r["same_as_plain"] and r["tokens"] > 0 for r in rows)
    assert all(r["accept_length"] >= 1 for r in rows if r["variant"] != "plain")
    with pytest.raises(ValueError, match="prompts-file"):
        spec.chat(argparse.Namespace(speculative_algorithm="EAGLE", speculative_draft_model_path="demo-eagle",
                                     prompts_file=None))

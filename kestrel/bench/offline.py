"""Offline throughput: N random-token prompts through `Engine.generate`, SGLang `random` dataset semantics.

    python -m kestrel.bench.offline --model kestrel/assets/configs/llama-3.1-8b --load-format dummy \
        --num-prompts 500 --random-input-len 4096 --random-output-len 2048 --random-range-ratio 0

`--transformers-batch-size B` also runs transformers `generate()` on the same model and the first
`--transformers-prompts` prompts, B at a time, as the baseline of the same run.
"""
from __future__ import annotations

import argparse

import torch

from kestrel.bench.common import (StepRecorder, add_random_dataset_flags, copy_bandwidth, decode_read_bytes,
                                  engine_from_args, kv_read_bytes, now, random_dataset, report, warm_up_workload)
from kestrel.bench.profile import add_profile_flag, profiled
from kestrel.cli import add_engine_flags
from kestrel.core.sampling_params import SamplingParams


def run_kestrel(engine, prompts: list[list[int]], out_lens: list[int]) -> dict:
    params = [SamplingParams(max_new_tokens=m, temperature=0.0, ignore_eos=True) for m in out_lens]
    device = engine.device
    start = now(device)
    outs = engine.generate(prompt_token_ids=prompts, sampling_params=params)
    elapsed = now(device) - start
    generated = sum(len(o.token_ids) for o in outs)
    assert generated == sum(out_lens), "every request must produce its full output (ignore_eos)"
    return {"elapsed_s": elapsed, "output_tokens": generated, "input_tokens": sum(map(len, prompts)),
            "output_tok_per_s": generated / elapsed, "total_tok_per_s": (generated + sum(map(len, prompts))) / elapsed,
            "retractions": engine.scheduler.num_retractions}


def decode_floor(engine, recorder: StepRecorder, prompts: list[list[int]], out_lens: list[int],
                 bandwidth: float) -> dict:
    """The decode steps' physical floor: the weights each step reads at its batch size plus the KV every
    decoded token reads (a request's token t past the first attends over its prompt and t tokens), over
    the measured copy bandwidth, against the decode steps' measured seconds. Prefill is compute-bound
    and left out."""
    model, weights_by_batch = engine.runner.model, {}
    decode = [s for s in recorder.steps if s[0] == "DECODE"]
    weights = sum(weights_by_batch.setdefault(n, decode_read_bytes(model, n)) for _, n, _, _ in decode)
    kv_tokens = sum(len(p) * (m - 1) + m * (m - 1) // 2 for p, m in zip(prompts, out_lens))
    kv = kv_read_bytes(engine, kv_tokens)
    floor, seconds = (weights + kv) / bandwidth, sum(s[3] for s in decode)
    return {"weight_bytes_read": weights, "kv_bytes_read": kv, "floor_s": floor, "decode_seconds": seconds,
            "fraction_of_floor": floor / seconds if seconds else None}


def run_transformers(model_path: str, dtype: torch.dtype, device: torch.device, prompts: list[list[int]],
                     out_lens: list[int], batch_size: int) -> dict:
    """transformers generate(), greedy, left-padded batches of `batch_size`; random weights like ours."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(model_path)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    generated, start = 0, now(device)
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i:i + batch_size]
        width = max(map(len, chunk))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=device)
        new = max(out_lens[i:i + batch_size])
        gen = GenerationConfig(do_sample=False, max_new_tokens=new, min_new_tokens=new, pad_token_id=0,
                               eos_token_id=None)
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, generation_config=gen)
        generated += new * len(chunk)
    elapsed = now(device) - start
    del model
    torch.cuda.empty_cache() if device.type == "cuda" else None
    return {"elapsed_s": elapsed, "output_tokens": generated, "output_tok_per_s": generated / elapsed,
            "batch_size": batch_size, "num_prompts": len(prompts)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_flags(parser)
    add_random_dataset_flags(parser, num_prompts=100, input_len=512, output_len=256, range_ratio=0.0)
    parser.add_argument("--transformers-batch-size", type=int, default=0, help="0: no transformers baseline")
    parser.add_argument("--transformers-prompts", type=int, default=256,
                        help="the first this many prompts make the transformers baseline (default 256)")
    parser.add_argument("--json", default=None, help="write the result here")
    add_profile_flag(parser)
    args = parser.parse_args(argv)
    engine = engine_from_args(args)
    prompts, out_lens = random_dataset(args, engine.vocab_size)
    run_kestrel(engine, *warm_up_workload(args.num_prompts, engine.vocab_size, args.seed))
    recorder = StepRecorder(engine)
    with profiled(args.profile, engine):
        result = {"workload": vars(args) | {"model": engine.config.model.model},
                  "kestrel": run_kestrel(engine, prompts, out_lens)}
    result["kestrel"]["steps"] = recorder.summary()
    recorder.detach()
    if (bandwidth := copy_bandwidth(engine.device)) is not None:
        result["kestrel"]["decode_floor"] = decode_floor(engine, recorder, prompts, out_lens, bandwidth)
    rows = [("prompts", args.num_prompts),
            ("input / output tokens", f"{result['kestrel']['input_tokens']} / {result['kestrel']['output_tokens']}"),
            ("elapsed (s)", result["kestrel"]["elapsed_s"]),
            ("kestrel output tok/s", result["kestrel"]["output_tok_per_s"]),
            ("kestrel total tok/s", result["kestrel"]["total_tok_per_s"]),
            ("retractions", result["kestrel"]["retractions"])]
    for mode, s in result["kestrel"]["steps"].items():
        rows.append((f"{mode} steps", f"{s['steps']} steps, {s['seconds']:.2f} s, {s['tokens']} tokens, "
                                      f"{s['mean_requests']:.1f} requests/step, median {s['median_step_ms']:.2f} ms"))
    if floor := result["kestrel"].get("decode_floor"):
        rows += [("decode floor: weights + KV read / copy bw (s)", floor["floor_s"]),
                 ("decode steps vs that floor", f"{100 * floor['fraction_of_floor']:.1f}% of it "
                                                f"(KV {floor['kv_bytes_read'] / 1e12:.2f} TB, weights "
                                                f"{floor['weight_bytes_read'] / 1e12:.2f} TB)")]
    if args.transformers_batch_size:
        device, dtype = engine.device, getattr(torch, engine.config.model.dtype)
        model_path = engine.config.model.model
        engine.shutdown()  # its KV pool goes back before transformers loads its model
        n = min(args.transformers_prompts, len(prompts))
        base = run_transformers(model_path, dtype, device, prompts[:n], out_lens[:n], args.transformers_batch_size)
        result["transformers"] = base
        rows += [(f"transformers output tok/s (bs {args.transformers_batch_size}, {n} prompts)",
                  base["output_tok_per_s"]),
                 ("kestrel / transformers", result["kestrel"]["output_tok_per_s"] / base["output_tok_per_s"])]
    report("offline throughput", rows, result, args.json)


if __name__ == "__main__":
    main()

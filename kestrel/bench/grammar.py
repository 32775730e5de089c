"""Structured outputs under load: what grammar rows add to a decode step, and the mask work alone.

    kestrel bench grammar --model demo --device cpu --batch-size 32 --constrained-fraction 0.5
    kestrel bench grammar --model kestrel/assets/configs/llama-3.1-8b --load-format dummy --batch-size 64
    kestrel bench grammar --smoke          # the same code at batch 4, a few steps (CPU, seconds)

Two runs of the same batch (prompts, seeds, lengths): every row plain, then `--constrained-fraction`
of the rows under a grammar (`--grammar tool`: a forced tool call's structural tag, as the server
builds for tool_choice "required"; `json`: a JSON schema). The decode steps at the full batch size
are timed (median), so the figure is the cost of one step with and without grammar rows. Then the
mask work of one step is timed on its own, replaying the constrained rows' tokens through fresh
matchers: fill the bitmask on the host, copy it to the device, apply it to [B, V] logits, accept
the tokens (the device is synchronized around each part). The goal: mask work <= 5 % of the step.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kestrel.bench.common import engine_from_args, report
from kestrel.bench.profile import add_profile_flag, profiled
from kestrel.cli import add_engine_flags
from kestrel.core.sampling_params import SamplingParams

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
           "required": ["city", "days"]}
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "tags"]}
PROMPT = "What's the weather like in Paris right now? Answer in JSON."


def grammar_field(kind: str) -> dict[str, str]:
    if kind == "json":
        return {"json_schema": json.dumps(PERSON)}
    from kestrel.server.tool_parsers import tool_parser

    # Parallel calls: a model keeps calling until max_new_tokens, so rows run the whole measurement.
    tag = tool_parser("hermes").grammar([{"name": "get_weather", "parameters": WEATHER}], None, True)
    return {"structural_tag": json.dumps(tag)}


def batch_params(n: int, constrained: int, kind: str, max_new: int) -> list[SamplingParams]:
    grammar = grammar_field(kind)
    return [SamplingParams(max_new_tokens=max_new, temperature=0.8, seed=i, ignore_eos=True,
                           **(grammar if i < constrained else {})) for i in range(n)]


def timed_run(engine, prompt: list[int], params: list[SamplingParams]) -> tuple[list[float], list]:
    """Decode step times (s) at the full batch size, and the outputs."""
    steps: list[float] = []

    def hook(info) -> None:
        if info.mode == "decode" and info.num_reqs == len(params):
            steps.append(info.seconds)

    engine.add_step_hook(hook)
    try:
        outs = engine.generate(prompt_token_ids=[prompt] * len(params), sampling_params=params, use_tqdm=False)
    finally:
        engine.remove_step_hook(hook)
    return steps, outs


def synced(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def mask_work(engine, params: list[SamplingParams], outs: list, batch: int, steps: int) -> dict[str, float]:
    """Median ms per step of each part of the mask work for the constrained rows, replayed."""
    from concurrent.futures import wait

    from kestrel.engine.grammar import apply_grammar_mask

    rows = [i for i, p in enumerate(params) if p.grammar is not None]
    states = [engine.grammars.state(params[i]) for i in rows]
    wait([s.compiled for s in states])
    assert all(s.poll() and s.matcher is not None for s in states)
    device = engine.device
    logits = torch.randn(batch, engine.vocab_size, device=device)
    row_ids = torch.tensor(rows, dtype=torch.int64, device=device)
    parts: dict[str, list[float]] = {"fill": [], "copy": [], "apply": [], "accept": []}
    for step in range(steps):
        live = [j for j, i in enumerate(rows) if step < len(outs[i].token_ids)]
        if len(live) < len(rows):
            break
        t0 = synced(device)
        mask = engine.grammars.fill(states)
        t1 = synced(device)
        on_device = mask.to(device, non_blocking=True)
        t2 = synced(device)
        apply_grammar_mask(logits, row_ids, on_device)
        t3 = synced(device)
        for j, i in enumerate(rows):
            assert states[j].accept(outs[i].token_ids[step])
        t4 = synced(device)
        for name, dt in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            parts[name].append(dt * 1e3)
    result = {f"{name}_ms": statistics.median(v) for name, v in parts.items() if v}
    result["mask_ms"] = sum(result.values())
    result["steps"] = len(parts["fill"])
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_flags(parser)
    parser.add_argument("--batch-size", type=int, default=64, help="requests decoding together")
    parser.add_argument("--constrained-fraction", type=float, default=1.0,
                        help="share of the batch under a grammar in the constrained run (default: all)")
    parser.add_argument("--grammar", choices=("tool", "json"), default="tool",
                        help="the constraint: a forced tool call (structural tag) or a JSON schema (default tool)")
    parser.add_argument("--output-len", type=int, default=64, help="max new tokens per request")
    parser.add_argument("--repeats", type=int, default=2, help="plain / constrained runs, alternated")
    parser.add_argument("--smoke", action="store_true", help="batch 4, 8 tokens, one repeat: checks the code")
    parser.add_argument("--json", default=None, help="write the result here")
    add_profile_flag(parser)
    args = parser.parse_args(argv)
    if args.smoke:
        args.batch_size, args.output_len, args.repeats = 4, 8, 1
    if not 0 < args.constrained_fraction <= 1:
        parser.error("--constrained-fraction must be in (0, 1]")
    engine = engine_from_args(args)
    prompt = engine.tokenizer.encode(PROMPT) if engine.tokenizer is not None else [3, 4, 5]
    constrained = max(1, round(args.batch_size * args.constrained_fraction))
    plain = batch_params(args.batch_size, 0, args.grammar, args.output_len)
    mixed = batch_params(args.batch_size, constrained, args.grammar, args.output_len)
    timed_run(engine, prompt, mixed[:2])  # warm-up; compiles the grammar
    # Alternated, so a neighbour's load on a shared machine falls on both alike.
    times: dict[str, list[float]] = {"plain": [], "constrained": []}
    outs = None
    with profiled(args.profile, engine):
        for _ in range(args.repeats):
            times["plain"] += timed_run(engine, prompt, plain)[0]
            steps, outs = timed_run(engine, prompt, mixed)
            times["constrained"] += steps
    step_ms = {k: statistics.median(v) * 1e3 if v else float("nan") for k, v in times.items()}
    mask = mask_work(engine, mixed, outs, args.batch_size, args.output_len)
    result = {"workload": {k: v for k, v in vars(args).items()} | {"model": engine.config.model.model,
                                                                     "device": str(engine.device),
                                                                     "constrained_rows": constrained},
              "step_ms": step_ms, "steps_timed": {k: len(v) for k, v in times.items()}, "mask": mask,
              "constrained_over_plain": step_ms["constrained"] / step_ms["plain"],
              "mask_share_of_step": mask["mask_ms"] / step_ms["plain"]}
    rows = [("batch / constrained rows", f"{args.batch_size} / {constrained} ({args.grammar})"),
            ("plain decode step (ms, median)", step_ms["plain"]),
            ("constrained decode step (ms, median)", step_ms["constrained"]),
            ("constrained / plain", result["constrained_over_plain"]),
            ("mask work per step (ms): fill / copy / apply / accept",
             " / ".join(f"{mask.get(k + '_ms', float('nan')):.3f}" for k in ("fill", "copy", "apply", "accept"))),
            ("mask work / plain step", result["mask_share_of_step"])]
    report("grammar masks per step", rows, result, args.json)
    engine.shutdown()


if __name__ == "__main__":
    main()

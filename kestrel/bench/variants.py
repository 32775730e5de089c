"""One-batch decode latency of several code variants in one process, on one model.

    python -m kestrel.bench.variants --model kestrel/assets/configs/llama-3.1-8b --load-format dummy \
        --batch-size 1 --cuda-graph-max-bs 1 \
        --variant "base=import kestrel.pdl as p; p.ENABLED = False" \
        --variant "pdl=import kestrel.pdl as p; p.ENABLED = True"

A variant is a name and Python that sets module constants (each variant sets every constant it compares:
they persist to the next). The model is built once; before each measurement the variant's Python runs and
the decode graphs are captured again, so what a constant changes inside a kernel launch is what the graph
replays. The variants run in turn, `--rounds` times, so drift of the machine falls on all of them alike; a
variant's figure is the median of its rounds' median steps (`kestrel.bench.one_batch.measure`).
"""
from __future__ import annotations

import argparse

from kestrel.bench.common import copy_bandwidth, engine_from_args, median, report
from kestrel.bench.one_batch import measure, run
from kestrel.cli import add_engine_flags
from kestrel.core.forward_mode import ForwardMode


def parse_variant(text: str) -> tuple[str, str]:
    name, sep, code = text.partition("=")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"a variant is NAME=PYTHON, got {text!r}")
    return name.strip(), code


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_flags(parser)
    parser.add_argument("--variant", type=parse_variant, action="append", required=True,
                        help="NAME=PYTHON, run before that variant's graphs are captured (repeat the flag)")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2, help="times each variant is measured, in turn (default 2)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    args.profile_phase = "decode"
    engine = engine_from_args(args)
    bandwidth = copy_bandwidth(engine.device)
    steps: dict[str, list[float]] = {name: [] for name, _ in args.variant}
    summaries: dict[str, dict] = {}
    for _ in range(args.rounds):
        for name, code in args.variant:
            exec(code, {})
            engine.runner.capture_graphs(ForwardMode.DECODE, 1)
            run(engine, args.batch_size, args.input_len, 8)  # warm-up: compiles the variant's kernels
            summary, _ = measure(engine, args, args.batch_size, bandwidth)
            steps[name].append(summary["decode_step_median_s"])
            summaries[name] = summary
    rows, result = [], {"variants": {}}
    first = args.variant[0][0]
    for name, _ in args.variant:
        step = median(steps[name])
        s = summaries[name]
        floor, kv_floor = s["decode_floor_s"], s["decode_weight_kv_floor_s"]
        result["variants"][name] = {**s, "decode_step_median_s": step, "round_steps_s": steps[name],
                                    "decode_fraction_of_floor": floor / step if floor else None,
                                    "decode_fraction_of_weight_kv_floor": kv_floor / step if kv_floor else None}
        shown = f"{step * 1e3:.3f} ms  ({', '.join(f'{t * 1e3:.3f}' for t in steps[name])})"
        if floor:
            shown += f"  {100 * floor / step:.1f} % of weights, {100 * kv_floor / step:.1f} % of weights + KV"
        if name != first:
            shown += f"  x{median(steps[first]) / step:.3f} vs {first}"
        rows.append((name, shown))
    report(f"variants at batch {args.batch_size}", rows, result, args.json)
    engine.shutdown()


if __name__ == "__main__":
    main()

"""Decode attention (the Triton decode kernel): the uniform split against the length-aware one on batches
of mixed context lengths, and the kernel's launch configurations.

    python -m kestrel.bench.kernels.decode_attention          # table last, JSON to $OUT/decode_mixed.json
    TRITON_INTERPRET=1 python -m kestrel.bench.kernels.decode_attention --smoke  # the same code on CPU (Triton's
                                                      # interpreter), lengths / 128, host timers, no graphs
    python -m kestrel.bench.kernels.decode_attention --cases 256x2048 --launch-sweep   # pick the launch defaults

One layer of the Llama-3.1-8B shape (32 query heads, 8 KV heads, head_dim 128, bf16 or with
`--kv-dtype fp8_e4m3` an FP8 pool, page size 1 with scattered slots) through `decode_attention`, as the Triton backend calls it, for each case below and
each policy: `uniform` (the backend's default rule, `uniform_splits`), `length/T` (the length-aware
split aiming at T programs, `LengthAwareSplit(target_programs=T)`, the engine's with T = 4096) and
`chunk/C` (length-aware with a fixed chunk of C keys: min_chunk = C, no program target). Cases (lengths drawn with a fixed seed):

- `r0-mid`, batch 177: the offline 500 x 4096/2048 random-ratio-0 workload in mid-run: input ~ U[1, 4096]
  plus a uniform share of an output ~ U[1, 2048] already generated (mean ~2.6k, 1 to 6,144);
- `u2k-6k`, batch 177: contexts ~ U[2048, 6144];
- `skewed`, batch 177: 85 % short (U[64, 1024]) and 15 % long (U[8192, 12288]), the worst case for a
  one-program-per-request grid;
- `64x4096`, `1x8192`: equal lengths (the uniform rule's measured cases);
- `8-mixed`: batch 8, contexts ~ U[256, 8192];
- `256x2048`: equal lengths, 2 GiB of KV per call (where the launch defaults were chosen).

`--launch-sweep` instead times the uniform split at each launch configuration of LAUNCH_SWEEP (BLOCK_N,
warps, pipeline stages) on the chosen cases (a configuration that does not fit the GPU is reported as
failed), against the same copy bandwidth.

Each figure is the median of CUDA-event timings after warm-up, eager (`eager ms`, the length-aware plan
made beforehand, as the engine makes it once per step for all layers) and inside a captured CUDA graph
(`graph ms`, the plan captured with the call: it counts once per call here, once per 32 layers in the
engine; `plan us` is the plan alone in a graph). Small cases cycle through copies of their KV so that
the reads come from HBM, not L2. Achieved bandwidth = KV bytes read / time, against the measured copy
bandwidth (a 4 GiB device copy, read + written). Each length-aware output is checked against the
uniform one first. About a minute on an H200 (an estimate: not run yet).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import time

import torch

from kestrel.bench.common import require_interpreter

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
DEVICE = "cuda"  # "cpu" with --smoke
L2_BYTES = 256 * 2**20  # KV read per timed unit at least this (5x the H200's 50 MB L2)


def case_lengths(name: str, rng: random.Random) -> list[int]:
    if name == "r0-mid":
        return [rng.randint(1, 4096) + int(rng.random() * rng.randint(1, 2048)) + 1 for _ in range(177)]
    if name == "u2k-6k":
        return [rng.randint(2048, 6144) for _ in range(177)]
    if name == "skewed":
        return [rng.randint(8192, 12288) if rng.random() < 0.15 else rng.randint(64, 1024) for _ in range(177)]
    if name == "64x4096":
        return [4096] * 64
    if name == "1x8192":
        return [8192]
    if name == "8-mixed":
        return [rng.randint(256, 8192) for _ in range(8)]
    if name == "256x2048":
        return [2048] * 256
    raise ValueError(f"unknown case {name!r}; valid: {', '.join(CASES)}")


CASES = ("r0-mid", "u2k-6k", "skewed", "64x4096", "1x8192", "8-mixed", "256x2048")
DEFAULT_CASES = CASES[:-1]
# (BLOCK_N, num_warps, num_stages) for --launch-sweep.
LAUNCH_SWEEP = [(n, w, s) for n in (32, 64, 128) for w in (4, 8) for s in (2, 3)]


def median_ms(fn, reps: int, graphed: bool) -> float:
    """Median ms of fn() (CUDA events; the host clock on CPU), or with `graphed` of the replays of a CUDA
    graph that captured it (on CPU, which has no graphs, of fn() itself)."""
    from kestrel.bench.common import graph_ms, timed_ms

    device = torch.device(DEVICE)
    times = graph_ms(fn, device, reps) if graphed and DEVICE == "cuda" else timed_ms(fn, device, reps, warmup=3)
    return statistics.median(times)


class Case:
    """The KV of one case, `copies` times over (each copy its own scattered slots and table rows)."""

    def __init__(self, lengths: list[int], seed: int, kv_dtype: torch.dtype) -> None:
        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        self.lengths = lengths
        batch, tokens = len(lengths), sum(lengths)
        self.kv_bytes = 2 * tokens * KV_HEADS * HEAD_DIM * kv_dtype.itemsize  # K and V
        self.copies = 1 if DEVICE == "cpu" else max(1, min(8, math.ceil(L2_BYTES / self.kv_bytes)))
        slots = self.copies * tokens + 1  # slot 0 unused, as in the engine
        self.k_buf = torch.randn(slots, KV_HEADS, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16,
                                 generator=gen).to(kv_dtype)
        self.v_buf = torch.randn(self.k_buf.shape, device=DEVICE, dtype=torch.bfloat16, generator=gen).to(kv_dtype)
        perm = torch.randperm(slots - 1, device=DEVICE, generator=gen) + 1
        self.table = torch.zeros(self.copies * batch, max(lengths), dtype=torch.int64, device=DEVICE)
        used = 0
        for row in range(self.copies * batch):
            n = lengths[row % batch]
            self.table[row, :n] = perm[used:used + n]
            used += n
        self.seq = torch.tensor(lengths, device=DEVICE)
        self.rows = [torch.arange(c * batch, (c + 1) * batch, device=DEVICE) for c in range(self.copies)]
        self.q = torch.randn(batch, HEADS, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16, generator=gen)
        self.out = torch.empty_like(self.q)
        # The new token's K/V is stored by the kernel at the row's last slot: store what is already there.
        self.new_slots = [self.table[r, self.seq - 1].contiguous() for r in self.rows]
        self.new_kv = [(self.k_buf[s].flatten(1).to(torch.bfloat16), self.v_buf[s].flatten(1).to(torch.bfloat16))
                       for s in self.new_slots]


def run_policy(case: Case, policy, block_n: int, plan_inside: bool, num_warps: int = 4, num_stages: int = 3):
    """fn() running one decode_attention per KV copy (one timed unit), for `policy` (None: uniform)."""
    from kestrel.attention.triton.decode import decode_attention, length_aware_plan, uniform_splits

    num_splits = uniform_splits(len(case.lengths), KV_HEADS)
    plan = None if policy is None or plan_inside else length_aware_plan(case.seq, KV_HEADS, policy)

    def fn():
        p = plan
        for c, rows in enumerate(case.rows):
            if policy is not None and plan_inside:  # once per call: the worst case, a one-layer model
                p = length_aware_plan(case.seq, KV_HEADS, policy)
            k_new, v_new = case.new_kv[c]
            decode_attention(case.q, k_new, v_new, case.k_buf, case.v_buf, case.out, case.table, rows, case.seq,
                             case.new_slots[c], 1 / math.sqrt(HEAD_DIM), None, DEVICE == "cpu", num_splits,
                             block_n=block_n, num_warps=num_warps, num_stages=num_stages, split_plan=p)
    return fn


def launch_sweep(case: Case, name: str, reps: int, bandwidth: float | None, smoke: bool) -> list[dict]:
    """The uniform split at each launch configuration: eager ms and the KV read rate, one row each."""
    rows = []
    for block_n, warps, stages in [(16, 4, 2), (16, 4, 3)] if smoke else LAUNCH_SWEEP:
        row = {"case": name, "batch": len(case.lengths), "block_n": block_n, "warps": warps, "stages": stages,
               "kv_bytes": case.kv_bytes}
        try:
            ms = median_ms(run_policy(case, None, block_n, False, warps, stages), reps, False) / case.copies
        except Exception as e:  # noqa: BLE001 - a configuration that does not fit (shared memory): say so
            row["error"] = f"{type(e).__name__}: {str(e)[:120]}"
            print(f"  BLOCK_N {block_n:>3} warps {warps} stages {stages}: failed ({row['error']})")
        else:
            row.update(eager_ms=ms, eager_tb_s=case.kv_bytes / ms / 1e9,
                       share_of_copy_bw=case.kv_bytes / (ms / 1e3) / bandwidth if bandwidth else None)
            print(f"  BLOCK_N {block_n:>3} warps {warps} stages {stages}: {ms:.3f} ms  {row['eager_tb_s']:.2f} TB/s")
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=list(DEFAULT_CASES), choices=CASES)
    parser.add_argument("--launch-sweep", action="store_true",
                        help="time the uniform split at each (BLOCK_N, warps, stages) of LAUNCH_SWEEP instead")
    parser.add_argument("--targets", nargs="+", type=int, default=[1024, 2048, 4096, 8192],
                        help="length-aware target_programs to try (default: 1024 2048 4096 8192)")
    parser.add_argument("--chunks", nargs="+", type=int, default=[512, 1024, 2048],
                        help="fixed chunk sizes to try: length-aware with min_chunk = C and no program target "
                             "(default: 512 1024 2048)")
    parser.add_argument("--max-splits", type=int, default=16, help="length-aware max_splits (default 16)")
    parser.add_argument("--block-n", type=int, default=64)
    parser.add_argument("--kv-dtype", choices=("bf16", "fp8_e4m3"), default="bf16",
                        help="the pool's dtype (fp8_e4m3: half the bytes per key, dequantized in registers)")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--smoke", action="store_true",
                        help="CPU, Triton's interpreter, every length / 128 and at most 6 requests: checks the script")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "decode_mixed.json"))
    args = parser.parse_args()
    global DEVICE
    if args.smoke:
        require_interpreter()
        DEVICE = "cpu"
        args.reps, args.targets, args.chunks, args.block_n = 1, [4096], [16], 16
    elif not torch.cuda.is_available():
        raise SystemExit("kestrel.bench.kernels.decode_attention needs a CUDA GPU (or --smoke)")
    from kestrel.attention.triton.decode import LengthAwareSplit, length_aware_plan, uniform_splits
    from kestrel.bench.common import copy_bandwidth

    started = time.time()
    bandwidth = copy_bandwidth(torch.device(DEVICE), gib=4.0)
    device_name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    if bandwidth:
        print(f"{device_name}: copy bandwidth {bandwidth / 1e12:.2f} TB/s (4 GiB, read + written)")
    policies = [("uniform", None)] + [(f"length/{t}", LengthAwareSplit(target_programs=t, max_splits=args.max_splits,
                                                                         min_chunk=args.block_n))
                                      for t in args.targets]
    policies += [(f"chunk/{c}", LengthAwareSplit(target_programs=2**40, max_splits=args.max_splits, min_chunk=c))
                 for c in args.chunks]
    rows = []
    for i, name in enumerate(args.cases):
        lengths = case_lengths(name, random.Random(args.seed * 100 + i))
        if args.smoke:
            lengths = [max(1, n // 128) for n in lengths[:6]]
        case = Case(lengths, args.seed + i, torch.bfloat16 if args.kv_dtype == "bf16" else torch.float8_e4m3fn)
        batch = len(lengths)
        print(f"{name}: batch {batch}, contexts {min(lengths)}-{max(lengths)} (mean {sum(lengths) / batch:.0f}), "
              f"KV {case.kv_bytes / 2**20:.0f} MiB per call, {case.copies} cop{'y' if case.copies == 1 else 'ies'}")
        if args.launch_sweep:
            rows += launch_sweep(case, name, args.reps, bandwidth, args.smoke)
            continue
        run_policy(case, None, args.block_n, False)()
        reference = case.out.float().clone()
        for label, policy in policies:
            run_policy(case, policy, args.block_n, False)()
            err = (case.out.float() - reference).abs().max().item()
            eager = median_ms(run_policy(case, policy, args.block_n, False), args.reps, False) / case.copies
            graph = median_ms(run_policy(case, policy, args.block_n, True), args.reps, True) / case.copies
            row = {"case": name, "batch": batch, "policy": label, "eager_ms": eager, "graph_ms": graph,
                   "kv_bytes": case.kv_bytes, "max_abs_diff_vs_uniform": err,
                   "eager_tb_s": case.kv_bytes / eager / 1e9, "graph_tb_s": case.kv_bytes / graph / 1e9}
            if policy is None:
                row["splits"] = uniform_splits(batch, KV_HEADS)
                row["programs"] = batch * KV_HEADS * row["splits"]
            else:
                plan = length_aware_plan(case.seq, KV_HEADS, policy)
                row["programs"] = int(plan.split_counts.sum()) * KV_HEADS
                row["chunk_max"] = int(plan.split_chunks.max())
                make_plan = lambda seq=case.seq, policy=policy: length_aware_plan(seq, KV_HEADS, policy)  # noqa: E731
                row["plan_us"] = median_ms(make_plan, args.reps, True) * 1e3
            row["graph_share_of_copy_bw"] = case.kv_bytes / (graph / 1e3) / bandwidth if bandwidth else None
            rows.append(row)
            print(f"  {label:<12} eager {eager:.3f} ms  graph {graph:.3f} ms  "
                  f"{row['graph_tb_s']:.2f} TB/s  max |diff| {err:.1e}")
        case = None  # free this case's KV before the next one's
        if DEVICE == "cuda":
            torch.cuda.empty_cache()

    elapsed = time.time() - started
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"device": device_name, "copy_bandwidth_bytes_s": bandwidth, "block_n": args.block_n,
                   "kv_dtype": args.kv_dtype, "max_splits": args.max_splits, "launch_sweep": args.launch_sweep,
                   "seconds": elapsed, "rows": rows}, f, indent=1)
    print(f"\n{len(rows)} timings in {elapsed:.0f} s; JSON: {args.json}\n")
    if args.launch_sweep:
        print("| case | BLOCK_N | warps | stages | eager ms | TB/s | of copy bw |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            share = f"{100 * r['share_of_copy_bw']:.1f} %" if r.get("share_of_copy_bw") else "-"
            timing = f"{r['eager_ms']:.3f} | {r['eager_tb_s']:.2f}" if "eager_ms" in r else "failed | -"
            print(f"| {r['case']} | {r['block_n']} | {r['warps']} | {r['stages']} | {timing} | {share} |")
        return
    print("| case | batch | policy | programs | max chunk | eager ms | graph ms | plan us | graph TB/s | of copy bw |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        chunk = r.get("chunk_max", "-")
        plan = f"{r['plan_us']:.1f}" if "plan_us" in r else "-"
        share = f"{100 * r['graph_share_of_copy_bw']:.1f} %" if r["graph_share_of_copy_bw"] else "-"
        print(f"| {r['case']} | {r['batch']} | {r['policy']} | {r['programs']} | {chunk} | {r['eager_ms']:.3f} | "
              f"{r['graph_ms']:.3f} | {plan} | {r['graph_tb_s']:.2f} | {share} |")

if __name__ == "__main__":
    main()

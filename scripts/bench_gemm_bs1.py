"""The batch-1 products of one Llama-3.1-8B decode step, alone in a CUDA graph, under torch's BLAS settings.

    python scripts/bench_gemm_bs1.py [--json out.json]

32 layers of qkv, o, gate_up and down products plus the logits, chained as in the model, captured
once per setting and replayed; medians of CUDA-event timings. Shows what the GEMMs cost without the
rest of the step, and whether cuBLASLt or disallowing reduced-precision reductions (which decide
whether cuBLAS adds a split-K reduce kernel) change it.
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

LAYERS, HIDDEN, INTER, QKV, VOCAB = 32, 4096, 14336, 6144, 128256


def step(x, layers, lm_head):
    h = x
    for qkv, o, gate_up, down in layers:
        a = F.linear(h, qkv)
        h = F.linear(a[:, :HIDDEN], o)
        g = F.linear(h, gate_up)
        h = F.linear(g[:, :INTER], down)
    return F.linear(h, lm_head).float().argmax(-1)


def timed(graph, reps=50):
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    dev, dt = "cuda", torch.bfloat16
    layers = [tuple(torch.randn(shape, device=dev, dtype=dt) * 0.02 for shape in
                    ((QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER))) for _ in range(LAYERS)]
    lm_head = torch.randn(VOCAB, HIDDEN, device=dev, dtype=dt) * 0.02
    gbytes = (sum(w.numel() for layer in layers for w in layer) + lm_head.numel()) * 2 / 1e9
    x = torch.randn(1, HIDDEN, device=dev, dtype=dt)
    # Copy bandwidth (read + write), as the benchmarks' floor uses it.
    src = torch.empty(2 * 2**30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    copy = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        copy.append(start.elapsed_time(end))
    copy_tbs = 2 * 2**31 / statistics.median(copy[2:]) / 1e9
    del src, dst
    floor_ms = gbytes / copy_tbs
    print(f"weights read per step {gbytes:.2f} GB; copy bandwidth {copy_tbs:.2f} TB/s; floor {floor_ms:.3f} ms")
    results = []
    settings = [("cublas", True), ("cublaslt", True), ("cublas", False), ("cublaslt", False)]
    for library, reduced in settings:
        torch.backends.cuda.preferred_blas_library(library)
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = reduced
        for _ in range(3):
            step(x, layers, lm_head)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step(x, layers, lm_head)
        for _ in range(5):
            graph.replay()
        ms = timed(graph)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            graph.replay()
            torch.cuda.synchronize()
        kernels = sorted(((e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total) / 1e3,
                          e.count, e.key[:70]) for e in prof.key_averages())[::-1]
        kernels = [k for k in kernels if k[0] > 0]
        row = {"library": library, "bf16_reduced_reduction": reduced, "ms": ms, "floor_ms": floor_ms,
               "launches": sum(k[1] for k in kernels), "kernels": kernels[:8]}
        results.append(row)
        print(f"\n{library:9} reduced-precision reduction {str(reduced):5}: {ms:.3f} ms "
              f"({floor_ms / ms:.1%} of the floor), {row['launches']} kernels")
        for t, n, name in kernels[:6]:
            print(f"   {t:7.3f} ms {n:4}  {name}")
        del graph
    # Greedy sampling's argmax over the vocabulary at batch 1, and a two-stage variant (rows, then the best row).
    logits = torch.randn(1, VOCAB, device=dev)

    def two_stage():
        values, idx = logits.view(256, VOCAB // 256).max(-1)
        row = values.argmax()
        return row * (VOCAB // 256) + idx[row]

    from kestrel.engine.argmax_triton import argmax_rows

    for name, fn in (("argmax", lambda: logits.argmax(-1)), ("two-stage max", two_stage),
                     ("triton argmax", lambda: argmax_rows(logits))):
        assert int(fn()) == int(logits.argmax())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(20):
                fn()
        graph.replay()
        us = timed(graph) / 20 * 1e3
        results.append({"op": name, "us": us})
        print(f"{name:14} [1, {VOCAB}] float32: {us:.1f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

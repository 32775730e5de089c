"""FP8 on the GPU: GEMMs at Llama-3.1-8B's linear shapes, and decode attention over a bf16 vs an FP8 KV pool.

    PYTHONPATH=. python scripts/bench_fp8.py            # prints tables, writes $OUT/fp8_gemm.json

GEMMs (M = tokens in the batch): bf16 `F.linear`; `torch._scaled_mm` with per-tensor, row-wise and (where
this torch and cuBLAS have it) 1x128 / 128x128 block scales, the GEMM alone, activations quantized
beforehand; kestrel's Triton FP8 GEMM (`kestrel.layers.fp8_gemm_triton`, block scales, activation
quantization included), at its default config and over a small sweep at M = 1 and 64. Every figure is
the median over graph replays of one call per weight copy, copies cycled so that the weights come from
HBM, not L2, as in a decode step; CUDA graphs, so launch gaps do not count (the engine replays graphs).
The floor of each is its bytes (weights + activations + output) at the measured copy bandwidth.

Attention: the Triton decode kernel at batch 64 x context 4096 (Llama-8B: 32 query heads, 8 KV heads,
head_dim 128, one layer), bf16 vs fp8_e4m3 KV, a few split counts; floor: KV bytes at copy bandwidth.
About a minute and a half on an H200, Triton's compiles included: the sweep runs last and stops at
--budget seconds from the start.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}  # (K, N)
LAYERS = 32
ATTENTION = dict(batch=64, context=4096, heads=32, kv_heads=8, head_dim=128)
DEVICE = "cuda"
MS = (1, 8, 32, 64, 256)
SWEEP_MS = (1, 64)


def graph_time(calls: list, replays: int = 15) -> float:
    """Median ms per call of `calls` (closures) captured back to back in one CUDA graph."""
    for call in calls:  # warm-up: compiles, picks cuBLAS kernels, allocates outside the graph
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(calls))
    del graph
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Bytes per second of a large device-to-device copy (read + write)."""
    src = torch.empty(2**30, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    ms = graph_time([lambda: dst.copy_(src)] * 4)
    return 2 * src.numel() / (ms / 1e3)


def scaled_mm_methods(x: torch.Tensor, k: int, n: int):
    """name -> (make(weight_fp8 [N, K]) -> call, bytes of scales): _scaled_mm with each scaling it may have."""
    from kestrel.quant.fp8 import quantize_token_groups

    m = x.shape[0]
    xq = x.to(torch.float8_e4m3fn)
    one = torch.ones((), device=DEVICE)
    row_a, row_b = torch.ones(m, 1, device=DEVICE), torch.ones(1, n, device=DEVICE)
    _, group_a = quantize_token_groups(x)  # [M, K/128]
    block_b = torch.ones(math.ceil(k / 128), math.ceil(n / 128), device=DEVICE)
    return {
        "scaled_mm_tensor": lambda w: lambda: torch._scaled_mm(xq, w.t(), scale_a=one, scale_b=one,
                                                               out_dtype=torch.bfloat16, use_fast_accum=True),
        "scaled_mm_row": lambda w: lambda: torch._scaled_mm(xq, w.t(), scale_a=row_a, scale_b=row_b,
                                                            out_dtype=torch.bfloat16, use_fast_accum=True),
        # cuBLAS wants the 1x128 activation scales M-major: try that layout after the plain one.
        "scaled_mm_block": lambda w: _first_working([
            lambda: torch._scaled_mm(xq, w.t(), scale_a=group_a, scale_b=block_b, out_dtype=torch.bfloat16),
            lambda: torch._scaled_mm(xq, w.t(), scale_a=group_a.t().contiguous().t(), scale_b=block_b,
                                     out_dtype=torch.bfloat16)]),
    }


def _first_working(calls: list):
    errors = []
    for call in calls:
        try:
            call()
            torch.cuda.synchronize()
            return call
        except Exception as e:  # noqa: BLE001 - torch raises RuntimeError or ValueError for a scaling it lacks
            errors.append(_why(e))
    raise RuntimeError(" | ".join(errors))  # both layouts refused: reported as this method's error


def _why(e: Exception) -> str:
    lines = str(e).strip().splitlines() or [""]
    return f"{type(e).__name__}: {' '.join(lines[:2])[:300]}"


def sweep_configs(m: int):
    from kestrel.layers.fp8_gemm_triton import GemmConfig

    bm = max(16, 1 << (m - 1).bit_length())
    configs = [GemmConfig(bm, bn, split, warps, stages) for bn, split, warps, stages in
               [(32, 1, 4, 4), (64, 1, 4, 4), (128, 1, 4, 4), (32, 2, 4, 4), (64, 2, 4, 4), (64, 4, 4, 4),
                (64, 8, 4, 3), (128, 4, 8, 3)]]
    if m >= 64:
        configs += [GemmConfig(64, 128, 1, 8, 3, fused_quant=False), GemmConfig(64, 64, 1, 4, 4, fused_quant=False)]
    return configs


def bench_gemms(bandwidth: float, deadline: float | None = None) -> list[dict]:
    """Every method at every shape and M; with a deadline (time.time()), the Triton sweep instead, at
    SWEEP_MS, its entries past the deadline skipped."""
    from kestrel.layers.fp8_gemm_triton import default_config, fp8_gemm
    from kestrel.quant.fp8 import quantize_blocks

    sweep = deadline is not None
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    rows = []
    for shape, (k, n) in SHAPES.items():
        copies = max(2, math.ceil(3 * l2 / (k * n)))  # FP8 bytes of all copies >= 3 x L2
        w_bf16 = [torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        w_fp8 = [quantize_blocks(w) for w in w_bf16]
        for m in SWEEP_MS if sweep else MS:
            x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
            io = m * k * 2 + m * n * 2

            def add(method: str, calls, weight_bytes: int, **extra) -> None:
                try:
                    ms = graph_time(calls)
                except Exception as e:  # noqa: BLE001 - a scaling or config this torch / GPU does not have
                    rows.append({"shape": shape, "M": m, "method": method, "error": _why(e), **extra})
                    return
                floor = (weight_bytes + io) / bandwidth * 1e3
                rows.append({"shape": shape, "M": m, "K": k, "N": n, "method": method, "ms": ms, "floor_ms": floor,
                             "pct_of_floor": 100 * floor / ms, "tflops": 2 * m * n * k / ms / 1e9, **extra})

            scale_bytes = w_fp8[0][1].numel() * 4
            if sweep:
                for c in sweep_configs(m):
                    if time.time() > deadline:
                        rows.append({"shape": shape, "M": m, "method": "triton_fp8_sweep", "error": "over budget",
                                     "config": repr(c)})
                        continue
                    add("triton_fp8_sweep", [lambda q=q, s=s, c=c: fp8_gemm(x, q, s, config=c) for q, s in w_fp8],
                        n * k + scale_bytes, config=repr(c))
                continue
            add("bf16", [lambda w=w: F.linear(x, w) for w in w_bf16], 2 * n * k)
            for method, make in scaled_mm_methods(x, k, n).items():
                try:
                    calls = [make(q) for q, _ in w_fp8]
                except Exception as e:  # noqa: BLE001
                    rows.append({"shape": shape, "M": m, "method": method, "error": _why(e)})
                    continue
                add(method, calls, n * k)
            cfg = default_config(m, n, k, x.device)
            add("triton_fp8", [lambda q=q, s=s: fp8_gemm(x, q, s, config=cfg) for q, s in w_fp8], n * k + scale_bytes,
                config=repr(cfg))
        del w_bf16, w_fp8
        torch.cuda.empty_cache()
    return rows


def bench_attention(bandwidth: float) -> list[dict]:
    from kestrel.attention.triton.decode import decode_attention
    from kestrel.quant.kv import to_pool

    batch, ctx, heads, kv_heads, d = (ATTENTION[k] for k in ("batch", "context", "heads", "kv_heads", "head_dim"))
    slots = batch * ctx + 16
    table = (torch.randperm(slots - 16, device=DEVICE) + 16).view(batch, ctx)  # scattered slots
    rows_idx = torch.arange(batch, device=DEVICE)
    seq = torch.full((batch,), ctx, device=DEVICE)
    new_slots = table[:, -1].contiguous()
    q = torch.randn(batch, heads, d, device=DEVICE, dtype=torch.bfloat16)
    k_new = torch.randn(batch, kv_heads * d, device=DEVICE, dtype=torch.bfloat16)
    v_new = torch.randn_like(k_new)
    out = torch.empty_like(q)
    results = []
    for kv_dtype in ("bf16", "fp8_e4m3"):
        values = torch.randn(slots, kv_heads, d, device=DEVICE, dtype=torch.bfloat16)
        k_buf = values if kv_dtype == "bf16" else to_pool(values, torch.float8_e4m3fn, 1.0)
        v_buf = k_buf.clone()
        kv_bytes = 2 * batch * ctx * kv_heads * d * k_buf.element_size()
        for splits in (1, 2, 4):
            ms = graph_time([lambda: decode_attention(q, k_new, v_new, k_buf, v_buf, out, table, rows_idx, seq,
                                                      new_slots, d ** -0.5, None, False, splits)])
            floor = kv_bytes / bandwidth * 1e3
            results.append({"kv_cache_dtype": kv_dtype, "batch": batch, "context": ctx, "num_splits": splits, "ms": ms,
                            "floor_ms": floor, "pct_of_floor": 100 * floor / ms,
                            "GBps": kv_bytes / ms / 1e6})
        del k_buf, v_buf, values
        torch.cuda.empty_cache()
    return results


def decode_step_totals(rows: list[dict]) -> dict[str, float]:
    """ms of one M = 1 decode step's GEMMs (4 shapes x 32 layers) per method (the sweep: its best per shape)."""
    totals = {}
    for method in ("bf16", "scaled_mm_tensor", "scaled_mm_row", "scaled_mm_block", "triton_fp8", "triton_fp8_sweep"):
        per_shape = [min((r["ms"] for r in rows if r["M"] == 1 and r["shape"] == s and r["method"] == method
                          and "ms" in r), default=None) for s in SHAPES]
        if all(t is not None for t in per_shape):
            totals[method] = LAYERS * sum(per_shape)
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=75.0,
                        help="seconds from the start after which Triton sweep entries are skipped")
    parser.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "fp8_gemm.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_fp8 needs a CUDA GPU")
    cap = torch.cuda.get_device_capability()
    if cap < (8, 9):
        raise SystemExit(f"FP8 needs compute capability >= 8.9; this GPU is {cap[0]}.{cap[1]}")
    import triton

    started = time.time()
    bandwidth = copy_bandwidth()
    gemm = bench_gemms(bandwidth)
    attention = bench_attention(bandwidth)
    gemm += bench_gemms(bandwidth, deadline=started + args.budget)  # what is left of the budget: the sweep
    totals = decode_step_totals(gemm)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "copy_bandwidth_GBps": bandwidth / 1e9, "gemm": gemm, "decode_step_gemm_ms_at_M1": totals,
              "attention": attention, "seconds": time.time() - started}

    print(f"{report['device']}  torch {torch.__version__}  triton {triton.__version__}  "
          f"copy {bandwidth / 1e9:.0f} GB/s")
    print(f"{'shape':8} {'M':>4} {'method':18} {'ms':>8} {'floor':>8} {'%floor':>7} {'TFLOP/s':>8}  config")
    for r in gemm:
        if "ms" in r:
            print(f"{r['shape']:8} {r['M']:>4} {r['method']:18} {r['ms']:8.4f} {r['floor_ms']:8.4f} "
                  f"{r['pct_of_floor']:6.1f}% {r['tflops']:8.1f}  {r.get('config', '')}")
        else:
            print(f"{r['shape']:8} {r['M']:>4} {r['method']:18} {r['error'][:90]}")
    print("decode step GEMMs at M=1 (32 layers):", {k: round(v, 3) for k, v in totals.items()})
    for r in attention:
        print(f"attention {r['kv_cache_dtype']:9} bs {r['batch']} ctx {r['context']} splits {r['num_splits']}: "
              f"{r['ms']:.3f} ms ({r['GBps']:.0f} GB/s, {r['pct_of_floor']:.0f}% of floor)")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.json} in {report['seconds']:.0f} s")


if __name__ == "__main__":
    main()

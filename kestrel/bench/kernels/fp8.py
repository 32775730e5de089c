"""FP8 on the GPU: GEMMs at Llama-3.1-8B's linear shapes, and decode attention over a bf16 vs an FP8 KV pool.

    python -m kestrel.bench.kernels.fp8              # prints tables, writes $OUT/fp8_gemm.json
    python -m kestrel.bench.kernels.fp8 --gemv-only  # only M <= 8: what sets GEMV_MAX_M

GEMMs (M = tokens in the batch): bf16 `F.linear`; `torch._scaled_mm` with per-tensor, row-wise and (where
this torch and cuBLAS have it) 1x128 / 128x128 block scales, the GEMM alone, activations quantized
beforehand; kestrel's Triton FP8 GEMM (`kestrel.layers.fp8_gemm_triton`, block scales, activation
quantization included): the tl.dot path at its default config, and for M <= 8 the GEMV path at its own,
and at M = 1 the same GEMV over the bf16 weights. Every figure is the median over graph replays of one
call per weight copy, copies cycled so that the weights come from HBM, not L2, as in a decode step; CUDA
graphs, so launch gaps do not count (the engine replays graphs). The floor of each is its bytes
(weights + activations + output) at the measured copy bandwidth (kestrel.bench.common.copy_bandwidth).

Attention: the Triton decode kernel at batch 64 x context 4096 (Llama-8B: 32 query heads, 8 KV heads,
head_dim 128, one layer), bf16 vs fp8_e4m3 KV, a few split counts; floor: KV bytes at copy bandwidth.

Then the sweeps, M by M (1, 2, 4, 8, 64): the GEMV's tiles, splits and warps; the tl.dot path's configs;
at M = 1 the GEMV over bf16 weights. They stop at --budget seconds from the start (Triton compiles a
config's kernel on its first call: most of the sweep's time). The last table sums up M <= 8: per shape and
for the 32 layers, bf16, the tl.dot path (default, fastest), the GEMV (default, fastest, its config)
against the FP8 floor; then bf16 weights at M = 1, F.linear against the GEMV.
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

from kestrel.bench import common

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}  # (K, N)
LAYERS = 32
ATTENTION = dict(batch=64, context=4096, heads=32, kv_heads=8, head_dim=128)
DEVICE = "cuda"
MS = (1, 2, 4, 8, 32, 64, 256)
GEMV_MS = (1, 2, 4, 8)  # decode batches where the GEMV may beat tl.dot (GEMV_LIMIT_M)
SWEEP_MS = GEMV_MS + (64,)


def graph_time(calls: list, replays: int = 15) -> float:
    """Median ms per call of `calls` (closures) captured back to back in one CUDA graph."""
    def all_calls() -> None:
        for call in calls:
            call()
    return statistics.median(common.graph_ms(all_calls, torch.device(DEVICE), replays)) / len(calls)


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


# The GEMV's tiles: (rows per program, bytes of each row per strip at M = 1, num_warps). The strip narrows
# as M grows (never below one scale block for FP8), so the float32 products per program stay put.
GEMV_TILES = [(16, 512, 4), (8, 1024, 4), (32, 256, 4), (16, 1024, 8), (32, 512, 8), (64, 256, 8)]


def gemv_sweep_configs(m: int, n: int, k: int, fp8: bool):
    """Each GEMV tile at the split rule's count, half and double it (at M = 1 also with `defer_reduce`);
    for FP8 also the default config and the default with the activations quantized by a separate launch,
    and at M = 1 each tile without quantizing the activations (`quantize_x`)."""
    from kestrel.layers.fp8_gemm_triton import GemvConfig, default_gemv_config, gemv_split_k

    device = torch.device(DEVICE)
    bm = 1 << (m - 1).bit_length()
    configs = []
    if fp8:
        default = default_gemv_config(m, n, k, device)
        configs += [default, GemvConfig(default.block_n, default.block_k, default.split_k, fused_quant=False)]
    for bn, strip_bytes, warps in GEMV_TILES:
        bk = max(128 if fp8 else 64, strip_bytes // (1 if fp8 else 2) // bm)
        split = gemv_split_k(n, k, bn, bk, device)
        for s in sorted({max(1, split // 2), split, 2 * split}):
            configs.append(GemvConfig(bn, bk, s, warps))
            if m == 1:  # the reduction across threads once per call instead of once per strip
                configs.append(GemvConfig(bn, bk, s, warps, defer_reduce=True))
            if m == 1 and fp8:  # W8A16: the activations not rounded to e4m3
                configs += [GemvConfig(bn, bk, s, warps, quantize_x=False),
                            GemvConfig(bn, bk, s, warps, defer_reduce=True, quantize_x=False)]
    return list(dict.fromkeys(configs))  # the default may repeat a tile


def make_weights() -> dict[str, tuple[list, list]]:
    """shape -> (bf16 weights, (FP8 weight, block scales) pairs): as many random copies as put the FP8
    bytes past 3 x L2, so cycling through them reads HBM as a decode step does."""
    from kestrel.quant.fp8 import quantize_blocks

    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    weights = {}
    for shape, (k, n) in SHAPES.items():
        copies = max(2, math.ceil(3 * l2 / (k * n)))
        w_bf16 = [torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        weights[shape] = (w_bf16, [quantize_blocks(w) for w in w_bf16])
    return weights


def measure(rows: list[dict], bandwidth: float, shape: str, m: int, method: str, calls, weight_bytes: int,
            **extra) -> None:
    """Appends one row: ms per call of `calls` and its floor (weight + activation + output bytes at
    `bandwidth`), or the error a method or config this torch / GPU lacks raised."""
    k, n = SHAPES[shape]
    try:
        ms = graph_time(calls)
    except Exception as e:  # noqa: BLE001 - a scaling or config this torch / GPU does not have
        rows.append({"shape": shape, "M": m, "method": method, "error": _why(e), **extra})
        return
    floor = (weight_bytes + m * k * 2 + m * n * 2) / bandwidth * 1e3
    rows.append({"shape": shape, "M": m, "K": k, "N": n, "method": method, "ms": ms, "floor_ms": floor,
                 "pct_of_floor": 100 * floor / ms, "tflops": 2 * m * n * k / ms / 1e9, **extra})


def bench_gemms(weights: dict, bandwidth: float, ms_list=MS, scaled_mm: bool = True) -> list[dict]:
    """Every method at its default config, at every shape and M in ms_list."""
    from kestrel.layers.fp8_gemm_triton import GEMV_LIMIT_M, default_dot_config, default_gemv_config, fp8_gemm, gemv

    rows = []
    for shape, (k, n) in SHAPES.items():
        w_bf16, w_fp8 = weights[shape]
        fp8_bytes = n * k + w_fp8[0][1].numel() * 4
        for m in ms_list:
            x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
            measure(rows, bandwidth, shape, m, "bf16", [lambda w=w: F.linear(x, w) for w in w_bf16], 2 * n * k)
            for method, make in (scaled_mm_methods(x, k, n).items() if scaled_mm else ()):
                try:
                    calls = [make(q) for q, _ in w_fp8]
                except Exception as e:  # noqa: BLE001
                    rows.append({"shape": shape, "M": m, "method": method, "error": _why(e)})
                    continue
                measure(rows, bandwidth, shape, m, method, calls, n * k)
            cfg = default_dot_config(m, n, k, x.device)
            measure(rows, bandwidth, shape, m, "triton_fp8", [lambda q=q, s=s: fp8_gemm(x, q, s, config=cfg)
                                                              for q, s in w_fp8], fp8_bytes, config=repr(cfg))
            if m <= GEMV_LIMIT_M:
                gcfg = default_gemv_config(m, n, k, x.device)
                measure(rows, bandwidth, shape, m, "triton_gemv", [lambda q=q, s=s: fp8_gemm(x, q, s, config=gcfg)
                                                                   for q, s in w_fp8], fp8_bytes, config=repr(gcfg))
                if m == 1:  # bf16 weights through the same GEMV (not used by the models: the bench only)
                    measure(rows, bandwidth, shape, m, "bf16_gemv", [lambda w=w: gemv(x, w, config=gcfg)
                                                                     for w in w_bf16], 2 * n * k, config=repr(gcfg))
    return rows


def bench_sweep(weights: dict, bandwidth: float, deadline: float, sweep_ms=SWEEP_MS) -> list[dict]:
    """The configs of the sweeps, M by M in sweep_ms (the GEMV's first, then tl.dot's, then at M = 1 the
    GEMV over bf16 weights); entries past the deadline (time.time()) are recorded as skipped."""
    from kestrel.layers.fp8_gemm_triton import GEMV_LIMIT_M, fp8_gemm, gemv

    rows = []
    for m in sweep_ms:
        for shape, (k, n) in SHAPES.items():
            w_bf16, w_fp8 = weights[shape]
            fp8_bytes = n * k + w_fp8[0][1].numel() * 4
            x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
            runs = []
            if m <= GEMV_LIMIT_M:
                runs += [("triton_gemv_sweep", c, [lambda q=q, s=s, c=c: fp8_gemm(x, q, s, config=c)
                                                   for q, s in w_fp8], fp8_bytes)
                         for c in gemv_sweep_configs(m, n, k, fp8=True)]
            runs += [("triton_fp8_sweep", c, [lambda q=q, s=s, c=c: fp8_gemm(x, q, s, config=c) for q, s in w_fp8],
                      fp8_bytes) for c in sweep_configs(m)]
            if m == 1:
                runs += [("bf16_gemv_sweep", c, [lambda w=w, c=c: gemv(x, w, config=c) for w in w_bf16], 2 * n * k)
                         for c in gemv_sweep_configs(m, n, k, fp8=False)]
            for method, c, calls, weight_bytes in runs:
                if time.time() > deadline:
                    rows.append({"shape": shape, "M": m, "method": method, "error": "over budget", "config": repr(c)})
                    continue
                measure(rows, bandwidth, shape, m, method, calls, weight_bytes, config=repr(c))
    return rows


# The small-M summary: each column is the fastest row per shape among these methods.
SMALL_M_COLUMNS = {
    "bf16": ("bf16",), "dot": ("triton_fp8",), "dot_best": ("triton_fp8", "triton_fp8_sweep"),
    "gemv": ("triton_gemv",), "gemv_best": ("triton_gemv", "triton_gemv_sweep"),
    "bf16_gemv_best": ("bf16_gemv", "bf16_gemv_sweep"),
}


def _fastest(rows: list[dict], m: int, shape: str, methods) -> dict | None:
    timed = [r for r in rows if r["M"] == m and r["shape"] == shape and r["method"] in methods and "ms" in r]
    return min(timed, key=lambda r: r["ms"], default=None)


def small_m_summary(rows: list[dict]) -> list[dict]:
    """Per M <= 8 and shape, then for the 32 layers: ms of each column, the FP8 and bf16 floors, and the
    fastest GEMV config (what default_gemv_config and GEMV_MAX_M are to be set from). A 32-layer figure
    only where every shape has one."""
    from kestrel.layers.fp8_gemm_triton import GEMV_LIMIT_M

    out = []
    for m in sorted({r["M"] for r in rows if r["M"] <= GEMV_LIMIT_M}):
        per_shape = []
        for shape in SHAPES:
            entry = {"M": m, "shape": shape}
            for col, methods in SMALL_M_COLUMNS.items():
                best = _fastest(rows, m, shape, methods)
                if best is not None:
                    entry[col] = best["ms"]
                    # Every row of a weight type has the same bytes: the floor of whichever was timed.
                    entry["bf16_floor" if col.startswith("bf16") else "fp8_floor"] = best["floor_ms"]
                    if col in ("gemv_best", "bf16_gemv_best"):
                        entry[col + "_config"] = best.get("config", "")
            per_shape.append(entry)
        out += per_shape
        total = {"M": m, "shape": f"{LAYERS} layers"}
        for key in per_shape[0]:
            if key not in ("M", "shape") and not key.endswith("_config") and all(key in e for e in per_shape):
                total[key] = LAYERS * sum(e[key] for e in per_shape)
        out.append(total)
    return out


def print_small_m(summary: list[dict]) -> None:
    def cell(entry: dict, key: str) -> str:
        return f"{entry[key]:8.4f}" if key in entry else f"{'-':>8}"

    def short(config: str) -> str:  # GemvConfig(block_n=16, ..., num_warps=4, ...) -> n=16, ..., warps=4, ...
        return config.replace("GemvConfig(", "").replace("block_", "").replace("num_", "").rstrip(")")

    print("M <= 8, FP8 weights: ms per GEMM (dot = tl.dot path, gemv = GEMV; *: fastest of its sweep); "
          "floor = FP8 bytes at copy bandwidth")
    print(f"{'M':>2} {'shape':10} {'bf16':>8} {'dot':>8} {'dot*':>8} {'gemv':>8} {'gemv*':>8} {'floor':>8} "
          f"{'gemv*%':>7}  gemv* config")
    for e in summary:
        pct = f"{100 * e['fp8_floor'] / e['gemv_best']:6.1f}%" if "gemv_best" in e else f"{'-':>7}"
        print(f"{e['M']:>2} {e['shape']:10} " + " ".join(cell(e, k) for k in ("bf16", "dot", "dot_best", "gemv",
                                                                              "gemv_best", "fp8_floor"))
              + f" {pct}  {short(e.get('gemv_best_config', ''))}")
    print("M = 1, bf16 weights: F.linear against the GEMV (fastest of its sweep); floor = bf16 bytes")
    print(f"{'shape':10} {'F.linear':>8} {'gemv*':>8} {'floor':>8} {'F.lin%':>7} {'gemv*%':>7}  gemv* config")
    for e in summary:
        if e["M"] == 1 and "bf16" in e:
            floor = e["bf16_floor"]  # present with "bf16"
            gemv_ms = e.get("bf16_gemv_best")
            print(f"{e['shape']:10} {e['bf16']:8.4f} {cell(e, 'bf16_gemv_best')} {floor:8.4f} "
                  f"{100 * floor / e['bf16']:6.1f}% " + (f"{100 * floor / gemv_ms:6.1f}%" if gemv_ms else f"{'-':>7}")
                  + f"  {short(e.get('bf16_gemv_best_config', ''))}")


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
            ms = graph_time([lambda k_buf=k_buf, v_buf=v_buf: decode_attention(  # bound: the loop's del ends them
                q, k_new, v_new, k_buf, v_buf, out, table, rows_idx, seq, new_slots, d ** -0.5, None, False, splits)])
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
    for method in ("bf16", "scaled_mm_tensor", "scaled_mm_row", "scaled_mm_block", "triton_fp8", "triton_fp8_sweep",
                   "triton_gemv", "triton_gemv_sweep", "bf16_gemv", "bf16_gemv_sweep"):
        per_shape = [min((r["ms"] for r in rows if r["M"] == 1 and r["shape"] == s and r["method"] == method
                          and "ms" in r), default=None) for s in SHAPES]
        if all(t is not None for t in per_shape):
            totals[method] = LAYERS * sum(per_shape)
    return totals


def print_rows(gemm: list[dict]) -> None:
    """Every default-config row; of each sweep, the fastest config per shape and M (all rows are in the JSON)."""
    sweeps = {(r["shape"], r["M"], r["method"]) for r in gemm if r["method"].endswith("_sweep")}
    fastest = [_fastest(gemm, m, shape, (method,)) for shape, m, method in sorted(sweeps)]
    shown = [r for r in gemm if not r["method"].endswith("_sweep")] + [r for r in fastest if r is not None]
    print(f"{'shape':8} {'M':>4} {'method':18} {'ms':>8} {'floor':>8} {'%floor':>7} {'TFLOP/s':>8}  config")
    for r in shown:
        if "ms" in r:
            print(f"{r['shape']:8} {r['M']:>4} {r['method']:18} {r['ms']:8.4f} {r['floor_ms']:8.4f} "
                  f"{r['pct_of_floor']:6.1f}% {r['tflops']:8.1f}  {r.get('config', '')}")
        else:
            print(f"{r['shape']:8} {r['M']:>4} {r['method']:18} {r['error'][:90]}")
    swept = [r for r in gemm if r["method"].endswith("_sweep")]
    print(f"sweeps: {sum('ms' in r for r in swept)} configs timed, "
          f"{sum(r.get('error') == 'over budget' for r in swept)} skipped over budget, "
          f"{sum('error' in r and r['error'] != 'over budget' for r in swept)} failed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=240.0,
                        help="seconds from the start after which Triton sweep entries are skipped")
    parser.add_argument("--gemv-only", action="store_true",
                        help=f"only M in {GEMV_MS} (bf16, the tl.dot path, the GEMV), no _scaled_mm, no attention")
    parser.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "fp8_gemm.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("kestrel.bench.kernels.fp8 needs a CUDA GPU")
    cap = torch.cuda.get_device_capability()
    if cap < (8, 9):
        raise SystemExit(f"FP8 needs compute capability >= 8.9; this GPU is {cap[0]}.{cap[1]}")
    import triton

    started = time.time()
    bandwidth = common.copy_bandwidth(torch.device(DEVICE))
    weights = make_weights()
    gemm = bench_gemms(weights, bandwidth, GEMV_MS if args.gemv_only else MS, scaled_mm=not args.gemv_only)
    attention = [] if args.gemv_only else bench_attention(bandwidth)
    # What is left of the budget: the sweeps.
    gemm += bench_sweep(weights, bandwidth, started + args.budget, GEMV_MS if args.gemv_only else SWEEP_MS)
    del weights
    totals = decode_step_totals(gemm)
    small_m = small_m_summary(gemm)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "copy_bandwidth_GBps": bandwidth / 1e9, "gemm": gemm, "decode_step_gemm_ms_at_M1": totals,
              "small_m": small_m, "attention": attention, "seconds": time.time() - started}

    print(f"{report['device']}  torch {torch.__version__}  triton {triton.__version__}  "
          f"copy {bandwidth / 1e9:.0f} GB/s")
    print_rows(gemm)
    print("decode step GEMMs at M=1 (32 layers):", {k: round(v, 3) for k, v in totals.items()})
    for r in attention:
        print(f"attention {r['kv_cache_dtype']:9} bs {r['batch']} ctx {r['context']} splits {r['num_splits']}: "
              f"{r['ms']:.3f} ms ({r['GBps']:.0f} GB/s, {r['pct_of_floor']:.0f}% of floor)")
    print_small_m(small_m)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.json} in {report['seconds']:.0f} s")


if __name__ == "__main__":
    main()

"""The W4A16 GEMM (kestrel/layers/int4_gemm_triton.py) over its configs at Llama-3.1-8B's projection shapes
and decode batches: what replaces `default_config` (and GEMV_MAX_M) by measurements.

    python -m kestrel.bench.kernels.int4_gemm              # CUDA, < 5 min; JSON to $OUT/int4_gemm.json
    TRITON_INTERPRET=1 python -m kestrel.bench.kernels.int4_gemm --smoke   # the same code on CPU, tiny

Shapes (K, N): qkv (4096, 6144), o (4096, 4096), gate_up (4096, 28672), down (14336, 4096), group size 128
(the AWQ checkpoint's), bf16 activations, random codes, zero points and scales. M = 1, 4, 16, 64. Configs
(`Int4GemmConfig`): the default, the GEMV (M <= GEMV_LIMIT_M) at each tile of GEMV_TILES and split of
SPLITS (and at M = 1 the nibble GEMV at each of NIBBLE_TILES), tl.dot at each of DOT_TILES and
SPLITS. Each figure is the median over replays of a CUDA graph of one call per weight copy, copies cycled so
that the weights come from HBM, not L2 (as in a decode step).
Floor: packed weights + scales + zero points, over the measured copy bandwidth
(kestrel.bench.common.copy_bandwidth); `% floor` = floor / time. `maxdiff`: the largest |y - default's y|
(a config that computes something else shows here). A config that does not compile or fit is reported as
failed; configs past --budget-s are skipped. The last table: the best config per (shape, M), its
fraction of the floor, the default's, and the 32 layers' sum per M.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from statistics import median

import torch

from kestrel.bench.common import copy_bandwidth, graph_ms, require_interpreter, timed_ms, write_result
from kestrel.layers.int4_gemm_triton import GEMV_LIMIT_M, Int4GemmConfig, default_config, int4_gemm

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}  # (K, N)
LAYERS = 32
GROUP = 128
FULL = dict(device="cuda", dtype=torch.bfloat16, shapes=SHAPES, ms=[1, 4, 16, 64], iters=15, configs=None)
SMOKE = dict(device="cpu", dtype=torch.float32, shapes={"qkv": (256, 48), "down": (384, 32)}, ms=[1, 4, 16],
             iters=1, configs=2)
GEMV_TILES = [(16, 256, 4), (32, 128, 4), (32, 256, 4), (64, 128, 4), (64, 256, 8), (128, 128, 8)]  # (bn, bk, warps)
NIBBLE_TILES = [(64, 128, 4), (128, 128, 4), (128, 64, 4), (256, 128, 4), (256, 128, 8), (512, 64, 8)]
DOT_TILES = [(32, 128, 4, 3), (64, 128, 4, 3), (128, 128, 4, 3), (64, 64, 4, 4), (128, 64, 8, 3), (64, 256, 4, 3)]
SPLITS = [1, 2, 4, 8]


def sweep_configs(m: int) -> list[Int4GemmConfig]:
    configs = []
    if m <= GEMV_LIMIT_M:
        configs += [Int4GemmConfig(triton_pow2(m), bn, bk, s, dot=False, num_warps=w)
                    for bn, bk, w in GEMV_TILES for s in SPLITS]
        if m == 1:
            configs += [Int4GemmConfig(1, bn, bk, s, dot=False, num_warps=w, nibbles=True)
                        for bn, bk, w in NIBBLE_TILES for s in SPLITS]
            if torch.cuda.is_available():  # inline PTX: not on the CPU smoke run
                configs += [Int4GemmConfig(1, bn, bk, s, dot=False, num_warps=w, half2=True)
                            for bn, bk, w in NIBBLE_TILES for s in SPLITS]
    bm = min(64, max(16, triton_pow2(m)))
    configs += [Int4GemmConfig(bm, bn, bk, s, dot=True, num_warps=w, num_stages=st)
                for bn, bk, w, st in DOT_TILES for s in SPLITS]
    return configs


def triton_pow2(m: int) -> int:
    return 1 << (m - 1).bit_length()


def make_weights(p: dict, k: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(qweight int32 [K/8, N], zeros uint8 [K/g, N], scales [K/g, N]) copies: enough to put 3 x L2 of
    bytes between two reads of one."""
    dev = torch.device(p["device"])
    gen = torch.Generator(dev).manual_seed(k * n)
    groups = k // GROUP
    one = k * n // 2 + groups * n * 3
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size if dev.type == "cuda" else 0
    copies = max(1, math.ceil(3 * l2 / one))
    return [(torch.randint(-2**31, 2**31 - 1, (k // 8, n), generator=gen, device=dev, dtype=torch.int32),
             torch.randint(0, 16, (groups, n), generator=gen, device=dev, dtype=torch.uint8),
             (torch.rand(groups, n, generator=gen, device=dev) * 0.01).to(p["dtype"])) for _ in range(copies)]


def time_calls(p: dict, calls: list) -> float:
    """Median ms per call of `calls` run back to back (a CUDA graph of them on the GPU)."""
    def all_calls() -> None:
        for call in calls:
            call()
    dev = torch.device(p["device"])
    times = graph_ms(all_calls, dev, p["iters"]) if dev.type == "cuda" else timed_ms(all_calls, dev, p["iters"])
    return median(times) / len(calls)


def bench_shape(p: dict, shape: str, m: int, weights: list, bandwidth: float | None, deadline: float) -> list[dict]:
    k, n = p["shapes"][shape]
    dev = torch.device(p["device"])
    x = torch.randn(m, k, device=dev, dtype=p["dtype"])
    floor = (k * n // 2 + k // GROUP * n * 3) / bandwidth * 1e3 if bandwidth else None
    default = default_config(m, n, k, dev, GROUP)
    want = int4_gemm(x, *weights[0], None, GROUP, config=default).float()
    configs = [c for c in sweep_configs(m) if not p["ways"] or way(dataclasses.asdict(c)) in p["ways"]]
    configs = configs[: p["configs"]]
    rows = []
    for name, cfg in [("default", default)] + [("sweep", c) for c in configs if c != default]:
        row = {"shape": shape, "M": m, "K": k, "N": n, "kind": name, "config": dataclasses.asdict(cfg)}
        if time.monotonic() > deadline:
            rows.append({**row, "error": "skipped: over budget"})
            continue
        try:
            got = int4_gemm(x, *weights[0], None, GROUP, config=cfg).float()
            row["maxdiff"] = (got - want).abs().max().item()
            row["ms"] = time_calls(p, [lambda w=w, cfg=cfg: int4_gemm(x, *w, None, GROUP, config=cfg) for w in weights])
        except Exception as e:  # noqa: BLE001 - a config that does not compile or fit: report it, go on
            row["error"] = f"{type(e).__name__}: {e}"[:200]
        if floor is not None and "ms" in row:
            row["floor_ms"], row["pct_floor"] = floor, 100 * floor / row["ms"]
        rows.append(row)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def way(cfg: dict) -> str:
    if cfg["dot"]:
        return "dot"
    return "gemv-half2" if cfg.get("half2") else "gemv-nibbles" if cfg.get("nibbles") else "gemv"


def short(cfg: dict) -> str:
    return (f"{way(cfg)} m{cfg['block_m']} n{cfg['block_n']} k{cfg['block_k']} s{cfg['split_k']} "
            f"w{cfg['num_warps']} st{cfg['num_stages']}")


def summary(rows: list[dict], shapes: dict, ms: list[int]) -> list[dict]:
    """The best config per (shape, M), with the default beside it."""
    best = []
    for m in ms:
        for shape in shapes:
            timed = [r for r in rows if r["M"] == m and r["shape"] == shape and "ms" in r]
            if not timed:
                continue
            top = min(timed, key=lambda r: r["ms"])
            dflt = next((r for r in timed if r["kind"] == "default"), None)
            best.append({"shape": shape, "M": m, "best_ms": top["ms"], "best_config": top["config"],
                         "best_pct_floor": top.get("pct_floor"), "default_ms": dflt["ms"] if dflt else None,
                         "default_pct_floor": dflt.get("pct_floor") if dflt else None,
                         "floor_ms": top.get("floor_ms")})
    return best


def print_summary(best: list[dict], ms: list[int]) -> None:
    def pct(v) -> str:
        return f"{v:.0f}" if isinstance(v, float) else "-"
    print("\n== int4 GEMM: best config per (shape, M), % of the packed-bytes floor ==")
    print(f"  {'shape':<8} {'M':>3} {'floor ms':>9} {'default ms':>10} {'%':>4} {'best ms':>8} {'%':>4}  best config")
    for b in best:
        floor = f"{b['floor_ms']:.4f}" if b["floor_ms"] else "-"
        dflt = f"{b['default_ms']:.4f}" if b["default_ms"] else "-"
        print(f"  {b['shape']:<8} {b['M']:>3} {floor:>9} {dflt:>10} {pct(b['default_pct_floor']):>4} "
              f"{b['best_ms']:>8.4f} {pct(b['best_pct_floor']):>4}  {short(b['best_config'])}")
    for m in ms:
        rows = [b for b in best if b["M"] == m]
        if rows and all(b["floor_ms"] for b in rows):
            total, floor = sum(b["best_ms"] for b in rows), sum(b["floor_ms"] for b in rows)
            print(f"  M={m}: {LAYERS} layers' projections {LAYERS * total:.3f} ms at best, floor {LAYERS * floor:.3f} ms "
                  f"({100 * floor / total:.0f} %)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="CPU (TRITON_INTERPRET=1), tiny shapes, fp32")
    parser.add_argument("--budget-s", type=float, default=270, help="configs that would start past it are skipped")
    parser.add_argument("--ms", type=str, default=None, help="batch rows, e.g. 1,4,16,64")
    parser.add_argument("--ways", type=str, default="",
                        help="only these kinds of config beside the default, e.g. gemv-nibbles,gemv "
                             "(dot, gemv, gemv-nibbles, gemv-half2)")
    args = parser.parse_args(argv)
    if args.smoke:
        require_interpreter()
    p = dict(SMOKE if args.smoke else FULL)
    if args.ms:
        p["ms"] = [int(v) for v in args.ms.split(",")]
    p["ways"] = set(filter(None, args.ways.split(",")))
    started = time.monotonic()
    dev = torch.device(p["device"])
    bandwidth = copy_bandwidth(dev)
    res = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__,
           "group_size": GROUP, "copy_GBps": bandwidth / 1e9 if bandwidth else None, "rows": []}
    for shape, (k, n) in p["shapes"].items():
        weights = make_weights(p, k, n)
        for m in p["ms"]:
            rows = bench_shape(p, shape, m, weights, bandwidth, started + args.budget_s)
            res["rows"] += rows
            timed = [r for r in rows if "ms" in r]
            print(f"[{shape} M{m}: {len(timed)} of {len(rows)} configs timed"
                  + (f", best {min(r['ms'] for r in timed):.4f} ms]" if timed else "]"), flush=True)
        del weights
    res["best"] = summary(res["rows"], p["shapes"], p["ms"])
    res["wall_s"] = time.monotonic() - started
    path = write_result(res, "int4_gemm_smoke.json" if args.smoke else "int4_gemm.json")
    print_summary(res["best"], p["ms"])
    print(f"  (total {res['wall_s']:.0f} s; JSON in {path})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

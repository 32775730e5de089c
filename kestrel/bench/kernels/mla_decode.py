"""MLA decode attention alone (the Triton kernel, kestrel/attention/triton/mla_decode.py) against the
latent-bytes floor, at DeepSeek-V3's widths: 128 heads, latent 512 + rope 64, one layer.

    python -m kestrel.bench.kernels.mla_decode            # CUDA, < 1 min; JSON to $OUT/mla_decode.json
    TRITON_INTERPRET=1 python -m kestrel.bench.kernels.mla_decode --smoke   # the same code on CPU, tiny

Cases: batch 1 and 32 at 32k context (every request as long), the pool in bf16 and in fp8_e4m3 (scale 1),
the queries and output in bf16, page size 1 with each request's slots scattered over the pool. The kernel
runs as the Triton MLA backend calls it (its split rule, `mla_decode_splits`; `--splits` adds other
counts), storing the new token's entry as it does in a step. Time: the median over replays of a CUDA
graph of one call per pool copy (copies cycled so that at least 256 MiB are read per replay: the
reads come from HBM, not L2, as in a step over 61 layers). Floor: batch x context x (512 + 64) x the
pool's bytes per element, over the measured copy bandwidth (kestrel.bench.common.copy_bandwidth);
`% floor` = floor / time. `maxdiff`: the largest |kernel - torch| over the output, against softmax
attention in float32 over the same (dequantised) entries.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from statistics import median

import torch

from kestrel.bench.common import copy_bandwidth, graph_ms, require_interpreter, run_budgeted, timed_ms, write_result
from kestrel.layers.fp8_gemm_triton import sm_count

FULL = dict(device="cuda", dtype=torch.bfloat16, heads=128, rank=512, rope=64, context=32768, batches=[1, 32],
            kv_dtypes=["bfloat16", "fp8_e4m3"], iters=20, min_bytes=256 * 2**20)
SMOKE = dict(device="cpu", dtype=torch.float32, heads=4, rank=32, rope=16, context=40, batches=[1, 2],
             kv_dtypes=["float32", "fp8_e4m3"], iters=1, min_bytes=0)
# --sweep: launch configs (block_h, block_n, num_warps, num_stages), each at the split counts that give about
# one and two programs per SM (mla_decode_splits); what sets mla_decode_attention's defaults.
SWEEP = [(16, 32, 4, 2), (32, 32, 4, 2), (32, 32, 8, 2), (32, 64, 8, 2), (64, 16, 8, 2), (64, 32, 8, 2),
         (64, 16, 16, 2), (64, 32, 16, 2), (64, 64, 16, 2), (128, 16, 16, 2), (64, 32, 8, 3), (64, 32, 16, 3)]
KV_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "fp8_e4m3": torch.float8_e4m3fn}


def reference(q_lat, q_rope, cache, table, seq_lens, rank: int, scale: float) -> torch.Tensor:
    """Softmax attention over each request's entries in float32: [B, heads, rank]."""
    outs = []
    for b in range(q_lat.shape[0]):
        entries = cache[table[b, : int(seq_lens[b])]].float()  # [S, rank + rope]
        scores = (q_lat[b].float() @ entries[:, :rank].T + q_rope[b].float() @ entries[:, rank:].T) * scale
        outs.append(torch.softmax(scores, -1) @ entries[:, :rank])
    return torch.stack(outs)


def run_case(p: dict, batch: int, kv_name: str, splits_extra: list[int], bandwidth: float | None,
             sweep: bool = False) -> dict:
    from kestrel.attention.triton.mla_decode import mla_decode_attention, mla_decode_splits

    dev, ctx, heads, rank, rope = torch.device(p["device"]), p["context"], p["heads"], p["rank"], p["rope"]
    kv_dtype = KV_DTYPES[kv_name]
    gen = torch.Generator(dev).manual_seed(batch)
    entry_bytes = (rank + rope) * torch.tensor([], dtype=kv_dtype).element_size()
    read_bytes = batch * ctx * entry_bytes
    copies = max(1, math.ceil(p["min_bytes"] / read_bytes))
    slots = batch * ctx + 1  # slot 0 unused, as in the engine's pool
    caches = [(torch.randn(slots, rank + rope, generator=gen, device=dev) * 0.5).to(kv_dtype) for _ in range(copies)]
    table = (torch.randperm(slots - 1, generator=gen, device=dev) + 1).view(batch, ctx).to(torch.int32)
    rows = torch.arange(batch, device=dev)
    seq_lens = torch.full((batch,), ctx, device=dev, dtype=torch.int32)
    new_slots = table[:, ctx - 1].long()
    q_lat = torch.randn(batch, heads, rank, generator=gen, device=dev, dtype=p["dtype"])
    q_rope = torch.randn(batch, heads, rope, generator=gen, device=dev, dtype=p["dtype"])
    new = (torch.randn(batch, rank + rope, generator=gen, device=dev) * 0.5).to(p["dtype"])
    out = torch.empty_like(q_lat)
    scale = (128 + rope) ** -0.5  # V3's q/k head width (nope 128 + rope 64)
    upcast = dev.type == "cpu"
    default = mla_decode_splits(batch, heads, sm_count(dev))
    res = {"context": ctx, "copies": copies, "read_MB": read_bytes / 1e6, "default_splits": default}
    if bandwidth:
        res["floor_ms"] = read_bytes / bandwidth * 1e3
    for splits in dict.fromkeys([default, *splits_extra]):
        def calls(splits=splits) -> None:
            for cache in caches:
                mla_decode_attention(q_lat, q_rope, new, cache, out, table, rows, seq_lens, new_slots, scale,
                                     upcast, splits)
        calls()
        if splits == default:
            want = reference(q_lat, q_rope, caches[-1], table, seq_lens, rank, scale)
            res["maxdiff"] = (out.float() - want).abs().max().item()
            del want
        times = graph_ms(calls, dev, p["iters"]) if dev.type == "cuda" else timed_ms(calls, dev, p["iters"])
        ms = median(times) / copies
        key = "" if splits == default else f"_s{splits}"
        res[f"ms{key}"] = ms
        if bandwidth:
            res[f"pct_floor{key}"] = 100 * res["floor_ms"] / ms
            res[f"GBps{key}"] = read_bytes / ms / 1e6
    if sweep and dev.type == "cuda":
        res["sweep"] = sweep_configs(p, batch, heads, (q_lat, q_rope, new, caches, out, table, rows, seq_lens,
                                                       new_slots, scale), copies, res.get("floor_ms"))
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return res


def sweep_configs(p: dict, batch: int, heads: int, args: tuple, copies: int, floor: float | None) -> dict:
    """ms (and % of the floor, and |out - the default's out|) per SWEEP config and split count."""
    from kestrel.attention.triton.mla_decode import mla_decode_attention, mla_decode_splits

    q_lat, q_rope, new, caches, out, table, rows, seq_lens, new_slots, scale = args
    want = out.float().clone()  # the default config's output, left in `out` by the last timed call
    sms = sm_count(q_lat.device)
    results = {}
    for bh, bn, warps, stages in SWEEP:
        for per_sm in (1, 2):
            splits = mla_decode_splits(batch, heads, sms, bh, per_sm)
            label = f"h{bh} n{bn} w{warps} st{stages} s{splits}"
            if label in results:
                continue

            def calls(bh=bh, bn=bn, warps=warps, stages=stages, splits=splits) -> None:
                for cache in caches:
                    mla_decode_attention(q_lat, q_rope, new, cache, out, table, rows, seq_lens, new_slots, scale,
                                         False, splits, block_h=bh, block_n=bn, num_warps=warps, num_stages=stages)
            try:
                calls()
                diff = (out.float() - want).abs().max().item()
                ms = median(graph_ms(calls, q_lat.device, 5)) / copies
                results[label] = {"ms": ms, "diff": diff, **({"pct_floor": 100 * floor / ms} if floor else {})}
            except Exception as e:  # noqa: BLE001 - a config that does not compile or fit: report it, go on
                results[label] = {"error": f"{type(e).__name__}: {e}"[:160]}
            torch.cuda.empty_cache()
    return results


def print_table(res: dict) -> None:
    print(f"\n== MLA decode attention, one layer ({res['device']}, copy {res['copy_GBps'] or 0:.0f} GB/s; "
          f"{res['widths']}) ==")
    columns = ["read_MB", "default_splits", "floor_ms", "ms", "GBps", "pct_floor", "maxdiff"]
    print(f"  {'case':<22}" + "".join(f"{c:>15}" for c in columns))
    for label, row in res["cases"].items():
        if not isinstance(row, dict):
            print(f"  {label:<22}  {row}")
            continue
        cells = [f"{row[c]:.3g}" if isinstance(row.get(c), float) else str(row.get(c, "-")) for c in columns]
        print(f"  {label:<22}" + "".join(f"{c:>15}" for c in cells))
        timed = {k: v for k, v in row.get("sweep", {}).items() if "ms" in v}
        for label, v in sorted(timed.items(), key=lambda kv: kv[1]["ms"])[:5]:
            print("  " + " " * 22 + f"sweep {label}: {v['ms']:.3f} ms, {v.get('pct_floor', 0):.0f} % "
                  f"(diff {v['diff']:.1e})")
        others = {k: v for k, v in row.items() if k.startswith("ms_s")}
        if others:
            print("  " + " " * 22 + "other splits: " + ", ".join(f"{k[3:]} {v:.3f} ms" for k, v in others.items()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="CPU (TRITON_INTERPRET=1), tiny widths, fp32")
    parser.add_argument("--budget-s", type=float, default=120, help="cases that would start past it are skipped")
    parser.add_argument("--context", type=int, default=None, help="tokens per request (default 32768)")
    parser.add_argument("--sweep", action="store_true", help="also time the SWEEP launch configs (CUDA)")
    parser.add_argument("--splits", type=str, default="", help="split counts to time besides the rule's, e.g. 4,8,16")
    args = parser.parse_args(argv)
    if args.smoke:
        require_interpreter()
    p = dict(SMOKE if args.smoke else FULL)
    if args.context:
        p["context"] = args.context
    extra = [int(v) for v in args.splits.split(",") if v]
    started = time.monotonic()
    dev = torch.device(p["device"])
    bandwidth = copy_bandwidth(dev)
    res = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__,
           "widths": {k: p[k] for k in ("heads", "rank", "rope")}, "copy_GBps": bandwidth / 1e9 if bandwidth else None,
           "cases": {}}
    for kv_name in p["kv_dtypes"]:
        for batch in p["batches"]:
            run_budgeted(res["cases"], f"{kv_name} B{batch} x {p['context']}",
                         lambda: run_case(p, batch, kv_name, extra, bandwidth, args.sweep), started, args.budget_s)
    res["wall_s"] = time.monotonic() - started
    path = write_result(res, "mla_decode_smoke.json" if args.smoke else "mla_decode.json")
    print_table(res)
    print(f"  (total {res['wall_s']:.0f} s; JSON in {path})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""DeepSeek-V4's sparse attention alone: the dsv4 backend's torch path against its Triton kernel
(kestrel/attention/triton/dsv4_sparse.py) at Flash widths (64 heads, D 512, window 128, bf16).

    python -m kestrel.bench.kernels.dsv4_attention           # CUDA, < 60 s; JSON to $OUT/dsv4_kernel.json
    TRITON_INTERPRET=1 python -m kestrel.bench.kernels.dsv4_attention --smoke   # the same code on CPU, tiny

Cases (`DSV4Backend.attend` on random inputs, its step plan built before timing, as every layer after
the first of its kind finds it): decode at batch 1 and 32 with 32k context (window only; ratio 4: window
+ 512 indexer picks; ratio 128: window + the 256 visible blocks), through the static-sizes plan the
engine's decode graphs use; and the last 8k chunk of a 32k prefill (one request, host-length plan).
Each is timed eagerly (CUDA events around the call from an idle device, median) and, for decode, also
captured in a CUDA graph and replayed (what the engine runs). `maxdiff` is the largest |kernel - torch|
of the outputs. Then the same over packed FP8 entries (ratios 4 and 128, decoded in the kernel), and a
small sweep of the kernel's tile sizes on the ratio-4 cases. Sections past `--budget-s` are skipped.
"""
from __future__ import annotations

import argparse
import sys
import time
from statistics import median
from types import SimpleNamespace

import torch

from kestrel.attention.dsv4 import DSV4Backend, WindowKeys
from kestrel.attention.dsv4_plan import StepPlan, V4Span
from kestrel.bench.common import graph_ms, require_interpreter, run_budgeted, timed_ms, write_result
from kestrel.quant.kv_entries import RopeEntryFP8

FULL = dict(device="cuda", dtype=torch.bfloat16, heads=64, dim=512, rope=64, window=128, topk=512, context=32768,
            batches=[1, 32], chunk=8192, iters=20)
SMOKE = dict(device="cpu", dtype=torch.float32, heads=16, dim=64, rope=16, window=8, topk=8, context=512,
             batches=[1, 2], chunk=16, iters=1)
# (kernel options, packed FP8 entries): the ratio-4 cases rerun with each (the default: block_h 16,
# block_n 32, 4 warps); an FP8 key tile is dequantised in registers, so smaller tiles may suit it.
SWEEP = [(dict(block_h=32, num_warps=8), False), (dict(block_h=64, num_warps=8), False),
         (dict(block_n=64, num_warps=8), False), (dict(block_n=16), True)]


def build(p: dict, ratio: int, batch: int, extend: int, fp8: bool):
    """(torch backend, kernel backend, attend arguments) for `batch` requests whose step covers the last
    `extend` positions of `context`."""
    dev, dtype, D, W, ctx = torch.device(p["device"]), p["dtype"], p["dim"], p["window"], p["context"]
    gen = torch.Generator(dev).manual_seed(ratio + batch)
    table = torch.arange(batch + 1, device=dev)[:, None] * ctx + torch.arange(ctx, device=dev)[None, :]
    rows, prefix = torch.arange(batch, device=dev), ctx - extend
    ratios = (ratio,) if ratio else ()
    if extend == 1:
        plan = StepPlan.decode(rows, torch.full((batch,), prefix, device=dev), table, ratios, batch, ctx)
    else:
        plan = StepPlan([V4Span(r, prefix, extend, r * extend) for r in range(batch)], table, ratios, batch)
    codec = RopeEntryFP8(D, p["rope"]) if fp8 else None
    entries = None
    if ratio:
        values = torch.randn(batch * ctx // ratio, D, generator=gen, device=dev, dtype=dtype)
        entries = codec.encode(values) if fp8 else values
        del values
    layer = SimpleNamespace(ckv=entries, ckv_codec=codec)
    pools = SimpleNamespace(layer=lambda layer_id: layer)
    backends = []
    for kernel in (False, True):
        backend = DSV4Backend(pools, None, sparse_kernel=kernel)
        backend.plan = plan
        backends.append(backend)
    T = plan.num_tokens
    index, valid = plan.window(W)
    window = WindowKeys(torch.randn(batch * (W - 1) + T, D, generator=gen, device=dev, dtype=dtype), index, valid)
    q = torch.randn(T, p["heads"], D, generator=gen, device=dev, dtype=dtype)
    sink = torch.randn(p["heads"], generator=gen, device=dev)
    selected = None
    if ratio == 4:
        visible = plan.blocks(4)[1]
        selected = (torch.rand(T, p["topk"], generator=gen, device=dev) * visible[:, None]).long()
    return (*backends, (q, window, sink, D ** -0.5, ratio, selected))


def run_case(p: dict, ratio: int, batch: int, extend: int, fp8: bool, options: dict | None = None) -> dict:
    torch_path, kernel, args = build(p, ratio, batch, extend, fp8)
    dev, iters = torch.device(p["device"]), p["iters"]
    if options:
        kernel.kernel_options = options
    want = torch_path.attend(0, *args)  # also builds the plan's parts, outside the timings
    got = kernel.attend(0, *args)
    res = {"maxdiff": (got.float() - want.float()).abs().max().item()}
    del got, want
    sides = {"kernel": kernel} if options else {"torch": torch_path, "kernel": kernel}
    for name, backend in sides.items():
        res[f"{name}_ms"] = median(timed_ms(lambda: backend.attend(0, *args), dev, iters, warmup=2))
        if extend == 1 and dev.type == "cuda":
            res[f"{name}_graph_ms"] = median(graph_ms(lambda: backend.attend(0, *args), dev, iters))
    return res


def cases(p: dict, fp8: bool) -> list[tuple[str, int, int, int]]:
    """(label, ratio, batch, extend)."""
    out = []
    for ratio in ((4, 128) if fp8 else (0, 4, 128)):
        for b in p["batches"]:
            out.append((f"decode bs{b} r{ratio}", ratio, b, 1))
        out.append((f"prefill {p['chunk']} r{ratio}", ratio, 1, p["chunk"]))
    return out


def fmt(column: str, v) -> str:
    if not isinstance(v, float):
        return str(v)
    return f"{v:.1e}" if column == "maxdiff" else f"{v:.3f}"


def print_table(res: dict) -> None:
    cols = ["torch_ms", "kernel_ms", "speedup", "torch_graph_ms", "kernel_graph_ms", "graph_speedup", "maxdiff"]
    print(f"\n== dsv4 sparse attention: torch path vs Triton kernel ({res['device']}) ==")
    print(f"  {'case':<44}" + "".join(f"{c:>16}" for c in cols))
    for label, row in res["cases"].items():
        if not isinstance(row, dict):
            print(f"  {label:<44}  {row}")
            continue
        row = dict(row)
        if "torch_ms" in row:
            row["speedup"] = row["torch_ms"] / row["kernel_ms"]
        if "torch_graph_ms" in row:
            row["graph_speedup"] = row["torch_graph_ms"] / row["kernel_graph_ms"]
        print(f"  {label:<44}" + "".join(f"{fmt(c, row.get(c, '-')):>16}" for c in cols))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="CPU (TRITON_INTERPRET=1), tiny widths, fp32")
    parser.add_argument("--budget-s", type=float, default=55, help="cases that would start past it are skipped")
    parser.add_argument("--no-fp8", action="store_true", help="skip the packed FP8 cases")
    parser.add_argument("--no-sweep", action="store_true", help="skip the tile-size sweep")
    args = parser.parse_args(argv)
    if args.smoke:
        require_interpreter()
    p = SMOKE if args.smoke else FULL
    started = time.monotonic()
    todo = [(label, r, b, e, False, None) for label, r, b, e in cases(p, False)]
    if not args.no_fp8:
        todo += [(label + " fp8", r, b, e, True, None) for label, r, b, e in cases(p, True)]
    if not args.no_sweep:
        todo += [(f"{label}{' fp8' if fp8 else ''} " + ",".join(f"{k}={v}" for k, v in o.items()), r, b, e, fp8, o)
                 for o, fp8 in SWEEP for label, r, b, e in cases(p, fp8) if r == 4 and not (fp8 and args.no_fp8)]
    res = {"device": torch.cuda.get_device_name() if p["device"] == "cuda" else "cpu", "torch": torch.__version__,
           "widths": {k: p[k] for k in ("heads", "dim", "window", "topk", "context", "chunk")},
           "dtype": str(p["dtype"]), "cases": {}}
    for label, ratio, batch, extend, fp8, options in todo:
        run_budgeted(res["cases"], label, lambda: run_case(p, ratio, batch, extend, fp8, options), started,
                     args.budget_s)
        if p["device"] == "cuda":
            torch.cuda.empty_cache()
    res["wall_s"] = time.monotonic() - started
    path = write_result(res, "dsv4_kernel_smoke.json" if args.smoke else "dsv4_kernel.json")
    print_table(res)
    print(f"  (total {res['wall_s']:.0f} s; JSON in {path})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

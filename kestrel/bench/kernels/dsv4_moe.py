"""DeepSeek-V4's routed experts alone, three of the MoE layer's paths (kestrel/layers/moe/paths.py): every local
expert on every token ("every", the decode graphs' path up to EVERY_EXPERT_MAX local experts), the Triton
grouped GEMM ("fused", fused_moe.py: the graphs' path above it, and eager on CUDA) and the hit-expert loop
("loop", eager only: it reads the ids on the host).

    python -m kestrel.bench.kernels.dsv4_moe            # CUDA, < 3 min; JSON to $OUT/dsv4_moe.json
    TRITON_INTERPRET=1 python -m kestrel.bench.kernels.dsv4_moe --smoke   # the same code on CPU, tiny

V4-Flash widths (hidden 4096, moe_intermediate 2048, 6 experts per token, bf16) at 16 local experts (the
bench slice) and 256 (full Flash on one rank: 12.9 GB of expert weights), batches of 1, 8, 32 and 128 tokens
(decode-like) and 2048 (prefill-like), uniformly random routing. Each way is timed eagerly (CUDA events
around the call from an idle device, median) and, for every-expert and fused, also captured in a CUDA graph
and replayed (what a decode step runs); every-expert at 2048 tokens runs at 16 experts only (at 256 it
would need ~30 GB of intermediates, and prefill is eager: it never takes that path). The floor is the
weight bytes the step needs (distinct local experts hit x one expert's bytes) over the measured copy
bandwidth; `% floor` = floor / fused graph (or eager) time. `maxdiff`: the largest |fused - loop|.

`--sweep` (about a minute more) then times the fused path in a graph with other tile sizes
(`SWEEP`) at the largest expert count, against the default rule's (`fused_moe.default_config`).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from statistics import median

import torch

from kestrel.bench.common import copy_bandwidth, graph_ms, require_interpreter, run_budgeted, timed_ms, write_result
from kestrel.layers.moe import MoE, fused_moe
from kestrel.layers.moe.paths import EVERY_EXPERT_MAX
from kestrel.models.deepseek_v4.config import parse_v4_config
from kestrel.models.deepseek_v4.moe import v4_moe

SLICE_CONFIG = Path(__file__).resolve().parents[2] / "assets/configs/deepseek-v4-flash-slice/config.json"
FULL = dict(device="cuda", dtype=torch.bfloat16, hidden=4096, inter=2048, k=6, experts=[16, 256],
            tokens=[1, 8, 32, 128, 2048], iters=20, prefill_iters=5, prefill_from=2048)
SMOKE = dict(device="cpu", dtype=torch.float32, hidden=64, inter=48, k=3, experts=[4, 20], tokens=[1, 8, 40],
             iters=1, prefill_iters=1, prefill_from=40)
# (block_m, block_n, block_k, num_warps): decode-height tiles with narrower / wider columns and steps, and
# taller ones for the prefill batch.
SWEEP = [(16, 32, 128, 4), (16, 128, 64, 4), (16, 64, 256, 4), (32, 64, 128, 4), (64, 64, 64, 4),
         (64, 128, 64, 8), (128, 128, 64, 8)]


def build_layer(p: dict, experts: int) -> MoE:
    """A V4 MoE layer at the widths of `p` with `experts` routed experts, random weights, on the device."""
    cfg = dataclasses.replace(parse_v4_config(json.loads(SLICE_CONFIG.read_text())), hidden_size=p["hidden"],
                              moe_intermediate_size=p["inter"], n_routed_experts=experts, num_experts_per_tok=p["k"])
    previous = torch.get_default_dtype()
    torch.set_default_dtype(p["dtype"])  # the expert stacks are made in bf16 on the device, not fp32 first
    try:
        with torch.device(p["device"]):
            layer = v4_moe(cfg, hash_routing=False)
    finally:
        torch.set_default_dtype(previous)
    gen = torch.Generator(p["device"]).manual_seed(experts)
    with torch.no_grad():
        for param in layer.experts.parameters():
            param.normal_(0.0, param.shape[-1] ** -0.5, generator=gen)
    return layer


def run_case(p: dict, layer: MoE, tokens: int, bandwidth: float | None) -> dict:
    dev, experts, k = torch.device(p["device"]), layer.experts.count, p["k"]
    gen = torch.Generator(dev).manual_seed(tokens)
    x = torch.randn(tokens, p["hidden"], generator=gen, device=dev, dtype=p["dtype"])
    ids = torch.rand(tokens, experts, generator=gen, device=dev).argsort(-1)[:, :k]
    weights = torch.rand(tokens, k, generator=gen, device=dev)
    routed = torch.zeros(tokens, p["hidden"], device=dev)
    hit = ids.unique().numel()
    expert_bytes = 3 * p["hidden"] * p["inter"] * torch.finfo(p["dtype"]).bits // 8
    res = {"experts_hit": hit, "needed_MB": hit * expert_bytes / 1e6, "all_MB": experts * expert_bytes / 1e6}
    if bandwidth:
        res["floor_ms"] = hit * expert_bytes / bandwidth * 1e3
    with torch.no_grad():
        want, got = torch.zeros_like(routed), torch.zeros_like(routed)
        layer.add_routed(x, ids, weights, want, "loop")
        layer.add_routed(x, ids, weights, got, "fused")
        res["maxdiff"] = (got - want).abs().max().item()
        del want, got
        ways = ["fused", "loop"]
        if tokens < p["prefill_from"] or experts <= EVERY_EXPERT_MAX:
            ways.append("every")
        iters = p["iters"] if tokens < p["prefill_from"] else p["prefill_iters"]
        for name in ways:
            call = lambda name=name: layer.add_routed(x, ids, weights, routed, name)  # noqa: E731
            res[f"{name}_ms"] = median(timed_ms(call, dev, iters, warmup=2))
            if name != "loop" and dev.type == "cuda":
                res[f"{name}_graph_ms"] = median(graph_ms(call, dev, iters))
                torch.cuda.empty_cache()  # the graph's pool
    best = res.get("fused_graph_ms", res["fused_ms"])
    if "floor_ms" in res:
        res["pct_floor"] = 100 * res["floor_ms"] / best
    return res


def sweep_case(p: dict, layer: MoE, tokens: int) -> dict:
    """The fused path's graphed (eager on CPU) time per tile config: {"bm,bn,bk,warps": ms}."""
    dev, experts, k = torch.device(p["device"]), layer.experts.count, p["k"]
    gen = torch.Generator(dev).manual_seed(tokens)
    x = torch.randn(tokens, p["hidden"], generator=gen, device=dev, dtype=p["dtype"])
    ids = torch.rand(tokens, experts, generator=gen, device=dev).argsort(-1)[:, :k]
    weights = torch.rand(tokens, k, generator=gen, device=dev)
    ex, default = layer.experts, fused_moe.default_config(ids.numel(), experts)
    configs = {"default " + ",".join(str(v) for v in dataclasses.astuple(default)[:4]): default}
    configs.update({",".join(map(str, c)): fused_moe.MoeTileConfig(*c) for c in SWEEP})
    iters = p["iters"] if tokens < p["prefill_from"] else p["prefill_iters"]
    res = {}
    with torch.no_grad():
        for name, cfg in configs.items():
            call = lambda cfg=cfg: fused_moe.fused_moe(x, ids, weights, ex.w13, ex.w2, ex.first, layer.cfg.activation, cfg=cfg)  # noqa: E731
            try:
                times = graph_ms(call, dev, iters) if dev.type == "cuda" else timed_ms(call, dev, iters)
                res[name] = median(times)
            except Exception as e:  # noqa: BLE001 - e.g. out of shared memory: report it, keep the others
                res[name] = f"failed: {type(e).__name__}: {e}"[:200]
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    return res


COLUMNS = ["experts_hit", "floor_ms", "every_ms", "every_graph_ms", "fused_ms", "fused_graph_ms", "loop_ms",
           "pct_floor", "maxdiff"]


def fmt(column: str, v) -> str:
    if not isinstance(v, float):
        return str(v)
    if column == "maxdiff":
        return f"{v:.1e}"
    return f"{v:.0f}" if column == "pct_floor" else f"{v:.3f}"


def print_table(res: dict) -> None:
    print(f"\n== dsv4 routed experts: every-expert vs fused grouped GEMM vs loop ({res['device']}, "
          f"copy {res['copy_GBps'] or 0:.0f} GB/s) ==")
    print(f"  {'case':<22}" + "".join(f"{c:>15}" for c in COLUMNS))
    sweeps = {}
    for label, row in res["cases"].items():
        if label.startswith("sweep"):
            sweeps[label] = row
        elif isinstance(row, dict):
            print(f"  {label:<22}" + "".join(f"{fmt(c, row.get(c, '-')):>15}" for c in COLUMNS))
        else:
            print(f"  {label:<22}  {row}")
    if sweeps:
        print("\n== fused tile sweep: ms per (block_m, block_n, block_k, warps), graphed ==")
        for label, row in sweeps.items():
            cells = ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()) \
                if isinstance(row, dict) else row
            print(f"  {label:<22}  {cells}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="CPU (TRITON_INTERPRET=1), tiny widths, fp32")
    parser.add_argument("--budget-s", type=float, default=150, help="cases that would start past it are skipped")
    parser.add_argument("--experts", type=str, default=None, help="local expert counts, e.g. 16,256")
    parser.add_argument("--tokens", type=str, default=None, help="token counts, e.g. 1,8,32,128,2048")
    parser.add_argument("--sweep", action="store_true", help="also time the fused path's tile sizes (SWEEP)")
    args = parser.parse_args(argv)
    if args.smoke:
        require_interpreter()
    p = dict(SMOKE if args.smoke else FULL)
    for key in ("experts", "tokens"):
        if getattr(args, key):
            p[key] = [int(v) for v in getattr(args, key).split(",")]
    started = time.monotonic()
    dev = torch.device(p["device"])
    bandwidth = copy_bandwidth(dev)
    res = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__,
           "widths": {k: p[k] for k in ("hidden", "inter", "k")}, "dtype": str(p["dtype"]),
           "every_expert_max": EVERY_EXPERT_MAX, "copy_GBps": bandwidth / 1e9 if bandwidth else None, "cases": {}}
    for experts in p["experts"]:
        built: list[MoE] = []

        def layer() -> MoE:  # built by the first case that runs: a failure to build (an OOM) is that case's
            if not built:
                built.append(build_layer(p, experts))
            return built[0]

        for tokens in p["tokens"]:
            run_budgeted(res["cases"], f"E{experts} T{tokens}", lambda: run_case(p, layer(), tokens, bandwidth),
                         started, args.budget_s)
        if args.sweep and experts == max(p["experts"]):
            for tokens in p["tokens"]:
                run_budgeted(res["cases"], f"sweep E{experts} T{tokens}", lambda: sweep_case(p, layer(), tokens),
                             started, args.budget_s)
        built.clear()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    res["wall_s"] = time.monotonic() - started
    path = write_result(res, "dsv4_moe_smoke.json" if args.smoke else "dsv4_moe.json")
    print_table(res)
    print(f"  (total {res['wall_s']:.0f} s; JSON in {path})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

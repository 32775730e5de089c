"""The MoE layer's routed paths (kestrel/layers/moe/paths.py) at decode sizes, for each family's real widths:
every local expert on every token ("every"), the Triton grouped GEMM ("fused"), the Triton per-assignment
GEMVs ("gemv") and the hit-expert loop ("loop", eager only: it reads the ids on the host). What sets
EVERY_EXPERT_MAX (the most local experts at which "every" still beats "fused" in a decode graph) and whether
"gemv" should serve decode's small batches (up to which T).

    python -m kestrel.bench.kernels.moe_paths           # CUDA, ~2 min; JSON to $OUT/moe_paths.json
    TRITON_INTERPRET=1 python -m kestrel.bench.kernels.moe_paths --smoke   # the same code on CPU, tiny

Families (their MoEConfig as kestrel parses kestrel/assets/configs/*/config.json, bf16):
- qwen3-30b-a3b: hidden 2048, experts 768 wide, 128 experts, 8 per token, SiLU;
- gpt-oss-20b: hidden 2880, experts 2880 wide with biases, 32 experts, 4 per token, gpt-oss's clamped SwiGLU
  (MXFP4 checkpoints are dequantised to bf16 at load, so bf16 is what a step reads).
T = 1, 4, 16, 64, 256 tokens, uniformly random routing. "every", "fused" and "gemv" are timed eagerly (CUDA
events from an idle device, median) and captured in a CUDA graph and replayed (what a decode step runs); "loop"
eagerly. Floor: the bytes of the experts the step hits (distinct ids x one expert's bytes) over the
measured copy bandwidth; `% floor` = floor / the fastest graph. `maxdiff`: the largest |fused - loop| or
|gemv - loop|. The third table names, per family and T, the fastest graphed path.

Up to GEMV_MAX_TOKENS tokens, one whole layer forward (router, experts, combine; random router weights) is
timed too, eager and graphed: today's decode (`layer_ms`: the torch router, "gemv", the torch combine; on the
CPU the loop) against the fused decode route (`decode_route_ms`: `MoE.forward_decode`, five Triton launches,
paths.FUSED_DECODE_ROUTE), with their largest output difference (`decode_route_maxdiff`); and the router
alone (`router_graph_ms`: `Router.forward` in torch; `route_graph_ms`: route_kernels.route, and per
RouteConfig in ROUTE_SWEEP). Which route a model takes is set before it is built: docs/benchmarks.md.
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
from kestrel.layers.moe import MoE, MoEConfig, paths
from kestrel.layers.moe.paths import EVERY_EXPERT_MAX
from kestrel.models.gpt_oss.config import parse_gpt_oss_config
from kestrel.models.qwen3_moe import parse_qwen3_moe_config

CONFIGS = Path(__file__).resolve().parents[2] / "assets/configs"
FAMILIES = {"qwen3-30b-a3b": lambda c: parse_qwen3_moe_config(c).moe, "gpt-oss-20b": lambda c: parse_gpt_oss_config(c).moe}
FULL = dict(device="cuda", dtype=torch.bfloat16, tokens=[1, 4, 16, 64, 256], iters=20, shrink=None)
# Smoke: the families' routers and activations at toy widths and expert counts.
SMOKE = dict(device="cpu", dtype=torch.float32, tokens=[1, 4], iters=1, shrink=dict(hidden=32, inter=16, experts=8))
KERNELS = ("fused", "gemv")  # the Triton paths: each checked against the loop (the reference) first
# GemvConfig (block_n, block_k, num_warps) timed in a graph at T <= GEMV_SWEEP_MAX_T: what sets its default.
GEMV_SWEEP = [(8, 128, 2), (8, 256, 4), (16, 128, 4), (16, 256, 4), (32, 128, 4), (32, 64, 2), (64, 64, 4)]
GEMV_SWEEP_MAX_T = 4
# The down GEMV's own config (gemv_moe.DOWN_CONFIG), the up GEMV at its default, at T = 1: what sets DOWN_CONFIG.
DOWN_SWEEP = [(16, 256, 4), (32, 256, 4), (64, 256, 4), (16, 512, 4), (16, 1024, 4), (32, 1024, 8), (8, 1024, 4),
              (32, 512, 4), (64, 128, 4)]
# RouteConfig (block_e, block_k, num_warps) of the fused decode route's router, graphed: what sets its default.
ROUTE_SWEEP = [(1, 512, 4), (2, 512, 4), (4, 256, 4), (4, 512, 4), (8, 256, 4)]


def family_config(name: str, shrink: dict | None) -> MoEConfig:
    cfg = FAMILIES[name](json.loads((CONFIGS / name / "config.json").read_text()))
    if shrink:
        router = dataclasses.replace(cfg.router, num_experts=shrink["experts"],
                                     top_k=min(cfg.router.top_k, shrink["experts"] // 2))
        cfg = dataclasses.replace(cfg, hidden_size=shrink["hidden"], intermediate_size=shrink["inter"], router=router)
    return cfg


def build_layer(p: dict, cfg: MoEConfig) -> MoE:
    """The layer at `cfg`, random weights (and expert biases), made in the bench dtype on the device."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(p["dtype"])
    try:
        with torch.device(p["device"]):
            layer = MoE(cfg)
    finally:
        torch.set_default_dtype(previous)
    gen = torch.Generator(p["device"]).manual_seed(cfg.num_experts)
    with torch.no_grad():  # the router too: all-zero logits would tie every expert (whole-layer timings)
        for param in [*layer.experts.parameters(), *layer.gate.parameters()]:
            param.normal_(0.0, param.shape[-1] ** -0.5, generator=gen)
    return layer


def run_case(p: dict, layer: MoE, tokens: int, bandwidth: float | None) -> dict:
    dev, cfg = torch.device(p["device"]), layer.cfg
    experts, k = layer.experts.count, cfg.router.top_k
    gen = torch.Generator(dev).manual_seed(tokens)
    x = torch.randn(tokens, cfg.hidden_size, generator=gen, device=dev, dtype=p["dtype"])
    ids = torch.rand(tokens, experts, generator=gen, device=dev).argsort(-1)[:, :k]
    weights = torch.rand(tokens, k, generator=gen, device=dev)
    routed = torch.zeros(tokens, cfg.hidden_size, device=dev)
    hit = ids.unique().numel()
    expert_bytes = sum(t[0].numel() * t.element_size() for t in layer.experts.parameters())
    res = {"experts_hit": hit, "needed_MB": hit * expert_bytes / 1e6, "all_MB": experts * expert_bytes / 1e6}
    if bandwidth:
        res["floor_ms"] = hit * expert_bytes / bandwidth * 1e3
    with torch.no_grad():
        want = torch.zeros_like(routed)
        layer.add_routed(x, ids, weights, want, "loop")
        res["maxdiff"] = 0.0
        for name in KERNELS:
            got = torch.zeros_like(routed)
            layer.add_routed(x, ids, weights, got, name)
            res["maxdiff"] = max(res["maxdiff"], (got - want).abs().max().item())
        del want, got
        for name in ("every", *KERNELS, "loop"):
            call = lambda name=name: layer.add_routed(x, ids, weights, routed, name)  # noqa: E731
            res[f"{name}_ms"] = median(timed_ms(call, dev, p["iters"], warmup=2))
            if name != "loop" and dev.type == "cuda":
                res[f"{name}_graph_ms"] = median(graph_ms(call, dev, p["iters"]))
                torch.cuda.empty_cache()  # the graph's pool
        if dev.type == "cuda" and tokens <= GEMV_SWEEP_MAX_T:
            res["gemv_sweep"] = sweep_gemv(p, layer, x, ids, weights)
        if tokens <= paths.GEMV_MAX_TOKENS:
            res.update(time_decode_route(p, layer, x))
    graphed = {name: res.get(f"{name}_graph_ms", res[f"{name}_ms"]) for name in ("every", *KERNELS)}
    if res.get("gemv_sweep"):
        best = min(res["gemv_sweep"], key=res["gemv_sweep"].get)
        res["gemv_best"], graphed["gemv"] = best, min(graphed["gemv"], res["gemv_sweep"][best])
    res["faster_graphed"] = min(graphed, key=graphed.get)
    if "floor_ms" in res:
        res["pct_floor"] = 100 * res["floor_ms"] / min(graphed.values())
    return res


def sweep_gemv(p: dict, layer: MoE, x, ids, weights) -> dict[str, float]:
    """Graphed ms of the GEMV path per GemvConfig in GEMV_SWEEP ("n8 k128 w2": block_n, block_k, warps)."""
    from kestrel.layers.moe.gemv_moe import GemvConfig, gemv_moe

    e, dev, times = layer.experts, torch.device(p["device"]), {}
    for bn, bk, warps in GEMV_SWEEP:
        cfg = GemvConfig(bn, bk, warps)
        call = lambda cfg=cfg: gemv_moe(x, ids, weights, e.w13, e.w2, e.first, layer.cfg.activation,  # noqa: E731
                                        e.b13, e.down_bias(), cfg)
        try:
            times[f"n{bn} k{bk} w{warps}"] = median(graph_ms(call, dev, p["iters"]))
        except Exception as e:  # noqa: BLE001 - a config that does not compile: skip it, go on
            print(f"gemv n{bn} k{bk} w{warps}: {type(e).__name__}: {e}"[:200])
        torch.cuda.empty_cache()
    if x.shape[0] == 1:
        for bn, bk, warps in DOWN_SWEEP:
            down = GemvConfig(bn, bk, warps)
            call = lambda down=down: gemv_moe(x, ids, weights, e.w13, e.w2, e.first,  # noqa: E731
                                              layer.cfg.activation, e.b13, e.down_bias(), GemvConfig(), down)
            try:
                times[f"down n{bn} k{bk} w{warps}"] = median(graph_ms(call, dev, p["iters"]))
            except Exception as e:  # noqa: BLE001 - a config that does not compile: skip it, go on
                print(f"gemv down n{bn} k{bk} w{warps}: {type(e).__name__}: {e}"[:200])
            torch.cuda.empty_cache()
    return times


def time_decode_route(p: dict, layer: MoE, x: torch.Tensor) -> dict:
    """One whole forward of `layer` on x: today's decode route against the fused one (see the docstring)."""
    from kestrel.layers.moe.route_kernels import RouteConfig, route

    dev, gate, res = torch.device(p["device"]), layer.gate, {}
    saved = paths.FUSED_DECODE_ROUTE
    paths.FUSED_DECODE_ROUTE = False  # `layer(x)` is today's route, whatever the default
    try:
        with torch.no_grad():
            res["decode_route_maxdiff"] = (layer.forward_decode(x).float() - layer(x).float()).abs().max().item()
            calls = {"layer": lambda: layer(x), "decode_route": lambda: layer.forward_decode(x),
                     "router": lambda: gate(x), "route": lambda: route(x, gate.weight, gate.bias, gate.cfg)}
            for name, call in calls.items():
                if name in ("layer", "decode_route"):
                    res[f"{name}_ms"] = median(timed_ms(call, dev, p["iters"], warmup=2))
                if dev.type == "cuda":
                    res[f"{name}_graph_ms"] = median(graph_ms(call, dev, p["iters"]))
                    torch.cuda.empty_cache()
            if dev.type == "cuda":
                res["route_sweep"] = {}
                for be, bk, warps in ROUTE_SWEEP:
                    cfg = RouteConfig(be, bk, warps)
                    call = lambda cfg=cfg: route(x, gate.weight, gate.bias, gate.cfg, cfg)  # noqa: E731
                    try:
                        res["route_sweep"][f"e{be} k{bk} w{warps}"] = median(graph_ms(call, dev, p["iters"]))
                    except Exception as e:  # noqa: BLE001 - a config that does not compile: skip it, go on
                        print(f"route e{be} k{bk} w{warps}: {type(e).__name__}: {e}"[:200])
                    torch.cuda.empty_cache()
                if res["route_sweep"]:
                    res["route_best"] = min(res["route_sweep"], key=res["route_sweep"].get)
    finally:
        paths.FUSED_DECODE_ROUTE = saved
    return res


COLUMNS = ["experts_hit", "floor_ms", "every_ms", "every_graph_ms", "fused_ms", "fused_graph_ms", "gemv_ms",
           "gemv_graph_ms", "gemv_best", "loop_ms", "pct_floor", "maxdiff", "faster_graphed"]


ROUTE_COLUMNS = ["layer_ms", "layer_graph_ms", "decode_route_ms", "decode_route_graph_ms", "router_graph_ms",
                 "route_graph_ms", "route_best", "decode_route_maxdiff"]


def fmt(column: str, v) -> str:
    if not isinstance(v, float):
        return str(v)
    if column.endswith("maxdiff"):
        return f"{v:.1e}"
    return f"{v:.0f}" if column == "pct_floor" else f"{v:.3f}"


def print_table(res: dict) -> None:
    print(f"\n== MoE routed paths: every expert vs grouped GEMM vs per-assignment GEMV vs loop ({res['device']}, "
          f"copy {res['copy_GBps'] or 0:.0f} GB/s, EVERY_EXPERT_MAX {res['every_expert_max']}) ==")
    print(f"  {'case':<24}" + "".join(f"{c:>15}" for c in COLUMNS))
    for label, row in res["cases"].items():
        if isinstance(row, dict):
            print(f"  {label:<24}" + "".join(f"{fmt(c, row.get(c, '-')):>15}" for c in COLUMNS))
        else:
            print(f"  {label:<24}  {row}")
    print("\n== one whole MoE forward at decode sizes: today's route (torch router, gemv, torch combine) vs the fused "
          "decode route; the router alone ==")
    print(f"  {'case':<24}" + "".join(f"{c:>22}" for c in ROUTE_COLUMNS))
    for label, row in res["cases"].items():
        if isinstance(row, dict) and "decode_route_ms" in row:
            print(f"  {label:<24}" + "".join(f"{fmt(c, row.get(c, '-')):>22}" for c in ROUTE_COLUMNS))
    print("\n== fastest graphed path per family (local experts) and T ==")
    for family, info in res["families"].items():
        cells = [f"T{t} {res['cases'][f'{family} T{t}'].get('faster_graphed', '?')}"
                 if isinstance(res["cases"].get(f"{family} T{t}"), dict) else f"T{t} -" for t in res["tokens"]]
        print(f"  {family} (E{info['experts']}, k{info['top_k']}): " + ", ".join(cells))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="CPU (TRITON_INTERPRET=1), tiny widths, fp32")
    parser.add_argument("--budget-s", type=float, default=150, help="cases that would start past it are skipped")
    parser.add_argument("--families", type=str, default=",".join(FAMILIES), help="comma-separated")
    parser.add_argument("--tokens", type=str, default=None, help="token counts, e.g. 1,4,16,64,256")
    args = parser.parse_args(argv)
    if args.smoke:
        require_interpreter()
    p = dict(SMOKE if args.smoke else FULL)
    if args.tokens:
        p["tokens"] = [int(v) for v in args.tokens.split(",")]
    started = time.monotonic()
    dev = torch.device(p["device"])
    bandwidth = copy_bandwidth(dev)
    res = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__,
           "dtype": str(p["dtype"]), "tokens": p["tokens"], "every_expert_max": EVERY_EXPERT_MAX,
           "copy_GBps": bandwidth / 1e9 if bandwidth else None, "families": {}, "cases": {}}
    for family in args.families.split(","):
        cfg = family_config(family, p["shrink"])
        res["families"][family] = {"hidden": cfg.hidden_size, "inter": cfg.intermediate_size,
                                   "experts": cfg.num_experts, "top_k": cfg.router.top_k,
                                   "activation": cfg.activation.kind, "expert_bias": cfg.expert_bias}
        built: list[MoE] = []

        def layer() -> MoE:  # built by the first case that runs: a failure to build is that case's
            if not built:
                built.append(build_layer(p, cfg))
            return built[0]

        for tokens in p["tokens"]:
            run_budgeted(res["cases"], f"{family} T{tokens}", lambda: run_case(p, layer(), tokens, bandwidth),
                         started, args.budget_s)
        built.clear()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    res["wall_s"] = time.monotonic() - started
    path = write_result(res, "moe_paths_smoke.json" if args.smoke else "moe_paths.json")
    print_table(res)
    print(f"  (total {res['wall_s']:.0f} s; JSON in {path})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

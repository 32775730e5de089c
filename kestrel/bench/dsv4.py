"""DeepSeek-V4 on the GPU (issue 15's figures): the V4-Flash-shaped slice with dummy weights, bf16.

    python -m kestrel.bench.dsv4            # CUDA; JSON to $OUT/dsv4.json (OUT default ./out)
    python -m kestrel.bench.dsv4 --smoke    # the same code on CPU, a tiny V4 config, fp32 (from the repository
                                            # root: the config is the model tests' tiny one)
    python -m kestrel.bench.dsv4 --kv-cache-dtype fp8_e4m3   # every section over FP8 KV entries

Sections (each in its own try: one failure or OOM is reported and the others still run):
- kv_bytes: bytes one request at 32k context holds in the engine's KV memory, read off its tensors
  (window rings, compressed blocks, indexer keys, compressor state), against the arithmetic of
  docs/design/deepseek-v4.md §6; for
  both entry formats (`--kv-cache-dtype` picks the one the engine, and so every other section, runs);
- prefill: one prompt of 8k and of 32k tokens through the Engine, chunked as its default; the time in
  the attention sublayers (CUDA events around each `V4Attention.forward`) against the whole forward;
- decode: batch 1 and 32 at 8k context through the Engine, synchronised step times (median), with the
  engine's decode CUDA graphs and eager (the same requests, the graphs set aside), on CUDA;
- layers: one window-only, one ratio-4 and one ratio-128 attention layer at 32k context (decode at
  batch 1 and 32, and the last 8k prefill chunk) against a dense layer of the same width
  (`kestrel/bench/dsv4_layers.py` says what each side includes), eager; on CUDA the decode cases also
  with each side's forward captured once in a CUDA graph and replayed (like with like for the goal);
- prefill_dense: the dense layer at every chunk of the 32k prefill, so the slice with dense attention
  is measured layer by layer: its prefill = ours - our attention sublayers + layers x dense sublayers.
A table of every figure, its goal and pass/fail is printed last.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path
from statistics import median

import torch

from kestrel import Engine, SamplingParams
from kestrel.bench.common import now, random_prompts
from kestrel.bench.dsv4_kv import kv_bytes
from kestrel.bench.dsv4_layers import LayerContext, dense_layer_ms, v4_layer_graph_ms, v4_layer_ms

SLICE = str(Path(__file__).resolve().parents[1] / "assets/configs/deepseek-v4-flash-slice")
FULL = dict(device="cuda", dtype="bfloat16", prefill_lens=[8192, 32768], decode_ctx=8192, decode_batches=[1, 32],
            layer_ctx=32768, chunk=None, decode_iters=8, layer_iters=5, chunk_iters=2)
SMOKE = dict(device="cpu", dtype="float32", prefill_lens=[300, 600], decode_ctx=300, decode_batches=[1, 4],
             layer_ctx=600, chunk=256, decode_iters=3, layer_iters=2, chunk_iters=1)


class AttentionTimer:
    """Times every `V4Attention.forward` of the model (forward hooks; CUDA events on the GPU)."""

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[tuple[object, object]] = []
        self.on = False
        for layer in model.layers:
            layer.attn.register_forward_pre_hook(lambda *_: self._mark(0))
            layer.attn.register_forward_hook(lambda *_: self._mark(1))

    def _mark(self, end: int) -> None:
        if not self.on:
            return
        if self.cuda:
            mark = torch.cuda.Event(enable_timing=True)
            mark.record()
        else:
            mark = time.perf_counter()
        if end:
            self.marks[-1] = (self.marks[-1][0], mark)
        else:
            self.marks.append((mark, None))

    def take_ms(self) -> float:
        """The recorded calls' total, and forget them (a call cut short by an error has no end: left out)."""
        marks = [(s, e) for s, e in self.marks if e is not None]
        self.marks.clear()
        if self.cuda:
            torch.cuda.synchronize()
            return sum(s.elapsed_time(e) for s, e in marks)
        return sum(e - s for s, e in marks) * 1e3


# ---- through the engine ---------------------------------------------------------------------------
def _finish(engine, rids: list[str]) -> None:
    for rid in rids:
        engine.abort(rid)
    while engine.has_work():
        engine.step()
    for rid in rids:
        req = engine.pop(rid)
        if req.finish_reason == "error":
            raise RuntimeError(f"the engine step failed: {req.error}")


def prefill_once(engine, length: int, rng: random.Random, attn: AttentionTimer) -> dict:
    device = engine.device
    params = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    prompt = random_prompts([length], engine.vocab_size, rng)[0]
    engine.runner.forward_events = [] if device.type == "cuda" else None
    attn.take_ms()
    attn.on = True
    try:
        start = now(device)
        rid = engine.add_request(prompt_token_ids=prompt, sampling_params=params)
        while engine.has_work():
            engine.step()
        seconds = now(device) - start
    finally:
        attn.on = False
        events = engine.runner.forward_events or []
        engine.runner.forward_events = None
    _finish(engine, [rid])
    forward_ms = sum(s.elapsed_time(e) for s, e in events) if events else seconds * 1e3
    attention_ms = attn.take_ms()
    return {"seconds": seconds, "tok_per_s": length / seconds, "forward_ms": forward_ms,
            "attention_ms": attention_ms, "rest_of_forward_ms": forward_ms - attention_ms,
            "attention_share": attention_ms / forward_ms}


def prefill(engine, lengths: list[int], attn: AttentionTimer, deadline: float) -> dict:
    rng = random.Random(0)
    prefill_once(engine, lengths[0], rng, attn)  # warm-up: cuBLAS, the caching allocator
    out = {}
    for length in lengths:
        runs = [prefill_once(engine, length, rng, attn)]
        if runs[0]["seconds"] < 20 and time.monotonic() + runs[0]["seconds"] < deadline:
            runs.append(prefill_once(engine, length, rng, attn))
        best = min(runs, key=lambda r: r["seconds"])
        out[str(length)] = {**best, "runs": len(runs), "chunk": engine.config.scheduler.chunked_prefill_size}
    return out


def decode(engine, context: int, batch: int, iters: int) -> dict:
    """Per way of running a decode step ("graphs": the engine's captured decode graphs, when it has them;
    "eager": the same requests with the graphs set aside), the median of `iters` engine steps."""
    device = engine.device
    graphs = dict(engine.runner.cuda_graphs)
    params = SamplingParams(max_new_tokens=batch + 2 * iters + 16, temperature=0.0, ignore_eos=True)
    prompts = random_prompts([context] * batch, engine.vocab_size, random.Random(batch))
    rids = [engine.add_request(prompt_token_ids=p, sampling_params=params) for p in prompts]
    try:
        while engine.scheduler.waiting or engine.scheduler.chunked:
            engine.step()
        for _ in range(2):
            engine.step()
        running = len(engine.scheduler.running)
        out = {"batch": batch, "context": context, "running_during_timing": running, "steps_timed": iters}
        for way in ("graphs", "eager") if graphs else ("eager",):
            engine.runner.cuda_graphs.clear()
            engine.runner.cuda_graphs.update(graphs if way == "graphs" else {})
            engine.step()  # the first step of this way untimed
            engine.runner.forward_events = [] if device.type == "cuda" else None
            walls = []
            for _ in range(iters):
                start = now(device)
                engine.step()
                walls.append(now(device) - start)
            gpu = [s.elapsed_time(e) for s, e in engine.runner.forward_events or []]
            engine.runner.forward_events = None
            step = median(walls)
            out[way] = {"step_median_ms": step * 1e3, "tok_per_s": batch / step,
                        "forward_median_ms": median(gpu) if gpu else None}
    finally:
        engine.runner.forward_events = None
        engine.runner.cuda_graphs.update(graphs)
        _finish(engine, rids)
    return out


# ---- one layer ------------------------------------------------------------------------------------
KINDS = {"window-only (ratio 0)": 0, "CSA (ratio 4)": 4, "HCA (ratio 128)": 128}


def layers(engine, p: dict, chunk: int) -> dict:
    model, device = engine.runner.model, engine.device
    cfg, ctx_len = model.config, p["layer_ctx"]
    ctx = LayerContext(model, max(p["decode_batches"]), ctx_len, engine.config.cache.page_size, device,
                       getattr(torch, engine.config.model.dtype))
    cases = [(f"decode bs{b}", b, ctx_len - 1, 1, p["layer_iters"]) for b in p["decode_batches"]]
    cases.append((f"prefill chunk {chunk}", 1, ctx_len - chunk, chunk, p["chunk_iters"]))
    out: dict = {"context": ctx_len, "cases": {}, "includes": {
        "v4": "V4Attention.forward: wq_a, q_norm, wq_b, per-head norm, rope; wkv, kv_norm, rope; window ring I/O; "
              "compressor(s) and (ratio 4) indexer; softmax over window + compressed entries with sink; inverse "
              "rope; wo_a (grouped), wo_b. Backend metadata (host lengths) set untimed before each call; the "
              "step's index plan already built (as by an earlier layer of the step); step_plan_ms: what the "
              "first layer of its kind pays on top, once per step.",
        "dense": "the same projections, norms and ropes; K=V written to a contiguous [batch, context, 512] cache; "
                 "torch SDPA over every earlier position (one K=V head, MQA; causal lower-right in prefill); "
                 "inverse rope; wo_a, wo_b. sdpa_ms: the SDPA call alone; projections_ms: the rest alone.",
        "graph": "decode cases on CUDA: each side's forward captured once in a CUDA graph and replayed (CUDA "
                 "events, median); V4 through the static-sizes decode plan the engine's decode graphs use, "
                 "its parts built before capture (with_plan_ms: the plan's construction captured too)."}}
    attn_of = {kind: model.layers[cfg.compress_ratios.index(r)].attn for kind, r in KINDS.items()}
    # Mean over the slice's main layers (MTP excluded): what one layer costs on average in a forward.
    mix = {kind: cfg.compress_ratios.count(r) / cfg.num_hidden_layers for kind, r in KINDS.items()}
    for name, batch, prefix, extend, iters in cases:
        row: dict = {"batch": batch, "prefix": prefix, "extend": extend}
        for kind, attn in attn_of.items():
            try:
                row[kind] = median(v4_layer_ms(attn, ctx, batch, prefix, extend, iters))
                fresh = median(v4_layer_ms(attn, ctx, batch, prefix, extend, iters, plan_built=False))
                row.setdefault("step_plan_ms", {})[kind] = fresh - row[kind]
            except Exception as e:  # noqa: BLE001 - one layer's failure (e.g. OOM) keeps the others
                row[kind] = f"failed: {type(e).__name__}: {e}"
                _free(device)
        graph = device.type == "cuda" and extend == 1
        if graph:
            row["graph"] = {}
            for kind, attn in attn_of.items():
                try:
                    row["graph"][kind] = v4_layer_graph_ms(attn, ctx, batch, prefix, iters)
                except Exception as e:  # noqa: BLE001
                    row["graph"][kind] = f"failed: {type(e).__name__}: {e}"
                    _free(device)
        try:
            row["dense"] = dense_layer_ms(attn_of["CSA (ratio 4)"], batch, ctx_len, prefix, extend, iters, graph)
        except Exception as e:  # noqa: BLE001
            row["dense"] = f"failed: {type(e).__name__}: {e}"
        _free(device)
        if all(isinstance(row[k], float) for k in KINDS):
            row["v4_mean_layer_ms"] = sum(mix[k] * row[k] for k in KINDS)
            if isinstance(row["dense"], dict):
                row["dense_over_v4_mean"] = row["dense"]["sublayer_ms"] / row["v4_mean_layer_ms"]
                row["dense_over_v4_by_kind"] = {k: row["dense"]["sublayer_ms"] / row[k] for k in KINDS}
        g = row.get("graph", {})
        if all(isinstance(g.get(k), dict) for k in KINDS) and isinstance(row["dense"], dict):
            g["v4_mean_layer_ms"] = sum(mix[k] * g[k]["layer_ms"] for k in KINDS)
            g["dense_over_v4_mean"] = row["dense"]["graph_sublayer_ms"] / g["v4_mean_layer_ms"]
        out["cases"][name] = row
        print(name, json.dumps(row, default=str), flush=True)
    out["layer_mix"] = mix
    del ctx
    return out


def prefill_dense(engine, length: int, chunk: int, iters: int) -> dict:
    """The dense layer at each chunk of a `length` prefill, as the engine splits it."""
    attn = engine.runner.model.layers[engine.runner.model.config.compress_ratios.index(4)].attn
    chunks = [(start, min(chunk, length - start)) for start in range(0, length, chunk)]
    per_chunk = [dense_layer_ms(attn, 1, length, start, extend, iters) for start, extend in chunks]
    return {"length": length, "chunks": [[s, e] for s, e in chunks],
            "dense_sublayer_ms": [c["sublayer_ms"] for c in per_chunk],
            "dense_sdpa_ms": [c["sdpa_ms"] for c in per_chunk], "sdpa_kernel": [c["sdpa_kernel"] for c in per_chunk],
            "dense_layer_total_ms": sum(c["sublayer_ms"] for c in per_chunk)}


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---- goals and the table --------------------------------------------------------------------------
def goals(res: dict, p: dict) -> list[dict]:
    rows = []

    def add(figure: str, value, goal: str, ok):
        rows.append({"figure": figure, "value": value, "goal": goal, "pass": ok})

    kv = res.get("kv_bytes")
    if isinstance(kv, dict):
        for name, f in kv["formats"].items():
            where = "engine" if name == kv["kv_cache_dtype"] else "layout"
            add(f"KV bytes/token at {f['context']} ({name}, {where})", round(f["bytes_per_token"], 1),
                f"within 10% of spec {kv['spec_bytes_per_token']:.1f}", abs(f["ratio_to_spec"] - 1) <= 0.10)
            add(f"  spec slope with {name} entry bytes", round(f["spec_slope_with_our_entry_bytes"], 1),
                "(explains)", None)
    pre = res.get("prefill")
    if isinstance(pre, dict):
        for length, r in pre.items():
            add(f"prefill {length} tok/s", round(r["tok_per_s"]), f"(attention {100 * r['attention_share']:.0f}% "
                f"of forward)", None)
    for key, r in res.items():
        if key.startswith("decode bs") and isinstance(r, dict):
            for way in ("graphs", "eager"):
                if way in r:
                    add(f"{key} ctx {r['context']} tok/s, {way}", round(r[way]["tok_per_s"], 1),
                        f"(step {r[way]['step_median_ms']:.2f} ms)", None)
    lay = res.get("layers")
    if isinstance(lay, dict):
        for name, row in lay["cases"].items():
            for kind in KINDS:
                if isinstance(row.get(kind), float):
                    plan = row.get("step_plan_ms", {}).get(kind)
                    add(f"{name} ctx {lay['context']} {kind} ms", round(row[kind], 3),
                        "" if plan is None else f"({plan:+.3f} ms: the step's plan, once a step)", None)
            if isinstance(row.get("dense"), dict):
                add(f"{name} ctx {lay['context']} dense ms", round(row["dense"]["sublayer_ms"], 3),
                    f"(SDPA {row['dense']['sdpa_kernel']} {row['dense']['sdpa_ms']:.3f} ms)", None)
            graph = row.get("graph", {})
            for kind in KINDS:
                if isinstance(graph.get(kind), dict):
                    add(f"{name} ctx {lay['context']} {kind} ms, graph", round(graph[kind]["layer_ms"], 3),
                        f"(with the plan captured too: {graph[kind]['with_plan_ms']:.3f} ms)", None)
                elif isinstance(graph.get(kind), str):
                    add(f"{name} {kind}, graph", "-", graph[kind][:80], False)
            if isinstance(row.get("dense"), dict) and row["dense"].get("graph_sublayer_ms") is not None:
                add(f"{name} ctx {lay['context']} dense ms, graph", round(row["dense"]["graph_sublayer_ms"], 3), "", None)
            # The decode goal compares like with like: both sides from CUDA graphs where they ran.
            decode_case = name.startswith("decode")
            if "dense_over_v4_mean" in row:
                goal = decode_case and "dense_over_v4_mean" not in graph
                add(f"{name}: dense / V4 mean layer" + (", eager" if decode_case else ""),
                    round(row["dense_over_v4_mean"], 2), ">= 4" if goal else "",
                    row["dense_over_v4_mean"] >= 4 if goal else None)
            if "dense_over_v4_mean" in graph:
                add(f"{name}: dense / V4 mean layer, graphs", round(graph["dense_over_v4_mean"], 2), ">= 4",
                    graph["dense_over_v4_mean"] >= 4)
    dense = res.get("prefill_dense")
    if isinstance(dense, dict) and isinstance(pre, dict) and str(dense["length"]) in pre:
        ours = pre[str(dense["length"])]
        n_layers = res["config"]["num_hidden_layers"]
        dense_ms = ours["seconds"] * 1e3 - ours["attention_ms"] + n_layers * dense["dense_layer_total_ms"]
        speedup = dense_ms / (ours["seconds"] * 1e3)
        res["prefill_goal"] = {"v4_ms": ours["seconds"] * 1e3, "dense_slice_ms": dense_ms, "speedup": speedup}
        add(f"prefill {dense['length']}: dense slice / V4 slice time", round(speedup, 2), ">= 3", speedup >= 3)
    for key, value in res.items():  # what did not run, so the table shows it too
        if isinstance(value, str) and value.startswith(("failed", "skipped")):
            add(key, "-", value[:80], False)
    for name, row in (lay["cases"] if isinstance(lay, dict) else {}).items():
        for kind in KINDS:
            if isinstance(row.get(kind), str):
                add(f"{name} {kind}", "-", row[kind][:80], False)
        if isinstance(row.get("dense"), str):
            add(f"{name} dense", "-", row["dense"][:80], False)
    return rows


def print_table(rows: list[dict]) -> None:
    width = max(len(r["figure"]) for r in rows) if rows else 10
    print("\n== DeepSeek-V4 slice ==")
    for r in rows:
        verdict = "" if r["pass"] is None else ("PASS" if r["pass"] else "FAIL")
        print(f"  {r['figure']:<{width}}  {r['value']!s:>12}  {r['goal']:<34} {verdict}")


def smoke_model(root: Path) -> str:
    from tests.model.dsv4_reference import RefConfig  # the tier-A tiny config of the model tests

    (root / "config.json").write_text(json.dumps(RefConfig().native_config()))
    return str(root)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="CPU, a tiny V4 config, fp32, tiny contexts")
    parser.add_argument("--model", default=None, help=f"a V4 config folder (default {SLICE})")
    parser.add_argument("--budget-s", type=float, default=200,
                        help="seconds from the start: a section that would begin (or, for decode, finish its "
                             "prefills) past it is skipped")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8_e4m3"],
                        help="the engine's V4 KV entries: the model dtype, or packed FP8 (584 B entries, "
                             "docs/design/deepseek-v4.md §6)")
    parser.add_argument("--only", default=None, help="comma-separated sections to run (kv_bytes, prefill, decode, "
                                                     "layers, prefill_dense); default all")
    args = parser.parse_args(argv)
    p = SMOKE if args.smoke else FULL
    started = time.monotonic()
    deadline = started + args.budget_s
    model = args.model or (smoke_model(Path(tempfile.mkdtemp())) if args.smoke else SLICE)
    longest = max(p["prefill_lens"] + [p["layer_ctx"]])
    pool = max(max(p["decode_batches"]) * (p["decode_ctx"] + 256), longest + 256)
    engine = Engine(model=model, load_format="dummy", device=p["device"], dtype=p["dtype"], max_total_tokens=pool,
                    max_running_requests=max(p["decode_batches"]), context_length=longest + 1024,
                    kv_cache_dtype=args.kv_cache_dtype, **({"chunked_prefill_size": p["chunk"]} if p["chunk"] else {}))
    chunk = engine.config.scheduler.chunked_prefill_size
    cfg = engine.runner.model.config
    res: dict = {"model": model, "device": str(engine.device), "dtype": p["dtype"], "load_format": "dummy",
                 "kv_cache_dtype": args.kv_cache_dtype,
                 "gpu": torch.cuda.get_device_name() if engine.device.type == "cuda" else None,
                 "config": {"num_hidden_layers": cfg.num_hidden_layers, "compress_ratios": list(cfg.compress_ratios),
                            "heads": cfg.num_attention_heads, "head_dim": cfg.head_dim, "hidden": cfg.hidden_size},
                 "page_size": engine.config.cache.page_size, "chunked_prefill_size": chunk,
                 "attention_backend": engine.runner.attn_backend.name, "torch": torch.__version__}
    attn = AttentionTimer(engine.runner.model, engine.device)
    sections = [("kv_bytes", lambda: kv_bytes(engine, p["layer_ctx"])),
                ("prefill", lambda: prefill(engine, p["prefill_lens"], attn, deadline))]
    # The sections with goals first; the batch-32 decode, whose 32 prefills cost most, last.
    sections += [("layers", lambda: layers(engine, p, chunk)),
                 ("prefill_dense", lambda: prefill_dense(engine, max(p["prefill_lens"]), chunk, p["chunk_iters"]))]
    sections += [(f"decode bs{b}", lambda b=b: decode(engine, p["decode_ctx"], b, p["decode_iters"]))
                 for b in p["decode_batches"]]
    out = Path(os.environ.get("OUT", "./out"))
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / ("dsv4_smoke.json" if args.smoke else "dsv4.json")
    only = set(args.only.split(",")) if args.only else None
    for name, run in sections:
        if only is not None and name.split(" ")[0] not in only:
            continue
        left = deadline - time.monotonic()
        # A decode section first prefills its batch: skip it when that alone would run past the budget.
        rate = (res.get("prefill") or {}).get(str(p["decode_ctx"])) if name.startswith("decode") else None
        needed = int(name.split("bs")[1]) * p["decode_ctx"] / rate["tok_per_s"] if isinstance(rate, dict) else 0
        if left < needed:
            res[name] = f"skipped: {left:.0f} s left of the {args.budget_s:.0f} s budget, needs ~{needed:.0f} s"
            continue
        t = time.monotonic()
        try:
            res[name] = run()
        except Exception as e:  # noqa: BLE001 - report it, keep the other sections
            traceback.print_exc()
            res[name] = f"failed: {type(e).__name__}: {e}"
            _free(engine.device)
        print(f"[{name}: {time.monotonic() - t:.1f} s]", json.dumps(res[name], default=str)[:2000], flush=True)
        json_path.write_text(json.dumps(res, indent=1, default=str))  # so far, in case the run is cut short
    rows = goals(res, p)
    res["goals"] = rows
    res["wall_s"] = time.monotonic() - started
    json_path.write_text(json.dumps(res, indent=1, default=str))
    engine.shutdown()
    print_table(rows)
    print(f"  (total {res['wall_s']:.0f} s; JSON in {json_path})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Prefill (EXTEND) attention: our Triton extend kernel and the sdpa backend against torch's SDPA kernels.

    python -m kestrel.bench.kernels.prefill_attention                 # H200: Llama-3.1-8B attention shape
    TRITON_INTERPRET=1 python -m kestrel.bench.kernels.prefill_attention --smoke   # CPU, tiny shapes

One layer's attention, bf16, 32 query / 8 KV heads, head dim 128, for each case (single prompts of
1k-16k tokens, a batch of mixed lengths, many short prompts, an extend after a cached prefix):
- `triton_p1`, `triton_p16`: the Triton backend as the engine calls it (K/V store + paged extend
  kernel) over pools of page size 1 and 16, pages scattered;
- `sdpa_cudnn`, `sdpa_flash`, `sdpa_efficient`: torch SDPA forced to one kernel, one call per request
  on contiguous q/k/v (GQA through enable_gqa, else K/V repeated: the `gqa` column says which);
- `varlen_flash`: torch.nn.attention.varlen.varlen_attn, one call for the batch (where torch has it);
- `sdpa_backend`: kestrel's sdpa backend as the engine calls it (page size 1): its per-request SDPA
  fast path, or its Triton fallback where its routing says so (`route` column).
Every path's output is first checked against a float32 reference (relative Frobenius error); then it is
timed with CUDA events (warm-up, median). TFLOP/s count causal work: 4 * head_dim * q_heads * the sum,
over queries, of the keys each query sees. `vs_best_sdpa` = this path's TFLOP/s / the best of the
three SDPA kernels on the same case. A table goes to stdout last, JSON to $OUT (default ./out).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from kestrel.attention import sdpa as sdpa_module
from kestrel.attention.sdpa import SdpaBackend
from kestrel.attention.torch_native import TorchNativeBackend
from kestrel.bench.common import require_interpreter, timed_ms
from kestrel.cache.kv_layout import Indexing
from kestrel.cache.kv_memory import LayerKV
from kestrel.cache.req_to_token import ReqToTokenPool
from kestrel.core.forward_batch import ForwardBatch
from kestrel.core.forward_mode import ForwardMode
from kestrel.layers.attention import AttentionLayer

K = 1024
FULL_CASES = {  # name → [(prefix, extend) per request]
    "1k": [(0, K)], "4k": [(0, 4 * K)], "8k": [(0, 8 * K)], "16k": [(0, 16 * K)],
    "batch 4 mixed (0.5k-3k)": [(0, 512), (0, 1536), (0, 2 * K), (0, 3 * K)],
    "batch 32 x 256": [(0, 256)] * 32,
    "4k prefix + 4k new": [(4 * K, 4 * K)],
    "batch 2 prefix + new": [(2 * K, 2 * K), (6 * K, 2 * K)],
}
SMOKE_CASES = {"32": [(0, 32)], "batch 3 mixed": [(0, 8), (0, 20), (0, 13)], "16 prefix + 16 new": [(16, 16)]}
SDPA_KERNELS = {"sdpa_cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa_flash": SDPBackend.FLASH_ATTENTION,
                "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION}
MAX_REL_ERR = 2e-2  # bf16 output vs float32 reference; a correct kernel lands near 4e-3


def causal_flops(case, heads: int, head_dim: int) -> float:
    """4 * hd * heads * sum over queries of visible keys (query j of a request after prefix p sees p + j + 1)."""
    return 4.0 * head_dim * heads * sum(e * p + e * (e + 1) / 2 for p, e in case)


class Pools:
    """One layer's paged K/V, as KVPools.layer() hands it to a backend."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.kv = LayerKV(k=k, v=v, k_scale=1.0, v_scale=1.0, k_indexing=Indexing.TOKEN)

    def layer(self, layer_id: int) -> LayerKV:
        return self.kv


class Setup:
    """One case's tensors: per-request contiguous q/k/v, and the same K/V in a paged pool."""

    def __init__(self, case, heads, kv_heads, head_dim, dtype, device, gen):
        self.case, self.heads, self.kv_heads, self.head_dim = case, heads, kv_heads, head_dim
        self.scale = head_dim ** -0.5
        seqs = [p + e for p, e in case]
        self.q = [torch.randn(e, heads, head_dim, generator=gen).to(device, dtype) for _, e in case]
        self.k = [torch.randn(s, kv_heads, head_dim, generator=gen).to(device, dtype) for s in seqs]
        self.v = [torch.randn(s, kv_heads, head_dim, generator=gen).to(device, dtype) for s in seqs]
        self.layer = AttentionLayer(0, heads, kv_heads, head_dim, self.scale)

    def paged(self, page_size: int, gen):
        """(pools, req_to_token, batch, q, k_new, v_new) for a backend, prefixes already in the pool."""
        case, device = self.case, self.q[0].device
        seqs = [p + e for p, e in case]
        pages = [math.ceil(s / page_size) for s in seqs]
        order = (torch.randperm(sum(pages), generator=gen) + 1).tolist()  # page 0 stays reserved
        slots_total = (sum(pages) + 1) * page_size
        k_buf = torch.zeros(slots_total, self.kv_heads, self.head_dim, dtype=self.q[0].dtype, device=device)
        v_buf = torch.zeros_like(k_buf)
        req_to_token = ReqToTokenPool(len(case), max(seqs), device)
        new_slots, used = [], 0
        for row, ((p, _), s, n) in enumerate(zip(case, seqs, pages)):
            slots = torch.cat([torch.arange(pg * page_size, (pg + 1) * page_size) for pg in order[used:used + n]])[:s]
            slots = slots.to(device)
            used += n
            req_to_token.table[row, :s] = slots
            k_buf[slots[:p]], v_buf[slots[:p]] = self.k[row][:p], self.v[row][:p]
            new_slots.append(slots[p:])
        tokens = sum(e for _, e in case)
        lens = lambda xs: torch.tensor(xs, device=device)  # noqa: E731
        batch = ForwardBatch(
            forward_mode=ForwardMode.EXTEND, input_ids=torch.zeros(tokens, dtype=torch.int64, device=device),
            positions=torch.cat([torch.arange(p, p + e) for p, e in case]).to(device),
            out_cache_loc=torch.cat(new_slots), req_pool_indices=lens(list(range(len(case)))),
            seq_lens=lens(seqs), prefix_lens=lens([p for p, _ in case]), extend_lens=lens([e for _, e in case]),
            seq_lens_cpu=seqs, prefix_lens_cpu=[p for p, _ in case], extend_lens_cpu=[e for _, e in case],
            max_extend=max(e for _, e in case), logits_indices=torch.arange(tokens, device=device), attn_backend=None)
        q = torch.cat(self.q).flatten(1)
        k_new = torch.cat([k[p:] for k, (p, _) in zip(self.k, case)]).flatten(1)
        v_new = torch.cat([v[p:] for v, (p, _) in zip(self.v, case)]).flatten(1)
        return Pools(k_buf, v_buf), req_to_token, batch, q, k_new, v_new


def reference(s: Setup) -> torch.Tensor:
    """float32, explicit lower-right causal mask, query rows in chunks (a 16k x 16k score matrix per head
    would not fit)."""
    outs = []
    group = s.heads // s.kv_heads
    for q, k, v, (p, e) in zip(s.q, s.k, s.v, s.case):
        k = k.float().repeat_interleave(group, dim=1).transpose(0, 1)
        v = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
        for c0 in range(0, e, 1024):
            qc = q[c0:c0 + 1024].float().transpose(0, 1)
            scores = qc @ k.transpose(1, 2) * s.scale
            q_pos = torch.arange(p + c0, p + c0 + qc.shape[1], device=q.device)[:, None]
            scores.masked_fill_(torch.arange(k.shape[1], device=q.device)[None, :] > q_pos, float("-inf"))
            outs.append((scores.softmax(-1) @ v).transpose(0, 1))
    return torch.cat(outs)


def sdpa_path(s: Setup, kernel: SDPBackend, repeat_kv: bool):
    """One SDPA call per request on contiguous q/k/v, forced to `kernel`."""
    group = s.heads // s.kv_heads
    qs = [q.transpose(0, 1).unsqueeze(0) for q in s.q]
    ks = [(k.repeat_interleave(group, dim=1) if repeat_kv else k).transpose(0, 1).unsqueeze(0) for k in s.k]
    vs = [(v.repeat_interleave(group, dim=1) if repeat_kv else v).transpose(0, 1).unsqueeze(0) for v in s.v]

    def call():
        outs = []
        with sdpa_kernel([kernel]):
            for q, k, v, (p, e) in zip(qs, ks, vs, s.case):
                mask = causal_lower_right(e, p + e) if p else None
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=not p, scale=s.scale,
                                                   enable_gqa=not repeat_kv)
                outs.append(o[0].transpose(0, 1))
        return torch.cat(outs)
    return call


def varlen_path(s: Setup):
    """torch's varlen flash attention, one call for the whole batch (its causal mask is lower-right)."""
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    device = s.q[0].device
    q, k, v = torch.cat(s.q), torch.cat(s.k), torch.cat(s.v)
    cu_q = torch.tensor([0] + [e for _, e in s.case], device=device).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + [p + e for p, e in s.case], device=device).cumsum(0).to(torch.int32)
    max_q, max_k = max(e for _, e in s.case), max(p + e for p, e in s.case)
    params = inspect.signature(varlen_attn).parameters  # torch 2.13 spells causal as a window, older as a flag
    kwargs = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if "enable_gqa" in params:
        kwargs["enable_gqa"] = True
    return lambda: varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, scale=s.scale, **kwargs)


def backend_path(s: Setup, make_backend, page_size: int, gen):
    pools, req_to_token, batch, q, k_new, v_new = s.paged(page_size, gen)
    backend = make_backend(pools, req_to_token)
    batch.attn_backend = backend
    backend.init_forward_metadata(batch)  # once per forward in the engine, not once per layer

    def call():
        return backend.forward(q, k_new, v_new, s.layer, batch).view(-1, s.heads, s.head_dim)
    return call, backend, batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, float32, CPU (with TRITON_INTERPRET=1)")
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--iters", type=int, default=None)
    args = parser.parse_args()
    smoke = args.smoke
    if smoke:
        require_interpreter()
    device = torch.device("cpu" if smoke else "cuda")
    dtype = torch.float32 if smoke else torch.bfloat16
    heads, kv_heads, head_dim = (4, 2, 16) if smoke else (32, 8, 128)
    cases = SMOKE_CASES if smoke else FULL_CASES
    warmup = args.warmup if args.warmup is not None else (1 if smoke else 3)
    iters = args.iters if args.iters is not None else (2 if smoke else 10)
    out_dir = os.environ.get("OUT", "./out")
    gen = torch.Generator().manual_seed(0)

    from kestrel.attention.triton_backend import TritonBackend  # needs triton (a GPU, or the interpreter)

    upcast = device.type == "cpu"  # the interpreter computes bf16/fp16 dots wrong
    triton_backend = lambda pools, rtt: TritonBackend(pools, rtt, upcast=upcast)  # noqa: E731
    if device.type == "cuda":
        fallback = triton_backend
    else:
        fallback = lambda pools, rtt: TorchNativeBackend(pools, rtt)  # noqa: E731
    sdpa_backend = lambda pools, rtt: SdpaBackend(pools, rtt, fallback(pools, rtt), on_cuda=device.type == "cuda")  # noqa: E731

    rows = []
    for name, case in cases.items():
        s = Setup(case, heads, kv_heads, head_dim, dtype, device, gen)
        ref = reference(s)
        flops = causal_flops(case, heads, head_dim)
        paths = {}
        for path, kernel in SDPA_KERNELS.items():
            paths[path] = [(sdpa_path(s, kernel, repeat_kv=False), "enable_gqa"),
                           (sdpa_path(s, kernel, repeat_kv=True), "repeat")]
        if device.type == "cuda":
            paths["varlen_flash"] = [(lambda: varlen_path(s)(), "native")]
        for page in (1, 16):
            paths[f"triton_p{page}"] = [(backend_path(s, triton_backend, page, gen)[0], "native")]
        call, backend, batch = backend_path(s, sdpa_backend, 1, gen)
        paths["sdpa_backend"] = [(call, "enable_gqa")]
        route = "sdpa" if sdpa_module.takes_fast_path(batch, on_cuda=device.type == "cuda") else "fallback"
        for path, attempts in paths.items():
            row = {"case": name, "path": path, "requests": len(case), "tokens": sum(e for _, e in case),
                   "prefix": sum(p for p, _ in case), "gflop": flops / 1e9}
            if path == "sdpa_backend":
                row["route"] = route
            errors = []
            for call, gqa in attempts:  # the first way that runs and is right is timed
                try:
                    out = call()
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    rel = ((out.float() - ref).norm() / ref.norm()).item()
                except Exception as e:  # a kernel that cannot take these inputs: say why, try the next way
                    errors.append(f"{gqa}: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}")
                    continue
                if not rel <= MAX_REL_ERR:
                    errors.append(f"{gqa}: relative error {rel:.2e} > {MAX_REL_ERR}")
                    continue
                ms = statistics.median(timed_ms(call, device, iters, warmup=warmup))
                row.update(gqa=gqa, rel_err=rel, ms=ms, tflops=flops / ms / 1e9)
                break
            if "ms" not in row:
                row["error"] = "; ".join(errors)
            rows.append(row)
        best = max((r["tflops"] for r in rows if r["case"] == name and r["path"] in SDPA_KERNELS and "tflops" in r),
                   default=None)
        for r in rows:
            if r["case"] == name and "tflops" in r and best:
                r["vs_best_sdpa"] = r["tflops"] / best
        if device.type == "cuda":
            torch.cuda.empty_cache()

    meta = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
            "dtype": str(dtype), "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "warmup": warmup,
            "iters": iters, "fast_max_requests": sdpa_module.FAST_MAX_REQUESTS,
            "fast_min_extend": sdpa_module.FAST_MIN_EXTEND}
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "prefill_attention.json")
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(json.dumps(meta))
    for r in rows:
        if "error" in r:
            print(f"note: {r['case']} / {r['path']}: {r['error']}")
    print(f"\n{'case':<24} {'path':<15} {'gqa':<10} {'ms':>9} {'TFLOP/s':>8} {'vs best':>7} {'rel err':>8}  route")
    for r in rows:
        if "ms" in r:
            print(f"{r['case']:<24} {r['path']:<15} {r['gqa']:<10} {r['ms']:>9.3f} {r['tflops']:>8.1f} "
                  f"{r.get('vs_best_sdpa', float('nan')):>7.2f} {r['rel_err']:>8.1e}  {r.get('route', '')}")
        else:
            print(f"{r['case']:<24} {r['path']:<15} {'-':<10} {'failed':>9}")
    print(f"\nJSON: {path}")


if __name__ == "__main__":
    main()

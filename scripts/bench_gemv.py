"""Batch-1 linear layers of Llama-3.1-8B: torch's GEMM (cuBLAS) against the Triton GEMV and its block sizes.

    python scripts/bench_gemv.py [--json out.json]

Medians of triton.testing.do_bench (which flushes L2 between runs, so weights come from HBM); the
step estimate sums one layer's four products x 32 layers + the logits.
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F
import triton

from kestrel.layers.activation import SiluAndMul
from kestrel.layers.gemv_triton import gemv

# (name, rows, cols, silu_mul, times per step)
SHAPES = [("qkv", 6144, 4096, False, 32), ("o", 4096, 4096, False, 32), ("gate_up+silu", 28672, 4096, True, 32),
          ("down", 4096, 14336, False, 32), ("logits", 128256, 4096, False, 1)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    results = []
    for name, rows, cols, silu_mul, per_step in SHAPES:
        weight = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16) / cols ** 0.5
        x = torch.randn(1, cols, device="cuda", dtype=torch.bfloat16)
        gbytes = weight.numel() * 2 / 1e9
        act = SiluAndMul(use_triton=True)
        cublas = (lambda: act(F.linear(x, weight))) if silu_mul else (lambda: F.linear(x, weight))
        row = {"name": name, "rows": rows, "cols": cols, "per_step": per_step, "gbytes": gbytes,
               "cublas_ms": triton.testing.do_bench(cublas, rep=200, return_mode="median")}
        row["default_ms"] = triton.testing.do_bench(lambda: gemv(x, weight, silu_mul=silu_mul), rep=200,
                                                    return_mode="median")
        sweep = {}
        for block_n, block_k, warps in itertools.product((4, 8, 16, 32), (256, 512, 1024), (4, 8)):
            fn = lambda: gemv(x, weight, silu_mul=silu_mul, block_n=block_n, block_k=block_k, num_warps=warps)  # noqa: E731
            try:
                sweep[f"{block_n}/{block_k}/{warps}"] = triton.testing.do_bench(fn, rep=100, return_mode="median")
            except Exception as exc:  # e.g. out of registers/shared memory for a large tile
                print(f"{name} {block_n}/{block_k}/{warps}: {type(exc).__name__}")
        best = min(sweep, key=sweep.get)
        row.update(best=best, best_ms=sweep[best], sweep=sweep)
        results.append(row)
        print(f"{name:14} {rows:6}x{cols:<6} cuBLAS {row['cublas_ms'] * 1e3:7.1f} us ({gbytes / row['cublas_ms']:5.2f} TB/s)"
              f"  GEMV default {row['default_ms'] * 1e3:7.1f} us ({gbytes / row['default_ms']:5.2f} TB/s)"
              f"  best {best} {row['best_ms'] * 1e3:7.1f} us ({gbytes / row['best_ms']:5.2f} TB/s)", flush=True)
    print("\nper decode step (sum over the 8B model's batch-1 products):")
    for key in ("cublas_ms", "default_ms", "best_ms"):
        print(f"  {key[:-3]:8} {sum(r[key] * r['per_step'] for r in results):6.3f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

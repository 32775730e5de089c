"""Achieved KV bandwidth of the Triton decode kernel for a few launch configurations (pick the defaults).

    python scripts/bench_decode_kernel.py --batch 256 --context 2048
"""
from __future__ import annotations

import argparse
import itertools
import math

import torch
import triton

from kestrel.attention.triton.decode import decode_attention


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--splits", type=int, default=1)
    args = parser.parse_args()
    b, ctx, d = args.batch, args.context, 128
    slots = b * ctx + 16
    k_buf = torch.randn(slots, args.kv_heads, d, device="cuda", dtype=torch.bfloat16)
    v_buf = torch.randn_like(k_buf)
    table = (torch.randperm(slots - 16, device="cuda") + 16).view(b, ctx)  # scattered slots
    rows = torch.arange(b, device="cuda")
    seq = torch.full((b,), ctx, device="cuda")
    q = torch.randn(b, args.heads, d, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    new_slots = table[:, -1].contiguous()  # the kernel stores the new tokens' K/V there, as in the engine
    k_new, v_new = k_buf[new_slots].flatten(1), v_buf[new_slots].flatten(1)
    kv_bytes = 2 * b * ctx * args.kv_heads * d * 2
    print(f"batch {b} context {ctx} splits {args.splits}: KV {kv_bytes / 2**30:.2f} GiB per call")
    for block_n, warps, stages in itertools.product([32, 64, 128], [4, 8], [2, 3]):
        def call():
            decode_attention(q, k_new, v_new, k_buf, v_buf, out, table, rows, seq, new_slots, 1 / math.sqrt(d),
                             None, False, args.splits, block_n=block_n, num_warps=warps, num_stages=stages)
        try:
            ms = triton.testing.do_bench(call, warmup=5, rep=30)
        except Exception as e:  # a configuration that does not fit (shared memory) is skipped
            print(f"  BLOCK_N {block_n:>3} warps {warps} stages {stages}: failed ({type(e).__name__})")
            continue
        print(f"  BLOCK_N {block_n:>3} warps {warps} stages {stages}: {ms:.3f} ms  {kv_bytes / ms / 1e6:.0f} GB/s")


if __name__ == "__main__":
    main()

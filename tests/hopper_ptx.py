"""Compiles kestrel's PDL-taking kernels for sm_90 on any machine (Triton's compiler and ptxas, no GPU) and
checks their PTX: the grid-dependency wait comes before every global memory access. Run as a module with TRITON_INTERPRET=0 (tests/unit/test_pdl_ptx.py does); prints one line
per kernel and exits non-zero on the first failure."""
from __future__ import annotations

import inspect
import re
import sys
import warnings

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kestrel.attention.triton import decode, store
from kestrel.layers import fp8_gemm_triton as fp8, fused_triton, int4_gemm_triton as int4, rope_triton
from kestrel.layers.moe import gemv_moe, route_kernels
from kestrel.sampling import argmax_triton

GLOBAL_ACCESS = re.compile(r"\b(ld|st|atom|red)\.global|cp\.async|cp\.reduce")


def ptx(kernel, types: dict[str, str], constexprs: dict, num_warps: int = 4) -> str:
    """The kernel's PTX for sm_90 launched with PDL: parameters not in `types` or `constexprs` are i32."""
    names = inspect.signature(kernel.fn).parameters
    signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs={**constexprs, "PDL": True}),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "launch_pdl": True})
    return compiled.asm["ptx"]


def check(code: str) -> str:
    wait = code.find("griddepcontrol.wait")
    if wait < 0:
        raise AssertionError("no griddepcontrol.wait")
    first = min((m.start() for m in GLOBAL_ACCESS.finditer(code)), default=len(code))
    if first < wait:
        raise AssertionError(f"a global access before the wait: {code[first:first + 60]!r}")
    if code.find("griddepcontrol.launch_dependents") < wait:
        raise AssertionError("the next kernel is let launch before the wait")
    return "wait"


BF16 = "*bf16"
GEMV = dict(HAS_BIAS=False, FUSED_QUANT=True, BLOCK_M=1, BLOCK_N=8, BLOCK_K=512, PARTIAL=False, EXACT_ROUND=False,
            DEFER=True, QUANT_X=False)
GEMV_TYPES = {"X": BF16, "X_s": "*fp32", "W": BF16, "W_s": BF16, "Y": BF16, "P": "*fp32", "Bias": BF16}
FP8_TYPES = {**GEMV_TYPES, "W": "*fp8e4nv", "W_s": "*fp32"}
INT4_TYPES = {"X": BF16, "Perm": "*i32", "QW": "*i32", "Z": "*u8", "S": BF16, "Y": BF16, "P": "*fp32", "Bias": BF16}
INT4 = dict(GROUP=128, HAS_PERM=False, HAS_BIAS=False, BLOCK_N=64, BLOCK_W=16, EVEN_N=True, PARTIAL=True)
DECODE_TYPES = {"Q": BF16, "K": BF16, "V": BF16, "O": BF16, "mid_o": "*fp32", "mid_lse": "*fp32",
                "req_to_token": "*i32", "req_pool_indices": "*i64", "seq_lens": "*i64", "split_chunks": "*i64",
                "split_counts": "*i64", "K_new": BF16, "V_new": BF16, "new_slots": "*i64", "Sinks": "*fp32",
                "sm_scale": "fp32", "k_scale": "fp32", "v_scale": "fp32"}
HEAD_TYPES = {"X": BF16, "WQ": BF16, "WK": BF16, "OUT": BF16, "positions": "*i64", "cos_sin": "*fp32", "eps": "fp32"}
CASES = {
    "bf16 one-row GEMV, gated": (fp8._gemv_kernel, GEMV_TYPES, {**GEMV, "SCALED": False, "GATED": True}),
    "FP8 GEMV, W8A16, split K": (fp8._gemv_kernel, FP8_TYPES,
                                 {**GEMV, "SCALED": True, "BLOCK_N": 32, "DEFER": False, "PARTIAL": True, "GATED": False}),
    "FP8 GEMV, W8A8 in the kernel, gated": (fp8._gemv_kernel, FP8_TYPES,
                                            {**GEMV, "SCALED": True, "BLOCK_N": 16, "DEFER": False, "QUANT_X": True,
                                             "GATED": True}),
    "FP8 tl.dot GEMM": (fp8._gemm_kernel, {**FP8_TYPES, "X_s": "*fp32"},
                        dict(HAS_BIAS=False, FUSED_QUANT=True, BLOCK_M=16, BLOCK_N=64, SPLIT_K=1, GROUP_M=8,
                             UPCAST=False, EXACT_ROUND=False)),
    "FP8 activation quantizer": (fp8._quant_kernel, {"X": BF16, "Q": "*fp8e4nv", "S": "*fp32"},
                                 dict(BLOCK_R=16, EXACT_ROUND=False)),
    "split-K sum": (fp8._split_sum_kernel, {"P": "*fp32", "Y": BF16, "Bias": BF16},
                    dict(SPLIT_K=4, HAS_BIAS=False, BLOCK=1024)),
    "int4 GEMV on pairs": (int4._w4a16_half2_gemv_kernel, INT4_TYPES, INT4),
    "int4 nibble GEMV": (int4._w4a16_nibble_gemv_kernel, INT4_TYPES, INT4),
    "int4 tl.dot GEMM": (int4._w4a16_kernel, INT4_TYPES,
                         dict(GROUP=128, SCALE_ROWS=1, ROWS_PER_SCALE=128, HAS_PERM=False, HAS_BIAS=False, BLOCK_M=16,
                              BLOCK_N=128, BLOCK_K=128, PARTIAL=False, DOT=True, IEEE=False)),
    "add + RMSNorm": (fused_triton._add_rmsnorm_kernel, {"X": BF16, "R": BF16, "W": BF16, "OUT": BF16, "eps": "fp32"},
                      dict(HAS_RESIDUAL=True, BLOCK=4096)),
    "head RMSNorm": (fused_triton._head_rmsnorm_kernel, HEAD_TYPES, dict(BLOCK=128, ROPE=False)),
    "head RMSNorm + rope": (fused_triton._head_rmsnorm_kernel, HEAD_TYPES, dict(BLOCK=128, ROPE=True)),
    "SiLU and mul": (fused_triton._silu_and_mul_kernel, {"X": BF16, "OUT": BF16}, dict(BLOCK=1024)),
    "rope": (rope_triton._rope_kernel, {"X": BF16, "OUT": BF16, "positions": "*i64", "cos_sin": "*fp32"},
             dict(HALF=64, BLOCK_H=64, BLOCK_HALF=64)),
    "KV store": (store._store_kv_kernel, {"K": BF16, "V": BF16, "K_buf": BF16, "V_buf": BF16, "slots": "*i64",
                                          "k_scale": "fp32", "v_scale": "fp32"},
                 dict(BLOCK=1024, FP8_MAX=448.0, EXACT_ROUND=False)),
    "decode attention": (decode._decode_partial_kernel, DECODE_TYPES,
                         dict(GROUP=4, BLOCK_H=16, HEAD_DIM=128, BLOCK_D=128, BLOCK_N=64, USE_WINDOW=False, UPCAST=False,
                              PRECISION="tf32", DIRECT=False, PER_REQUEST_CHUNK=False, FP8_MAX=448.0, EXACT_ROUND=False,
                              HAS_SINKS=False, RING=0, FP16_DOTS=False)),
    "decode merge": (decode._decode_merge_kernel, {"mid_o": "*fp32", "mid_lse": "*fp32", "O": BF16,
                                                   "split_counts": "*i64", "Sinks": "*fp32"},
                     dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_S=16, PER_TOKEN_COUNT=False, HAS_SINKS=False)),
    "MoE up GEMV": (gemv_moe._up_kernel, {"X": BF16, "Ids": "*i64", "W13": BF16, "B13": BF16, "Act": BF16,
                                          "limit": "fp32", "alpha": "fp32"},
                    dict(BLOCK_N=16, BLOCK_K=512, ACT=0, HAS_BIAS=False)),
    "MoE down GEMV": (gemv_moe._down_kernel, {"Act": BF16, "Ids": "*i64", "W2": BF16, "B2": BF16,
                                              "Weights": "*fp32", "Out": "*fp32"},
                      dict(BLOCK_N=8, BLOCK_K=1024, HAS_BIAS=False)),
    "MoE combine": (gemv_moe._combine_kernel, {"Rows": "*fp32", "Ids": "*i64", "Shared": "*fp32", "Gate": "*fp32",
                                               "Out": BF16}, dict(TOP_K=8, BLOCK_N=256, HAS_SHARED=False,
                                                                   HAS_GATE=False)),
    "router logits": (route_kernels._logits_kernel, {"X": BF16, "W": "*fp32", "B": "*fp32", "Logits": "*fp32"},
                      dict(BLOCK_E=2, BLOCK_K=512, HAS_BIAS=False)),
    "router top-k": (route_kernels._select_kernel, {"Logits": "*fp32", "Ids": "*i64", "Weights": "*fp32"},
                     dict(TOP_K=8, BLOCK_E=128, SOFTMAX_FIRST=True, RENORMALIZE=True)),
    "argmax chunks": (argmax_triton._chunk_argmax_kernel, {"X": "*fp32", "values": "*fp32", "indices": "*i64"},
                      dict(BLOCK=4096)),
    "argmax best chunk": (argmax_triton._best_chunk_kernel, {"values": "*fp32", "indices": "*i64", "OUT": "*i64"},
                          dict(BLOCK_C=32)),
}


def main() -> int:
    warnings.filterwarnings("ignore")
    for name, (kernel, types, constexprs) in CASES.items():
        try:
            print(f"{name}: {check(ptx(kernel, types, constexprs))}", flush=True)
        except Exception as e:  # noqa: BLE001 - reported with the kernel's name
            print(f"{name}: FAILED {type(e).__name__}: {e}", flush=True)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env bash
# The H200 runs that session 6 (no device lent) left for the next session, one part per device call
# (each under 10 minutes). Needs the server's wheels for `tests`: scripts/fetch_server_wheels.sh here first,
# then carry ".whl"; the held-out texts for `dsv4` (the perplexity check) must travel in heldout_texts/
# (docs/benchmarks.md, "Runs still to make", says how).
# Usage: bash scripts/gpu_pending.sh PART       PART: tests | kernels | piecewise | offline | fp8 | dsv4
#        (in that order; six calls take more than one session's 30 minutes)
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
LLAMA="--model kestrel/assets/configs/llama-3.1-8b --load-format dummy"
S=$(date +%s)
case ${1:?a part: tests kernels piecewise offline fp8 dsv4} in
  kernels)  # issue 16: the FP8 GEMV at M <= 8 (decides GEMV_MAX_M); decode attention at mixed lengths (the split policy)
    timeout 230 python3 scripts/bench_fp8.py --gemv-only --budget 200 2>&1 | tail -40
    timeout 200 python3 scripts/bench_decode_mixed.py 2>&1 | tail -30
    for block_n in 64 128; do  # an FP8 pool read 0.305 ms vs bf16's 0.262 at 64 x 4096: too few bytes in flight?
      timeout 90 python3 scripts/bench_decode_mixed.py --kv-dtype fp8_e4m3 --block-n $block_n --cases r0-mid 64x4096 \
        --targets 4096 --chunks 1024 --json "$OUT/decode_mixed_fp8_n$block_n.json" 2>&1 | tail -8
    done ;;
  offline)  # issue 16's r=0 goals (6,000 tok/s bf16 KV, 8,000 fp8_e4m3) and item 5 in the engine
    for variant in "|" "_lensplit|--triton-decode-split length" "_fp8kv|--kv-cache-dtype fp8_e4m3"; do
      echo "== offline r=0 ${variant#*|}"
      OFFLINE4K_TIMEOUT=170 OFFLINE_TAG=${variant%%|*} OFFLINE_FLAGS=${variant#*|} bash scripts/gpu_check.sh offline4k_r0
    done ;;
  piecewise)  # issue 16 item 4 (ITL tail): piecewise CUDA graphs, and with them smaller chunks beside the decodes
    PW="--enable-mixed-chunk --enable-piecewise-cuda-graph"
    PROMPTS=160 bash scripts/gpu_piecewise.sh "mixed_pw_c2048|$PW --chunked-prefill-size 2048" \
      "mixed_pw_c1024|$PW --chunked-prefill-size 1024" ;;
  fp8)  # issue 16's batch-1 goals: bf16 (88 % of the floor) and --quantization fp8 (80 % of its own), dot vs GEMV
    bash scripts/gpu_check.sh bench1
    for max_m in 0 1; do
      echo "== one_batch --quantization fp8, GEMV_MAX_M=$max_m"
      timeout 100 python3 -c "import runpy, sys; import kestrel.layers.fp8_gemm_triton as g; g.GEMV_MAX_M = $max_m
sys.argv = ['one_batch'] + sys.argv[1:]; runpy.run_module('kestrel.bench.one_batch', run_name='__main__')" \
        $LLAMA --batch-size 1 --input-len 128 --output-len 128 --max-total-tokens 65536 --cuda-graph-max-bs 64 \
        --quantization fp8 --json "$OUT/one_batch_fp8_gemv$max_m.json" 2>&1 | grep -v "^\s*$" | tail -11
    done ;;
  dsv4)  # issue 15 with the sparse-attention kernel; issue 16's quality check on the H200
    timeout 200 python3 scripts/bench_dsv4.py 2>&1 | tail -25
    timeout 150 python3 scripts/bench_dsv4.py --kv-cache-dtype fp8_e4m3 --only kv_bytes,prefill,decode 2>&1 | tail -15
    timeout 120 python3 scripts/bench_dsv4_kernel.py --budget-s 90 2>&1 | tail -25
    timeout 100 python3 -m kestrel.bench.perplexity --compare --text heldout_texts/* --json "$OUT/perplexity.json" \
      2>&1 | grep -v INFO | tail -16 ;;
  tests)  # first: the new kernels (FP8 GEMV, length-aware split, V4 grouped-GEMM MoE) compile on triton 3.6
    timeout 400 python3 -m pytest tests/gpu -q -p no:cacheprovider -rf 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
    timeout 170 python3 scripts/bench_dsv4_moe.py --budget-s 150 2>&1 | tail -25 ;;
esac
echo "part $1: $(( $(date +%s) - S )) s"

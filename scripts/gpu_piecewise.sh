#!/usr/bin/env bash
# Piecewise CUDA graphs (issue 16, item 4), in one device call (~5-8 min on an H200):
#   1. lone 400- and 1000-token prefill forwards of the dummy Llama-3.1-8B, eager and with piecewise graphs
#      (CUDA events, median of 5; the graphs' memory; scripts/profile_prefill_step.py --compare);
#   2. the closed-loop serving workload (gpu_closed_loop.sh) with --enable-mixed-chunk, without and with them;
#   3. the GPU tests of tests/gpu/test_piecewise_graph_gpu.py.
# Usage: bash scripts/gpu_piecewise.sh      (PROMPTS=160 halves the closed loops; more closed-loop variants
#        "label|flags" in the array EXTRA_VARIANTS when sourced, or as arguments: bash scripts/gpu_piecewise.sh "l|flags")
EXTRA_VARIANTS=("$@")
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-/tmp/out}
echo "== prefill forwards"
timeout 200 python3 scripts/profile_prefill_step.py --compare 2>&1 | grep -vE "INFO|WARNING" | tail -30
bash scripts/gpu_closed_loop.sh "mixed|--enable-mixed-chunk" "mixed_pw|--enable-mixed-chunk --enable-piecewise-cuda-graph" \
  ${EXTRA_VARIANTS[@]+"${EXTRA_VARIANTS[@]}"}
echo "== tests"
timeout 120 python3 -m pytest -q -s tests/gpu/test_piecewise_graph_gpu.py 2>&1 | tail -8

#!/usr/bin/env bash
# Issue 16 item 4: the serving workload (dummy Llama-3.1-8B, 320 prompts, 64 in flight, input 200-1000,
# output 100-500) in process, without HTTP, one engine per scheduling variant; the table of each is printed.
# Usage: bash scripts/gpu_closed_loop.sh "label|engine flags" ...
# With piecewise CUDA graphs: "mixed_pw|--enable-mixed-chunk --enable-piecewise-cuda-graph" (gpu_piecewise.sh).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
for variant in "$@"; do
  label=${variant%%|*}; flags=${variant#*|}
  echo "== $label ($flags)"
  timeout 240 python3 -m kestrel.bench.closed_loop --model kestrel/assets/configs/llama-3.1-8b --load-format dummy \
    --num-prompts ${PROMPTS:-320} --max-concurrency 64 --json "$OUT/closed_$label.json" $flags 2>&1 \
    | grep -vE "INFO|WARNING" | tail -30
done

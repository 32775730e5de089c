#!/usr/bin/env bash
# The c64 closed loop with step-cost traces (kestrel bench closed-loop --cost-trace), one engine per entry,
# on a CUDA machine from the repository root:
#
#   bash scripts/cost_trace.sh OUT_DIR "LABEL|ENGINE FLAGS|PYTHON" ...
#
# Llama-3.1-8B shape, dummy weights, mixed chunks and piecewise CUDA graphs; PYTHON (optional) runs in the
# process before the engine is built, e.g. "import kestrel.engine.policy as p; p.AMORTIZE_PREFILL_STEP = False".
# Writes OUT_DIR/closed_LABEL.json and OUT_DIR/trace_LABEL.json.
set -u
OUT=${1:?usage: bash scripts/cost_trace.sh OUT_DIR "LABEL|ENGINE FLAGS|PYTHON" ...}
shift
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
for entry in "$@"; do
  IFS='|' read -r label flags setup <<< "$entry"
  echo "== $label (${flags:-no flags}${setup:+; $setup})"
  timeout "${TRACE_TIMEOUT:-200}" python3 -c "import sys
${setup:-pass}
from kestrel.bench.closed_loop import main; main(sys.argv[1:])" --model kestrel/assets/configs/llama-3.1-8b \
    --load-format dummy --enable-mixed-chunk --enable-piecewise-cuda-graph --num-prompts "${PROMPTS:-320}" \
    --max-concurrency 64 --json "$OUT/closed_$label.json" --cost-trace "$OUT/trace_$label.json" $flags 2>&1 \
    | grep -E "output_tok_per_s|itl_|ttft_p99|step_median|step_p99|step-cost model|GPU forward, MIXED"
done

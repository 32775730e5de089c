#!/usr/bin/env bash
# GPU checks after the defect fixes of round 3, one part per device call (each under 10 minutes).
# Carry ".whl" (scripts/fetch_server_wheels.sh) and, for `grammar`, ".tok": a Llama 3 tokenizer folder
# (scripts/llama3_tokenizer.py writes one from the `llama-models` package's tokenizer file) with its
# tokenizer.json gzipped.
# Usage: bash scripts/gpu_round3.sh PART       PART: grammar | tests
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=.:/tmp/site || exit 1
# The tokenizer travels gzipped: the working tree a device call carries is bounded.
mkdir -p /tmp/llama3 && cp .tok/llama3/tokenizer_config.json /tmp/llama3/ 2>/dev/null \
  && gunzip -c .tok/llama3/tokenizer.json.gz > /tmp/llama3/tokenizer.json
LLAMA="--model kestrel/assets/configs/llama-3.1-8b --load-format dummy --tokenizer /tmp/llama3"
case ${1:?a part: grammar tests} in
  grammar)  # mask work per decode step at batch 64: the goal is <= 5 % of the step
    for variant in "tool 1.0" "tool 0.5" "json 1.0"; do
      set -- $variant
      echo "== grammar $1, constrained fraction $2"
      timeout 150 python3 -m kestrel.bench.grammar $LLAMA --batch-size 64 --grammar $1 --constrained-fraction $2 \
        --output-len 96 --repeats 2 --json "$OUT/grammar_$1_$2.json" 2>&1 | grep -v "^\s*$" | tail -8
    done ;;
  tests)
    timeout ${TESTS_TIMEOUT:-560} python3 -m pytest tests/gpu -q --durations=10 2>&1 | tail -30 ;;
esac

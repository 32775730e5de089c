#!/usr/bin/env bash
# The whole H200 round in one device call (about 8 min): GPU tests, bs=1 decode latency, the 4k offline
# workload, then the serving benchmark with its bs=64 one-batch comparison. Each stage has its own
# time limit so one slow stage cannot take the others' results with it.
# Needs the server's wheels: run scripts/fetch_server_wheels.sh here first, then carry ".whl".
set -u
OUT=${OUT:-/tmp/out}
S=$(date +%s)
GPU_TESTS_TIMEOUT=200 OFFLINE4K_TIMEOUT=180 bash scripts/gpu_check.sh gpu bench1 offline4k_r0 2>&1
echo "after check: $(( $(date +%s) - S ))s"
SERVING_PROMPTS=192 ONE_BATCH_OUTPUT=100 bash scripts/gpu_serving.sh 2>&1
echo "total: $(( $(date +%s) - S ))s"

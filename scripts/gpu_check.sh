#!/usr/bin/env bash
# One device call: GPU tests, the CPU suite on the device's torch/transformers, and quick benchmarks.
# Usage (on the GPU machine, from the repo root): bash scripts/gpu_check.sh [stage ...]
# The offline stages take engine flags from OFFLINE_FLAGS and add OFFLINE_TAG to their JSON's name, e.g.
#   OFFLINE_FLAGS="--kv-cache-dtype fp8_e4m3" OFFLINE_TAG=_fp8kv bash scripts/gpu_check.sh offline4k_r0
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
stages=${*:-"gpu cpu bench"}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
for stage in $stages; do
  case $stage in
    gpu) timeout ${GPU_TESTS_TIMEOUT:-420} python3 -m pytest tests/gpu -q -p no:cacheprovider -rf 2>&1 | tee "$OUT/gpu_tests.log" | tail -15 ;;
    cpu) CUDA_VISIBLE_DEVICES= timeout 150 python3 -m pytest tests/model tests/e2e/test_engine.py \
           -q -p no:cacheprovider -x 2>&1 | tee "$OUT/cpu_tests.log" | tail -3 ;;
    bench)
      for bs in 1 64; do
        timeout 200 python3 -m kestrel.bench.one_batch --model kestrel/assets/configs/llama-3.1-8b --load-format dummy \
          --batch-size $bs --input-len 128 --output-len 128 --max-total-tokens 65536 --cuda-graph-max-bs 64 \
          --json "$OUT/one_batch_bs$bs.json" 2>&1 | grep -v "^\s*$" | tail -11
      done ;;
    bench1)  # bs=1 only
      timeout 120 python3 -m kestrel.bench.one_batch --model kestrel/assets/configs/llama-3.1-8b --load-format dummy \
        --batch-size 1 --input-len 128 --output-len 128 --max-total-tokens 65536 --cuda-graph-max-bs 64 \
        --json "$OUT/one_batch_bs1.json" 2>&1 | grep -v "^\s*$" | tail -11 ;;
    bench_sync)  # the same decode without overlap scheduling, to see what the overlap hides
      timeout 200 python3 -m kestrel.bench.one_batch --model kestrel/assets/configs/llama-3.1-8b --load-format dummy \
        --batch-size 1 --input-len 128 --output-len 128 --max-total-tokens 65536 --cuda-graph-max-bs 64 \
        --disable-overlap-schedule --json "$OUT/one_batch_bs1_sync.json" 2>&1 | grep -v "^\s*$" | tail -11 ;;
    profile)
      for bs in ${PROFILE_BS:-1 64}; do
        timeout 150 python3 scripts/profile_decode.py --batch-size $bs --steps 5 2>&1 | grep -v "Warn\|warn" \
          | cut -c1-150 | tee -a "$OUT/profile.log"
      done ;;
    offline512)
      timeout 300 python3 -m kestrel.bench.offline --model kestrel/assets/configs/llama-3.1-8b --load-format dummy \
        --num-prompts 1000 --random-input-len 512 --random-output-len 256 --random-range-ratio 1 \
        --transformers-batch-size 128 --transformers-prompts 256 --json "$OUT/offline_512_256.json" 2>&1 | tail -12 ;;
    offline4k_r0|offline4k_r1)  # SGLang's CI workload (r=0) and fixed lengths (r=1)
      r=${stage#offline4k_r}
      timeout ${OFFLINE4K_TIMEOUT:-290} python3 -m kestrel.bench.offline --model kestrel/assets/configs/llama-3.1-8b \
        --load-format dummy --num-prompts ${OFFLINE4K_PROMPTS:-500} --random-input-len 4096 --random-output-len 2048 --random-range-ratio $r \
        --json "$OUT/offline_4096_2048_r$r${OFFLINE_TAG:-}.json" ${OFFLINE_FLAGS:-} 2>&1 | tail -10 ;;
  esac
done

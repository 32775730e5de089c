#!/usr/bin/env bash
# Serving benchmark on the GPU machine: dummy Llama-3.1-8B behind `kestrel serve`, 64 concurrent streams
# with ShareGPT-like lengths (input 200-1000, output 100-500), and one-batch at bs=64 for comparison.
# Needs the server's wheels carried in .whl: run scripts/fetch_server_wheels.sh first, then carry ".whl".
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-/tmp/out}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=.:/tmp/site || exit 1
MODEL=kestrel/assets/configs/llama-3.1-8b
python3 -m kestrel.cli serve --model $MODEL --load-format dummy --port 30000 > "$OUT/server.log" 2>&1 &
server=$!
for _ in $(seq 240); do grep -q "ready on" "$OUT/server.log" && break; sleep 1; done
grep "ready on" "$OUT/server.log" || { tail -30 "$OUT/server.log"; exit 1; }
timeout 200 python3 -m kestrel.bench.serving --base-url http://127.0.0.1:30000 --num-prompts ${SERVING_PROMPTS:-320} --max-concurrency 64 \
  --random-input-len 1000 --random-output-len 500 --random-range-ratio 0.2 --vocab-size 128000 \
  --json "$OUT/serving_c64.json" 2>&1 | tail -12
kill -TERM $server; wait $server
timeout 150 python3 -m kestrel.bench.one_batch --model $MODEL --load-format dummy --batch-size 64 --input-len 600 \
  --output-len ${ONE_BATCH_OUTPUT:-300} --max-total-tokens 131072 --cuda-graph-max-bs 64 --json "$OUT/one_batch_bs64_600.json" 2>&1 | tail -11

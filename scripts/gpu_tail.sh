#!/usr/bin/env bash
# Tail latency under load (issue 16, item 4): the serving workload of gpu_serving.sh (dummy Llama-3.1-8B,
# 320 prompts, 64 concurrent, input 200-1000, output 100-500) against one server per scheduling variant.
# Usage: bash scripts/gpu_tail.sh "label|server flags" ...   (needs the server's wheels carried in .whl)
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=.:/tmp/site || exit 1
MODEL=kestrel/assets/configs/llama-3.1-8b
for variant in "$@"; do
  label=${variant%%|*}; flags=${variant#*|}
  python3 -m kestrel.cli serve --model $MODEL --load-format dummy --port 30000 $flags > "$OUT/server_$label.log" 2>&1 &
  server=$!
  for _ in $(seq 240); do grep -q "ready on" "$OUT/server_$label.log" && break; sleep 1; done
  if grep -q "ready on" "$OUT/server_$label.log"; then
    echo "== $label ($flags)"
    timeout 150 python3 -m kestrel.bench.serving --base-url http://127.0.0.1:30000 --num-prompts ${SERVING_PROMPTS:-320} \
      --max-concurrency 64 --random-input-len 1000 --random-output-len 500 --random-range-ratio 0.2 \
      --json "$OUT/tail_$label.json" 2>&1 | tail -11
    # The server's own ITL histogram (tokens as the HTTP process receives them from the engine), to tell
    # stalls in the engine from stalls on the way to the client.
    python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:30000/metrics').read().decode())" \
      | grep -E "inter_token_latency_seconds_(bucket|count)" > "$OUT/metrics_$label.txt"
    if [ -n "${SWEEP:-}" ]; then  # once, on the first variant's server: throughput and latency against concurrency
      timeout 200 python3 -m kestrel.bench.serving --base-url http://127.0.0.1:30000 --num-prompts 96 \
        --max-concurrency $SWEEP --random-input-len 1000 --random-output-len 200 --random-range-ratio 0.2 \
        --json "$OUT/serving_sweep.json" --plot "$OUT/serving_sweep.png" 2>&1 | grep -E "prompts|output tok/s|p99"
      SWEEP=
    fi
  else
    tail -20 "$OUT/server_$label.log"
  fi
  kill -TERM $server; wait $server
done

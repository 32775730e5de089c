#!/usr/bin/env bash
# The GPU runs of docs/benchmarks.md, by named stage, on a CUDA machine from the repository root:
#
#   bash scripts/gpu.sh OUT_DIR STAGE [STAGE ...]
#
# Every stage writes its JSON, logs and tables under OUT_DIR and has its own time limit, so one slow or
# failing stage leaves the others' results. The machine's GPU and library versions go to OUT_DIR/gpu.txt.
# The model is the Llama-3.1-8B shape with dummy weights unless a stage says otherwise.
#
# Stages:
#   tests           tests/gpu and the unit tests whose kernels run on CUDA when present (TESTS_TIMEOUT, default 420 s)
#   cpu-tests       the model and engine tests on this machine's torch / transformers, GPU hidden
#   one-batch       decode latency at batch 1 and 64, 128 / 128 tokens (ONE_BATCH_BS: the batch sizes)
#   one-batch-sync  batch 1 without overlap scheduling, to see what the overlap hides
#   one-batch-fp8   batch 1 with --quantization fp8, through the tl.dot path (GEMV_MAX_M=0) and the GEMV (1)
#   profile-decode  kernels of eager decode steps per batch size (PROFILE_BS, default "1 64"): --profile tables
#   offline-512     1000 x 512/256 prompts against transformers generate() at batch 128
#   offline-4k-r0   500 x 4096/2048, random range ratio 0 (SGLang's CI workload); -r1: fixed lengths.
#   offline-4k-r1   OFFLINE_FLAGS: engine flags, OFFLINE_TAG: a suffix for the JSON's name, OFFLINE_PROMPTS,
#                   OFFLINE_TIMEOUT (default 290 s), OFFLINE_SETUP: Python run in the process before the engine
#   serving         `kestrel serve` + the HTTP benchmark at concurrency 64 (SERVING_PROMPTS, default 320), then
#                   one-batch at batch 64 with 600-token prompts (ONE_BATCH_OUTPUT output tokens, default 300)
#   tail            the serving workload against one server per variant in VARIANTS, with the server's own ITL
#                   histogram; SWEEP="8 32 64": also a concurrency sweep with its plot on the first server
#   slo             the serving workload (c64) against a server without --itl-target-ms and one per target in
#                   SLO_TARGETS (default "20 30 50" ms); then on each, Poisson arrivals at 80 % of the first
#                   server's measured request rate (SLO_POISSON_PROMPTS, default 200); a lone request's TTFT;
#                   a table of output tok/s, ITL and TTFT median / p99 per variant (slo_table.txt) and the c64
#                   ITL p99 and tok/s against the target (slo_sweep.png); SLO_FLAGS:
#                   server flags every variant takes (e.g. "--enable-mixed-chunk")
#   closed-loop     the serving workload in process (kestrel bench closed-loop), one engine per variant in VARIANTS
#                   (PROMPTS, default 320)
#   mixed-decodes   the c64 closed loop with mixed chunks and piecewise graphs, a MIXED step's decodes through the
#                   extend kernel, then through the decode kernel (triton_backend.DECODE_KERNEL_FOR_MIXED_DECODES),
#                   with every step's shape, time and prediction (OUT/trace_split_*.json); its GPU test. < 4 min
#   trace           the c64 closed loop with mixed chunks and piecewise graphs, traced (OUT/trace_default.json), and
#                   its slow MIXED steps: wall against GPU time with the host phases. < 2.5 min
#   piecewise       lone 400- and 1000-token prefills eager and with piecewise CUDA graphs; the closed loop with
#                   --enable-mixed-chunk without and with them (and VARIANTS); tests/gpu/test_piecewise_graph_gpu.py
#   grammar         grammar masks per decode step at batch 64 (tool call, half tool call, JSON schema); needs
#                   a Llama 3 tokenizer in .tok/llama3 (scripts/llama3_tokenizer.py, tokenizer.json gzipped)
#   spec            kestrel bench spec demo and llama8b, with a kernel profile of the 5/4/8 round at batch 1
#   eagle3-train    an EAGLE-3 head for SPEC_MODEL trained on the GPU into SPEC_HEAD (EAGLE3_TRAIN_FLAGS: the
#                   script's flags, e.g. --prompts, --gen-tokens, --time-budget); OUT/eagle3_training_info.json.
#                   A Python without the stdlib's test/ folder gets demo's held-out files from heldout_texts/ (dsv4)
#   spec-chat       kestrel bench spec chat: a chat model (SPEC_MODEL, e.g. the SmolLM2 GGUF) and its head (SPEC_HEAD,
#                   SPEC_ALGORITHM, default EAGLE3) on the head's held-out prompts, plain / chain / tree at
#                   batch 1, 8, 32: measured speedup and accept length (SPEC_CHAT_FLAGS: the bench's other flags)
#   kernels         the FP8 GEMV at M <= 8; decode attention at mixed lengths, bf16 and over an FP8 pool
#   decode-launch   the decode kernel's launch configurations at 256 x 2048
#   prefill-attention  the Triton extend kernel and the sdpa backend against torch's SDPA kernels
#   fp8             the FP8 GEMMs and decode attention, every method and the sweeps (kestrel.bench.kernels.fp8)
#   dsv4            the DeepSeek-V4 slice (bf16 and FP8 entries), its sparse attention alone, and the perplexity
#                   comparison on demo's held-out files, which travel in heldout_texts/ (docs/benchmarks.md)
#   dsv4-layers     the slice's attention layers against the dense one at 32k (kestrel.bench.dsv4 --only layers), with
#                   the decode kernels of the compressors and the indexer and the window read from its ring in place
#                   off, then on (compressor.DECODE_KERNEL, dsv4.DECODE_WINDOW_IN_RING). < 5 min
#   dsv4-moe        DeepSeek-V4's routed experts: every expert, the grouped GEMM, the loop
#   moe             Qwen3-30B-A3B and gpt-oss-20b (dummy weights; MOE_MODELS: a subset of "qwen3-30b-a3b
#                   gpt-oss-20b"): one-batch decode at batch 1, 32, 128 against the floor of the experts a step
#                   is expected to hit; offline MOE_PROMPTS (default 500) x 1024/512; a lone 8k prefill. < 9 min
#   moe-paths       the MoE layer's routed paths (every, fused, gemv, loop) at both families' widths, T = 1 .. 256
#                   tokens: what sets EVERY_EXPERT_MAX (kestrel.bench.kernels.moe_paths); at T <= 4 also the whole
#                   layer, today's decode against the fused decode route. < 3 min; one command with `moe` may
#                   pass 10 min: run them as two
#   moe-decode-route  one-batch at batch 1 and 4 (graphs up to 4) with paths.FUSED_DECODE_ROUTE off, then on, one
#                   process each (MOE_MODELS as `moe`). < 8 min
#   mla             MLA decode attention alone at 32k context, batch 1 and 32, bf16 and FP8 pools, against the
#                   latent-bytes floor (kestrel.bench.kernels.mla_decode); the deepseek-v3 slice's one-batch at
#                   batch 1 and 32 and its lone 8k prefill. < 6 min
#   fp8-pool        decode attention over an FP8 pool with its dots in fp16 (triton/decode.py FP8_POOL_FP16_DOTS): the
#                   FP8 GPU tests with it on, and the mixed-length kernel bench off, then on. < 4 min
#   one-row-gemv    its GPU test; one-batch at batch 1 with float linears through cuBLAS, then the one-row GEMV
#                   (kestrel.layers.one_row_gemv.ENABLED); batch 1 with --quantization fp8 and llama-3.1-8b-awq. < 7 min
#   fp8-w8a16       the FP8 GEMV sweep at M <= 8 with W8A16 configs (GemvConfig.quantize_x False), then batch 1 with
#                   --quantization fp8 with fp8_gemm_triton.GEMV_QUANTIZE_X True, then False. < 6 min
#   one-row-defaults  the FP8 and int4 GPU tests; batch 1 with --quantization fp8 at the one-row defaults, then the earlier
#                   ones (activations quantized, the split rule, no ONE_ROW_TUNED); llama-3.1-8b-awq
#                   at batch 1. < 5 min
#   int4-half2      the int4 GPU tests, the W4A16 GEMVs at M = 1 (nibbles, and on pairs: Int4GemmConfig.half2), then
#                   llama-3.1-8b-awq at batch 1 with int4_gemm_triton.HALF2 off, then on. < 6 min
#   moe-bs1         Qwen3-30B-A3B and gpt-oss-20b at batch 1 (graphs up to 1), then Qwen3's eager kernels at batch 1
#                   (OUT/moe_profile_bs1.txt). < 5 min
#   int4-m1         the W4A16 GEMM's GEMVs at M = 1 (the nibble GEMV and the other; < 3 min), then llama-3.1-8b-awq
#                   one-batch at batch 1 without and with the nibble GEMV as default_config's (NIBBLE_TILE). < 7 min
#   pdl             programmatic dependent launch and the activation inside the down GEMV: the GPU tests of the
#                   kernels they touch, then batch 1 (graphs up to 1) of PDL_MODELS (default "bf16 fp8 awq": the 8B in
#                   bf16, with --quantization fp8, llama-3.1-8b-awq), one process a model, its variants in turn twice
#                   (kestrel.bench.variants): base (neither), pdl (kestrel/pdl.py), gated (one_row_gemv.GATED_DOWN;
#                   not for awq), pdl_gated (both, the default). PDL_TESTS=0 leaves the tests out. < 5 min
#   pdl-moe         PDL off and on for Qwen3-30B-A3B and gpt-oss-20b at batch 1 (MOE_MODELS as `moe`). < 5 min
#   int4            llama-3.1-8b-awq one-batch at batch 1 and 64 against its 4-bit floor, the bf16 8B beside it
#                   (the ratio from one machine), and the W4A16 GEMM's config sweep at the 8B's projection shapes,
#                   M = 1, 4, 16, 64 (kestrel.bench.kernels.int4_gemm). < 9 min
#
# VARIANTS: "label|engine or server flags" entries separated by ";", e.g. "default|;mixed|--enable-mixed-chunk".
# Stages that start a server, and `tests` and `grammar`, need the server's pure-Python dependencies: where this
# machine lacks them, run scripts/fetch_server_wheels.sh on a machine that has them and bring .whl/ along.
set -u
OUT=${1:?usage: bash scripts/gpu.sh OUT_DIR STAGE [STAGE ...]}
shift
[ $# -gt 0 ] || { echo "gpu.sh: name at least one stage (the list is at the top of scripts/gpu.sh)" >&2; exit 2; }
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
LLAMA="--model kestrel/assets/configs/llama-3.1-8b --load-format dummy"
ONE_BATCH="$LLAMA --input-len 128 --output-len 128 --max-total-tokens 65536 --cuda-graph-max-bs 64"
AWQ_BS1="--model kestrel/assets/configs/llama-3.1-8b-awq --load-format dummy --batch-size 1 --input-len 128 \
  --output-len 128 --max-total-tokens 65536 --cuda-graph-max-bs 1"
SERVER_LOG_WAIT=240

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', \
transformers.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
git rev-parse --short HEAD 2>/dev/null | sed 's/^/commit /' | tee -a "$OUT/gpu.txt"

server_deps() {  # the wheels in .whl/, where there are any, into a private site folder
  if ls .whl/*.whl > /dev/null 2>&1 && [ -z "${SERVER_DEPS:-}" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl || return 1
    export PYTHONPATH=$PYTHONPATH:/tmp/site SERVER_DEPS=1
  fi
}

start_server() {  # start_server LOG FLAGS...: a dummy-weight server on port 30000; its pid in $server
  local log=$1
  shift
  python3 -m kestrel.cli serve $LLAMA --port 30000 "$@" > "$log" 2>&1 &
  server=$!
  for _ in $(seq $SERVER_LOG_WAIT); do
    grep -q "ready on" "$log" && return 0
    kill -0 "$server" 2> /dev/null || break  # it died at start-up: no use waiting
    sleep 1
  done
  tail -30 "$log"
  stop_server
  return 1
}

stop_server() {
  kill -TERM "$server" 2> /dev/null
  wait "$server"
}

each_variant() {  # each_variant FUNCTION: FUNCTION LABEL FLAGS for every "label|flags" entry of VARIANTS
  local entry
  IFS=';' read -ra entries <<< "${VARIANTS:-default|}"
  for entry in "${entries[@]}"; do
    "$1" "${entry%%|*}" "${entry#*|}"
  done
}

one_batch() {  # one_batch TIMEOUT JSON_NAME FLAGS...
  local limit=$1 name=$2
  shift 2
  timeout "$limit" python3 -m kestrel.cli bench one-batch "$@" --json "$OUT/$name.json" 2>&1 \
    | grep -v "^\s*$" | grep -v " INFO " | tail -14
}

one_batch_set() {  # one_batch_set TIMEOUT PYTHON JSON_NAME FLAGS...: one_batch with PYTHON run in the process
  # first, to set a module constant before the model is built (TAIL: result lines shown, default 9)
  local limit=$1 setup=$2 name=$3
  shift 3
  timeout "$limit" python3 -c "import sys
$setup
from kestrel.cli import main; sys.exit(main(['bench', 'one-batch'] + sys.argv[1:]))" "$@" --json "$OUT/$name.json" \
    2>&1 | grep -v "^\s*$" | grep -v " INFO " | tail -"${TAIL:-9}"
}

offline_4k() {  # offline_4k RATIO; OFFLINE_SETUP: Python run in the process first (e.g. setting a module constant)
  timeout "${OFFLINE_TIMEOUT:-290}" python3 -c "import sys
${OFFLINE_SETUP:-}
from kestrel.cli import main; sys.exit(main(['bench', 'offline'] + sys.argv[1:]))" $LLAMA --num-prompts "${OFFLINE_PROMPTS:-500}" \
    --random-input-len 4096 --random-output-len 2048 --random-range-ratio "$1" \
    --json "$OUT/offline_4096_2048_r$1${OFFLINE_TAG:-}.json" ${OFFLINE_FLAGS:-} 2>&1 | tail -10
}

traced_closed_loop() {  # traced_closed_loop LABEL PYTHON: the closed loop with mixed chunks and piecewise graphs,
  # PYTHON run in the process before the engine is built, every step the step-cost model observes in
  # OUT/trace_LABEL.json (kestrel bench closed-loop --cost-trace)
  echo "== closed loop $1 ($2)"
  timeout "${TRACE_TIMEOUT:-200}" python3 -c "import sys
$2
from kestrel.bench.closed_loop import main; main(sys.argv[1:])" $LLAMA --enable-mixed-chunk --enable-piecewise-cuda-graph \
    --num-prompts "${PROMPTS:-320}" --max-concurrency 64 --json "$OUT/closed_$1.json" --cost-trace "$OUT/trace_$1.json" \
    2>&1 | grep -E "output_tok_per_s|itl_|ttft_p99|step_median|step_p99|GPU forward, MIXED"
  slow_steps "$OUT/trace_$1.json"
}

slow_steps() {  # slow_steps TRACE: the slowest MIXED steps of a traced closed loop, wall against GPU time
  python3 - "$1" <<'PY'
import json, statistics, sys
timeline = json.load(open(sys.argv[1]))["step_timeline"]
mixed = [(i, row) for i, row in enumerate(timeline) if row[0] == "MIXED" and row[5] is not None]
if mixed:
    typical = statistics.median(row[3] for _, row in mixed)
    slow = [(i, row) for i, row in mixed if row[3] > 2 * typical]
    print(f"MIXED steps {len(mixed)}, median {typical:.1f} ms, {len(slow)} over twice that; wall / GPU ms, phases:")
    for i, row in slow[:40]:
        phases = " ".join(f"{k} {v:.1f}" for k, v in row[4].items())
        print(f"  step {i:5d} {row[1]:3d} reqs {row[2]:5d} tok  wall {row[3]:6.1f}  gpu {row[5]:6.1f}  {phases}")
PY
}

closed_loop() {  # closed_loop LABEL FLAGS
  echo "== closed loop $1 ($2)"
  timeout 240 python3 -m kestrel.cli bench closed-loop $LLAMA --num-prompts "${PROMPTS:-320}" --max-concurrency 64 \
    --json "$OUT/closed_$1.json" $2 2>&1 | grep -vE "INFO|WARNING" | tail -30
}

tail_variant() {  # tail_variant LABEL FLAGS: the serving workload against a fresh server
  start_server "$OUT/server_$1.log" $2 || return 1
  echo "== $1 ($2)"
  timeout 150 python3 -m kestrel.cli bench serving --base-url http://127.0.0.1:30000 \
    --num-prompts "${SERVING_PROMPTS:-320}" --max-concurrency 64 --random-input-len 1000 --random-output-len 500 \
    --random-range-ratio 0.2 --json "$OUT/tail_$1.json" 2>&1 | tail -11
  # The server's own ITL histogram (tokens as the HTTP process receives them from the engine), to tell
  # stalls in the engine from stalls on the way to the client.
  python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:30000/metrics').read().decode())" \
    | grep -E "inter_token_latency_seconds_(bucket|count)" > "$OUT/metrics_$1.txt"
  if [ -n "${SWEEP:-}" ]; then  # once, on the first variant's server: throughput and latency against concurrency
    timeout 200 python3 -m kestrel.cli bench serving --base-url http://127.0.0.1:30000 --num-prompts 96 \
      --max-concurrency $SWEEP --random-input-len 1000 --random-output-len 200 --random-range-ratio 0.2 \
      --json "$OUT/serving_sweep.json" --plot "$OUT/serving_sweep.png" 2>&1 | grep -E "prompts|output tok/s|p99"
    SWEEP=
  fi
  stop_server
}

slo_variant() {  # slo_variant LABEL FLAGS: c64 and Poisson runs against a fresh server
  start_server "$OUT/server_slo_$1.log" $2 ${SLO_FLAGS:-} || return 1
  echo "== $1 (${2:-no target})"
  grep -h "step-cost model" "$OUT/server_slo_$1.log" | tail -1
  local workload="--random-input-len 1000 --random-output-len 500 --random-range-ratio 0.2 --vocab-size 128000"
  timeout 200 python3 -m kestrel.cli bench serving --base-url http://127.0.0.1:30000 $workload \
    --num-prompts "${SERVING_PROMPTS:-320}" --max-concurrency 64 --json "$OUT/slo_c64_$1.json" 2>&1 | tail -11
  if [ -z "${slo_rate:-}" ]; then  # the first server's capacity sets the Poisson rate of every variant
    slo_rate=$(python3 -c "import json; print(round(0.8 * json.load(open('$OUT/slo_c64_$1.json'))['request_per_s'], 2))")
    echo "Poisson rate: $slo_rate requests/s (80 % of $1's)"
    timeout 60 python3 -m kestrel.cli bench serving --base-url http://127.0.0.1:30000 $workload --num-prompts 8 \
      --max-concurrency 1 --json "$OUT/slo_lone.json" 2>&1 | grep -i ttft
  fi
  timeout 200 python3 -m kestrel.cli bench serving --base-url http://127.0.0.1:30000 $workload \
    --num-prompts "${SLO_POISSON_PROMPTS:-200}" --request-rate "$slo_rate" --json "$OUT/slo_poisson_$1.json" 2>&1 | tail -11
  stop_server
}

slo_table() {  # the variants side by side, from their JSON
  python3 - "$OUT" <<'PY' | tee "$OUT/slo_table.txt"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
lone = json.loads((out / "slo_lone.json").read_text())["ttft_median_ms"] if (out / "slo_lone.json").exists() else None
print(f"lone request TTFT median: {lone:.1f} ms" if lone else "lone request TTFT: not measured")
print(f"{'variant':<10} {'run':<8} {'out tok/s':>9} {'ITL med':>8} {'ITL p99':>8} {'TTFT med':>9} {'TTFT p99':>9}")
def variant_order(path):  # no target first, then the targets from the smallest
    label = path.stem.split("_", 2)[2]
    return label != "off", float(label[3:]) if label.startswith("itl") else 0.0
for path in sorted(out.glob("slo_c64_*.json"), key=variant_order) + sorted(out.glob("slo_poisson_*.json"), key=variant_order):
    r = json.loads(path.read_text())
    run, label = path.stem.split("_", 2)[1:]
    print(f"{label:<10} {run:<8} {r['output_tok_per_s']:>9.0f} {r['itl_median_ms']:>8.2f} {r['itl_p99_ms']:>8.2f} "
          f"{r['ttft_median_ms']:>9.1f} {r['ttft_p99_ms']:>9.1f}")
# The first wave: 64 prompts arrive together; the last of them cannot see its first token before all 64 are
# prefilled. At a lone request's prefill rate (its prompt tokens over its TTFT, HTTP included) that takes:
lone_run = json.loads((out / "slo_lone.json").read_text()) if (out / "slo_lone.json").exists() else None
for path in sorted(out.glob("slo_c64_*.json"), key=variant_order):
    r = json.loads(path.read_text())
    if lone_run and "ttft_first_wave_max_ms" in r:
        rate = lone_run["input_tokens"] / lone_run["num_prompts"] / (lone_run["ttft_median_ms"] / 1e3)
        wave = r["input_tokens"] / r["num_prompts"] * r["max_concurrency"]
        print(f"{path.stem.split('_', 2)[2]:<10} first wave: TTFT median {r['ttft_first_wave_median_ms']:.0f} ms, "
              f"max {r['ttft_first_wave_max_ms']:.0f} ms; its ~{wave:,.0f} prompt tokens at the lone prefill rate "
              f"({rate:,.0f} tok/s): {wave / rate * 1e3:.0f} ms")
# The c64 sweep over the target: ITL p99 and output tok/s against it (no target drawn as dashed lines).
c64 = {path.stem.split("_", 2)[2]: json.loads(path.read_text()) for path in out.glob("slo_c64_*.json")}
targets = sorted((float(k[3:]), v) for k, v in c64.items() if k.startswith("itl"))
if targets:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (itl, rate) = plt.subplots(1, 2, figsize=(9, 3.5))
    xs = [t for t, _ in targets]
    itl.plot(xs, [r["itl_p99_ms"] for _, r in targets], "o-", label="ITL p99")
    itl.plot(xs, [r["itl_median_ms"] for _, r in targets], "s-", label="ITL median")
    itl.plot(xs, xs, ":", color="gray", label="the target")
    rate.plot(xs, [r["output_tok_per_s"] for _, r in targets], "o-")
    if "off" in c64:
        itl.axhline(c64["off"]["itl_p99_ms"], ls="--", color="C0", label="ITL p99, no target")
        rate.axhline(c64["off"]["output_tok_per_s"], ls="--", color="C0", label="no target")
        rate.axhline(0.95 * c64["off"]["output_tok_per_s"], ls=":", color="C0", label="95 % of no target")
        rate.legend()
    itl.set(xlabel="--itl-target-ms", ylabel="ms", title="c64 inter-token latency")
    rate.set(xlabel="--itl-target-ms", ylabel="output tok/s", title="c64 throughput")
    itl.legend()
    fig.tight_layout()
    fig.savefig(out / "slo_sweep.png", dpi=110)
PY
}

run_stage() {
  case $1 in
    tests)
      server_deps || return 1
      # With tests/gpu, the unit tests whose kernels run on CUDA when it is there (bf16 cases included).
      timeout "${TESTS_TIMEOUT:-420}" python3 -m pytest tests/gpu tests/unit/test_fused_kernels.py \
        tests/unit/test_dsv4_triton_ops.py tests/model/test_dsv4_compress_decode.py tests/unit/test_mla_triton.py -q \
        -p no:cacheprovider -rf --durations=10 2>&1 \
        | tee "$OUT/gpu_tests.log" | tail -25 ;;
    cpu-tests)
      CUDA_VISIBLE_DEVICES= timeout 150 python3 -m pytest tests/model tests/e2e/test_engine.py -q -p no:cacheprovider \
        -x 2>&1 | tee "$OUT/cpu_tests.log" | tail -3 ;;
    one-batch)
      for bs in ${ONE_BATCH_BS:-1 64}; do one_batch 200 "one_batch_bs$bs" $ONE_BATCH --batch-size "$bs"; done ;;
    one-batch-sync)
      one_batch 200 one_batch_bs1_sync $ONE_BATCH --batch-size 1 --disable-overlap-schedule ;;
    one-batch-fp8)
      for max_m in 0 1; do  # GEMV_MAX_M is a module constant: set it in the process before the benchmark runs
        echo "== one-batch --quantization fp8, GEMV_MAX_M=$max_m"
        TAIL=11 one_batch_set 100 "import kestrel.layers.fp8_gemm_triton as g; g.GEMV_MAX_M = $max_m" \
          "one_batch_fp8_gemv$max_m" $ONE_BATCH --batch-size 1 --quantization fp8
      done ;;
    profile-decode)
      for bs in ${PROFILE_BS:-1 64}; do
        one_batch 150 "profile_decode_bs$bs" $LLAMA --attention-backend triton --disable-cuda-graph --batch-size "$bs" \
          --input-len 256 --output-len 8 --profile "$OUT/profile_decode_bs$bs.txt"
        head -25 "$OUT/profile_decode_bs$bs.txt"
      done ;;
    offline-512)
      timeout 300 python3 -m kestrel.cli bench offline $LLAMA --num-prompts 1000 --random-input-len 512 \
        --random-output-len 256 --random-range-ratio 1 --transformers-batch-size 128 --transformers-prompts 256 \
        --json "$OUT/offline_512_256.json" 2>&1 | tail -12 ;;
    offline-4k-r0) offline_4k 0 ;;
    offline-4k-r1) offline_4k 1 ;;
    serving)
      server_deps || return 1
      start_server "$OUT/server.log" || return 1
      timeout 200 python3 -m kestrel.cli bench serving --base-url http://127.0.0.1:30000 \
        --num-prompts "${SERVING_PROMPTS:-320}" --max-concurrency 64 --random-input-len 1000 --random-output-len 500 \
        --random-range-ratio 0.2 --vocab-size 128000 --json "$OUT/serving_c64.json" 2>&1 | tail -12
      stop_server
      one_batch 150 one_batch_bs64_600 $LLAMA --batch-size 64 --input-len 600 --output-len "${ONE_BATCH_OUTPUT:-300}" \
        --max-total-tokens 131072 --cuda-graph-max-bs 64 ;;
    tail)
      server_deps || return 1
      each_variant tail_variant ;;
    slo)
      server_deps || return 1
      slo_rate=
      slo_variant off ""
      for target in ${SLO_TARGETS:-20 30 50}; do slo_variant "itl$target" "--itl-target-ms $target"; done
      slo_table ;;
    closed-loop)
      each_variant closed_loop ;;
    mixed-decodes)
      timeout 60 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_triton_mixed_gpu.py 2>&1 | tail -2
      for split in False True; do
        TRACE_TIMEOUT=100 traced_closed_loop "split_$split" \
          "import kestrel.attention.triton_backend as t; t.DECODE_KERNEL_FOR_MIXED_DECODES = $split"
      done ;;
    trace)
      TRACE_TIMEOUT=120 traced_closed_loop default "pass" ;;
    piecewise)
      for flags in "" "--enable-piecewise-cuda-graph"; do
        for len in 400 1000; do
          echo "== lone $len-token prefill ${flags:-eager}"
          one_batch 150 "prefill_${len}${flags:+_piecewise}" $LLAMA --batch-size 1 --input-len "$len" --output-len 4 \
            $flags | grep -E "prefill|batch size"
        done
      done
      VARIANTS="mixed|--enable-mixed-chunk;mixed_pw|--enable-mixed-chunk --enable-piecewise-cuda-graph${VARIANTS:+;$VARIANTS}" \
        each_variant closed_loop
      timeout 120 python3 -m pytest -q -s tests/gpu/test_piecewise_graph_gpu.py 2>&1 | tail -8 ;;
    grammar)
      server_deps || return 1
      # The tokenizer travels gzipped: the working tree a copy to the GPU machine carries may be bounded.
      mkdir -p /tmp/llama3 && cp .tok/llama3/tokenizer_config.json /tmp/llama3/ \
        && gunzip -c .tok/llama3/tokenizer.json.gz > /tmp/llama3/tokenizer.json || return 1
      for variant in "tool 1.0" "tool 0.5" "json 1.0"; do
        set -- $variant
        echo "== grammar $1, constrained fraction $2"
        timeout 150 python3 -m kestrel.cli bench grammar $LLAMA --tokenizer /tmp/llama3 --batch-size 64 --grammar "$1" \
          --constrained-fraction "$2" --output-len 96 --repeats 2 --json "$OUT/grammar_$1_$2.json" 2>&1 \
          | grep -v "^\s*$" | tail -8
      done ;;
    spec)
      timeout 280 python3 -m kestrel.cli bench spec demo --json "$OUT/spec_demo.json" 2>&1 | grep -v INFO | tail -12
      timeout 300 python3 -m kestrel.cli bench spec llama8b --json "$OUT/spec_llama8b.json" \
        --profile "$OUT/spec_profile.txt" 2>&1 | grep -v INFO | tail -14 ;;
    eagle3-train)
      # An EAGLE-3 head for SPEC_MODEL (a chat model: GGUF file or folder) trained on this GPU into SPEC_HEAD
      # (scripts/train_eagle_head.py --device cuda; EAGLE3_TRAIN_FLAGS: its other flags); its record to OUT.
      server_deps || return 1  # gguf, for a GGUF target
      local stdlib
      stdlib=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
      if [ ! -d "$stdlib/test" ]; then  # held-out prompts come from demo's held-out files, in the stdlib's test/
        local f name
        for f in heldout_texts/*; do  # named as docs/benchmarks.md writes them: "/" as "__"
          name=$(basename "$f")
          name=${name//__//}
          mkdir -p "$stdlib/$(dirname "$name")" && cp "$f" "$stdlib/$name" || return 1
        done
      fi
      timeout "${EAGLE3_TRAIN_TIMEOUT:-560}" python3 scripts/train_eagle_head.py --variant eagle3 --device cuda \
        --target "$SPEC_MODEL" --out "$SPEC_HEAD" $EAGLE3_TRAIN_FLAGS 2>&1 | grep -v "it/s\]" | tail -30
      cp "$SPEC_HEAD/training_info.json" "$OUT/eagle3_training_info.json" ;;
    spec-chat)
      server_deps || return 1  # gguf, for a GGUF target
      timeout "${SPEC_CHAT_TIMEOUT:-400}" python3 -m kestrel.cli bench spec chat --model "$SPEC_MODEL" \
        --speculative-algorithm "${SPEC_ALGORITHM:-EAGLE3}" --speculative-draft-model-path "$SPEC_HEAD" \
        --prompts-file "$SPEC_HEAD/training_info.json" --json "$OUT/spec_chat.json" $SPEC_CHAT_FLAGS 2>&1 \
        | grep -v INFO | tail -12 ;;
    kernels)
      timeout 230 python3 -m kestrel.bench.kernels.fp8 --gemv-only --budget 200 2>&1 | tail -40
      timeout 200 python3 -m kestrel.bench.kernels.decode_attention 2>&1 | tail -30
      for block_n in 64 128; do  # an FP8 pool read slower than bf16 at 64 x 4096: too few bytes in flight?
        timeout 90 python3 -m kestrel.bench.kernels.decode_attention --kv-dtype fp8_e4m3 --block-n $block_n \
          --cases r0-mid 64x4096 --targets 4096 --chunks 1024 --json "$OUT/decode_mixed_fp8_n$block_n.json" 2>&1 \
          | tail -8
      done ;;
    decode-launch)
      timeout 200 python3 -m kestrel.bench.kernels.decode_attention --cases 256x2048 --launch-sweep \
        --json "$OUT/decode_launch.json" 2>&1 | tail -16 ;;
    prefill-attention)
      timeout 300 python3 -m kestrel.bench.kernels.prefill_attention 2>&1 | tail -50 ;;
    fp8)
      timeout 400 python3 -m kestrel.bench.kernels.fp8 --budget 300 2>&1 | tail -60 ;;
    dsv4)
      timeout 200 python3 -m kestrel.bench.dsv4 2>&1 | tail -25
      timeout 150 python3 -m kestrel.bench.dsv4 --kv-cache-dtype fp8_e4m3 --only kv_bytes,prefill,decode 2>&1 | tail -15
      timeout 120 python3 -m kestrel.bench.kernels.dsv4_attention --budget-s 90 2>&1 | tail -25
      timeout 100 python3 -m kestrel.cli bench perplexity --compare --text heldout_texts/* \
        --json "$OUT/perplexity.json" 2>&1 | grep -v INFO | tail -16 ;;
    dsv4-layers)
      timeout 100 python3 -m pytest -q -p no:cacheprovider tests/model/test_dsv4_compress_decode.py \
        tests/unit/test_dsv4_triton_ops.py 2>&1 | tail -3
      for on in False True; do  # the decode kernels and the window read in place off, then on
        echo "== dsv4 layers, compressor.DECODE_KERNEL = dsv4.DECODE_WINDOW_IN_RING = $on"
        OUT="$OUT/dsv4_layers_$on" timeout 150 python3 -c "import sys
import kestrel.models.deepseek_v4.compressor as c, kestrel.attention.dsv4 as d
c.DECODE_KERNEL = d.DECODE_WINDOW_IN_RING = $on
from kestrel.bench.dsv4 import main; sys.exit(main(sys.argv[1:]))" --only layers 2>&1 | grep -v INFO | tail -8
      done ;;
    dsv4-moe)
      timeout 170 python3 -m kestrel.bench.kernels.dsv4_moe --budget-s 150 2>&1 | tail -25 ;;
    moe)
      for model in ${MOE_MODELS:-qwen3-30b-a3b gpt-oss-20b}; do
        local flags="--model kestrel/assets/configs/$model --load-format dummy --max-total-tokens 65536"
        echo "== $model: one-batch at batch 1, 32, 128"
        one_batch 110 "moe_${model}_decode" $flags --batch-size 1 32 128 --input-len 128 --output-len 64 \
          --cuda-graph-max-bs 128
        echo "== $model: offline ${MOE_PROMPTS:-500} x 1024/512"
        timeout 110 python3 -m kestrel.cli bench offline $flags --num-prompts "${MOE_PROMPTS:-500}" \
          --random-input-len 1024 --random-output-len 512 --random-range-ratio 1 \
          --json "$OUT/moe_${model}_offline.json" 2>&1 | tail -10
        echo "== $model: lone 8k prefill"
        one_batch 50 "moe_${model}_prefill8k" $flags --batch-size 1 --input-len 8192 --output-len 4 \
          --disable-cuda-graph | grep -iE "prefill|batch size"
      done ;;
    moe-decode-route)
      for model in ${MOE_MODELS:-qwen3-30b-a3b gpt-oss-20b}; do
        for fused in False True; do  # a module constant: set it in the process before the model is built
          echo "== $model: one-batch at batch 1 and 4, FUSED_DECODE_ROUTE=$fused"
          TAIL=14 one_batch_set 110 "import kestrel.layers.moe.paths as p; p.FUSED_DECODE_ROUTE = $fused" \
            "moe_${model}_decode_route_$fused" --model "kestrel/assets/configs/$model" --load-format dummy \
            --max-total-tokens 65536 --batch-size 1 4 --input-len 128 --output-len 64 --cuda-graph-max-bs 4
        done
      done ;;
    moe-paths)
      timeout 170 python3 -m kestrel.bench.kernels.moe_paths --budget-s 150 2>&1 | tail -25 ;;
    mla)
      timeout 120 python3 -m kestrel.bench.kernels.mla_decode --budget-s 100 --splits 4,8,16 2>&1 | tail -16
      local v3="--model kestrel/assets/configs/deepseek-v3-slice --load-format dummy --max-total-tokens 65536"
      one_batch 150 mla_v3_slice_decode $v3 --batch-size 1 32 --input-len 128 --output-len 128 --cuda-graph-max-bs 32
      one_batch 90 mla_v3_slice_prefill8k $v3 --batch-size 1 --input-len 8192 --output-len 4 --disable-cuda-graph \
        | grep -iE "prefill|batch size" ;;
    int4)
      for model in llama-3.1-8b-awq llama-3.1-8b; do
        echo "== $model: one-batch at batch 1 and 64"
        one_batch 120 "int4_${model}" --model "kestrel/assets/configs/$model" --load-format dummy --batch-size 1 64 \
          --input-len 128 --output-len 128 --max-total-tokens 65536 --cuda-graph-max-bs 64
      done
      timeout 270 python3 -m kestrel.bench.kernels.int4_gemm --budget-s 240 2>&1 | tail -24 ;;
    fp8-pool)
      server_deps || return 1
      # A module constant: set it in the process before the kernel compiles.
      timeout 120 python3 -c "import sys, pytest; import kestrel.attention.triton.decode as d; d.FP8_POOL_FP16_DOTS = True
sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '-rf', 'tests/gpu/test_fp8_gpu.py']))" 2>&1 | tail -3
      for on in False True; do
        echo "== decode attention over an FP8 pool, FP8_POOL_FP16_DOTS = $on"
        timeout 60 python3 -c "import sys, runpy; import kestrel.attention.triton.decode as d; d.FP8_POOL_FP16_DOTS = $on
sys.argv[0] = 'decode_attention'; runpy.run_module('kestrel.bench.kernels.decode_attention', run_name='__main__')" \
          --kv-dtype fp8_e4m3 --cases r0-mid 64x4096 --targets 4096 --chunks 1024 \
          --json "$OUT/decode_fp8_fp16dots_$on.json" 2>&1 | tail -6
      done ;;
    one-row-gemv)
      timeout 90 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_one_row_gemv_gpu.py 2>&1 | tail -2
      for on in False True; do  # a module constant: set it in the process before the model is loaded
        echo "== one-batch at batch 1, one_row_gemv.ENABLED = $on"
        one_batch_set 100 "import kestrel.layers.one_row_gemv as g; g.ENABLED = $on" "one_batch_bs1_gemv_$on" \
          $ONE_BATCH --batch-size 1 --cuda-graph-max-bs 1
      done
      echo "== one-batch at batch 1, --quantization fp8"
      one_batch 100 one_batch_bs1_fp8 $ONE_BATCH --batch-size 1 --cuda-graph-max-bs 1 --quantization fp8 | tail -9
      echo "== llama-3.1-8b-awq one-batch at batch 1"
      one_batch 100 int4_bs1 $AWQ_BS1 | tail -9 ;;
    fp8-w8a16)
      # The FP8 GEMV at M = 1 without quantizing the activations (GemvConfig.quantize_x) in the sweep, then
      # batch 1 with --quantization fp8 with GEMV_QUANTIZE_X off and on, one process each.
      timeout 150 python3 -m kestrel.bench.kernels.fp8 --gemv-only --budget 120 2>&1 | grep -E "^ ?1 |M <=|shape" \
        | head -12
      for quant in True False; do  # a module constant: set it in the process before the model runs
        echo "== one-batch at batch 1, --quantization fp8, GEMV_QUANTIZE_X = $quant"
        one_batch_set 100 "import kestrel.layers.fp8_gemm_triton as g; g.GEMV_QUANTIZE_X = $quant" \
          "one_batch_bs1_fp8_quantx_$quant" $ONE_BATCH --batch-size 1 --cuda-graph-max-bs 1 --quantization fp8
      done ;;
    one-row-defaults)
      timeout 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fp8_gpu.py tests/gpu/test_int4_gpu.py 2>&1 \
        | tail -2
      for setup in "pass" "g.GEMV_QUANTIZE_X = True; g.ONE_ROW_TUNED = {}"; do  # module constants, set first
        echo "== one-batch at batch 1, --quantization fp8, $setup"
        one_batch_set 100 "import kestrel.layers.fp8_gemm_triton as g; $setup" \
          "one_batch_bs1_fp8_$([ "$setup" = pass ] && echo now || echo before)" $ONE_BATCH --batch-size 1 \
          --cuda-graph-max-bs 1 --quantization fp8
      done
      echo "== llama-3.1-8b-awq one-batch at batch 1"
      one_batch 100 int4_bs1 $AWQ_BS1 | tail -8 ;;
    int4-half2)
      timeout 90 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_int4_gpu.py 2>&1 | tail -2
      timeout 130 python3 -m kestrel.bench.kernels.int4_gemm --ms 1 --ways gemv-nibbles,gemv-half2 \
        --budget-s 110 2>&1 | tail -12
      for on in False True; do  # a module constant: set it in the process before the model runs
        echo "== llama-3.1-8b-awq one-batch at batch 1, HALF2 = $on"
        one_batch_set 100 "import kestrel.layers.int4_gemm_triton as g; g.HALF2 = $on" "int4_bs1_half2_$on" $AWQ_BS1
      done ;;
    moe-bs1)
      # Batch 1 of both MoE families (graphs up to 1), then Qwen3-30B-A3B's eager kernels at batch 1.
      for model in ${MOE_MODELS:-qwen3-30b-a3b gpt-oss-20b}; do
        echo "== $model: one-batch at batch 1"
        one_batch 100 "moe_${model}_bs1" --model "kestrel/assets/configs/$model" --load-format dummy \
          --max-total-tokens 65536 --batch-size 1 --input-len 128 --output-len 128 --cuda-graph-max-bs 1 | tail -9
      done
      one_batch 100 moe_profile_bs1 --model kestrel/assets/configs/qwen3-30b-a3b --load-format dummy \
        --max-total-tokens 65536 --batch-size 1 --input-len 256 --output-len 8 --disable-cuda-graph \
        --profile "$OUT/moe_profile_bs1.txt" > /dev/null
      head -30 "$OUT/moe_profile_bs1.txt" ;;
    int4-m1)
      timeout 170 python3 -m kestrel.bench.kernels.int4_gemm --ms 1 --ways gemv-nibbles,gemv \
        --budget-s 150 2>&1 | tail -12
      for tile in None "(128, 128, 16)"; do  # a module constant: set it in the process before the model runs
        echo "== llama-3.1-8b-awq one-batch at batch 1, NIBBLE_TILE = $tile"
        one_batch_set 100 "import kestrel.layers.int4_gemm_triton as g; g.NIBBLE_TILE = $tile" \
          "int4_bs1_nibbles_$([ "$tile" = None ] && echo off || echo on)" $AWQ_BS1
      done ;;
    pdl)
      if [ "${PDL_TESTS:-1}" = 1 ]; then
        timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_pdl_gpu.py tests/gpu/test_cuda_graph.py \
          tests/gpu/test_one_row_gemv_gpu.py tests/gpu/test_fp8_gpu.py tests/gpu/test_int4_gpu.py 2>&1 | tail -3
      fi
      for model in ${PDL_MODELS:-bf16 fp8 awq}; do
        case $model in
          bf16) flags="$ONE_BATCH --batch-size 1 --cuda-graph-max-bs 1" ;;
          fp8) flags="$ONE_BATCH --batch-size 1 --cuda-graph-max-bs 1 --quantization fp8" ;;
          awq) flags=$AWQ_BS1 ;;
        esac
        # One process a model: the variants in turn, twice (kestrel.bench.variants), each setting every constant.
        set_v() { echo "$1=import kestrel.pdl as p, kestrel.layers.one_row_gemv as g; p.ENABLED = $2; g.GATED_DOWN = $3"; }
        variants=(--variant "$(set_v base False False)" --variant "$(set_v pdl True False)")
        [ "$model" = awq ] || variants+=(--variant "$(set_v gated False True)" --variant "$(set_v pdl_gated True True)")
        echo "== $model at batch 1"
        timeout 300 python3 -m kestrel.bench.variants $flags "${variants[@]}" --json "$OUT/launches_${model}_bs1.json" \
          2>&1 | grep -v "^\s*$" | grep -v " INFO " | tail -8
      done ;;
    pdl-moe)
      for model in ${MOE_MODELS:-qwen3-30b-a3b gpt-oss-20b}; do
        echo "== $model at batch 1"
        timeout 200 python3 -m kestrel.bench.variants --model "kestrel/assets/configs/$model" --load-format dummy \
          --max-total-tokens 65536 --batch-size 1 --input-len 128 --output-len 128 --cuda-graph-max-bs 1 \
          --variant "base=import kestrel.pdl as p; p.ENABLED = False" --variant "pdl=import kestrel.pdl as p; p.ENABLED = True" \
          --json "$OUT/pdl_${model}_bs1.json" 2>&1 | grep -v "^\s*$" | grep -v " INFO " | tail -4
      done ;;
    *)
      echo "gpu.sh: unknown stage '$1' (the list is at the top of scripts/gpu.sh)" >&2
      return 2 ;;
  esac
}

started=$(date +%s)
for stage in "$@"; do
  echo "=== $stage"
  stage_start=$(date +%s)
  run_stage "$stage" || echo "stage $stage failed"
  echo "=== $stage: $(( $(date +%s) - stage_start )) s"
done
echo "all stages: $(( $(date +%s) - started )) s"

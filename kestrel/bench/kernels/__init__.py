"""Kernel micro-benchmarks: one kernel or layer on synthetic inputs, no engine, timed with kestrel.bench.common's
timers (CUDA events, CUDA-graph replays). Each is `python -m kestrel.bench.kernels.NAME`; those with `--smoke` run
the same code on the CPU through Triton's interpreter (TRITON_INTERPRET=1 set before the command).

- decode_attention: the Triton decode kernel, uniform vs length-aware split on mixed lengths; launch configs
- prefill_attention: the Triton extend kernel and the sdpa backend against torch's SDPA kernels
- fp8: FP8 GEMMs at Llama-3.1-8B's shapes (cuBLAS, the Triton GEMM and GEMV) and decode attention over FP8 KV
- dsv4_attention: DeepSeek-V4's sparse attention, the torch path against the Triton kernel
- dsv4_moe: DeepSeek-V4's routed experts: every expert, the grouped GEMM, the hit-expert loop
"""

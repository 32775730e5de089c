"""FP8: the KV cache in FP8 (`--kv-cache-dtype`) and FP8 linear weights (`--quantization fp8`)."""

"""DeepSeek-V4 (the architecture: docs/design/deepseek-v4.md), split by part: config, rope, mHC, compressor, indexer,
attention, MoE, MTP, the model, its KV layout and its checkpoint loading."""

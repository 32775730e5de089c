"""DeepSeek-V3 family (DeepseekV3ForCausalLM: V3, R1, V3.1, Kimi-K2)."""

"""gpt-oss (GptOssForCausalLM)."""

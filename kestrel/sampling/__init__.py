"""Turning logits into tokens: the sampler (penalties, filters, counter-based randomness, logprobs),
shared by the engine, the tensor-parallel ranks and speculative acceptance."""

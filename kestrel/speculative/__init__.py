"""Speculative decoding building blocks (specs/speculative.md): flag resolution, the draft-backend
factory, draft trees, acceptance, the n-gram proposer."""

"""Speculative decoding building blocks (docs/design/speculative-decoding.md): flag resolution, the draft-backend
factory, draft trees, acceptance, the n-gram proposer."""

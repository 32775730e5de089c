"""Forward modes: what kind of work one model forward does."""
from __future__ import annotations

import enum


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prefill, possibly after a cached prefix or an earlier chunk
    DECODE = "decode"  # one new token per request
    MIXED = "mixed"  # prefill chunks and decodes in one batch
    TARGET_VERIFY = "target_verify"  # target scores draft tokens (speculative decoding)
    DRAFT_EXTEND = "draft_extend"  # draft model catches up on accepted tokens

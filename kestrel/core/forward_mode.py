"""Forward modes: what kind of work one model forward does."""
from __future__ import annotations

import enum


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prefill, possibly after a cached prefix or an earlier chunk
    DECODE = "decode"  # one new token per request
    MIXED = "mixed"  # prefill chunks and decodes in one batch
    IDLE = "idle"  # nothing to run (kept for parallel ranks that must step together)
    TARGET_VERIFY = "target_verify"  # target scores draft tokens (speculative decoding)
    DRAFT_EXTEND = "draft_extend"  # draft model catches up on accepted tokens

    def is_extend(self) -> bool:
        """Modes whose batches carry a variable number of new tokens per request."""
        return self in (ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.DRAFT_EXTEND,
                        ForwardMode.TARGET_VERIFY)

    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE

    def is_idle(self) -> bool:
        return self is ForwardMode.IDLE

"""Incremental detokenization and stop strings.

One `OutputText` per request turns the generated token ids into streamed text deltas. It chains
two parts that are also usable alone:

- `IncrementalDetokenizer`: ids → text, only ever emitting complete characters;
- `StopStringMatcher`: text → text, cut right before the first stop string, holding back text that
  could still become one.
"""
from __future__ import annotations

from kestrel.core.sampling_params import SamplingParams

# Prompt tokens decoded in front of the first output tokens: tokenizers that drop a leading space
# at the start of a decode (SentencePiece) need real context to decode the first word right.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, correct across multi-byte characters.

    Text is only emitted once the bytes decode to complete characters (no U+FFFD from a split
    character); `flush()` emits whatever is pending at the end.

    Invariant: `ids[prefix_offset:read_offset]` decodes to the tail of what was already emitted and
    `ids[read_offset:]` is pending. Each step decodes only that short window, so the cost per token
    does not grow with the output. For byte-level BPE tokenizers `text` after `flush()` equals
    `tokenizer.decode(output_ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)`,
    given a prompt that is itself valid text.
    """

    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def _step(self, final: bool) -> str:
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        # A trailing U+FFFD is most likely a character whose remaining bytes are in the next token:
        # wait for them unless this is the end.
        if len(new_text) <= len(prefix_text) or (new_text.endswith("\ufffd") and not final):
            return ""
        delta = new_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        # Only the last window is needed from here on; drop older ids so memory stays bounded.
        del self.ids[: self.prefix_offset]
        self.read_offset -= self.prefix_offset
        self.prefix_offset = 0
        self.text += delta
        return delta

    def add(self, new_token_ids: list[int]) -> str:
        """Append generated ids; return the newly completed text ("" while a character is split)."""
        self.ids.extend(new_token_ids)
        return self._step(final=False)

    def flush(self) -> str:
        """At the end: emit whatever is pending, even an incomplete character (as U+FFFD)."""
        return self._step(final=True)


class StopStringMatcher:
    """Finds the first stop string in the generated text.

    Text that could still be the start of a stop string is held back from streaming. Invariant:
    emitted text never contains a stop string nor any part of one that later completes, so the
    concatenation of all emitted text is the generated text cut right before the first stop string
    (or all of it, after `flush()`, when none matched). The earliest match wins; at equal positions
    the stop string listed first wins. After a match, nothing more is emitted.
    """

    def __init__(self, stop_strs: list[str]) -> None:
        if not all(isinstance(s, str) and s for s in stop_strs):
            raise ValueError(f"stop strings must be non-empty strings, got {stop_strs!r}")
        self.stop_strs = list(stop_strs)
        self.held = ""
        self.matched: str | None = None

    def _held_back_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self.stop_strs:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest

    def feed(self, delta: str, match: bool = True) -> tuple[str, str | None]:
        """Add new text; return (text safe to emit now, the stop string matched now or None). With
        `match` false (the request has not reached min_new_tokens) nothing matches, but the text that
        may begin a stop string is still held back: a stop string ending past the minimum counts."""
        if self.matched is not None:
            return "", None
        # Held text was already searched, but a stop string may straddle it and the new delta.
        text = self.held + delta
        best: tuple[int, str] | None = None
        for stop in self.stop_strs if match else ():
            pos = text.find(stop)
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, stop)
        if best is not None:
            self.matched, self.held = best[1], ""
            return text[: best[0]], best[1]
        keep = self._held_back_len(text)
        self.held = text[len(text) - keep :]
        return text[: len(text) - keep], None

    def flush(self) -> str:
        """At the end (no stop matched): release the held-back text."""
        held, self.held = self.held, ""
        return held


class OutputText:
    """The text of one request's output: detokenization followed by stop-string matching.

    `text` is everything emitted so far; once `matched_stop` is set the request should finish and
    no more text is emitted.
    """

    def __init__(self, tokenizer, prompt_ids: list[int], params: SamplingParams) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, params.skip_special_tokens)
        self.stops = StopStringMatcher(params.stop_strs)
        self.text = ""

    @property
    def matched_stop(self) -> str | None:
        return self.stops.matched

    def add(self, token_ids: list[int], match: bool = True) -> tuple[str, str | None]:
        """Append generated ids; return (text delta, stop string matched by this step or None; none
        without `match`)."""
        delta, matched = self.stops.feed(self.detokenizer.add(token_ids), match)
        self.text += delta
        return delta, matched

    def finish(self) -> str:
        """At the end of the request: the remaining text (empty after a stop string matched)."""
        if self.matched_stop is not None:
            return ""
        delta, _ = self.stops.feed(self.detokenizer.flush())
        delta += self.stops.flush()
        self.text += delta
        return delta

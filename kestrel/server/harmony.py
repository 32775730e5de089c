"""gpt-oss's chat format (harmony), read from the text of an answer as it grows.

An answer is a run of messages, each a header and a body:

    <|channel|>analysis<|message|>The user asks for the weather: call the tool.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}<|call|>

or, on the next turn, `...<|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>`. The chat
template's generation prompt ends in `<|start|>assistant`, so the first header starts at its channel.
The recipient (`to=functions.NAME`) stands after the channel or before it (after the role); the content
type follows as `<|constrain|>json` or as a bare word. A body ends at `<|end|>`, `<|return|>`, `<|call|>`
(the last two end generation), `<|endoftext|>`, or where the next message starts (a model that skipped
`<|end|>`). Text that does not start with a header is a message of no channel (plain content).

The markers are special tokens: the answer must be detokenized keeping them (skip_special_tokens off).
`MessageReader` is fed the text as it grows, `final` on the answer's last text: before that, a header
not yet whole and a tail that may be the start of a marker are held back, so what it gives out only
grows, however the text is cut. `read_messages` reads a whole text at once.
"""
from __future__ import annotations

from dataclasses import dataclass

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
RETURN, CALL, CONSTRAIN, END_OF_TEXT = "<|return|>", "<|call|>", "<|constrain|>", "<|endoftext|>"
# They end a body and are part of its message.
_CLOSING = (END, RETURN, CALL, END_OF_TEXT)
# They end a body by starting the next message.
_OPENING = (START, CHANNEL)
_MARKERS = (*_CLOSING, *_OPENING, MESSAGE, CONSTRAIN)
# What a header may start with: the first one's role is in the prompt, so it may start with its recipient.
_HEADER_STARTS = (START, CHANNEL, " to=", "to=")
FUNCTIONS = "functions."  # the namespace of the tools the request gives (the template's)


@dataclass
class Message:
    """One message as far as the text goes: its header, its body, its span in the text (`end` after its
    closing marker, or as far as is safe to read while it is open), and whether it is `closed` (a
    marker, the next message or the end of the answer ended it)."""

    channel: str | None
    recipient: str | None
    content_type: str | None
    body: str
    start: int
    end: int
    closed: bool


@dataclass
class Piece:
    """What one `MessageReader.feed` added to message number `index` (a message comes in one or more
    pieces, its header fields in each): body text, raw text (its markup included), and whether the
    message closed with it."""

    index: int
    start: int  # where the message starts in the answer
    channel: str | None
    recipient: str | None
    content_type: str | None
    body: str
    raw: str
    closed: bool


def _marker_tail(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of `text` may be the start of one of `markers`."""
    tail = text.rfind("<", max(0, len(text) - max(map(len, markers)) + 1))
    if tail < 0:
        return 0
    rest = text[tail:]
    return len(rest) if any(m.startswith(rest) and m != rest for m in markers) else 0


def _header(header: str) -> tuple[str | None, str | None, str | None]:
    """(channel, recipient, content type) of a header's text (between its start and `<|message|>`)."""
    head, _, constrain = header.partition(CONSTRAIN)
    role, _, channel_part = head.partition(CHANNEL)
    words = channel_part.split()
    channel = words[0] if words else None
    recipient = next((w[3:] for w in role.split() + words if w.startswith("to=")), None)
    others = [w for w in words[1:] if not w.startswith("to=")]
    content_type = constrain.strip() or (others[0] if others else None)
    return channel, recipient, content_type


class MessageReader:
    """An answer's messages, fed its text as it grows; each character is searched about once (the
    text of closed messages is let go), so reading a long answer costs its length, not its square."""

    def __init__(self) -> None:
        self._text = ""  # the answer from the start of the message not yet closed
        self._offset = 0  # where `_text` starts in the answer
        self._index = 0  # of that message
        self._header: tuple[str | None, str | None, str | None] | None = None  # its header, once whole
        self._sent = 0  # in `_text`: its text given out so far (no marker can start before)

    def feed(self, delta: str, final: bool = False) -> list[Piece]:
        """The pieces `delta` adds; `final` on the answer's last text."""
        self._text += delta
        pieces = []
        while self._text:
            text = self._text
            if self._header is None:
                if not final and any(len(text) < len(h) and h.startswith(text) for h in _HEADER_STARTS):
                    break  # may still become a header
                if text.startswith(_HEADER_STARTS):
                    marker = text.find(MESSAGE)
                    if marker < 0:
                        break  # a header not yet whole; at the end of the answer, no message
                    self._header = _header(text[:marker].removeprefix(START))
                    self._sent = marker + len(MESSAGE)
                else:
                    self._header = (None, None, None)
                    self._sent = 0
                body_start, raw_start = self._sent, 0
            else:
                body_start = raw_start = self._sent
            ends = [(i, m) for m in (*_CLOSING, *_OPENING) if (i := text.find(m, self._sent)) >= 0]
            if ends:
                end, marker = min(ends)
                after = end + len(marker) if marker in _CLOSING else end
                pieces.append(Piece(self._index, self._offset, *self._header, text[body_start:end],
                                    text[raw_start:after], True))
                self._text, self._offset, self._index, self._header = text[after:], self._offset + after, \
                    self._index + 1, None
                continue
            safe = max(body_start, len(text) if final else len(text) - _marker_tail(text, _MARKERS))
            if safe > body_start or raw_start == 0 or final:
                pieces.append(Piece(self._index, self._offset, *self._header, text[body_start:safe],
                                    text[raw_start:safe], final))
            self._sent = safe
            if final:
                self._text = ""
            break
        return pieces


def read_messages(text: str, final: bool) -> list[Message]:
    """The messages of `text`, a whole answer so far (`final`: the whole answer)."""
    messages: list[Message] = []
    for piece in MessageReader().feed(text, final):  # one piece per message, read at once
        messages.append(Message(piece.channel, piece.recipient, piece.content_type, piece.body, piece.start,
                                piece.start + len(piece.raw), piece.closed))
    return messages


def is_reasoning(message: Message | Piece) -> bool:
    """The model's thinking: the analysis channel, unless addressed to a tool (built-in tools' calls are
    written there)."""
    return message.channel == "analysis" and message.recipient is None


def is_content(message: Message | Piece) -> bool:
    """A message for the user: the final channel, a commentary preamble, plain text (no recipient)."""
    return message.channel != "analysis" and message.recipient is None

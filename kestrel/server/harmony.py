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
Reading is of the whole text so far, `final` when the answer ends there: before that, a header not yet
whole and a tail that may be the start of a marker are held back, so everything read only grows as the
text does.
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
    """One message as far as the text goes. `start`/`end`: its span in the text (`end` after its closing
    marker, or as far as is safe to read while it is open); `closed` once a marker, the next message or
    the end of the answer ended it."""

    channel: str | None
    recipient: str | None
    content_type: str | None
    body: str
    start: int
    end: int
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


def read_messages(text: str, final: bool) -> list[Message]:
    """The messages of `text`, an answer so far (`final`: the whole answer)."""
    messages: list[Message] = []
    pos = 0
    while pos < len(text):
        tail = text[pos:]
        if not final and any(len(tail) < len(h) and h.startswith(tail) for h in _HEADER_STARTS):
            break  # may still become a header
        if text.startswith(_HEADER_STARTS, pos):
            marker = text.find(MESSAGE, pos)
            if marker < 0:
                break  # a header not yet whole; at the end of the answer, no message
            channel, recipient, content_type = _header(text[pos:marker].removeprefix(START))
            body_start = marker + len(MESSAGE)
        else:
            channel = recipient = content_type = None
            body_start = pos
        ends = [(i, m) for m in (*_CLOSING, *_OPENING) if (i := text.find(m, body_start)) >= 0]
        if ends:
            end, marker = min(ends)
            after = end + len(marker) if marker in _CLOSING else end
            messages.append(Message(channel, recipient, content_type, text[body_start:end], pos, after, True))
            pos = after
            continue
        safe = len(text) if final else len(text) - _marker_tail(text, _MARKERS)
        messages.append(Message(channel, recipient, content_type, text[body_start:max(safe, body_start)], pos,
                                max(safe, body_start), final))
        break
    return messages


def is_reasoning(message: Message) -> bool:
    """The model's thinking: the analysis channel, unless addressed to a tool (built-in tools' calls are
    written there)."""
    return message.channel == "analysis" and message.recipient is None


def is_content(message: Message) -> bool:
    """A message for the user: the final channel, a commentary preamble, plain text (no recipient)."""
    return message.channel != "analysis" and message.recipient is None


def content_of(messages: list[Message]) -> str:
    """The user-facing text of `messages`: their content messages' bodies, a blank line between two."""
    return "\n\n".join(m.body for m in messages if is_content(m))

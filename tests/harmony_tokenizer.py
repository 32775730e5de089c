"""A tiny tokenizer with gpt-oss's harmony special tokens, and a chat template in harmony's shape.

The template is written for these tests (not gpt-oss's own), but renders what the server relies on the
same way: a system message naming the reasoning effort, the first system or developer message's
instructions and the tools in a developer message, user turns, an assistant's reasoning (`thinking`)
and calls as commentary messages to `functions.NAME` ended by `<|call|>`, tool results as messages from
`functions.NAME`, and a generation prompt `<|start|>assistant`.
"""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

HARMONY_TOKENS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>", "<|constrain|>",
                  "<|endoftext|>"]

CHAT_TEMPLATE = (
    "{%- set ns = namespace(rest=messages, instructions=none, last_call=none) -%}"
    "{%- if messages and messages[0].role in ('system', 'developer') -%}"
    "{%- set ns.instructions = messages[0].content -%}{%- set ns.rest = messages[1:] -%}"
    "{%- endif -%}"
    "<|start|>system<|message|>You are a tiny test model.\n"
    "Reasoning: {{ reasoning_effort | default('medium') }}\n"
    "# Valid channels: analysis, commentary, final.<|end|>"
    "{%- if ns.instructions is not none or tools -%}"
    "<|start|>developer<|message|>"
    "{%- if ns.instructions is not none -%}# Instructions\n{{ ns.instructions }}\n{% endif -%}"
    "{%- if tools -%}# Tools\nnamespace functions {\n"
    "{% for tool in tools -%}"
    "type {{ tool.function.name }} = (_: {{ tool.function.parameters | tojson }}) => any;\n"
    "{% endfor -%}} // namespace functions{%- endif -%}"
    "<|end|>"
    "{%- endif -%}"
    "{%- for message in ns.rest -%}"
    "{%- if message.role == 'user' -%}"
    "<|start|>user<|message|>{{ message.content }}<|end|>"
    "{%- elif message.role == 'assistant' and message.tool_calls -%}"
    "{%- if message.thinking -%}<|start|>assistant<|channel|>analysis<|message|>{{ message.thinking }}<|end|>"
    "{%- endif -%}"
    "{%- for call in message.tool_calls -%}{%- set ns.last_call = call.function.name -%}"
    "<|start|>assistant<|channel|>commentary to=functions.{{ call.function.name }} <|constrain|>json<|message|>"
    "{{ call.function.arguments | tojson }}<|call|>"
    "{%- endfor -%}"
    "{%- elif message.role == 'assistant' -%}"
    "<|start|>assistant<|channel|>final<|message|>{{ message.content }}<|end|>"
    "{%- elif message.role == 'tool' -%}"
    "<|start|>functions.{{ message.name or ns.last_call }} to=assistant<|channel|>commentary<|message|>"
    "{{ message.content }}<|end|>"
    "{%- else -%}{{ raise_exception('unexpected role ' + message.role) }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"
)

CORPUS = [
    "analysis commentary final assistant user developer system functions to=functions.get_weather json",
    '{"city": "Oslo", "unit": "celsius"} {"location": "San Francisco, CA"}',
    "The user asks for the weather. I should call the tool. It is sunny and 21 degrees in Oslo.",
    "Reasoning: low medium high. You are a helpful assistant. # Instructions # Tools namespace",
    "Café, naïve, 你好，世界！ Emoji 🙂🚀",
]


def build_harmony_tokenizer(path: str | Path, vocab_size: int = 600) -> PreTrainedTokenizerFast:
    """Train, save in `path` and return the tokenizer; every byte has a token, so any text round-trips,
    and every harmony marker is one special token."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=HARMONY_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|return|>", pad_token="<|endoftext|>",
                                 additional_special_tokens=HARMONY_TOKENS, clean_up_tokenization_spaces=False)
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(str(path))
    return hf

"""A tiny byte-level BPE tokenizer for tests, trained in milliseconds from built-in text.

The corpus mixes ASCII code, accented Latin, CJK and emoji, and the vocabulary is small, so many
multi-byte UTF-8 characters end up split across several tokens: exactly the case incremental
detokenization must get right. Training is deterministic (same corpus, same trainer settings).
"""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|user|>", "<|assistant|>", "<|system|>"]

# Renders `<|role|>content<|eos|>` per message; roles without a token (tool) still render as text.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}{{ eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(f\"value {i}\")\n",
    "import torch\nx = torch.zeros(4, 8)\ny = x @ x.T  # matmul\n",
    "The quick brown fox jumps over the lazy dog. Hello, world!",
    "Café, naïve, résumé, façade, jalapeño, Müller, Ærøskøbing, São Paulo.",
    "Ça va? Où est la bibliothèque? Größe, Straße, über, çà et là.",
    "你好，世界！今天天气很好。我们一起学习机器学习。",
    "東京は日本の首都です。こんにちは、元気ですか？",
    "안녕하세요, 만나서 반갑습니다.",
    "Привет, мир! Как дела?",
    "Emoji: 🙂😀🚀🔥👍🏽🎉 and flags 🇫🇷🇯🇵, family 👨‍👩‍👧‍👦.",
    "Math: ∑ x² ≤ ∞, α β γ δ → λ. Price: 5€ £3 ¥100.",
]


def build_tokenizer(path: str | Path, vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Train, save (`save_pretrained(path)`) and return the tiny tokenizer.

    Invariant: `len(tokenizer) <= vocab_size`, so a model with `vocab_size` rows covers every id.
    Every byte has a token (byte-level alphabet), so any text round-trips through encode/decode.
    """
    min_size = 256 + len(SPECIAL_TOKENS)
    if vocab_size < min_size:
        raise ValueError(f"vocab_size must be >= {min_size} (256 bytes + special tokens), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Repeat the corpus so merges are driven by counts, not by a single occurrence.
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        additional_special_tokens=["<|user|>", "<|assistant|>", "<|system|>"],
        clean_up_tokenization_spaces=False,
    )
    hf.chat_template = CHAT_TEMPLATE
    assert len(hf) <= vocab_size, (len(hf), vocab_size)
    hf.save_pretrained(str(path))
    return hf

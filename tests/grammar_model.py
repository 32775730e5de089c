"""A tiny random Llama for structured-output tests: a real byte-level BPE tokenizer (tests/tiny_tokenizer.py)
smaller than the model's vocabulary (padded ids exist, as in many checkpoints), and the bundled demo
model's chat template (tools rendered, Hermes-style `<tool_call>` calls).

Random weights are enough: the grammar, not the model, makes the output valid.
"""
from __future__ import annotations

from pathlib import Path

from kestrel.assets import resolve_model_path
from tests.tiny_models import make_tiny_model
from tests.tiny_tokenizer import build_tokenizer

TOKENIZER_VOCAB = 512
MODEL_VOCAB = 544  # 32 padded ids past the tokenizer's


def make_grammar_model(path: str | Path) -> str:
    path = Path(path)
    make_tiny_model("llama", path, vocab_size=MODEL_VOCAB, max_position_embeddings=1024)
    build_tokenizer(path, TOKENIZER_VOCAB)  # its special tokens have the ids the model config names
    template = Path(resolve_model_path("demo")) / "chat_template.jinja"
    (path / "chat_template.jinja").write_text(template.read_text())
    return str(path)

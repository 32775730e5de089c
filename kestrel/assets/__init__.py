"""The demo models bundled with kestrel, trained by `scripts/train_demo_model.py` (docs/demo-model.md).

`demo` is the default model; `demo-draft` is its small draft for speculative decoding (STANDALONE).
Both are ordinary Hugging Face folders, so the rest of kestrel loads them like any other model folder.
`demo-eagle` (scripts/train_eagle_head.py) is an EAGLE head for `demo`: a draft, not a model of its
own (no tokenizer, no embedding or lm_head), so it is not in BUNDLED_MODELS.
"""
from __future__ import annotations

from pathlib import Path

BUNDLED_MODELS = ("demo", "demo-draft")
BUNDLED_HEADS = ("demo-eagle",)
_HERE = Path(__file__).resolve().parent


def resolve_model_path(model: str) -> str:
    """The folder of a bundled model's or head's name (`demo`, `demo-draft`, `demo-eagle`); any other
    value is returned as is.

    The names always mean the bundled models, whatever the working directory holds: a local folder
    with such a name is reached as `./demo`.
    """
    return str(_HERE / model) if model in BUNDLED_MODELS + BUNDLED_HEADS else model

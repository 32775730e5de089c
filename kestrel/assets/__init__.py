"""The demo models bundled with kestrel, trained by `scripts/train_demo_model.py` (docs/demo-model.md).

`demo` is the default model; `demo-draft` is its small draft for speculative decoding. Both are
ordinary Hugging Face folders, so the rest of kestrel loads them like any other model folder.
"""
from __future__ import annotations

from pathlib import Path

BUNDLED_MODELS = ("demo", "demo-draft")
_HERE = Path(__file__).resolve().parent


def resolve_model_path(model: str) -> str:
    """The folder of a bundled model's name (`demo`, `demo-draft`); any other value is returned as is.

    The names always mean the bundled models, whatever the working directory holds: a local folder
    with such a name is reached as `./demo`.
    """
    return str(_HERE / model) if model in BUNDLED_MODELS else model

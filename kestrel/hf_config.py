"""A model's config.json (or its GGUF equivalent), read as a dict: what resolution, the loader and the
draft checks read before any model is built."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kestrel.models.gguf import gguf_file, read_gguf_config


def read_hf_config(model: str) -> dict[str, Any]:
    """config.json of a Hugging Face folder, or its equivalent for a GGUF file (kestrel.models.gguf)."""
    if (gguf := gguf_file(model)) is not None:
        return read_gguf_config(gguf)
    path = Path(model) / "config.json"
    if not path.is_file():
        raise ValueError(f"model {model!r} is not a Hugging Face model folder (nor a GGUF file): {path} not found")
    return read_json_config(path)


def read_json_config(path: Path) -> dict[str, Any]:
    """A config.json as a dict; ValueError naming the file when it is not a JSON object."""
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object, not a {type(config).__name__}")
    return config

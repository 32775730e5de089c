"""How the served model embeds and scores, read from its folder once at start-up.

Embeddings: a sentence-transformers folder names its modules in `modules.json`; its Pooling module's
`config.json` picks the pooling (`pooling_mode_lasttoken`, `pooling_mode_mean_tokens`,
`pooling_mode_cls_token`) and a Normalize module scales to unit length. A folder without them is a plain
causal LM: its last token's hidden state, normalised (the state that has read the whole input; what
decoder embedding models such as Qwen3-Embedding are trained to use). `dimensions` is served only for a
Matryoshka model (`is_matryoshka` or `matryoshka_dimensions` in config.json).

Scoring (rerank, score): a decoder reranker reads the prompt `template` (with `{query}` and
`{document}`) and answers one of two tokens; the score is the probability of the first (e.g. "yes")
against the second ("no"): the softmax over their two logits at the last position. The defaults are
Qwen3-Reranker's prompt format and tokens; `--score-template` and `--score-tokens` replace them.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kestrel.core.pooling_params import PoolingParams
from kestrel.hf_config import read_hf_config

_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}

QWEN3_RERANKER_TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
    "Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n"
    "<Instruct>: Given a web search query, retrieve relevant passages that answer the query\n"
    "<Query>: {query}\n<Document>: {document}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
DEFAULT_SCORE_TOKENS = ("yes", "no")


class PoolingConfigError(ValueError):
    """The model folder's pooling configuration cannot be served (names the file and the value)."""


@dataclass(frozen=True)
class Embedder:
    method: str
    normalize: bool
    hidden_size: int
    matryoshka: tuple[int, ...] | bool  # the dimensions a client may ask for: listed ones, any (True), none

    def params(self, dimensions: int | None) -> PoolingParams:
        return PoolingParams(self.method, self.normalize, dimensions)

    def check_dimensions(self, dimensions: int) -> str | None:
        """Why `dimensions` cannot be served, or None."""
        if not self.matryoshka:
            return "this model is not a Matryoshka model: it cannot shorten its embeddings, so dimensions must be unset"
        allowed = self.matryoshka if isinstance(self.matryoshka, tuple) else None
        if allowed is not None and dimensions not in allowed:
            return f"dimensions must be one of {list(allowed)} for this model, got {dimensions}"
        if not 1 <= dimensions <= self.hidden_size:
            return f"dimensions must be in [1, {self.hidden_size}], got {dimensions}"
        return None


@dataclass(frozen=True)
class Scorer:
    template: str
    token_ids: tuple[int, int] | None  # (the "yes" token, the "no" token); None: see `unavailable`
    unavailable: str | None = None  # why this model cannot score

    def prompt(self, query: str, document: str) -> str:
        # One pass: a query holding "{document}" stays as it was written.
        return re.sub(r"\{(query|document)\}", lambda m: query if m[1] == "query" else document, self.template)

    def params(self) -> PoolingParams:
        return PoolingParams("last", normalize=False, score_token_ids=self.token_ids)


def read_embedder(model_path: str) -> Embedder:
    folder = Path(model_path)
    # A GGUF file (not a folder) holds its config and no sentence-transformers modules.
    config = (_json(folder / "config.json") if folder.is_dir() else read_hf_config(model_path)) or {}
    text = config.get("text_config") or config
    method, normalize = "last", True
    modules = _json(folder / "modules.json") if folder.is_dir() else None
    if modules is not None:
        kinds = {m.get("type", "").rsplit(".", 1)[-1]: m for m in modules}
        normalize = "Normalize" in kinds
        if "Pooling" in kinds:
            pooling_file = folder / kinds["Pooling"].get("path", "1_Pooling") / "config.json"
            pooling = _json(pooling_file) or {}
            chosen = [mode for key, mode in _MODES.items() if pooling.get(key)]
            others = [k for k, v in pooling.items() if k.startswith("pooling_mode_") and v and k not in _MODES]
            if others or len(chosen) != 1:
                raise PoolingConfigError(f"{pooling_file}: one of {', '.join(_MODES)} must be true (kestrel pools "
                                         f"by one of last, mean, cls), got {sorted(k for k, v in pooling.items() if v)}")
            method = chosen[0]
    dims = config.get("matryoshka_dimensions")
    matryoshka = tuple(dims) if dims else bool(config.get("is_matryoshka", False))
    return Embedder(method, normalize, int(text.get("hidden_size", 0)), matryoshka)


def read_scorer(template: str | None, tokens: str | None, tokenizer: Any) -> Scorer:
    """`template`: the text, or a path to a file holding it (default Qwen3-Reranker's); `tokens`: "yes,no"."""
    text = QWEN3_RERANKER_TEMPLATE
    if template is not None:
        text = Path(template).read_text() if Path(template).is_file() else template
    if "{query}" not in text or "{document}" not in text:
        raise PoolingConfigError("--score-template must contain {query} and {document}")
    names = tuple(t.strip() for t in tokens.split(",")) if tokens else DEFAULT_SCORE_TOKENS
    if len(names) != 2:
        raise PoolingConfigError(f"--score-tokens must name two tokens, 'yes,no', got {tokens!r}")
    if tokenizer is None:
        return Scorer(text, None, "this model has no tokenizer, so it cannot read a query and documents")
    ids = [tokenizer.convert_tokens_to_ids(name) for name in names]
    unknown = tokenizer.unk_token_id
    missing = [name for name, i in zip(names, ids) if i is None or (i == unknown and name != tokenizer.unk_token)]
    if missing:
        return Scorer(text, None, f"this model cannot score: {missing} are not tokens of its vocabulary "
                                  "(--score-tokens names the two answer tokens of a reranker)")
    return Scorer(text, (ids[0], ids[1]))


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise PoolingConfigError(f"{path} cannot be read: {e}") from None

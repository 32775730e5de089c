"""Resolution of the speculative flags: SGLang's auto-choice of the draft shape, the draft model's path,
and the checks that can fail at start-up instead of at the first request (docs/design/speculative-decoding.md §1)."""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kestrel.config import SpeculativeConfig

logger = logging.getLogger(__name__)

# Spelled as SGLang spells them (its flag takes exactly these).
ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM")
# Algorithms that run a draft model (and so need draft attention backends and a draft path).
DRAFT_MODEL_ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE")
# Drafts that read the target's hidden states: draft position p reads token p + 1 and a feature of p.
FEATURE_DRAFT_ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN")
SHAPE_FIELDS = ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens")
# SGLang's choices when none of the three is set: a tree for EAGLE heads on Llama-like targets, a short
# chain for MTP layers, draft models and everything else.
EAGLE_LLAMA_SHAPE = (5, 4, 8)
CHAIN_SHAPE = (3, 1, 4)
# NGRAM: SGLang proposes up to 12 tokens (its longest match window), branching up to 10 ways.
NGRAM_DRAFT_TOKENS = 12
NGRAM_MAX_BREADTH = 10


def draft_forwards(spec: "SpeculativeConfig") -> int:
    """Draft-decode forwards per round: a feature draft gets its first tree level from its last
    DRAFT_EXTEND, a STANDALONE draft runs a forward on the root for it."""
    return spec.speculative_num_steps - (1 if spec.speculative_algorithm in FEATURE_DRAFT_ALGORITHMS else 0)


def resolve_speculative(spec: "SpeculativeConfig", target_path: str, target_hf: dict[str, Any]) -> "SpeculativeConfig":
    """Return `spec` with every automatic choice made, or raise ValueError naming the field to fix.

    `target_path` is the resolved target folder and `target_hf` its config.json.
    """
    if spec.speculative_attention_mode not in ("prefill", "decode"):
        raise ValueError("speculative_attention_mode must be 'prefill' or 'decode', "
                         f"got {spec.speculative_attention_mode!r}")
    algorithm = spec.speculative_algorithm
    if algorithm is None:
        given = [f for f in (*SHAPE_FIELDS, "speculative_draft_model_path") if getattr(spec, f) is not None]
        if given:
            raise ValueError(f"{', '.join(given)} only apply to speculative decoding; set speculative_algorithm "
                             f"({', '.join(ALGORITHMS)}) or unset them")
        return spec
    if algorithm not in ALGORITHMS:
        raise ValueError(f"speculative_algorithm must be one of {', '.join(ALGORITHMS)} (spelled as SGLang does), "
                         f"got {algorithm!r}")
    if spec.speculative_disable_batch_size < 1:
        raise ValueError(f"speculative_disable_batch_size must be >= 1, got {spec.speculative_disable_batch_size}")
    steps, topk, draft_tokens = (_ngram_shape if algorithm == "NGRAM" else _draft_shape)(spec, target_hf)
    for name, value, least in zip(SHAPE_FIELDS, (steps, topk, draft_tokens), (1, 1, 2)):
        if value < least:
            raise ValueError(f"{name} must be >= {least}, got {value}")
    if topk == 1 and draft_tokens != steps + 1:
        # A chain of `steps` drafted tokens plus the root: any other size is unreachable or wasted.
        if spec.speculative_num_draft_tokens is not None:
            logger.warning("speculative_num_draft_tokens=%d is set to speculative_num_steps + 1 = %d, as "
                           "speculative_eagle_topk=1 drafts a chain", draft_tokens, steps + 1)
        draft_tokens = steps + 1
    if _dsv4_target(target_hf):
        # Its backend keeps each request's window ring and compressor state by position, one entry per
        # position, which a tree's sibling nodes would share.
        if algorithm == "NGRAM":
            raise ValueError("NGRAM is not supported on DeepSeek-V4 targets: its trees are padded with sibling "
                             "nodes, and a DeepSeek-V4 target verifies chains only (use NEXTN)")
        if topk > 1:
            raise ValueError(f"speculative_eagle_topk={topk}: a DeepSeek-V4 target verifies chains only; set "
                             "speculative_eagle_topk=1 (and speculative_num_draft_tokens = speculative_num_steps + 1)")
    proposed = topk + (steps - 1) * topk * topk  # step 0 proposes topk nodes, each later step topk^2
    if algorithm != "NGRAM" and draft_tokens - 1 > proposed:
        raise ValueError(f"speculative_num_draft_tokens={draft_tokens} is more than the root plus the {proposed} "
                         f"nodes that {steps} steps of top-{topk} drafting propose; lower it or raise the others")
    return dataclasses.replace(
        spec, speculative_num_steps=steps, speculative_eagle_topk=topk, speculative_num_draft_tokens=draft_tokens,
        speculative_draft_model_path=_draft_path(spec, target_path, target_hf))


def _draft_shape(spec: "SpeculativeConfig", target_hf: dict[str, Any]) -> tuple[int, int, int]:
    values = tuple(getattr(spec, f) for f in SHAPE_FIELDS)
    if all(v is not None for v in values):
        return values  # type: ignore[return-value]
    if any(v is not None for v in values):
        raise ValueError(f"set all of {', '.join(SHAPE_FIELDS)} or none of them (then kestrel chooses as SGLang "
                         f"does); got {dict(zip(SHAPE_FIELDS, values))}")
    if spec.speculative_algorithm in ("EAGLE", "EAGLE3") and _llama_like(target_hf):
        return EAGLE_LLAMA_SHAPE
    return CHAIN_SHAPE


def _ngram_shape(spec: "SpeculativeConfig", target_hf: dict[str, Any]) -> tuple[int, int, int]:
    """NGRAM has no draft steps: topk is the tree's largest branching and num_steps its depth, each
    settable on its own (SGLang takes only the token count)."""
    draft_tokens = spec.speculative_num_draft_tokens
    if draft_tokens is None:
        draft_tokens = NGRAM_DRAFT_TOKENS if spec.speculative_num_steps is None else spec.speculative_num_steps + 1
    topk = spec.speculative_eagle_topk if spec.speculative_eagle_topk is not None else NGRAM_MAX_BREADTH
    steps = spec.speculative_num_steps if spec.speculative_num_steps is not None else draft_tokens - 1
    return steps, topk, draft_tokens


def _dsv4_target(target_hf: dict[str, Any]) -> bool:
    from kestrel.models.registry import needs_dsv4_attention

    return needs_dsv4_attention(target_hf.get("architectures") or [])


def _mtp_target(target_hf: dict[str, Any]) -> bool:
    """A family whose checkpoints carry MTP layers kestrel drafts with: DeepSeek-V4's (`mtp.*`) and
    DeepSeek-V3's (layer `num_hidden_layers`, shared by R1, V3.1 and Kimi-K2's class)."""
    from kestrel.models.registry import needs_mla_attention

    return _dsv4_target(target_hf) or needs_mla_attention(target_hf.get("architectures") or [])


def _llama_like(target_hf: dict[str, Any]) -> bool:
    from kestrel.models.llama import LlamaForCausalLM
    from kestrel.models.registry import supported_architectures, model_class

    archs = [a for a in target_hf.get("architectures") or [] if a in supported_architectures()]
    return bool(archs) and model_class(archs) is LlamaForCausalLM


def _draft_path(spec: "SpeculativeConfig", target_path: str, target_hf: dict[str, Any]) -> str | None:
    from kestrel.assets import resolve_model_path
    from kestrel.hf_config import read_hf_config

    algorithm, path = spec.speculative_algorithm, spec.speculative_draft_model_path
    if algorithm == "NGRAM":
        for name in ("speculative_draft_model_path", "speculative_draft_attention_backend"):
            if getattr(spec, name) is not None:
                raise ValueError(f"NGRAM drafts from the request's own tokens and runs no draft model; unset {name}")
        return None
    if path is None:
        if algorithm != "NEXTN":
            example = " (the bundled pairs: demo + demo-eagle, demo + demo-draft)" if algorithm != "EAGLE3" else ""
            raise ValueError(f"speculative_algorithm={algorithm} needs speculative_draft_model_path: the folder "
                             f"of the {'draft model' if algorithm == 'STANDALONE' else algorithm + ' head'}{example}")
        path = target_path  # the MTP layers live in the target's own checkpoint
    path = resolve_model_path(path)
    if algorithm == "NEXTN" and os.path.realpath(path) != os.path.realpath(target_path):
        raise ValueError(f"NEXTN drafts with the target's own MTP layers: speculative_draft_model_path must be "
                         f"the target's folder ({target_path}) or unset, got {path}")
    draft_hf = read_hf_config(path)
    # HF's spelling, or DeepSeek's native config.json (REF ModelArgs)
    if algorithm == "NEXTN" and not (draft_hf.get("num_nextn_predict_layers") or draft_hf.get("n_mtp_layers")):
        raise ValueError(f"NEXTN drafts with the MTP layers of the checkpoint at {path}, which has none "
                         "(num_nextn_predict_layers is unset); use EAGLE/EAGLE3 with a head or STANDALONE")
    if algorithm == "NEXTN" and not _mtp_target(target_hf):
        raise ValueError(f"NEXTN drafts with the MTP layer of a DeepSeek-V3 / V4 target (R1, V3.1 and Kimi-K2 "
                         f"included); {target_hf.get('architectures')} has none kestrel can run (use EAGLE/EAGLE3 "
                         "with a head, or STANDALONE)")
    if algorithm in ("EAGLE", "EAGLE3"):
        from kestrel.models.llama_eagle import check_eagle_head

        check_eagle_head(path, algorithm, target_hf)
    elif algorithm == "STANDALONE" and draft_hf.get("vocab_size") != target_hf.get("vocab_size"):
        raise ValueError(f"the STANDALONE draft model at {path} has vocab_size {draft_hf.get('vocab_size')} but the "
                         f"target has {target_hf.get('vocab_size')}: a draft model must share the target's tokenizer")
    return path

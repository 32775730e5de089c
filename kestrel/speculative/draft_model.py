"""The draft model of a speculative engine, behind one interface for EAGLE, EAGLE-3, NEXTN and STANDALONE.

A draft runs in its own ModelRunner over its own KV pools (the engine's KV memory, same slots as the
target). Two kinds:
- feature drafts (EAGLE, EAGLE-3, NEXTN): draft position p reads token p + 1 and a feature of position p
  (the target's hidden state, or during drafting the draft's own output at p - 1); its KV at p therefore
  exists once token p + 1 is known, and it lags the target by nothing at the end of a step;
- STANDALONE: a small LM over the same tokens as the target, position p reading token p.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from kestrel.cache.kv_layout import KVLayout
from kestrel.core.forward_batch import ForwardBatch
from kestrel.layers.kernels import Kernels
from kestrel.models.base import CausalLM, FeatureDraft
from kestrel.quant.kv import kv_cache_dtype


class HeadAsModel(FeatureDraft):
    """An EAGLE head in the shape a ModelRunner runs: forward(input_ids, positions, batch) reads the
    feature input from `batch.spec_features`."""

    def __init__(self, head: nn.Module) -> None:
        super().__init__()
        self.head = head
        self.config = head.config
        self.feature_size = head.config.hidden_size  # the width of `spec_features` and of the output

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        assert batch.spec_features is not None, "an EAGLE head's forward needs the features of its positions"
        return self.head.hidden_states(input_ids, positions, batch.spec_features, batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head.compute_logits(hidden)


@dataclass
class Draft:
    # forward(input_ids, positions, batch) -> hidden [T, H]; compute_logits(hidden); a feature draft's
    # `feature_size` is the width of its feature input, which its hidden output (the next step's) shares.
    model: nn.Module
    kv_layout: KVLayout
    uses_features: bool
    # The target's side: the layers whose inputs are captured as features (EAGLE-3), else () for the
    # target's final hidden state; `features` maps what the target returns to the draft's feature input.
    target_capture: tuple[int, ...] = ()
    features: Callable[[torch.Tensor], torch.Tensor] = lambda hidden: hidden


def load_draft(config: Any, target: CausalLM, dtype: torch.dtype, device: torch.device,
               kernels: Kernels) -> Draft:
    """The draft `config.speculative` names, on `device` in `dtype`, checked against `target`."""
    from kestrel.models.llama_eagle import TargetParts, check_eagle_head, load_eagle_head
    from kestrel.models.loader import load_model

    spec, path = config.speculative, config.speculative.speculative_draft_model_path
    algorithm = spec.speculative_algorithm
    if algorithm == "STANDALONE":
        model = load_model(path, dtype, device, kernels, config.model.load_format)
        if model.config.vocab_size != target.config.vocab_size:
            raise ValueError(f"the draft model at {path} has vocab_size {model.config.vocab_size}, the target "
                             f"{target.config.vocab_size}: a STANDALONE draft must share the target's tokenizer")
        return Draft(model, model.kv_layout(dtype), uses_features=False)
    if algorithm in ("EAGLE", "EAGLE3"):
        if not target.accepts_eagle_heads:
            raise ValueError(f"{algorithm} heads draft for Llama-family targets; "
                             f"{type(target).__name__} is not one")
        check_eagle_head(path, algorithm, config.model.hf_config)
        head = load_eagle_head(path, algorithm, TargetParts.of(target), target.config.num_hidden_layers,
                               config.model.context_length, dtype, device, kernels, config.model.load_format)
        cfg = head.config
        layout = KVLayout.full_attention(1, cfg.num_key_value_heads, cfg.head_dim, dtype)
        if algorithm == "EAGLE":
            return Draft(HeadAsModel(head), layout, uses_features=True)
        return Draft(HeadAsModel(head), layout, uses_features=True, target_capture=head.target_hidden_layers,
                     features=head.project_target_hidden)
    if algorithm == "NEXTN":  # its KV in the target's entry format (SGLang's MTP ring is FP8 too)
        from kestrel.models.deepseek_v3.model import DeepseekV3ForCausalLM

        kv_dtype = kv_cache_dtype(config.cache.kv_cache_dtype, dtype)
        if isinstance(target, DeepseekV3ForCausalLM):
            return _v3_nextn_draft(config, target, dtype, device, kernels, kv_dtype)
        return _v4_nextn_draft(target, kv_dtype)
    raise ValueError(f"speculative_algorithm={algorithm} has no draft model kestrel can run here")


def _v3_nextn_draft(config: Any, target: CausalLM, dtype: torch.dtype, device: torch.device, kernels: Kernels,
                    kv_dtype: torch.dtype) -> Draft:
    """A DeepSeek-V3-family target's MTP layer, read from its own folder: an MLA layer over its own KV
    pool, reading the target's final-normed hidden state (its `token_hidden`)."""
    from kestrel.models.deepseek_v3.mtp import load_v3_mtp_draft

    spec = config.speculative
    model = load_v3_mtp_draft(spec.speculative_draft_model_path, target, config.model.hf_config, dtype, device,
                              kernels, config.model.load_format)
    return Draft(model, model.kv_layout(kv_dtype), uses_features=True)


def _v4_nextn_draft(target: nn.Module, kv_dtype: torch.dtype) -> Draft:
    """The target's own MTP layer (a DeepSeek-V4 target: `resolve_speculative` checked), reading the
    target's pre-hc_head streams; `kv_dtype`: the target's KV pool dtype (`mtp_kv_layout`)."""
    from kestrel.models.deepseek_v4.kv_layout import mtp_kv_layout
    from kestrel.models.deepseek_v4.mtp import MTPDraft

    if not len(target.mtp):
        raise ValueError("NEXTN needs the target's MTP layer, but its checkpoint has no mtp.* tensors (a folder "
                         "saved by transformers keeps none); use DeepSeek's own checkpoint")
    cfg = target.config
    return Draft(MTPDraft(target), mtp_kv_layout(cfg, kv_dtype), uses_features=True,
                 target_capture=(cfg.num_hidden_layers,))

"""The model interface: what the loader, the model runner, its CUDA graphs and the speculative drafts
call on a model.

- `ForwardModel`: anything a ModelRunner runs (a target, an EAGLE head wrapped for the runner,
  DeepSeek-V4's MTP layer as a draft): `forward`, `compute_logits`, optionally a segmented decoder.
- `FeatureDraft`: a ForwardModel that also reads a feature per token (EAGLE, EAGLE-3, NEXTN drafts).
- `CausalLM`: a model family, built from a checkpoint folder by `kestrel.models.loader` and served as
  the target. Its required hooks are abstract; its optional ones have the defaults below, which a
  family overrides to declare what it has. Nothing probes a model for a hook.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch
from torch import nn

from kestrel.cache.kv_layout import KVLayout
from kestrel.core.forward_batch import ForwardBatch
from kestrel.distributed.parallel_state import ParallelState

# Checkpoint projection name -> (merged module name, shard index), e.g. "q_proj" -> ("qkv_proj", 0).
StackedParams = Mapping[str, tuple[str, int]]


class ForwardModel(nn.Module, ABC):
    """forward: input_ids [T], positions [T], the batch -> the final hidden state of every new token
    [T, H] (and, when the batch names `capture_hidden` layers, their inputs in `batch.captured_hidden`);
    compute_logits: hidden [N, H] -> float32 logits [N, vocab]."""

    config: Any  # the parsed architecture config; the runner reads `config.vocab_size`

    @abstractmethod
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        ...

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        ...

    def segmented_decoder(self) -> SegmentedDecoder | None:
        """Optional: the decoder cut at its attention calls, for piecewise CUDA graphs of prefills;
        None: the model's prefills run eagerly."""
        return None


class FeatureDraft(ForwardModel):
    """A draft whose forward also reads a feature per token, `batch.spec_features` [T, feature_size]:
    the target's hidden state there or, while drafting, the draft's own previous output, whose width
    is the same."""

    feature_size: int


@dataclass(frozen=True)
class SegmentShapes:
    """The widths of what one segment hands the next (the piecewise graphs' static buffers)."""

    hidden_size: int  # the residual stream and the final hidden state
    q_size: int  # queries and the attention's output
    kv_size: int  # keys, values
    dtype: torch.dtype


class DecoderLayerHalves(Protocol):
    """A decoder layer split at its attention call. Neither half reads the batch: only `attention` does."""

    def pre_attention(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(previous sub-layer output, residual or None before the first layer) -> (q, k, v, residual)."""

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """The batch's attention backend: stores k/v in the KV pool, returns [T, q_size]."""

    def post_attention(self, attn_out: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (sub-layer output, residual) for the next layer's `pre_attention` or the final norm."""


class SegmentedDecoder(Protocol):
    """A decoder cut at its attention calls, as `kestrel.runner.piecewise_graph` drives it: embed, each
    layer's halves, the final norm (the LM head stays the model's `compute_logits`). Every op in the
    halves works row by row, so padded rows cannot change real ones."""

    layers: Sequence[DecoderLayerHalves]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        ...

    def final_norm(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The last layer's (output, residual) -> the final-normed hidden state."""

    def segment_shapes(self) -> SegmentShapes:
        ...


class CausalLM(ForwardModel):
    """A model family. The loader builds it as `cls(cls.parse_config(hf_config), kernels, parallel)`
    (this rank's shard, on the engine's device and in its dtype) and fills it from the checkpoint: by
    parameter name, or through the family's own `load_checkpoint`."""

    # Checkpoint projections merged into one parameter (q/k/v -> qkv_proj): the loader copies each into
    # its rows; an FP8 checkpoint must store all parts of a merged layer in FP8 or none.
    stacked_params: ClassVar[StackedParams] = {}
    # The family reads its checkpoint itself (`load_checkpoint`, `skips_checkpoint_tensor`,
    # `fill_dummy`): other tensor names, its own dequantisation; kestrel's FP8 layers do not apply.
    loads_own_checkpoint: ClassVar[bool] = False
    # Quantised checkpoint formats its own loader dequantises (quantization_config.quant_method), beyond
    # the block-scaled FP8 every family loads.
    checkpoint_quantizations: ClassVar[tuple[str, ...]] = ()
    # EAGLE / EAGLE-3 heads trained on this family's hidden states draft for it, borrowing its
    # `input_embedding` and `compute_logits`.
    accepts_eagle_heads: ClassVar[bool] = False
    # The family has routed experts, which `--ep-size` splits over the ranks.
    has_routed_experts: ClassVar[bool] = False

    def __init__(self, config: Any, parallel: ParallelState) -> None:
        super().__init__()
        self.config = config
        self.parallel = parallel

    # ---- required ------------------------------------------------------------------------------
    @staticmethod
    @abstractmethod
    def parse_config(hf_config: dict[str, Any]) -> Any:
        """config.json -> the family's architecture config (reads it only: builds no model)."""

    @abstractmethod
    def kv_layout(self, dtype: torch.dtype, speculative_tokens: int = 1) -> KVLayout:
        """This rank's per-token KV storage, from which the engine builds its KV memory.
        `speculative_tokens`: the new tokens of a verify step, all written before acceptance."""

    @abstractmethod
    def input_embedding(self) -> nn.Module:
        """The token embedding: ids [T] -> [T, H]."""

    # ---- optional: the defaults say "not this family" (and `segmented_decoder` above) -----------------
    def load_checkpoint(self, tensors: Iterable[tuple[str, torch.Tensor]], source: str) -> None:
        """Fill the model from (checkpoint name, tensor) pairs; only with `loads_own_checkpoint`."""
        raise NotImplementedError(f"{type(self).__name__} is filled by parameter name by the loader")

    def checkpoint_name(self, name: str) -> str:
        """The parameter name (before merging, `stacked_params`) of checkpoint tensor `name`, for
        checkpoints that name a module otherwise than the model does; loaded by name only."""
        return name

    def skips_checkpoint_tensor(self, name: str) -> bool:
        """A tensor this rank never reads (another expert-parallel rank's expert, a draft's layer)."""
        return False

    def fill_dummy(self) -> None:
        """Random weights in place of a checkpoint (`--load-format dummy`)."""
        fill_random(self)


def fill_random(model: nn.Module) -> None:
    """Small random weights (norm weights 1, biases 0), the same on every load: a fixed-seed generator."""
    device = next(model.parameters()).device
    gen = torch.Generator(device).manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.fill_(1.0 if name.endswith("norm.weight") else 0.0)
            else:
                param.normal_(0.0, 0.02, generator=gen)

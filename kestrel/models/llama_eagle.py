"""EAGLE (1/2) and EAGLE-3 draft heads for Llama-family targets, in their public checkpoint layouts.

EAGLE: `fc(cat(embed(token), feature))` -> one decoder layer without its input norm -> the target's lm_head.
The feature at position p is the target's last hidden state after its final norm (or, during drafting,
the head's own output at p). Checkpoint: `fc.weight` [H, 2H] (+ `fc.bias`), `layers.0.self_attn.*`,
`layers.0.mlp.*`, `layers.0.post_attention_layernorm.weight`.

EAGLE-3: `fc` maps 3 target layers' hidden states [T, 3 H_target] to H once (`project_target_hidden`);
the layer reads `cat(input_layernorm(embed), hidden_norm(feature))` (2H) and the head has its own `norm`
and `lm_head` over a draft vocabulary, mapped to target ids by `d2t` (target id = i + d2t[i]).
Checkpoint: `fc.weight`, `midlayer.*` (vLLM's exports spell it `layers.0.*`), `norm.weight`,
`lm_head.weight`, `d2t`, `t2d`; config `architectures: ["LlamaForCausalLMEagle3"]`.

Both heads embed with the target's embedding (a checkpoint's own `embed_tokens.weight` is not used, as
in SGLang) and return logits over the target vocabulary. The attention runs through the batch's
backend like any kestrel layer (layer id 0 of the draft's own KV pools).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from kestrel.core.forward_batch import ForwardBatch
from kestrel.layers.kernels import Kernels
from kestrel.layers.norm import RMSNorm
from kestrel.layers.rotary import RotaryEmbedding
from kestrel.models.arch_config import ArchConfig, parse_arch_config
from kestrel.models.base import CausalLM, StackedParams, fill_random
from kestrel.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP
from kestrel.hf_config import read_hf_config
from kestrel.models.loader import checkpoint_names, checkpoint_tensor, copy_checkpoint, default_dtype

EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
_EAGLE3_MARKERS = ("midlayer.", "d2t", "layers.0.hidden_norm.")  # tensors only an EAGLE-3 head has
# Exports of EAGLE heads carry tensors the head does not use: the target's embedding (the target's own is
# used), EAGLE's never-applied layer-0 input norm, EAGLE-3's t2d (the inverse of d2t, checked, not kept).
_UNUSED = {"EAGLE": ("embed_tokens.weight", "layers.0.input_layernorm.weight"),
           "EAGLE3": ("embed_tokens.weight", "t2d")}


@dataclass(frozen=True)
class TargetParts:
    """What a head borrows from its target: the embedding, and hidden -> float32 logits over the target
    vocabulary (the target's lm_head)."""

    embed_tokens: nn.Module
    compute_logits: Callable[[torch.Tensor], torch.Tensor]

    @classmethod
    def of(cls, target: CausalLM) -> "TargetParts":
        return cls(target.input_embedding(), target.compute_logits)


class _EagleLayer(nn.Module):
    """The head's decoder layer. EAGLE: the input goes straight into attention (no input norm).
    EAGLE-3: attention reads `cat(input_layernorm(embeds), hidden_norm(feature))`."""

    def __init__(self, cfg: ArchConfig, rotary: RotaryEmbedding, kernels: Kernels, eagle3: bool) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.self_attn = LlamaAttention(cfg, 0, rotary, input_size=2 * h if eagle3 else h)
        self.mlp = LlamaMLP(cfg, kernels)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.eagle3 = eagle3
        if eagle3:
            self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
            self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, embeds: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        """x: the layer's residual input [T, H], embeds: the tokens' embeddings (read by EAGLE-3's layer
        only) -> the residual stream after the layer (pre-norm)."""
        attn_in = x if not self.eagle3 else torch.cat([self.input_layernorm(embeds), self.hidden_norm(x)], dim=-1)
        hidden, residual = self.post_attention_layernorm(self.self_attn(positions, attn_in, batch), x)
        return self.mlp(hidden) + residual


class DraftHead(nn.Module, ABC):
    """An EAGLE-family head. forward(input_ids [T], positions [T], features [T, H], batch) -> (the
    head's feature at each position [T, H], float32 logits over the target vocabulary [T, V]).

    The forward is the same for both variants: the tokens' embeddings (the target's) and the features
    make the layer's residual input (`layer_input`); the layer's output is the next feature. A variant
    says what its layer is, how its input is made, how target hidden states become features
    (`project_target_hidden`) and how its logits are computed."""

    variant: ClassVar[str]  # the speculative algorithm it serves: "EAGLE" or "EAGLE3"
    stacked_params: ClassVar[StackedParams] = LlamaForCausalLM.stacked_params
    # Target layers whose inputs are the head's features (`ForwardBatch.capture_hidden`); None: the
    # target's final-normed last hidden state.
    target_hidden_layers: tuple[int, ...] | None = None

    def __init__(self, cfg: ArchConfig, target: TargetParts) -> None:
        super().__init__()
        self.config = cfg
        self.target = target  # not a submodule: the target owns (and loads, and moves) these

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, features: torch.Tensor,
                batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.hidden_states(input_ids, positions, features, batch)
        return hidden, self.compute_logits(hidden)

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, features: torch.Tensor,
                      batch: ForwardBatch) -> torch.Tensor:
        embeds = self.target.embed_tokens(input_ids)
        return self.layer()(positions, self.layer_input(embeds, features), embeds, batch)

    @abstractmethod
    def layer(self) -> _EagleLayer:
        """The head's one decoder layer (its checkpoint name differs between the variants)."""

    @abstractmethod
    def layer_input(self, embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """The layer's residual input [T, H] from the tokens' embeddings and the features."""

    @abstractmethod
    def project_target_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's captured hidden states -> the head's feature input."""

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        ...


class EagleHead(DraftHead):
    """EAGLE-1/2: `fc(cat(embed, feature))` into a layer without input norm; the target's lm_head."""

    variant = "EAGLE"

    def __init__(self, cfg: ArchConfig, target: TargetParts, fc_bias: bool, max_positions: int,
                 kernels: Kernels = Kernels()) -> None:
        super().__init__(cfg, target)
        rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope, use_triton=kernels.triton_rope)
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=fc_bias)
        self.layers = nn.ModuleList([_EagleLayer(cfg, rotary, kernels, eagle3=False)])

    def layer(self) -> _EagleLayer:
        return self.layers[0]

    def layer_input(self, embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat([embeds, features], dim=-1))

    def project_target_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden  # the target's final hidden state is the feature as it is

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target.compute_logits(hidden)  # EAGLE has no final norm


class Eagle3Head(DraftHead):
    """EAGLE-3: features from `project_target_hidden` (the target's) or from the head's own previous
    output, which is the pre-norm residual stream; its own norm and lm_head over a draft vocabulary."""

    variant = "EAGLE3"

    def __init__(self, cfg: ArchConfig, target: TargetParts, target_hidden_size: int, draft_vocab_size: int,
                 target_hidden_layers: tuple[int, ...], max_positions: int, kernels: Kernels = Kernels()) -> None:
        super().__init__(cfg, target)
        # Inputs of these target layers (the residual stream entering each; N = after the last layer).
        self.target_hidden_layers = target_hidden_layers
        rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope, use_triton=kernels.triton_rope)
        self.fc = nn.Linear(len(target_hidden_layers) * target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = _EagleLayer(cfg, rotary, kernels, eagle3=True)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.int64))
        self.target_vocab_size = cfg.vocab_size
        # Set by the loader from d2t: the draft vocabulary is the target's, in order (no scatter needed).
        self.identity_vocab = draft_vocab_size == cfg.vocab_size

    def layer(self) -> _EagleLayer:
        return self.midlayer

    def layer_input(self, embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        return features  # the layer reads the embeddings itself, through its input norm

    def project_target_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, 3 H_target], the captured layers concatenated in `target_hidden_layers` order -> [T, H]."""
        return self.fc(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        draft_logits = self.lm_head(self.norm(hidden)).float()
        if self.identity_vocab:
            return draft_logits
        # Target ids outside the draft vocabulary can never be drafted.
        logits = draft_logits.new_full((draft_logits.shape[0], self.target_vocab_size), float("-inf"))
        logits[:, torch.arange(draft_logits.shape[1], device=logits.device) + self.d2t] = draft_logits
        return logits


# ---- checkpoints ---------------------------------------------------------------------------------
def detect_eagle_variant(path: str | Path) -> str:
    """"EAGLE" or "EAGLE3", from the config's architectures and (when weights are present) the tensor
    names. Raises ValueError for a folder that holds neither kind of head."""
    config = read_hf_config(path)
    names = checkpoint_names(path) if _has_weights(Path(path)) else []
    if EAGLE3_ARCHITECTURE in (config.get("architectures") or []) or any(
            n.startswith(_EAGLE3_MARKERS) for n in names):
        return "EAGLE3"
    if not names or "fc.weight" in names and any(n.startswith("layers.0.") for n in names):
        return "EAGLE"
    raise ValueError(f"{path} is not an EAGLE head: expected fc.weight and layers.0.* (EAGLE) or midlayer.* and "
                     f"d2t (EAGLE-3), found {sorted(names)[:8]}{' ...' if len(names) > 8 else ''}")


def check_eagle_head(path: str | Path, algorithm: str, target_hf: dict[str, Any]) -> None:
    """Refuse, at start-up, a head of the other variant (an EAGLE-3 head run as EAGLE drafts garbage:
    accept length 1) or one whose sizes do not fit the target."""
    variant = detect_eagle_variant(path)
    if variant != algorithm:
        raise ValueError(f"the draft at {path} is an {'EAGLE-3' if variant == 'EAGLE3' else 'EAGLE'} head but "
                         f"speculative_algorithm is {algorithm}; use --speculative-algorithm {variant}")
    config = read_hf_config(path)
    target_hidden = target_hf.get("hidden_size")
    # The head embeds with the target's embedding, so its width is the target's (EAGLE-3's fc input too).
    for key in ("hidden_size", "target_hidden_size"):
        if (config.get(key) or target_hidden) != target_hidden:
            raise ValueError(f"the {variant} head at {path} has {key} {config[key]}, the target's hidden size is "
                             f"{target_hidden}: it was trained for another model")
    if config.get("vocab_size") != target_hf.get("vocab_size"):
        raise ValueError(f"the {variant} head at {path} has vocab_size {config.get('vocab_size')}, the target "
                         f"{target_hf.get('vocab_size')}: it was trained for another model")


def eagle3_target_layers(config: dict[str, Any], num_target_layers: int) -> tuple[int, ...]:
    """Target layers whose input the head reads: the checkpoint's `eagle_aux_hidden_state_layer_ids`
    name layers whose *output* it was trained on (the input of the next one); else [2, N//2, N-3]."""
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    layers = tuple(i + 1 for i in ids) if ids else (2, num_target_layers // 2, num_target_layers - 3)
    if not all(0 <= i <= num_target_layers for i in layers):
        raise ValueError(f"EAGLE-3 aux hidden state layers {layers} do not fit a {num_target_layers}-layer target")
    return layers


def load_eagle_head(path: str | Path, algorithm: str, target: TargetParts, num_target_layers: int,
                    max_positions: int, dtype: torch.dtype, device: torch.device | str,
                    kernels: Kernels = Kernels(), load_format: str = "auto") -> DraftHead:
    """Build the head on `device` in `dtype` and fill it from the checkpoint (random weights from a
    config-only folder with `load_format="dummy"`, for benchmarks); `algorithm` ("EAGLE" or "EAGLE3")
    must match what the checkpoint is. `max_positions` is the target's context length."""
    variant = detect_eagle_variant(path)
    if variant != algorithm:
        raise ValueError(f"the checkpoint at {path} is a {variant} head, asked to load it as {algorithm}")
    config = read_hf_config(path)
    cfg = parse_arch_config(config)
    names = set(checkpoint_names(path)) if load_format != "dummy" else set()
    with torch.device(device), default_dtype(dtype):
        if variant == "EAGLE":
            head = EagleHead(cfg, target, fc_bias="fc.bias" in names, max_positions=max_positions, kernels=kernels)
        else:
            head = Eagle3Head(cfg, target, target_hidden_size=config.get("target_hidden_size") or cfg.hidden_size,
                              draft_vocab_size=config.get("draft_vocab_size") or cfg.vocab_size,
                              target_hidden_layers=eagle3_target_layers(config, num_target_layers),
                              max_positions=max_positions, kernels=kernels)
    if load_format == "dummy":
        fill_random(head)
        if variant == "EAGLE3":  # the first draft_vocab_size target ids
            head.d2t.zero_()
            head.identity_vocab = head.d2t.numel() == head.target_vocab_size
        return head.eval()
    unused = _UNUSED[variant]
    copy_checkpoint(head, path, f"an {variant} head", head.stacked_params, skip=lambda name: name in unused,
                    rename=_vllm_to_midlayer if variant == "EAGLE3" else lambda name: name)
    if variant == "EAGLE3":
        _check_vocab_map(head, path, "t2d" in names)
    return head.eval()


def _vllm_to_midlayer(name: str) -> str:
    return "midlayer." + name[len("layers.0."):] if name.startswith("layers.0.") else name


def _check_vocab_map(head: Eagle3Head, path: str | Path, has_t2d: bool) -> None:
    """d2t must send the draft vocabulary to distinct target ids (and agree with t2d when present)."""
    vocab = head.target_vocab_size
    ids = torch.arange(head.d2t.numel(), device=head.d2t.device) + head.d2t
    if ids.min() < 0 or ids.max() >= vocab or ids.unique().numel() != ids.numel():
        raise ValueError(f"{path}: d2t does not map the draft vocabulary to distinct target ids below {vocab}")
    if has_t2d:
        t2d = checkpoint_tensor(path, "t2d").to(ids.device).bool()
        if t2d.numel() != vocab or int(t2d.sum()) != ids.numel() or not t2d[ids].all():
            raise ValueError(f"{path}: t2d does not mark exactly the target ids that d2t maps to")
    head.identity_vocab = ids.numel() == vocab and bool((ids == torch.arange(vocab, device=ids.device)).all())


def _has_weights(path: Path) -> bool:
    return (path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file()

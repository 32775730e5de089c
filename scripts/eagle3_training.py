"""The EAGLE-3 pieces of scripts/train_eagle_head.py (`--variant eagle3`): the target hidden states the
head reads, its draft vocabulary, the head as kestrel serves it (kestrel.models.llama_eagle.Eagle3Head),
its loss and its checkpoint.

What differs from EAGLE-1: the head's first drafted token reads `fc` of three target layers' inputs
(the residual stream entering layers 2, N/2 and N-3 of an N-layer target, as kestrel captures them),
later ones its own output (the pre-norm residual stream of its layer); it has its own final norm and an
lm_head over a draft vocabulary (the target ids its training answers use most), so its loss is a soft
cross-entropy against the target's next-token distribution restricted to that vocabulary, with no
feature regression: the head's output is not the target's feature, only its logits are matched.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F

from kestrel.models.arch_config import parse_arch_config
from kestrel.models.llama_eagle import EAGLE3_ARCHITECTURE, Eagle3Head, TargetParts, eagle3_target_layers

DEFAULT_DRAFT_VOCAB = 8192


def aux_layers(num_target_layers: int) -> tuple[int, ...]:
    """The target layers whose inputs the head reads: kestrel's default for a checkpoint that names none."""
    return eagle3_target_layers({}, num_target_layers)


def aux_hidden(hidden_states: tuple[torch.Tensor, ...], layers: tuple[int, ...]) -> torch.Tensor:
    """transformers' `output_hidden_states` -> the inputs of `layers`, concatenated [B, L, len(layers) H].
    Entry i < N of `hidden_states` is the residual stream entering layer i (entry 0 the embeddings), what
    kestrel's `capture_hidden` keeps; entry N is the final-normed state, not the last layer's residual
    stream, so a head reading layer N cannot be trained from it."""
    assert max(layers) < len(hidden_states) - 1, f"layers {layers}: entry N of hidden_states is normed"
    return torch.cat([hidden_states[i] for i in layers], dim=-1)


# ---- the draft vocabulary --------------------------------------------------------------------------
def draft_vocab(counted: torch.Tensor, size: int, vocab_size: int, special_ids: Iterable[int]) -> torch.Tensor:
    """The draft vocabulary as ascending target ids: the special ids (EOS, ...) that occur in `counted`
    (the target tokens the loss counts), then the most frequent ids of `counted`, ties to the lower id,
    `size` in all (capped at the vocabulary; ids that never occur fill it, lowest first)."""
    size = min(size, vocab_size)
    counts = torch.bincount(counted, minlength=vocab_size)
    special = torch.zeros(vocab_size, dtype=torch.bool)
    special[torch.tensor([i for i in special_ids if 0 <= i < vocab_size], dtype=torch.int64)] = True
    # One key orders all ids: occurring specials first, then by count, then by id (a stable sort on -count
    # keeps the id order among equal counts).
    key = torch.where(special & (counts > 0), counts.max() + 1, counts)
    order = torch.sort(-key, stable=True).indices
    return order[:size].sort().values


def vocab_maps(ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The public layout of a draft vocabulary: d2t (int64 offsets, target id = i + d2t[i]) and t2d (a
    bool mask over the target vocabulary, true at the draft ids)."""
    t2d = torch.zeros(vocab_size, dtype=torch.bool, device=ids.device)
    t2d[ids] = True
    return (ids - torch.arange(len(ids), device=ids.device)).to(torch.int64), t2d


# ---- the head ----------------------------------------------------------------------------------------
def head_config(eagle_config: dict, draft_vocab_size: int, target_hidden_size: int, layers: tuple[int, ...]) -> dict:
    """An EAGLE-1 head's config (the target's Llama fields, one layer) as an EAGLE-3 checkpoint states it.
    `eagle_aux_hidden_state_layer_ids` names the layers whose output was read: each one before `layers`."""
    config = {k: v for k, v in eagle_config.items() if k != "bias"}  # EAGLE-1's fc bias; EAGLE-3's fc has none
    return {**config, "architectures": [EAGLE3_ARCHITECTURE], "draft_vocab_size": draft_vocab_size,
            "target_hidden_size": target_hidden_size,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in layers]}}


def build_head(config: dict, parts: TargetParts, vocab: torch.Tensor, final_norm: torch.Tensor,
               lm_head_weight: torch.Tensor, layers: tuple[int, ...]) -> Eagle3Head:
    """A new head over the draft vocabulary `vocab`. Its norm and lm_head start as the target's final norm
    and lm_head rows: the head's output plays the target's last residual stream, so drafting starts from
    the target's own reading of it instead of from noise."""
    head = Eagle3Head(parse_arch_config(config), parts, target_hidden_size=config["target_hidden_size"],
                      draft_vocab_size=len(vocab), target_hidden_layers=layers,
                      max_positions=config["max_position_embeddings"])
    with torch.no_grad():
        head.norm.weight.copy_(final_norm)
        head.lm_head.weight.copy_(lm_head_weight[vocab])
        head.d2t.copy_(vocab_maps(vocab, head.target_vocab_size)[0])
    head.identity_vocab = len(vocab) == head.target_vocab_size  # the ids are ascending: all of them, in order
    return head


def draft_logits(head: Eagle3Head, hidden: torch.Tensor) -> torch.Tensor:
    """float32 logits over the draft vocabulary (Eagle3Head.compute_logits before it scatters them into
    the target vocabulary)."""
    return head.lm_head(head.norm(hidden)).float()


def objective(head: Eagle3Head, lm_head_weight: torch.Tensor, vocab: torch.Tensor
              ) -> Callable[[torch.Tensor, torch.Tensor, bool], tuple[dict, float | None]]:
    """The loss terms of drafted positions: (the head's outputs [P, H], the target's final-normed hidden
    state at the drafted token's position [P, H], measure?) -> ({"ce": soft cross-entropy to the target's
    next-token distribution over the draft vocabulary, renormalised}, with `measure` the top-1 agreement
    with the target's greedy token (one outside the draft vocabulary is a miss), else None)."""
    draft_lm_head = lm_head_weight[vocab]  # softmax over these rows = the restricted, renormalised distribution

    def terms(pred: torch.Tensor, next_feat: torch.Tensor, measure: bool) -> tuple[dict, float | None]:
        logits = draft_logits(head, pred)
        with torch.no_grad():
            target_logp = F.log_softmax((next_feat @ draft_lm_head.T).float(), -1)
            agree = None
            if measure:  # the target's argmax over its whole vocabulary: only on logged steps
                target_next = (next_feat @ lm_head_weight.T).argmax(-1)
                agree = (vocab[logits.argmax(-1)] == target_next).float().mean().item()
        return {"ce": -(target_logp.exp() * F.log_softmax(logits, -1)).sum(-1).mean()}, agree

    return terms


def checkpoint_tensors(head: Eagle3Head, public: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The head's public tensors (`public_tensors`: fc, midlayer.*, norm, lm_head, d2t) and t2d."""
    ids = torch.arange(len(head.d2t), device=head.d2t.device) + head.d2t
    return {**public, "t2d": vocab_maps(ids, head.target_vocab_size)[1].cpu()}

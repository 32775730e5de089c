"""DeepSeek-V3's MTP (next-n) layer as a NEXTN draft (docs/design/speculative-decoding.md §1).

The checkpoint stores it as layer `num_hidden_layers`: `enorm`, `hnorm`, `eh_proj`, a decoder layer
with a MoE MLP (`self_attn`, `mlp`, `input_layernorm`, `post_attention_layernorm`) and
`shared_head.norm`; also `embed_tokens` and `shared_head.head`, copies of the target's embedding and
LM head, which the draft does not read: it uses the target's own (as DeepSeek-V3's MTP modules share
them by design), so they are never held twice.

Position t of the draft reads the token at t + 1 and a feature of position t:
    x = eh_proj(cat(enorm(E[token t+1]), hnorm(h_t)))
    out = shared_head.norm(the decoder layer over x)
where h_t is the target's final-normed hidden state (what its LM head reads) or, for a further draft
step of a chain, the draft's own `out` at t - 1; the logits are the target's LM head over `out`.
A checkpoint with several MTP layers drafts with the first, every step (chains reuse it).

The layer's attention is MLA over the draft's own KV pool (one latent layer, id 0), run by the draft
backends (kestrel/speculative/draft_backends.py).
"""
from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from kestrel.cache.kv_layout import KVLayout
from kestrel.core.forward_batch import ForwardBatch
from kestrel.distributed.parallel_state import ParallelState
from kestrel.layers.kernels import Kernels
from kestrel.layers.norm import RMSNorm
from kestrel.layers.rotary import RotaryEmbedding
from kestrel.models.base import FeatureDraft, fill_random
from kestrel.models.deepseek_v3.config import V3Config
from kestrel.models.deepseek_v3.model import DeepseekV3ForCausalLM, V3DecoderLayer
from kestrel.models.llama_eagle import TargetParts
from kestrel.models.loader import HARMLESS_SUFFIXES, checkpoint_names, copy_checkpoint, default_dtype
from kestrel.quant.resolve import checkpoint_quantization

# The MTP layer's copies of what it shares with the target (names after its layer prefix).
_SHARED_COPIES = ("embed_tokens.weight", "shared_head.head.weight")


class SharedHead(nn.Module):
    """`shared_head`: the norm before the (target's) LM head."""

    def __init__(self, cfg: V3Config, kernels: Kernels) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, use_triton=kernels.triton_elementwise)


class V3MTPLayer(V3DecoderLayer):
    """The decoder layer (MoE MLP, layer id 0 in the draft's KV pool) between the input combine and
    `shared_head.norm`. forward: the tokens' embeddings [T, H] and features [T, H] -> out [T, H]."""

    def __init__(self, cfg: V3Config, kernels: Kernels, parallel: ParallelState) -> None:
        rotary = RotaryEmbedding(cfg.qk_rope_head_dim, cfg.max_position_embeddings, cfg.rope,
                                 use_triton=kernels.triton_rope)
        super().__init__(cfg, 0, True, rotary, kernels, parallel)
        d = cfg.hidden_size
        self.enorm = RMSNorm(d, cfg.rms_norm_eps, use_triton=kernels.triton_elementwise)
        self.hnorm = RMSNorm(d, cfg.rms_norm_eps, use_triton=kernels.triton_elementwise)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)  # replicated on every rank, as the features it reads are
        self.shared_head = SharedHead(cfg, kernels)

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(features)], dim=-1))
        hidden, residual = super().forward(positions, x, None, batch)
        return self.shared_head.norm(hidden, residual)[0]


class V3MTPDraft(FeatureDraft):
    """A DeepSeek-V3 target's MTP layer as a NEXTN feature draft, in the shape a ModelRunner runs:
    forward(the tokens at t + 1, positions t, batch with `spec_features` h_t [T, H]) -> out [T, H], both
    the next draft step's feature and what `compute_logits` (the target's LM head) reads."""

    stacked_params = DeepseekV3ForCausalLM.stacked_params

    def __init__(self, cfg: V3Config, target: TargetParts, kernels: Kernels, parallel: ParallelState) -> None:
        super().__init__()
        self.config = cfg
        self.feature_size = cfg.hidden_size
        self.target = target  # not a submodule: the target owns (and loads) its embedding and head
        self.mtp = V3MTPLayer(cfg, kernels, parallel)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        assert batch.spec_features is not None, "the MTP layer's forward needs the features of its positions"
        return self.mtp(self.target.embed_tokens(input_ids), batch.spec_features, positions, batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target.compute_logits(hidden)

    def kv_layout(self, dtype: torch.dtype) -> KVLayout:
        """One latent layer, in `dtype` (the target's pool dtype: its entries are as small as the target's)."""
        cfg = self.config
        return KVLayout.latent_attention(1, cfg.kv_lora_rank, cfg.qk_rope_head_dim, dtype)


def load_v3_mtp_draft(path: str | Path, target: DeepseekV3ForCausalLM, hf_config: dict, dtype: torch.dtype,
                      device: torch.device | str, kernels: Kernels, load_format: str = "auto") -> V3MTPDraft:
    """The first MTP layer of the checkpoint at `path` (the target's folder) as a draft on `device` in
    `dtype`, sharded as the target is. A block-FP8 checkpoint's FP8 linears stay FP8, as the target's.
    Raises ValueError when the checkpoint lacks a tensor of the layer or has one it does not know."""
    cfg: V3Config = target.config
    if not cfg.num_nextn_predict_layers:
        raise ValueError(f"the checkpoint at {path} has no MTP layer (num_nextn_predict_layers is 0)")
    with torch.device(device), default_dtype(dtype):
        draft = V3MTPDraft(cfg, TargetParts.of(target), kernels, target.parallel)
    if load_format == "dummy":
        fill_random(draft)
        return draft.eval()
    layer = re.compile(rf"^model\.layers\.{cfg.num_hidden_layers}\.")
    names = checkpoint_names(path)
    if not any(layer.match(n) for n in names):
        raise ValueError(f"NEXTN needs the MTP layer model.layers.{cfg.num_hidden_layers}.* of the checkpoint at "
                         f"{path}, which has none (a folder saved by transformers keeps none); use the model's own "
                         "release")

    def skip(name: str) -> bool:
        m = layer.match(name)
        return m is None or name[m.end():] in _SHARED_COPIES or name.endswith(HARMLESS_SUFFIXES)

    def rename(name: str) -> str:
        return target.checkpoint_name(layer.sub("mtp.", name))

    if checkpoint_quantization(hf_config) is not None:
        from kestrel.quant.linears import use_checkpoint_fp8_linears

        use_checkpoint_fp8_linears(draft, [rename(n) for n in names if not skip(n)], kernels.triton_fp8)
    copy_checkpoint(draft, path, "DeepSeek-V3's MTP layer", draft.stacked_params, skip, rename, hf_config=hf_config)
    return draft.eval()

"""Multi-head Latent Attention (DeepSeek-V3) as the model sees it: queries and the compressed KV in, the
running MLA backend does the rest (docs/design/attention-backends.md §7).

The model computes, per new token, the query split into its no-rope part [T, heads, qk_nope_head_dim]
and its rotated rope part [T, heads, qk_rope_head_dim], and the compressed KV: the latent [T,
kv_lora_rank] after the KV norm and the rotated rope key [T, qk_rope_head_dim], which all heads share.
This layer holds the one weight attention needs beyond them: the up-projection `kv_b_proj` from a latent
to each head's no-rope key and value, [heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank] with
head h's key rows first, then its value rows (the checkpoint's `kv_b_proj.weight`, in the model dtype:
a block-scaled FP8 checkpoint's is dequantised at load, `KvBProjLoader`, since the backends slice it into
W_UK and W_UV and fold them into the query and the output, which FP8 blocks across heads would not allow).

The math, per head h with key rows W_UK[h] and value rows W_UV[h]:
    score(t, s) = scale * (q_nope[t,h] . W_UK[h] latent[s] + q_rope[t,h] . k_rope[s])
    out[t, h]   = W_UV[h] sum_s softmax(score)(t, s) latent[s]
Backends either up-project the latents to per-head keys and values (the MHA form) or fold W_UK into the
query and W_UV after the sum (the absorbed form): q_nope[t,h] @ W_UK[h] is a query in latent space.

Tensor parallelism: `num_heads` is this rank's heads, from `first_head`; the latent and the rope key
are whole on every rank (the KV layout is the same on every rank).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kestrel.attention.mla.base import mla_backend
from kestrel.core.forward_batch import ForwardBatch
from kestrel.quant.fp8 import dequantize_blocks, is_fp8

_WEIGHT, _SCALE = "kv_b_proj.weight", "kv_b_proj.weight_scale_inv"


class MLAAttention(nn.Module):
    """`scaling`: the softmax scale, qk_head_dim^-0.5 times YaRN's mscale^2 where the config's rope
    scaling has `mscale_all_dim` (the model computes it)."""

    def __init__(self, layer_id: int, num_heads: int, qk_nope_head_dim: int, qk_rope_head_dim: int,
                 v_head_dim: int, kv_lora_rank: int, scaling: float, first_head: int = 0) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.kv_lora_rank = kv_lora_rank
        self.scaling = scaling
        self.first_head = first_head
        self.kv_b_proj = nn.Parameter(torch.empty(num_heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank),
                                      requires_grad=False)

    def tensor_loader(self, prefix: str = "") -> "KvBProjLoader":
        """What the model loader hands this layer's checkpoint tensors to (`kv_b_proj.weight` and, in a
        block-FP8 checkpoint, `kv_b_proj.weight_scale_inv`; names relative to this module)."""
        return KvBProjLoader(self, prefix)

    @property
    def w_uk(self) -> torch.Tensor:
        """[heads, qk_nope_head_dim, kv_lora_rank]: latent -> each head's no-rope key (a view)."""
        return self.kv_b_proj.view(self.num_heads, -1, self.kv_lora_rank)[:, :self.qk_nope_head_dim]

    @property
    def w_uv(self) -> torch.Tensor:
        """[heads, v_head_dim, kv_lora_rank]: latent -> each head's value (a view)."""
        return self.kv_b_proj.view(self.num_heads, -1, self.kv_lora_rank)[:, self.qk_nope_head_dim:]

    def forward(self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        """q_nope [T, heads, nope], q_rope [T, heads, rope], latent [T, kv_lora_rank], k_rope [T, rope]
        -> [T, heads * v_head_dim]. Stores latent | k_rope at the new tokens' slots first."""
        return mla_backend(batch).forward_mla(q_nope, q_rope, latent, k_rope, self, batch)


class KvBProjLoader:
    """Fills `MLAAttention.kv_b_proj` from the checkpoint: a float weight as it is, an FP8 one (e4m3 with
    128 x 128 `weight_scale_inv` blocks, DeepSeek's layout) dequantised once both halves have come, in
    whichever order. Only this rank's heads' rows are kept. The loader protocol of
    `kestrel.models.loader.copy_checkpoint`: `expected_keys`, `load`, `unpaired`."""

    def __init__(self, layer: MLAAttention, prefix: str = "") -> None:
        self.layer, self.prefix = layer, prefix
        self._waiting: dict[str, torch.Tensor] = {}  # the half that came first: its name -> tensor

    def expected_keys(self) -> set[str]:
        return {"kv_b_proj"}

    def load(self, name: str, read: Callable[[], torch.Tensor]) -> list[str]:
        """The keys filled ([] for the first half of an FP8 pair); ValueError for any other name or a
        tensor of the wrong shape."""
        if name not in (_WEIGHT, _SCALE):
            raise ValueError(f"{self.prefix}.{name}: an MLA layer takes {_WEIGHT} (float, or FP8 with {_SCALE}) only")
        tensor = read()
        if name == _WEIGHT and not is_fp8(tensor.dtype):
            return self._place(tensor)
        other = _SCALE if name == _WEIGHT else _WEIGHT
        if other not in self._waiting:
            self._waiting[name] = tensor
            return []
        weight, scale = (tensor, self._waiting.pop(other)) if name == _WEIGHT else (self._waiting.pop(other), tensor)
        try:
            return self._place(dequantize_blocks(weight, scale))
        except RuntimeError as e:
            raise ValueError(f"{self.prefix}.{_WEIGHT}: cannot dequantise {tuple(weight.shape)} {weight.dtype} with "
                             f"scales {tuple(scale.shape)} (128 x 128 blocks): {e}") from None

    def unpaired(self) -> list[str]:
        return [f"{name} (without its {'scale' if name == _WEIGHT else 'weight'})" for name in self._waiting]

    def _place(self, weight: torch.Tensor) -> list[str]:
        layer = self.layer
        rows = layer.qk_nope_head_dim + layer.v_head_dim
        first, count = layer.first_head * rows, layer.num_heads * rows
        if weight.dim() != 2 or weight.shape[0] < first + count or weight.shape[1:] != layer.kv_b_proj.shape[1:]:
            raise ValueError(f"{self.prefix}.{_WEIGHT}: checkpoint shape {tuple(weight.shape)} does not hold this "
                             f"rank's heads {layer.first_head}..{layer.first_head + layer.num_heads - 1} of "
                             f"{rows} rows each by {layer.kv_lora_rank}")
        with torch.no_grad():
            layer.kv_b_proj.copy_(weight.narrow(0, first, count))  # casts to the model dtype, moves to its device
        return ["kv_b_proj"]

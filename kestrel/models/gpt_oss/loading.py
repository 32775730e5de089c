"""gpt-oss checkpoints (transformers' names) -> the model's parameters.

Attention and embeddings copy by name (q/k/v into `qkv_proj`'s rows, `self_attn.sinks` into the
attention layer's, the router's `mlp.router` into the MoE's `mlp.gate`), each rank reading its slice.
The experts go to the MoE layer's loader (kestrel.layers.moe.loading) as stacked tensors in gpt-oss's
layouts: `gate_up_proj` [E, H, 2I] with gate and up columns alternating, `down_proj` [E, I, H], their
biases; or, in an MXFP4 checkpoint, `<proj>_blocks` + `<proj>_scales` stored [E, out, in], which
dequantise (kestrel.quant.mxfp4) and transpose into the float layout, so one conversion serves both.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

from kestrel.layers.moe.loading import (ExpertCheckpoint, QuantizedPair, StackedLayout, interleaved_gate_up,
                                        interleaved_gate_up_bias, transposed)
from kestrel.models.destination import checkpoint_destination, expected_keys
from kestrel.quant.mxfp4 import dequantize_mxfp4


def _mxfp4_as_float_layout(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    # bfloat16 holds every MXFP4 value exactly, at half float32's transient memory.
    return dequantize_mxfp4(blocks, scales, torch.bfloat16).transpose(-1, -2)


MXFP4_EXPERTS = QuantizedPair("_blocks", "_scales", "", _mxfp4_as_float_layout)
GPT_OSS_EXPERTS = ExpertCheckpoint(
    stacked={"gate_up_proj": StackedLayout("gate_up", interleaved_gate_up),
             "gate_up_proj_bias": StackedLayout("gate_up_bias", interleaved_gate_up_bias),
             "down_proj": StackedLayout("down", transposed),
             "down_proj_bias": StackedLayout("down_bias")},
    quantized=(MXFP4_EXPERTS,),
)
STACKED_PARAMS = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2)}
_RENAMES = ((".self_attn.sinks", ".self_attn.attn.sinks"), (".mlp.router.", ".mlp.gate."))
_EXPERT_PARAMS = (".w13", ".w2", ".b13", ".b2")


def load_gpt_oss(model, tensors: Iterable[tuple[str, torch.Tensor]], source: str) -> None:
    """Fill `model` (a GptOssForCausalLM, this rank's shard) from (name, tensor) pairs; ValueError naming
    the missing and unexpected tensors, so a checkpoint loads whole or not at all."""
    cfg = model.config
    params = dict(model.state_dict(keep_vars=True))
    experts = {f"model.layers.{i}.mlp.experts.": layer.mlp.experts.tensor_loader()
               for i, layer in enumerate(model.model.layers)}
    expected = {key for key in expected_keys(model, params) if not key.endswith(_EXPERT_PARAMS)}
    expected |= {prefix + key for prefix, loader in experts.items() for key in loader.expected_keys()}
    loaded: set[str] = set()
    unexpected: list[str] = []
    with torch.no_grad():
        for name, tensor in tensors:
            if name.endswith("rotary_emb.inv_freq") or (cfg.tie_word_embeddings and name == "lm_head.weight"):
                continue
            prefix = name[:name.find(".mlp.experts.") + len(".mlp.experts.")] if ".mlp.experts." in name else None
            if prefix in experts:
                keys = experts[prefix].load(name[len(prefix):], lambda t=tensor: t)
                if keys is None:
                    unexpected.append(name)
                loaded |= {prefix + key for key in keys or ()}
                continue
            renamed = name
            for old, new in _RENAMES:
                renamed = renamed.replace(old, new)
            key, rows, part = checkpoint_destination(model, params, STACKED_PARAMS, renamed)
            if key is None:
                unexpected.append(name)
                continue
            if part is not None:  # tensor parallelism: this rank's slice
                rows = rows.narrow(part.dim, 0, part.length)
                tensor = tensor.narrow(part.dim, part.start, part.length)
            if rows.shape != tensor.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(rows.shape)}")
            rows.copy_(tensor)
            loaded.add(key)
    missing = sorted(expected - loaded)
    unpaired = [prefix + half for prefix, loader in experts.items() for half in loader.unpaired()]
    if missing or unexpected or unpaired:
        raise ValueError(f"checkpoint at {source} does not match GptOssForCausalLM: missing {missing}, unexpected "
                         f"{sorted(unexpected)}, unpaired {unpaired}; experts are read as "
                         f"{GPT_OSS_EXPERTS.supported()}")


"""How gpt-oss checkpoints (transformers' names) map onto the model; the loader (kestrel.models.loader)
copies them.

Attention and embeddings copy by name (q/k/v into `qkv_proj`'s rows, `self_attn.sinks` into the
attention layer's, the router's `mlp.router` into the MoE's `mlp.gate`), each rank reading its slice.
The experts go to the MoE layer's loader (kestrel.layers.moe.loading) as stacked tensors in gpt-oss's
layouts: `gate_up_proj` [E, H, 2I] with gate and up columns alternating, `down_proj` [E, I, H], their
biases; or, in an MXFP4 checkpoint, `<proj>_blocks` + `<proj>_scales` stored [E, out, in], which
dequantise (kestrel.quant.mxfp4) and transpose into the float layout, so one conversion serves both.
"""
from __future__ import annotations

import torch

from kestrel.layers.moe.loading import (ExpertCheckpoint, QuantizedPair, StackedLayout, interleaved_gate_up,
                                        interleaved_gate_up_bias, transposed)
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
RENAMES = ((".self_attn.sinks", ".self_attn.attn.sinks"), (".mlp.router.", ".mlp.gate."))

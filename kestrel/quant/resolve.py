"""Resolution of `--kv-cache-dtype` and `--quantization` against the checkpoint and the device."""
from __future__ import annotations

from typing import Any

import torch

from kestrel.quant.fp8 import BLOCK
from kestrel.quant.int4 import INT4_METHODS, check_int4_family, int4_config
from kestrel.quant.kv import KV_CACHE_DTYPES
from kestrel.quant.mxfp4 import is_mxfp4_checkpoint

QUANTIZATIONS = ("fp8", *INT4_METHODS)
# Ada (sm89) and Hopper (sm90) have FP8 tensor cores and conversions; older GPUs have neither.
FP8_MIN_CAPABILITY = (8, 9)


def checkpoint_quantization(hf: dict[str, Any]) -> str | None:
    """"fp8" for a block-scaled FP8 checkpoint (Qwen3-FP8 / DeepSeek layout), "awq" / "gptq" for a 4-bit
    one (kestrel.quant.int4), None for a float one; ValueError for any quantized format kestrel cannot load."""
    qc = hf.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method in INT4_METHODS:
        int4_config(qc)  # validates
        return method
    if method != "fp8":
        raise ValueError(f"the checkpoint is quantized with {method!r}; kestrel loads float checkpoints, "
                         f"block-scaled fp8 ones (quantization_config.quant_method 'fp8') and 4-bit 'awq' / 'gptq'")
    if list(qc.get("weight_block_size") or []) != [BLOCK, BLOCK]:
        raise ValueError(f"the fp8 checkpoint has weight_block_size {qc.get('weight_block_size')}; kestrel loads "
                         f"[{BLOCK}, {BLOCK}] block scales (weight_scale_inv) only, not per-tensor scales")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(f"the fp8 checkpoint has activation_scheme {qc['activation_scheme']!r}; kestrel "
                         "quantizes activations dynamically (per token) and supports 'dynamic' only")
    return "fp8"


def resolve_quantization(quantization: str | None, kv_cache_dtype: str, hf: dict[str, Any], device: str) -> str | None:
    """The weight quantization to load with (None: float weights); validates both FP8 options."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)} or unset, got {quantization!r}")
    from kestrel.models.registry import needs_dsv4_attention

    if needs_dsv4_attention(hf.get("architectures") or []):
        if kv_cache_dtype not in ("auto", "fp8_e4m3"):
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not supported for DeepSeek-V4: its FP8 KV "
                             "entries are e4m3 with power-of-two scales per 64 values "
                             "(docs/design/deepseek-v4.md §6); use kv_cache_dtype 'auto' (the model dtype) or "
                             "'fp8_e4m3'")
        if quantization is not None:
            raise ValueError("quantization 'fp8' is not supported for DeepSeek-V4: its loader dequantizes the "
                             "checkpoint's FP8/FP4 weights to the model dtype; leave quantization unset")
        return None
    if is_mxfp4_checkpoint(hf):
        return _mxfp4_checkpoint(quantization, hf)
    stored = checkpoint_quantization(hf)
    if stored in INT4_METHODS or quantization in INT4_METHODS:
        _check_int4(quantization, stored, hf)
    quantization = quantization or stored
    fp8 = quantization == "fp8" or kv_cache_dtype != "auto"
    if fp8 and device != "cpu":
        have = torch.cuda.get_device_capability(device)
        if have < FP8_MIN_CAPABILITY:
            what = " and ".join(filter(None, [f"kv_cache_dtype {kv_cache_dtype!r}" if kv_cache_dtype != "auto" else "",
                                              f"quantization {quantization!r}" if quantization == "fp8" else ""]))
            raise ValueError(f"{what} need a GPU with FP8 support (compute capability >= 8.9: Ada, Hopper or "
                             f"newer); this one is {have[0]}.{have[1]}. Use kv_cache_dtype='auto' and no "
                             "quantization (on CPU, FP8 is emulated)")
    return quantization


def _mxfp4_checkpoint(quantization: str | None, hf: dict[str, Any]) -> None:
    """An MXFP4 checkpoint loads only into a family that dequantises it at load (gpt-oss's experts), to
    the model dtype: so no weight quantization is left to resolve, and any device that runs the model
    dtype serves it."""
    from kestrel.models.registry import model_class

    cls = model_class(hf.get("architectures") or [])
    if "mxfp4" not in cls.checkpoint_quantizations:
        raise ValueError(f"the checkpoint is quantized with 'mxfp4', which kestrel loads for gpt-oss's experts "
                         f"only, not for {cls.__name__}")
    if quantization is not None:
        raise ValueError(f"quantization {quantization!r} is not supported for an MXFP4 checkpoint: its experts are "
                         "dequantised to the model dtype at load; leave quantization unset")
    return None


def _check_int4(quantization: str | None, stored: str | None, hf: dict[str, Any]) -> None:
    """AWQ / GPTQ come from a checkpoint only (no online 4-bit quantization), into dense models."""
    from kestrel.models.registry import model_class

    if stored not in INT4_METHODS:
        raise ValueError(f"quantization {quantization!r} needs an {quantization} checkpoint (quantization_config."
                         f"quant_method {quantization!r}); kestrel does not quantize float weights to 4 bits")
    if quantization not in (None, stored):
        raise ValueError(f"quantization {quantization!r} does not match the checkpoint's {stored!r} weights; leave "
                         "quantization unset to load what the checkpoint holds")
    check_int4_family(model_class(hf.get("architectures") or []), stored)

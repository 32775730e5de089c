"""HF checkpoint directory (config.json + safetensors, single or sharded) or GGUF file -> model on a device."""
from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from kestrel.hf_config import read_hf_config
from kestrel.distributed.parallel_state import ParallelState
from kestrel.layers.kernels import Kernels
from kestrel.layers.linear import Slice
from kestrel.models.base import CausalLM, StackedParams
from kestrel.models.destination import checkpoint_destination, expected_keys
from kestrel.models.gguf import gguf_file, gguf_tensors, read_gguf_config
from kestrel.models.registry import model_class
from kestrel.progress import progress_bar
from kestrel.quant.int4 import INT4_METHODS, check_int4_family, int4_config
from kestrel.quant.resolve import checkpoint_quantization

# Buffers some checkpoints store that kestrel recomputes (rope frequencies).
HARMLESS_SUFFIXES = ("rotary_emb.inv_freq",)

TensorRead = Callable[[Slice | None], torch.Tensor]


def read_arch_config(model_path: str | Path):
    """The model's architecture config (its class's `parse_config`: an ArchConfig for the Llama family,
    a V4Config for DeepSeek-V4), without building the model."""
    config = read_hf_config(str(model_path))
    return model_class(config.get("architectures") or []).parse_config(config)


def load_model(model_path: str | Path, dtype: torch.dtype, device: torch.device | str,
               kernels: Kernels = Kernels(), load_format: str = "auto", hf_config: dict | None = None,
               quantization: str | None = None, parallel: ParallelState = ParallelState()) -> CausalLM:
    """Build the model directly on `device` in `dtype` and fill it from the checkpoint.

    Checkpoint names map to parameters by name, except projections the model merges
    (`stacked_params`: q/k/v → qkv_proj, gate/up → gate_up_proj), which are copied into their rows.
    `load_format="dummy"` fills random weights instead (benchmarks of a config-only folder).
    `kernels` picks Triton or torch implementations of rope, norms and activations.
    `hf_config` is the folder's config.json when the caller has read it already.
    A family that `loads_own_checkpoint` (DeepSeek-V4: other namings, FP8/FP4 dequantisation) fills
    itself from the same tensor stream.
    `quantization="fp8"` runs the decoder's linear layers in FP8 (kestrel.quant.linears): an FP8
    checkpoint's weights as stored, a float checkpoint's (or dummy weights) quantized after loading;
    "awq" / "gptq" (the checkpoint's own) run them in 4 bits (random 4-bit weights with dummy);
    None loads what the checkpoint holds.
    `parallel`: the model is built as this rank's shard and reads only its slices of the checkpoint.
    Raises ValueError listing missing or unexpected parameter names.
    """
    if load_format not in ("auto", "dummy"):
        raise ValueError(f"load_format must be 'auto' or 'dummy', got {load_format!r}")
    config = hf_config if hf_config is not None else read_hf_config(str(model_path))
    cls = model_class(config.get("architectures") or [])
    cfg = cls.parse_config(config)
    with torch.device(device), default_dtype(dtype):
        model = cls(cfg, kernels, parallel)
    if cls.loads_own_checkpoint and quantization is not None:
        raise ValueError(f"quantization {quantization!r} is not supported for {cls.__name__}")
    if load_format == "dummy":
        model.fill_dummy()
        return _quantized(model, quantization, kernels, config).eval()
    if cls.loads_own_checkpoint:
        # A tensor the model says it skips (another expert-parallel rank's expert) is never read.
        tensors = ((name, read(None)) for name, read in _checkpoint_reads(Path(model_path), hf_config=config)
                   if not model.skips_checkpoint_tensor(name))
        with progress_bar(None, "Loading weights", "tensor") as bar:  # its own loader: no count known ahead
            model.load_checkpoint(_counted(tensors, bar), str(model_path))
        return model.eval()

    def skip(name: str) -> bool:
        return name.endswith(HARMLESS_SUFFIXES) or (cfg.tie_word_embeddings and name == "lm_head.weight") \
            or model.skips_checkpoint_tensor(name)

    # A format the family's expert loaders dequantise (gpt-oss's MXFP4) leaves the linears in float.
    method = (config.get("quantization_config") or {}).get("quant_method")
    stored = None if method in cls.checkpoint_quantizations else checkpoint_quantization(config)
    # The quantized layers exist before the copy, which fills weights and scales by name.
    names = [model.checkpoint_name(n) for n in checkpoint_names(model_path)] if stored is not None else []
    if stored == "fp8":
        from kestrel.quant.linears import use_checkpoint_fp8_linears

        use_checkpoint_fp8_linears(model, names, kernels.triton_fp8)
    elif stored is not None:
        from kestrel.quant.linears import use_checkpoint_int4_linears

        check_int4_family(cls, stored)
        use_checkpoint_int4_linears(model, names, int4_config(config["quantization_config"]), kernels.triton_int4)
    copy_checkpoint(model, model_path, getattr(cfg, "architecture", cls.__name__), cls.stacked_params, skip, model.checkpoint_name,
                    hf_config=config)
    if stored in INT4_METHODS:
        from kestrel.quant.linears import finish_int4_linears

        finish_int4_linears(model)
    return _quantized(model, quantization if stored is None else None, kernels, config).eval()


def _quantized(model: CausalLM, quantization: str | None, kernels: Kernels, hf_config: dict) -> CausalLM:
    """The model with its float weights quantized online (`quantization="fp8"`), or given random 4-bit
    weights (dummy weights under an AWQ / GPTQ config), or as it is; then its float linears at one row
    through the Triton GEMV (`kernels.triton_gemv`)."""
    _quantize_weights(model, quantization, kernels, hf_config)
    if kernels.triton_gemv:
        from kestrel.layers.one_row_gemv import route_one_row_linears

        route_one_row_linears(model)
    return model


def _quantize_weights(model: CausalLM, quantization: str | None, kernels: Kernels, hf_config: dict) -> None:
    if quantization == "fp8":
        from kestrel.quant.linears import quantize_linears

        quantize_linears(model, kernels.triton_fp8)
    elif quantization is not None:
        from kestrel.quant.linears import random_int4_linears

        random_int4_linears(model, int4_config(hf_config["quantization_config"]), kernels.triton_int4)


def copy_checkpoint(model: nn.Module, model_path: str | Path, what: str, stacked_params: StackedParams,
                    skip: Callable[[str], bool] = lambda n: False, rename: Callable[[str], str] = lambda n: n,
                    hf_config: dict | None = None) -> None:
    """Copy every checkpoint tensor into the parameter or persistent buffer of the same name (after
    `rename`), or into its rows of a merged parameter (`stacked_params`, as `CausalLM` declares it),
    except names `skip` accepts. Raises ValueError listing missing or unexpected names, so a
    checkpoint loads whole or not at all. `hf_config`: the model's config, if read already."""
    own = _tensor_loaders(model)
    params = {name: p for name, p in model.state_dict(keep_vars=True).items() if _owner(name, own) is None}
    expected = expected_keys(model, params) | {f"{prefix}.{key}" for prefix, loader in own.items()
                                               for key in loader.expected_keys()}
    loaded: set[str] = set()
    unexpected: list[str] = []
    with torch.no_grad(), progress_bar(len(expected), "Loading weights", "tensor") as bar:
        for name, read in _checkpoint_reads(Path(model_path), hf_config=hf_config):
            if skip(name):
                continue
            if (prefix := _owner(rename(name), own)) is not None:  # the module places it (MoE experts)
                keys = own[prefix].load(rename(name)[len(prefix) + 1:], lambda read=read: read(None))
                if keys is None:
                    raise ValueError(f"{name}: not a tensor {what} knows for its routed experts; supported: "
                                     f"{own[prefix].fmt.supported()}")
                loaded.update(f"{prefix}.{key}" for key in keys)
                bar.update()
                continue
            target, rows, part = checkpoint_destination(model, params, stacked_params, rename(name))
            if target is None:
                unexpected.append(name)
                continue
            if part is not None:  # a tensor-parallel shard: read only this rank's slice of the file
                rows = rows.narrow(part.dim, 0, part.length)  # past it: the vocabulary's zero padding
            tensor = read(part)
            if rows.shape != tensor.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(rows.shape)}")
            rows.copy_(tensor)  # casts to the model dtype and moves to its device
            loaded.add(target)
            bar.update()
    missing = sorted(expected - loaded)
    unexpected += [f"{prefix}.{half}" for prefix, loader in own.items() for half in loader.unpaired()]
    if missing or unexpected:
        raise ValueError(f"checkpoint at {model_path} does not match {what}: "
                         f"missing {missing}, unexpected {sorted(unexpected)}")


def checkpoint_names(model_path: str | Path) -> list[str]:
    """The tensor names of a checkpoint, read from the file headers only."""
    return [name for name, _ in _checkpoint_tensors(Path(model_path), load=False)]


def checkpoint_tensor(model_path: str | Path, name: str) -> torch.Tensor:
    """One tensor of a checkpoint, by name; KeyError if it has none of that name."""
    for file in _checkpoint_files(Path(model_path)):
        with safe_open(str(Path(model_path) / file), framework="pt") as f:
            if name in f.keys():
                return f.get_tensor(name)
    raise KeyError(f"no tensor {name!r} in the checkpoint at {model_path}")


def _tensor_loaders(model: nn.Module) -> dict:
    """Module name -> the loader of a module that places its own checkpoint tensors (a MoE layer's
    stacked experts: `tensor_loader()`, kestrel.layers.moe.loading)."""
    return {name: m.tensor_loader(name) for name, m in model.named_modules() if hasattr(m, "tensor_loader")}


def _owner(name: str, owners: dict) -> str | None:
    """The module of `owners` that `name` lies under, or None."""
    parts = name.split(".")
    for end in range(len(parts) - 1, 0, -1):
        if (prefix := ".".join(parts[:end])) in owners:
            return prefix
    return None


def _counted(tensors: Iterator[tuple[str, torch.Tensor]], bar) -> Iterator[tuple[str, torch.Tensor]]:
    for item in tensors:
        yield item
        bar.update()


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _checkpoint_tensors(model_path: Path, load: bool = True,
                        hf_config: dict | None = None) -> Iterator[tuple[str, torch.Tensor | None]]:
    """(name, CPU tensor) for every tensor in `model.safetensors` or the shards of its index (or of a
    GGUF file, dequantized; `hf_config` spares reading its metadata again); with `load=False` the
    tensors are not read (None)."""
    if (gguf := gguf_file(model_path)) is not None:
        yield from gguf_tensors(gguf, hf_config or read_gguf_config(gguf), load)
        return
    for name, read in _checkpoint_reads(model_path):
        yield name, read(None) if load else None


def _checkpoint_reads(model_path: Path, hf_config: dict | None = None) -> Iterator[tuple[str, TensorRead]]:
    """(name, read) for every checkpoint tensor, where `read(part)` returns the tensor, or only its
    `Slice` `part` (safetensors reads just those bytes, so a tensor-parallel rank never holds the
    rest). Call `read` before advancing: the file is open only until then."""
    if (gguf := gguf_file(model_path)) is not None:  # dequantized whole, then sliced
        for name, tensor in gguf_tensors(gguf, hf_config or read_gguf_config(gguf), True):
            yield name, lambda part, t=tensor: t if part is None else t.narrow(part.dim, part.start, part.length)
        return
    for file in _checkpoint_files(model_path):
        with safe_open(str(model_path / file), framework="pt") as f:
            for name in f.keys():
                yield name, lambda part, name=name, f=f: _read(f, name, part)


def _read(f, name: str, part: Slice | None) -> torch.Tensor:
    if part is None:
        return f.get_tensor(name)
    view = f.get_slice(name)
    index = [slice(None)] * len(view.get_shape())
    index[part.dim] = slice(part.start, part.start + part.length)
    return view[tuple(index)]


def _checkpoint_files(model_path: Path) -> list[str]:
    index = model_path / "model.safetensors.index.json"
    if index.is_file():
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    if (model_path / "model.safetensors").is_file():
        return ["model.safetensors"]
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {model_path}")

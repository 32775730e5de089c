"""GGUF checkpoints (llama.cpp's one-file format), read through transformers' GGUF support and `gguf`.

`model` is a `.gguf` file, or a folder with exactly one (and no config.json). transformers parses the
file's metadata into a Hugging Face config (and, in `engine/tokenizer.py`, the tokenizer with the chat
template the file carries). Each tensor is dequantized by `gguf` to float32, renamed to its Hugging Face
name and un-permuted by transformers' tensor processor (llama.cpp stores Llama's q/k rows in another rope
layout), then copied into kestrel's parameters in the compute dtype, one tensor at a time: the model
runs dequantized, so the quantization only saves disk, and the weights equal what transformers loads.
"""
from __future__ import annotations

import functools
import importlib.util
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

SUFFIX = ".gguf"


def gguf_file(model: str | Path) -> Path | None:
    """The GGUF file `model` names: itself, or the one `.gguf` of a folder without config.json; None when
    `model` is no GGUF model. ValueError for a folder of several, which must be named."""
    path = Path(model)
    if path.is_file():
        return path if path.suffix == SUFFIX else None
    if not path.is_dir() or (path / "config.json").exists():
        return None
    found = sorted(p.name for p in path.glob("*" + SUFFIX) if p.is_file())
    if len(found) > 1:
        raise ValueError(f"{path} holds {len(found)} GGUF files ({', '.join(found)}); pass one of them as the "
                         "model (a model split into several GGUF shards is not supported: merge it first)")
    return path / found[0] if found else None


@functools.lru_cache(maxsize=4)
def _metadata(file: str) -> dict[str, Any]:
    """transformers' parse of the file's metadata, once per process: it reads every vocabulary entry
    through numpy views, seconds for a 50k vocabulary."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    return load_gguf_checkpoint(file, return_tensors=False)


def read_gguf_config(file: Path) -> dict[str, Any]:
    """The config.json a Hugging Face folder of this model would hold (transformers' defaults filled in),
    with `architectures` from the model type; ValueError for a file it cannot read."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if importlib.util.find_spec("gguf") is None:
        raise ValueError(f"{file} is a GGUF file, which needs the gguf package: pip install 'kestrel[gguf]'")
    try:
        parsed = dict(_metadata(str(file))["config"])
        config = AutoConfig.for_model(parsed.pop("model_type"), **parsed).to_dict()
    except (ValueError, KeyError) as e:
        raise ValueError(f"cannot read the GGUF file {file}: {e}") from e
    arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config["model_type"])
    if arch is None:
        raise ValueError(f"the GGUF file {file} holds a {config['model_type']!r} model, which has no causal LM class")
    config["architectures"] = [arch]
    return config


def _hf_names(architecture: str, hf_config: dict[str, Any]) -> dict[str, str]:
    """GGUF tensor name -> Hugging Face parameter name, from gguf's name table for the architecture.
    (transformers' own mapper builds that table again for every submodule: seconds for a small model.)"""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map
    from transformers import AutoConfig, AutoModelForCausalLM

    arch = next((key for key, name in MODEL_ARCH_NAMES.items() if name == architecture), None)
    if arch is None:
        raise ValueError(f"the gguf package has no tensor names for the GGUF architecture {architecture!r}")
    table = get_tensor_name_map(arch, hf_config["num_hidden_layers"])
    fields = {k: v for k, v in hf_config.items() if k != "model_type"}
    with torch.device("meta"):  # only its parameter names are needed
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(hf_config["model_type"], **fields))
    names = {}
    for hf_name in model.state_dict():
        base, dot, suffix = hf_name.rpartition(".")
        if suffix not in ("weight", "bias"):
            base, dot, suffix = hf_name, "", ""
        gguf_name = table.get_name(base)
        if gguf_name is not None:
            names[gguf_name + dot + suffix] = hf_name
    return names


def gguf_tensors(file: Path, hf_config: dict[str, Any], load: bool = True) -> Iterator[tuple[str, torch.Tensor | None]]:
    """(Hugging Face name, float32 CPU tensor) for every tensor of the file (whose `read_gguf_config` is
    `hf_config`), dequantized one at a time; tensors without a Hugging Face name (precomputed rope
    factors) are left out. With `load=False` the tensors are not read (None)."""
    from gguf import GGUFReader, dequantize
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, read_field

    reader = GGUFReader(file)
    architecture = read_field(reader, "general.architecture")[0]
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=hf_config)
    names = _hf_names(architecture, hf_config)
    for tensor in reader.tensors:
        if tensor.name not in names:
            if tensor.name == "rope_freqs.weight":
                logger.warning("%s stores rope frequency factors (llama.cpp's form of Llama 3.1+ rope scaling), "
                               "which transformers' GGUF reader does not turn into rope_scaling: the model runs "
                               "without that scaling, as transformers runs it", file)
            continue
        if not load:
            yield names[tensor.name], None
            continue
        result = processor.process(weights=dequantize(tensor.data, tensor.tensor_type), name=tensor.name,
                                   tensor_key_mapping=names, parsed_parameters={"tensors": {}, "config": hf_config})
        yield names[result.name], torch.from_numpy(result.weights.copy())

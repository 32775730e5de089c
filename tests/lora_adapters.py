"""Tiny PEFT LoRA adapters of a tiny base model, made with peft itself (the oracle's own format)."""
from __future__ import annotations

from pathlib import Path

import torch

# name -> (rank, alpha, target modules, rsLoRA): ranks and targets differ from one another.
ADAPTERS = {
    "sql": (4, 8, ["q_proj", "v_proj", "down_proj"], False),
    "poet": (8, 16, ["k_proj", "o_proj", "gate_proj", "up_proj"], True),
    "wide": (6, 6, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], False),
}


def make_adapter(base: Path, out: Path, rank: int, alpha: int, targets: list[str], rslora: bool = False,
                 seed: int = 0) -> Path:
    """A PEFT folder (adapter_config.json + adapter_model.safetensors) with random, non-zero A and B."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, lora_dropout=0.0,
                        init_lora_weights=False)
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():  # large enough to change greedy tokens of a random model
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.3)
    peft_model.save_pretrained(out)
    return out


def make_adapters(base: Path, root: Path, names: tuple[str, ...] = tuple(ADAPTERS)) -> dict[str, Path]:
    return {name: make_adapter(base, root / name, *ADAPTERS[name][:3], ADAPTERS[name][3], seed=i)
            for i, name in enumerate(names)}


def peft_model(base: Path, adapter: Path | None) -> torch.nn.Module:
    """transformers + peft with the adapter applied (None: the base model alone)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager")
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    return model.eval()

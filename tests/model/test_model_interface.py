"""The declared model interface (kestrel.models.base): every family implements its required hooks and
declares its optional ones; the loader follows the declarations."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from kestrel.cache.kv_layout import KVLayout
from kestrel.models import registry
from kestrel.models.base import CausalLM, FeatureDraft, ForwardModel
from kestrel.models.deepseek_v4.model import DeepseekV4ForCausalLM
from kestrel.models.deepseek_v4.mtp import MTPDraft
from kestrel.models.llama import LlamaForCausalLM
from kestrel.models.llama_eagle import DraftHead, Eagle3Head, EagleHead
from kestrel.models.loader import load_model
from kestrel.speculative.draft_model import HeadAsModel


def test_every_family_implements_the_required_hooks():
    for name in registry.supported_architectures():
        cls = registry.model_class([name])
        assert issubclass(cls, CausalLM) and not cls.__abstractmethods__, name
    for cls in (EagleHead, Eagle3Head):
        assert issubclass(cls, DraftHead) and not cls.__abstractmethods__
    for cls in (HeadAsModel, MTPDraft):
        assert issubclass(cls, FeatureDraft) and not cls.__abstractmethods__


def test_families_declare_their_capabilities():
    assert LlamaForCausalLM.accepts_eagle_heads and not LlamaForCausalLM.loads_own_checkpoint
    assert LlamaForCausalLM.stacked_params["k_proj"] == ("qkv_proj", 1)
    assert DeepseekV4ForCausalLM.loads_own_checkpoint and not DeepseekV4ForCausalLM.accepts_eagle_heads
    assert DeepseekV4ForCausalLM.segmented_decoder is ForwardModel.segmented_decoder  # prefills run eagerly


def test_a_family_missing_a_required_hook_cannot_be_built():
    class NoKVLayout(CausalLM):
        parse_config = staticmethod(dict)

        def forward(self, input_ids, positions, batch):
            return input_ids

        def compute_logits(self, hidden):
            return hidden

        def input_embedding(self):
            return torch.nn.Identity()

    with pytest.raises(TypeError, match="kv_layout"):
        NoKVLayout({}, None)


class OwnLoader(CausalLM):
    """A family that reads its own checkpoint and never reads tensors named `remote.*`."""

    parse_config = staticmethod(dict)
    loads_own_checkpoint = True

    def __init__(self, cfg, kernels, parallel) -> None:
        super().__init__(cfg, parallel)
        self.weight = torch.nn.Parameter(torch.zeros(2, 2))
        self.seen: list[str] = []

    def forward(self, input_ids, positions, batch):
        return self.weight[input_ids]

    def compute_logits(self, hidden):
        return hidden.float()

    def input_embedding(self):
        return torch.nn.Identity()

    def kv_layout(self, dtype, speculative_tokens=1):
        return KVLayout.full_attention(1, 1, 2, dtype)

    def load_checkpoint(self, tensors, source):
        for name, tensor in tensors:
            self.seen.append(name)
            if name == "w":
                self.weight.data.copy_(tensor)

    def skips_checkpoint_tensor(self, name):
        return name.startswith("remote.")

    def fill_dummy(self):
        self.weight.data.fill_(7.0)


def test_the_loader_follows_the_declarations(tmp_path, monkeypatch):
    monkeypatch.setitem(registry._MODELS, "OwnLoader", OwnLoader)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["OwnLoader"]}))
    save_file({"w": torch.ones(2, 2), "remote.w": torch.ones(3), "extra": torch.ones(1)},
              str(tmp_path / "model.safetensors"))
    model = load_model(tmp_path, torch.float32, "cpu")
    assert sorted(model.seen) == ["extra", "w"] and bool((model.weight == 1).all())
    assert bool((load_model(tmp_path, torch.float32, "cpu", load_format="dummy").weight == 7).all())
    with pytest.raises(ValueError, match="quantization"):
        load_model(tmp_path, torch.float32, "cpu", quantization="fp8")

"""LoRA on CUDA: the Triton kernels under CUDA graphs (decode replays) give the tokens of transformers +
peft, in fp32, for a batch mixing adapters and base rows; the same with graphs off."""
from __future__ import annotations

import pytest
import torch

from kestrel import Engine, SamplingParams
from kestrel.core.forward_mode import ForwardMode
from tests.lora_adapters import make_adapters, peft_model
from tests.tiny_models import make_tiny_model


@pytest.mark.parametrize("graphs", [True, False])
def test_mixed_adapters_on_cuda_equal_peft(tmp_path, graphs: bool) -> None:
    base = make_tiny_model("llama", tmp_path / "base")
    adapters = make_adapters(base, tmp_path)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (7, 12, 9, 5, 10)]
    loras = ["sql", "poet", None, "wide", "sql"]
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    with Engine(model=str(base), device="cuda", dtype="float32", enable_lora=True, max_total_tokens=4096,
                lora_paths=tuple(f"{n}={p}" for n, p in adapters.items()), disable_cuda_graph=not graphs,
                cuda_graph_max_bs=8) as engine:
        assert (ForwardMode.DECODE, 1) in engine.runner.cuda_graphs if graphs else not engine.runner.cuda_graphs
        assert any(type(m).__name__ == "LoRALinear" and m.use_triton for m in engine.runner.model.modules())
        outs = engine.generate(prompt_token_ids=prompts, sampling_params=params, lora_name=loras, use_tqdm=False)
    for prompt, lora, out in zip(prompts, loras, outs):
        model = peft_model(base, adapters[lora] if lora else None)
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(6):
                ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
        assert out.token_ids == ids[len(prompt):], f"adapter {lora}"

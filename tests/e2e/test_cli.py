"""`kestrel generate` and start-up validation."""
from __future__ import annotations

import pytest

from kestrel import Engine, SamplingParams
from kestrel.cli import main


def test_generate_prints_the_engines_text(tiny_model, capsys):
    model = tiny_model("llama")
    assert main(["generate", "--model", model, "--device", "cpu", "--dtype", "float32",
                 "--prompt", "def fibonacci(n):", "--max-new-tokens", "8"]) == 0
    printed = capsys.readouterr().out
    with Engine(model=model, device="cpu", dtype="float32") as engine:
        expected = engine.generate("def fibonacci(n):", SamplingParams(max_new_tokens=8, temperature=0.0))[0].text
    assert printed == expected + "\n"


def test_generate_reports_a_missing_model_folder(tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path / "nope"), "--prompt", "x"]) == 2
    assert "not a Hugging Face model folder" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["attention_backend", "prefill_attention_backend", "decode_attention_backend"])
def test_unknown_attention_backend_fails_at_start_up_with_the_valid_names(tiny_model, flag):
    with pytest.raises(ValueError, match="valid choices: .*torch_native"):
        Engine(model=tiny_model("llama"), device="cpu", **{flag: "flashinfer-typo"})


def test_unknown_engine_option_lists_valid_ones(tiny_model):
    with pytest.raises(TypeError, match="max_total_tokens"):
        Engine(model=tiny_model("llama"), device="cpu", max_total_token=5)

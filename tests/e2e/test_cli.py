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


def test_generate_without_a_tokenizer_takes_token_ids_and_names_the_way_out(tmp_path, capsys):
    from tests.tiny_models import make_tiny_model

    model = str(make_tiny_model("llama", tmp_path / "bare"))  # no tokenizer files
    flags = ["generate", "--model", model, "--device", "cpu", "--dtype", "float32", "--max-new-tokens", "6"]
    assert main(flags + ["--prompt", "def f():"]) == 2
    assert "--tokenizer" in capsys.readouterr().err
    assert main(flags + ["--prompt-token-ids", "5,17,42"]) == 0
    with Engine(model=model, device="cpu", dtype="float32") as engine:
        expected = engine.generate(prompt_token_ids=[[5, 17, 42]],
                                   sampling_params=SamplingParams(max_new_tokens=6, temperature=0.0))[0].token_ids
    assert capsys.readouterr().out == " ".join(map(str, expected)) + "\n"
    assert main(flags + ["--prompt-token-ids", "5,x"]) == 2
    assert "comma-separated integers" in capsys.readouterr().err


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


def test_a_bundled_name_as_tokenizer_means_the_bundled_folder(tiny_model):
    from kestrel.assets import resolve_model_path
    from kestrel.config import EngineConfig

    config = EngineConfig.from_flat(model=tiny_model("llama"), tokenizer="demo", device="cpu").resolve()
    assert config.model.tokenizer == resolve_model_path("demo") != "demo"

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
    from kestrel.config_resolve import resolve_config

    config = resolve_config(EngineConfig.from_flat(model=tiny_model("llama"), tokenizer="demo", device="cpu"))
    assert config.model.tokenizer == resolve_model_path("demo") != "demo"


def test_vllm_flag_names_are_aliases_of_ours_shown_together_in_help(tiny_model, capsys):
    from kestrel.cli import build_parser, config_from_args

    vllm = build_parser().parse_args([
        "serve", tiny_model("llama"), "--max-model-len", "512", "--max-num-seqs", "3", "--max-num-batched-tokens",
        "64", "--gpu-memory-utilization", "0.5", "--tensor-parallel-size", "1", "--no-enable-prefix-caching",
        "--served-model-name", "a", "b", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    ours = build_parser().parse_args([
        "serve", "--model", tiny_model("llama"), "--context-length", "512", "--max-running-requests", "3",
        "--chunked-prefill-size", "64", "--mem-fraction-static", "0.5", "--tp-size", "1", "--disable-radix-cache",
        "--tool-call-parser", "hermes"])
    assert vllm.model_tag == ours.model and vllm.served_model_name == ["a", "b"]
    assert config_from_args(vllm) == config_from_args(ours)
    on = build_parser().parse_args(["serve", "--enable-prefix-caching"])
    assert config_from_args(on).cache.disable_radix_cache is False
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for pair in ["--context-length CONTEXT_LENGTH, --max-model-len", "--tp-size TP_SIZE, --tensor-parallel-size",
                 "--max-running-requests MAX_RUNNING_REQUESTS, --max-num-seqs",
                 "--chunked-prefill-size CHUNKED_PREFILL_SIZE, --max-num-batched-tokens",
                 "--mem-fraction-static MEM_FRACTION_STATIC, --gpu-memory-utilization",
                 "--enable-prefix-caching, --no-enable-prefix-caching"]:
        assert pair in help_text, pair


@pytest.mark.parametrize("extra, message", [
    (["--model", "demo"], "the model is given twice"),
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
    (["--enable-prefix-caching", "--disable-radix-cache"], "contradict each other"),
])
def test_serve_refuses_contradicting_flags_in_one_line(tiny_model, capsys, extra, message):
    assert main(["serve", tiny_model("llama"), *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kestrel: error: ") and message in err and err.count("\n") == 1, err


def test_a_broken_config_json_is_one_line_naming_the_file(tiny_model, tmp_path, capsys):
    """A malformed file, and sizes that do not fit together: `kestrel: error:` and exit 2, no traceback."""
    import json
    import shutil

    cases = {"malformed": lambda c: "{\n  \"hidden_size\": 64,\n",
             "heads": lambda c: json.dumps({**c, "num_attention_heads": 6, "num_key_value_heads": 6, "head_dim": None}),
             "kv_heads": lambda c: json.dumps({**c, "num_key_value_heads": 3})}
    expected = {"malformed": "is not valid JSON: Expecting property name enclosed in double quotes: line 3",
                "heads": "hidden_size (64) is not a multiple of num_attention_heads (6)",
                "kv_heads": "num_attention_heads (4) is not a multiple of num_key_value_heads (3)"}
    for name, edit in cases.items():
        folder = tmp_path / name
        shutil.copytree(tiny_model("llama"), folder)
        config = folder / "config.json"
        config.write_text(edit(json.loads(config.read_text())))
        for argv in (["serve", str(folder)], ["generate", "--model", str(folder), "--prompt", "x"]):
            assert main(argv) == 2
            err = capsys.readouterr().err
            assert err.startswith(f"kestrel: error: {config}"), err
            assert expected[name] in err and err.count("\n") == 1 and "Traceback" not in err, err

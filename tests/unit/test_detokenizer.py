"""Incremental detokenization, stop strings, chat templates and eos ids on the tiny tokenizer."""
from __future__ import annotations

import json
import random

import pytest

from kestrel.core.sampling_params import SamplingParams
from kestrel.engine.detokenizer import IncrementalDetokenizer, OutputText, StopStringMatcher
from kestrel.engine.tokenizer import apply_chat_template, apply_chat_template_text, eos_token_ids, load_tokenizer
from tests.tiny_tokenizer import build_tokenizer

TEXTS = [
    "Hello, world! def f(x): return x * 2",
    "Café naïve façade — 你好，世界！今天天气很好。",
    "🙂😀🚀 mixed 東京 and 👨‍👩‍👧‍👦 family, ∑ x² ≤ ∞",
    "한국어 텍스트 and Ærøskøbing 🇫🇷",
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    build_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def tok(tok_dir):
    return load_tokenizer(str(tok_dir))


def chunks(ids: list[int], rng: random.Random | None) -> list[list[int]]:
    """One token at a time without rng, random chunk sizes (1..4) with it."""
    out, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 4) if rng else 1
        out.append(ids[i : i + n])
        i += n
    return out


def stream(tok, prompt_ids, output_ids, rng=None, skip_special_tokens=True) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens)
    deltas = [detok.add(c) for c in chunks(output_ids, rng)] + [detok.flush()]
    assert "".join(deltas) == detok.text
    return deltas


def full_decode(tok, ids, skip_special_tokens=True) -> str:
    return tok.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)


def test_tiny_tokenizer_fits_vocab_and_is_deterministic(tmp_path, tok):
    assert len(tok) <= 512
    again = build_tokenizer(tmp_path / "again")
    assert again.get_vocab() == tok.get_vocab()
    small = build_tokenizer(tmp_path / "small", vocab_size=300)
    assert len(small) <= 300
    # The point of the tiny tokenizer: some characters span several tokens.
    assert any("\ufffd" in tok.decode([i]) for i in tok.encode(TEXTS[2], add_special_tokens=False))


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunked", [False, True])
def test_multilingual_text_streams_exactly_without_replacement_chars(tok, text, chunked):
    prompt = tok.encode("Translate: 你好 🙂", add_special_tokens=False)
    output = tok.encode(text, add_special_tokens=False)
    deltas = stream(tok, prompt, output, random.Random(0) if chunked else None)
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_ids_match_full_decode(tok, seed, skip_special_tokens):
    rng = random.Random(seed)
    prompt = tok.encode(rng.choice(TEXTS), add_special_tokens=False) if seed % 2 else []
    output = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 40))]
    for chunk_rng in (None, rng):
        deltas = stream(tok, prompt, output, chunk_rng, skip_special_tokens)
        assert "".join(deltas) == full_decode(tok, output, skip_special_tokens)


def test_split_character_is_held_back_until_complete(tok):
    ids = tok.encode("🚀", add_special_tokens=False)
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tok, [], True)
    assert [detok.add([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.add(ids[-1:]) == "🚀"
    # An incomplete character at the very end is released by flush, as U+FFFD.
    detok = IncrementalDetokenizer(tok, [], True)
    assert detok.add(ids[:1]) == ""
    assert detok.flush() == full_decode(tok, ids[:1])


def test_stop_string_split_across_deltas():
    m = StopStringMatcher(["STOP", "\n\n"])
    out = []
    for delta in ["hello S", "T", "O", "P world"]:
        text, matched = m.feed(delta)
        out.append(text)
        if matched:
            break
    assert "".join(out) == "hello "
    assert matched == "STOP"
    assert m.feed("more") == ("", None)
    assert m.flush() == ""


def test_held_back_text_is_released_when_the_stop_does_not_complete():
    m = StopStringMatcher(["STOP"])
    assert m.feed("abc ST") == ("abc ", None)
    assert m.feed("O") == ("", None)
    assert m.feed("x") == ("STOx", None)
    assert m.feed("end S") == ("end ", None)
    assert m.flush() == "S"


def test_earliest_stop_wins_and_overlapping_prefixes():
    m = StopStringMatcher(["world", "lo w"])
    assert m.feed("hel") == ("he", None)  # "l" may start "lo w"
    assert m.feed("lo world") == ("l", "lo w")  # all emitted: "hel"
    # A stop string that repeats its own prefix: "aab" inside "aaab".
    m = StopStringMatcher(["aab"])
    assert m.feed("xa") == ("x", None)
    assert m.feed("a") == ("", None)
    assert m.feed("ab!") == ("a", "aab")


def test_no_stop_strings_passes_text_through():
    m = StopStringMatcher([])
    assert m.feed("anything") == ("anything", None)
    assert m.flush() == ""


@pytest.mark.parametrize("seed", range(5))
def test_output_text_stops_exactly_before_stop_string(tok, seed):
    rng = random.Random(seed)
    text = "Café 你好 🙂 then STOP and more text after"
    output = tok.encode(text, add_special_tokens=False)
    out = OutputText(tok, [], SamplingParams(stop=["STOP", "never"]))
    deltas, matched = [], None
    for c in chunks(output, rng):
        delta, matched = out.add(c)
        deltas.append(delta)
        if matched:
            break
    deltas.append(out.finish())
    assert matched == "STOP" and out.matched_stop == "STOP"
    assert "".join(deltas) == out.text == "Café 你好 🙂 then "


def test_output_text_without_match_releases_everything(tok):
    text = "ends with a partial sto"
    out = OutputText(tok, [], SamplingParams(stop="stop"))
    deltas = [out.add([i])[0] for i in tok.encode(text, add_special_tokens=False)]
    assert not "".join(deltas).endswith("sto")
    deltas.append(out.finish())
    assert "".join(deltas) == out.text == text
    assert out.matched_stop is None


def test_chat_template_renders_and_tokenizes(tok):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]},
    ]
    text = apply_chat_template_text(tok, messages)
    assert text == "<|bos|><|system|>Be brief.<|eos|><|user|>Hi\nthere<|eos|><|assistant|>"
    ids = apply_chat_template(tok, messages)
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert ids[-1] == tok.convert_tokens_to_ids("<|assistant|>")
    assert not apply_chat_template_text(tok, messages, add_generation_prompt=False).endswith("<|assistant|>")


@pytest.mark.parametrize(
    "messages, fragment",
    [
        ([], "non-empty list"),
        ("hi", "non-empty list"),
        (["hi"], "messages[0] must be a dict"),
        ([{"role": "robot", "content": "x"}], "messages[0].role"),
        ([{"role": "user"}], "no 'content'"),
        ([{"role": "user", "content": "a"}, {"role": "user", "content": 3}], "messages[1].content"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], "content parts"),
    ],
)
def test_chat_template_rejects_malformed_messages(tok, messages, fragment):
    with pytest.raises(ValueError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        apply_chat_template(tok, messages)


def test_chat_template_missing(tok, monkeypatch):
    monkeypatch.setattr(tok, "chat_template", None)
    with pytest.raises(ValueError, match="no chat template"):
        apply_chat_template(tok, [{"role": "user", "content": "hi"}])


def test_load_tokenizer_missing(tmp_path):
    assert load_tokenizer(str(tmp_path), required=False) is None
    with pytest.raises(FileNotFoundError, match="no tokenizer"):
        load_tokenizer(str(tmp_path))


def test_eos_token_ids_reads_both_configs(tmp_path, tok_dir, tok):
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9, 11]}))
    assert eos_token_ids(str(tmp_path), tok, {"eos_token_id": 7}) == {7, 9, 11, tok.eos_token_id}
    assert eos_token_ids(str(tmp_path), None, {"eos_token_id": 5}) == {5, 7, 9, 11}
    # No generation config (the tokenizer folder) and none in config.json: just the tokenizer's eos.
    assert eos_token_ids(str(tok_dir), tok, {}) == {tok.eos_token_id}

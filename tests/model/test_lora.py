"""Multi-LoRA serving against transformers + peft: one engine serves a batch that mixes adapters of
different ranks and targets with base-model rows; each row equals peft with its own adapter."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kestrel import Engine, SamplingParams
from kestrel.lora.pool import LoRANotFoundError
from tests.lora_adapters import make_adapters, peft_model
from tests.tiny_models import make_tiny_model

NEW_TOKENS = 6


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    root = tmp_path_factory.mktemp("lora")
    base = make_tiny_model("llama", root / "base")
    return base, make_adapters(base, root)


def _engine(base: Path, adapters: dict[str, Path], **kw) -> Engine:
    return Engine(model=str(base), device="cpu", dtype="float32", enable_lora=True,
                  lora_paths=tuple(f"{n}={p}" for n, p in adapters.items()), max_total_tokens=2048, **kw)


def _oracle(model: torch.nn.Module, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and the log-softmax at every position of prompt + generated."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            logits = model(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids))).logits[0]
            ids.append(int(logits[-1].argmax()))
        logits = model(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids))).logits[0]
    return ids[len(prompt):], torch.log_softmax(logits.float(), -1)


def test_mixed_batch_matches_peft_per_adapter(setup) -> None:
    base, adapters = setup
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (7, 12, 9, 5, 10)]
    loras = ["sql", "poet", None, "wide", "sql"]
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0,
                            prompt_logprobs=0)
    with _engine(base, adapters) as engine:
        outs = engine.generate(prompt_token_ids=prompts, sampling_params=params, lora_name=loras, use_tqdm=False)
    models = {name: peft_model(base, adapters[name] if name else None) for name in set(loras)}
    base_tokens = _oracle(models[None], prompts[0])[0]
    differs = 0
    for prompt, lora, out in zip(prompts, loras, outs):
        tokens, logprobs = _oracle(models[lora], prompt)
        assert out.token_ids == tokens, f"adapter {lora}: greedy tokens differ from peft"
        seq = prompt + tokens
        want = [float(logprobs[i - 1, seq[i]]) for i in range(1, len(seq))]
        got = [lp for lp, _ in out.meta["prompt_token_logprobs"][1:]] + [lp for lp, _ in out.meta["output_token_logprobs"]]
        assert got == pytest.approx(want, abs=2e-4), f"adapter {lora}: logprobs differ from peft"
        differs += lora is not None and _oracle(models[None], prompt)[0] != tokens
    assert differs >= 2, "the adapters must change greedy tokens, or this test checks nothing"
    assert base_tokens  # the base row ran through the same batches


def test_radix_cache_is_not_shared_across_adapters(setup) -> None:
    base, adapters = setup
    prompt = torch.randint(3, 512, (24,), generator=torch.Generator().manual_seed(5)).tolist()
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    with _engine(base, adapters) as engine:
        runs = {}
        for lora in ("sql", "poet", None, "sql"):
            out = engine.generate(prompt_token_ids=[prompt], sampling_params=params, lora_name=lora, use_tqdm=False)[0]
            runs.setdefault(lora, []).append(out)
    assert runs["sql"][0].meta["cached_tokens"] == 0
    assert runs["poet"][0].meta["cached_tokens"] == 0, "another adapter's KV was reused"
    assert runs[None][0].meta["cached_tokens"] == 0, "an adapter's KV was reused by the base model"
    assert runs["sql"][1].meta["cached_tokens"] > 0, "the same adapter reuses its own prefix"
    assert runs["sql"][1].token_ids == runs["sql"][0].token_ids
    assert runs["sql"][0].token_ids != runs["poet"][0].token_ids


def test_slots_are_evicted_and_admission_waits_for_one(setup) -> None:
    """One slot, three adapters: each batch holds one adapter (plus base rows); outputs still equal the
    runs one at a time."""
    base, adapters = setup
    prompts = [torch.randint(3, 512, (8,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(4)]
    loras = ["sql", "poet", "wide", None]
    params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    with _engine(base, adapters) as engine:
        alone = [engine.generate(prompt_token_ids=[p], sampling_params=params, lora_name=l, use_tqdm=False)[0].token_ids
                 for p, l in zip(prompts, loras)]
    with _engine(base, adapters, max_loras_per_batch=1) as engine:
        seen = []
        engine.add_step_hook(lambda info: seen.append({engine.lora.holder[s].name for s in range(1)
                                                       if engine.lora.pins[s]}))
        mixed = [o.token_ids for o in engine.generate(prompt_token_ids=prompts, sampling_params=params,
                                                      lora_name=loras, use_tqdm=False)]
        assert engine.lora.pins == [0]
    assert mixed == alone
    assert {"sql", "poet", "wide"} <= set().union(*seen)


def test_unknown_and_broken_adapters(setup, tmp_path: Path) -> None:
    base, adapters = setup
    with _engine(base, {"sql": adapters["sql"]}, max_lora_rank=6) as engine:
        with pytest.raises(LoRANotFoundError, match=r"'nope'.*'sql'"):
            engine.add_request(prompt_token_ids=[1, 2, 3], lora_name="nope")
        with pytest.raises(ValueError, match="rank 8, above --max-lora-rank 6"):
            engine.load_lora_adapter("poet", str(adapters["poet"]))
        with pytest.raises(ValueError, match="no adapter_config.json"):
            engine.load_lora_adapter("missing", str(tmp_path / "nowhere"))
        bad = tmp_path / "bad"
        bad.mkdir()
        config = json.loads((adapters["wide"] / "adapter_config.json").read_text())
        (bad / "adapter_config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError, match="no adapter_model.safetensors"):
            engine.load_lora_adapter("bad", str(bad))
        from safetensors.torch import load_file, save_file

        weights = load_file(adapters["wide"] / "adapter_model.safetensors")
        key = next(k for k in weights if "q_proj.lora_B" in k)
        save_file({**weights, key: torch.zeros(3, 6)}, bad / "adapter_model.safetensors")
        with pytest.raises(ValueError, match="another base model"):
            engine.load_lora_adapter("bad", str(bad))
        renamed = {k.replace("q_proj", "qq_proj"): v for k, v in weights.items()}
        save_file(renamed, bad / "adapter_model.safetensors")
        with pytest.raises(ValueError, match="qq_proj"):
            engine.load_lora_adapter("bad", str(bad))
        # PEFT's "all-linear" on a MoE model adapts the experts and the router as raw parameters.
        save_file(weights, bad / "adapter_model.safetensors")
        moe_config = {**config, "target_parameters": ["gate_up_proj", "down_proj", "gate.weight"],
                      "rank_pattern": {".*\\.gate_up_proj": 8}}
        (bad / "adapter_config.json").write_text(json.dumps(moe_config))
        with pytest.raises(ValueError, match="target_parameters .*MoE experts and routers"):
            engine.load_lora_adapter("bad", str(bad))
        engine.load_lora_adapter("wide", str(adapters["wide"]))  # the engine still loads and serves
        assert set(engine.lora_adapters()) == {"sql", "wide"}
        out = engine.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=SamplingParams(max_new_tokens=2),
                              lora_name="wide", use_tqdm=False)
        assert len(out[0].token_ids) == 2
        engine.unload_lora_adapter("wide")
        with pytest.raises(LoRANotFoundError):
            engine.add_request(prompt_token_ids=[1, 2], lora_name="wide")


def test_target_modules_limit_what_adapters_may_change(setup) -> None:
    base, adapters = setup
    with Engine(model=str(base), device="cpu", dtype="float32", enable_lora=True, max_total_tokens=1024,
                lora_target_modules=("q_proj", "v_proj", "down_proj")) as engine:
        engine.load_lora_adapter("sql", str(adapters["sql"]))
        with pytest.raises(ValueError, match="mlp.gate_proj.*does not serve"):
            engine.load_lora_adapter("poet", str(adapters["poet"]))


def test_fp8_base_weights_serve_adapters(setup) -> None:
    """--quantization fp8 with adapters: the delta rides on the FP8 projection's output; an adapter moves
    the FP8 model's logits as it moves the float model's."""
    base, adapters = setup
    prompt = [[9, 8, 7, 6, 5]]
    params = SamplingParams(max_new_tokens=1, temperature=0.0, logprobs=5)
    tops = {}
    for quant in (None, "fp8"):
        with _engine(base, {"sql": adapters["sql"]}, quantization=quant) as engine:
            for lora in ("sql", None):
                out = engine.generate(prompt_token_ids=prompt, sampling_params=params, lora_name=lora, use_tqdm=False)
                tops[quant, lora] = dict(out[0].meta["output_top_logprobs"][0])
    for lora in ("sql", None):  # FP8 stays near float (same top token), with and without the adapter
        common = set(tops[None, lora]) & set(tops["fp8", lora])
        assert common and all(abs(tops[None, lora][t] - tops["fp8", lora][t]) < 0.2 for t in common)
        assert max(tops[None, lora], key=tops[None, lora].get) == max(tops["fp8", lora], key=tops["fp8", lora].get)
    assert tops["fp8", "sql"] != tops["fp8", None]


def test_lora_refuses_what_it_cannot_serve(setup) -> None:
    base, adapters = setup
    with pytest.raises(ValueError, match="need --enable-lora"):
        Engine(model=str(base), device="cpu", lora_paths=(f"sql={adapters['sql']}",))
    with pytest.raises(ValueError, match="valid projections"):
        Engine(model=str(base), device="cpu", enable_lora=True, lora_target_modules=("lm_head",))
    from kestrel.lora.resolve import resolve_lora
    from kestrel.config import LoRAConfig

    with pytest.raises(ValueError, match="float or fp8 weights.*'awq'"):
        resolve_lora(LoRAConfig(enable_lora=True), "awq", 1)


def test_an_adapter_waiting_for_a_slot_is_not_starved(setup) -> None:
    """One slot; requests for "sql" keep arriving while one for "poet" waits. Once the "poet" request has aged
    (the policy's aging: 4 x 2 s without a TTFT target), no new "sql" request is admitted before it, so the
    slot drains and "poet" runs; before it has aged, later "sql" requests go ahead of it."""
    base, adapters = setup
    now = [0.0]
    params = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)
    with _engine(base, adapters, max_loras_per_batch=1, clock=lambda: now[0]) as engine:
        engine.add_request(prompt_token_ids=[5, 6, 7], sampling_params=params, lora_name="sql")
        engine.step()
        poet = engine.add_request(prompt_token_ids=[8, 9, 10], sampling_params=params, lora_name="poet")
        admitted_at = None
        for step in range(60):
            if step % 2 == 0:  # a steady stream of "sql" requests keeps the slot pinned
                engine.add_request(prompt_token_ids=[11, step, 12], sampling_params=params, lora_name="sql")
            now[0] += 0.5
            engine.step()
            if admitted_at is None and engine.request(poet).kv_len > 0:
                admitted_at = now[0]
        assert admitted_at is not None and 8.0 <= admitted_at <= 12.0, admitted_at


@pytest.mark.parametrize("algorithm", ["NGRAM", "STANDALONE"])
def test_speculative_decoding_keeps_each_adapters_greedy_tokens(setup, algorithm) -> None:
    """A verify scores several tokens of each row through its own adapter: greedy tokens equal the plain
    engine's in a batch mixing adapters and base rows. The draft model (the base itself here) drafts without
    adapters, so only the base row accepts every draft."""
    base, adapters = setup
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 60, (n,), generator=g).tolist() * 3 for n in (5, 8, 6, 4)]  # repeats: n-grams hit
    loras = ["sql", "poet", None, "wide"]
    params = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)

    def run(names=loras, **spec):
        with _engine(base, adapters, **spec) as engine:
            return engine.generate(prompt_token_ids=prompts, sampling_params=params, lora_name=names, use_tqdm=False)

    plain = run()
    base_only = run([None] * len(prompts))
    assert sum(a.token_ids != b.token_ids for a, b in zip(plain, base_only)) >= 2, "adapters must change tokens"
    draft = {"speculative_draft_model_path": str(base)} if algorithm == "STANDALONE" else {}
    spec = run(speculative_algorithm=algorithm, **draft)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    accepted = [o.meta["spec_accept_length"] for o in spec]
    assert max(accepted) > 1.0, f"no draft was accepted ({accepted}): the verify path was not exercised"
    if algorithm == "STANDALONE":
        assert accepted[2] == max(accepted)  # the base row: the draft is its own model

"""NEXTN on a DeepSeek-V3 target: its MTP layer (model.layers.{num_hidden_layers}.*) drafts chains over
its own MLA KV, through the engine, on a tiny random config in float32.

The checkpoint is made from a 4-layer transformers DeepseekV3: its first three layers are the target,
its fourth the MTP layer's decoder layer, with enorm / hnorm / eh_proj / shared_head.norm added, and
the copies of the embedding and head DeepSeek's releases carry. Oracles: plain greedy decoding (token
for token), and a naive MTP reference built on transformers' layers (transformers has no MTP): every
position a DRAFT_EXTEND scores has the reference's logits. Random weights make the MTP layer a poor
guesser, so a second test swaps in drafts that are right at chosen depths: verify rounds then accept
0..num_steps drafts and the draft's latent KV is rolled back at every depth.
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3ForCausalLM

from kestrel import Engine, SamplingParams, envs
from tests.e2e.conftest import assert_pool_full
from tests.e2e.test_spec_nextn import record_draft_extends
from tests.model.dsv3_tiny import make_dsv3

TARGET_LAYERS = 3
COMMON = dict(device="cpu", dtype="float32", max_total_tokens=1024, chunked_prefill_size=8)
PROMPT_LENS = (19, 5, 12)
VOCAB = 128

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(checkpoint folder, the 4-layer transformers model, the MTP layer's own weights)."""
    path = make_dsv3(tmp_path_factory.mktemp("dsv3-mtp"), num_hidden_layers=TARGET_LAYERS + 1)
    full = DeepseekV3ForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    g = torch.Generator().manual_seed(1)
    d = full.config.hidden_size
    mtp = {"enorm.weight": 1 + 0.1 * torch.randn(d, generator=g), "hnorm.weight": 1 + 0.1 * torch.randn(d, generator=g),
           "eh_proj.weight": 0.05 * torch.randn(d, 2 * d, generator=g),
           "shared_head.norm.weight": 1 + 0.1 * torch.randn(d, generator=g)}
    tensors = load_file(str(path / "model.safetensors"))
    prefix = f"model.layers.{TARGET_LAYERS}."
    tensors.update({prefix + k: v for k, v in mtp.items()})
    tensors[prefix + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors[prefix + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    config.update(num_hidden_layers=TARGET_LAYERS, num_nextn_predict_layers=1)
    (path / "config.json").write_text(json.dumps(config))
    return str(path), full, mtp


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _layers(full, x: torch.Tensor, layers) -> torch.Tensor:
    t = x.shape[0]
    positions = torch.arange(t)[None]
    mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
    rope = full.model.rotary_emb(x[None], positions)
    x = x[None]
    for layer in layers:
        x = layer(x, attention_mask=mask, position_ids=positions, position_embeddings=rope)
    return x[0]


@torch.no_grad()
def reference_mtp_logits(full, mtp: dict, seq: list[int]) -> torch.Tensor:
    """[len(seq) - 1, vocab]: the MTP layer's logits at each position t, from the target's final-normed
    hidden state at t and the token at t + 1."""
    eps, embed = full.config.rms_norm_eps, full.model.embed_tokens
    ids = torch.tensor(seq)
    h = full.model.norm(_layers(full, embed(ids[:-1]), full.model.layers[:TARGET_LAYERS]))
    x = torch.cat([_rms(embed(ids[1:]), mtp["enorm.weight"], eps), _rms(h, mtp["hnorm.weight"], eps)], dim=-1)
    x = _layers(full, x @ mtp["eh_proj.weight"].T, full.model.layers[TARGET_LAYERS:])
    return full.lm_head(_rms(x, mtp["shared_head.norm.weight"], eps))


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def plain(tiny) -> list[list[int]]:
    with Engine(model=tiny[0], **COMMON) as engine:
        return [o.token_ids for o in engine.generate(prompt_token_ids=prompts(), sampling_params=greedy(12))]


def check_draft_logits(records, finals: dict[str, list[int]], full, mtp) -> None:
    """Every real row a DRAFT_EXTEND scored equals the reference MTP logits at that position of the
    request's final sequence; each prompt's last position (the first draft) is among them."""
    expected = {rid: reference_mtp_logits(full, mtp, seq) for rid, seq in finals.items()}
    checked: dict[str, set[int]] = {rid: set() for rid in finals}
    for batch, logits in records:
        tokens, k = [], 0
        for req, p, e in zip(batch.reqs, batch.prefix_lens, batch.extend_lens):
            tokens += [(req.rid, p + t, int(batch.out_cache_loc[k + t])) for t in range(e)]
            k += e
        for row, index in enumerate(batch.logit_rows()):
            rid, pos, slot = tokens[index]
            if slot == 0 or pos + 1 >= len(finals[rid]):  # padding, or past the request's end
                continue
            torch.testing.assert_close(logits[row], expected[rid][pos], atol=2e-4, rtol=0)
            checked[rid].add(pos)
    for rid, n in zip(finals, PROMPT_LENS):
        assert n - 1 in checked[rid] and len(checked[rid]) > 3


@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_equals_plain_greedy_and_the_draft_is_the_mtp_layer(tiny, plain, batch):
    """SGLang's MTP chain (3 steps, topk 1); chunked prefill; at batch 3 speculation is off above 2
    running requests until one finishes. Accept counts reach the outputs' meta."""
    path, full, mtp = tiny
    with Engine(model=path, speculative_algorithm="NEXTN", max_running_requests=batch,
                speculative_disable_batch_size=2 if batch > 1 else 32, **COMMON) as engine:
        spec = engine.config.speculative
        assert (spec.speculative_num_steps, spec.speculative_eagle_topk, spec.speculative_num_draft_tokens) == (3, 1, 4)
        worker = engine.spec_worker
        assert worker.runner.attn_backend.name == "torch_native" and worker.draft.kv_layout.latent
        assert type(worker.runner.attn_backend).__name__ == "TorchNativeMLABackend"
        records = record_draft_extends(engine)
        new_tokens = (12, 4, 8)
        outs = engine.generate(prompt_token_ids=prompts(), sampling_params=[greedy(n) for n in new_tokens])
        assert [o.token_ids for o in outs] == [p[:n] for p, n in zip(plain, new_tokens)]
        verified = [o.meta for o in outs if "spec_verify_ct" in o.meta]  # a request may finish before any round
        rounds = sum(m["spec_verify_ct"] for m in verified)
        assert rounds > 0 and sum(sum(m["spec_accept_histogram"]) for m in verified) == rounds
        assert_pool_full(engine)
    check_draft_logits(records, {o.meta["id"]: p + o.token_ids for o, p in zip(outs, prompts())}, full, mtp)


def test_verify_rollback_with_drafts_that_are_partly_right(tiny, plain, monkeypatch):
    """Drafts replaced by the plain greedy continuation, wrong wherever (position % 3 == 0): rounds
    accept 0..4 drafts, the draft's latent KV is rolled back at every depth; tokens equal plain greedy."""
    want = {tuple(p): p + out for p, out in zip(prompts(), plain)}
    shape = dict(speculative_num_steps=4, speculative_eagle_topk=1, speculative_num_draft_tokens=5)
    with Engine(model=tiny[0], speculative_algorithm="NEXTN", **shape, **COMMON) as engine:
        lanes = engine.spec_worker.lanes
        draft = lanes.draft

        def oracle_draft(rows, prefix_host, roots):
            tree = draft(rows, prefix_host, roots)
            running = {r.req_pool_idx: r for r in engine.scheduler.running}
            for b, (row, p) in enumerate(zip(rows.tolist(), prefix_host)):
                seq = want[tuple(running[row].prompt_ids)]
                for depth in range(1, tree.tokens.shape[1]):
                    pos = p + depth
                    right = seq[pos] if pos < len(seq) else 0
                    tree.tokens[b, depth] = right if pos % 3 else (right + 1) % VOCAB
            return tree

        monkeypatch.setattr(lanes, "draft", oracle_draft)
        outs = engine.generate(prompt_token_ids=prompts(), sampling_params=greedy(12))
        assert [o.token_ids for o in outs] == plain
        assert {1, 2, 3}.issubset(set(engine.spec_worker.accept_lengths))
        assert_pool_full(engine)


def test_block_fp8_checkpoint_drafts_with_fp8_linears_and_greedy_equals_plain_fp8_greedy(tiny, tmp_path):
    """The same checkpoint in DeepSeek's FP8 layout (e4m3 + 128 x 128 weight_scale_inv, the MTP layer
    included; the dense layer's MLP stays float: its merged gate|up rows are not 128-aligned at these
    sizes): the draft's linears are FP8 as the target's, its kv_b_proj dequantised at load."""
    from kestrel.layers.fp8_linear import Fp8Linear
    from kestrel.quant.fp8 import quantize_blocks

    src = tiny[0]
    tensors = {}
    for name, t in load_file(f"{src}/model.safetensors").items():
        if t.dim() == 2 and ".layers." in name and ".layers.0.mlp." not in name and not name.endswith(
                ("mlp.gate.weight", "embed_tokens.weight", "shared_head.head.weight")):
            tensors[name], tensors[name.removesuffix("weight") + "weight_scale_inv"] = quantize_blocks(t)
        else:
            tensors[name] = t
    config = json.loads(open(f"{src}/config.json").read())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    chosen = prompts()[:2]
    with Engine(model=str(tmp_path), **COMMON) as engine:
        expected = [o.token_ids for o in engine.generate(prompt_token_ids=chosen, sampling_params=greedy(8))]
    with Engine(model=str(tmp_path), speculative_algorithm="NEXTN", **COMMON) as engine:
        mtp = engine.spec_worker.draft.model.mtp
        assert isinstance(mtp.eh_proj, Fp8Linear) and isinstance(mtp.self_attn.q_b_proj, Fp8Linear)
        assert mtp.self_attn.attn.kv_b_proj.dtype == torch.float32
        outs = engine.generate(prompt_token_ids=chosen, sampling_params=greedy(8))
        assert [o.token_ids for o in outs] == expected


@pytest.mark.skipif(not torch.cuda.is_available() and not envs.triton_interpret(),
                    reason="Triton kernels need CUDA or TRITON_INTERPRET=1")
def test_triton_mla_draft_backends_greedy_equals_plain_greedy(tiny):
    """The Triton MLA backend for target and draft (the draft's two decode steps and its extend each a
    TritonMLABackend over the draft's latent pool): NEXTN tokens equal plain greedy."""
    chosen, triton = prompts()[:2], dict(COMMON, attention_backend="triton")
    with Engine(model=tiny[0], **triton) as engine:
        expected = [o.token_ids for o in engine.generate(prompt_token_ids=chosen, sampling_params=greedy(6))]
    with Engine(model=tiny[0], speculative_algorithm="NEXTN", **triton) as engine:
        worker = engine.spec_worker
        assert [type(b).__name__ for b in [worker.runner.attn_backend, *worker.lanes.backends]] == \
            ["TritonMLABackend"] * 3
        outs = engine.generate(prompt_token_ids=chosen, sampling_params=greedy(6))
        assert [o.token_ids for o in outs] == expected


def test_trees_greedy_equals_plain_greedy(tiny, plain):
    """MLA keeps no per-request state, so a V3 target verifies trees: top-2 over 3 steps, 6 nodes."""
    tree = dict(speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=6)
    with Engine(model=tiny[0], speculative_algorithm="NEXTN", **tree, **COMMON) as engine:
        modes = []
        engine.add_step_hook(lambda info: modes.append(info.mode))
        outs = engine.generate(prompt_token_ids=prompts(), sampling_params=greedy(12))
        assert [o.token_ids for o in outs] == plain and "target_verify" in modes
        assert_pool_full(engine)

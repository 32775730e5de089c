"""EAGLE-3 training (scripts/train_eagle_head.py --variant eagle3, scripts/eagle3_training.py) on a tiny
random Llama target built with transformers: the draft vocabulary; the aux hidden states against what
kestrel's model captures; training against serving (the saved head reloaded through kestrel's loader
drafts what the trained one does, and the training attention matches the torch_native backend); and a
few training steps lowering the loss."""
from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from kestrel.core.forward_mode import ForwardMode
from kestrel.models.llama_eagle import TargetParts, load_eagle_head
from kestrel.models.loader import load_model
from tests.model.harness import Harness
from tests.tiny_models import make_tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import eagle3_training  # noqa: E402
import train_eagle_head as trainer  # noqa: E402

LAYERS, HIDDEN, VOCAB, DRAFT_VOCAB = 4, 64, 256, 100


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The target (transformers, float32, frozen), its folder and config, the aux layers, and a training
    set: 12 rows of 10 to 24 tokens whose first 4 are a prompt (only the answer positions count)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    path = make_tiny_model("llama", tmp_path_factory.mktemp("target"), vocab_size=VOCAB, num_hidden_layers=LAYERS)
    target = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().requires_grad_(False)
    layers = eagle3_training.aux_layers(LAYERS)
    gen = torch.Generator().manual_seed(1)
    # Answers drawn from a skewed distribution, so the draft vocabulary is not all of the vocabulary.
    weights = 1.0 / torch.arange(1, VOCAB + 1)
    rows = [torch.multinomial(weights, n, replacement=True, generator=gen).tolist()
            for n in torch.randint(10, 25, (12,), generator=gen).tolist()]
    data = trainer.target_features(target, rows, [3] * len(rows), 5, trainer.Clock(1e9), 1.0, layers=layers)
    config = json.loads((path / "config.json").read_text())
    return SimpleNamespace(target=target, path=path, config=config, layers=layers, rows=rows, data=data)


def new_head(tiny, draft_vocab_size: int = DRAFT_VOCAB):
    torch.manual_seed(2)
    tok = SimpleNamespace(all_special_ids=[0, 1, 2])
    lm_head = tiny.target.lm_head.weight
    return trainer.new_head(SimpleNamespace(draft_vocab_size=draft_vocab_size), tiny.target, tok, tiny.config,
                            [tiny.data], tiny.layers, lm_head)


def fixed_loss(head, objective, data, unroll: int = 2) -> torch.Tensor:
    terms, _ = trainer.losses(head, objective, data.tokens, data.aux.float(), data.feats.float(), data.first,
                              data.lengths, unroll, measure=False)
    return terms["ce"]


# ---- the draft vocabulary ---------------------------------------------------------------------------
def test_draft_vocab_takes_frequent_ids_ties_to_the_lower_id_and_occurring_special_ids():
    counted = torch.tensor([5, 5, 5, 7, 7, 3, 3, 9, 1, 12])
    # 1 (EOS) occurs once but is special; 2 is special but never occurs; 3 and 7 tie, 3 is kept.
    ids = eagle3_training.draft_vocab(counted, 3, 16, special_ids={1, 2})
    assert ids.tolist() == [1, 3, 5]
    # 1, 9 and 12 occur once each: the lower ids are kept.
    assert eagle3_training.draft_vocab(counted, 5, 16, special_ids=()).tolist() == [1, 3, 5, 7, 9]
    assert eagle3_training.draft_vocab(counted, 5, 16, special_ids={12}).tolist() == [1, 3, 5, 7, 12]
    # Ids that never occur fill the rest, lowest first.
    assert eagle3_training.draft_vocab(counted, 8, 16, special_ids={1}).tolist() == [0, 1, 2, 3, 5, 7, 9, 12]
    d2t, t2d = eagle3_training.vocab_maps(ids, 16)
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool and t2d.shape == (16,)
    assert (torch.arange(3) + d2t).tolist() == [1, 3, 5] and t2d.nonzero().flatten().tolist() == [1, 3, 5]


def test_a_draft_vocab_covering_the_vocabulary_is_the_identity():
    counted = torch.tensor([9, 9, 4])
    for size in (16, 100):  # capped at the target's vocabulary
        ids = eagle3_training.draft_vocab(counted, size, 16, special_ids={1})
        d2t, t2d = eagle3_training.vocab_maps(ids, 16)
        assert ids.tolist() == list(range(16)) and not d2t.any() and t2d.all()


# ---- the target's hidden states -----------------------------------------------------------------------
def test_aux_hidden_states_are_what_kestrel_captures(tiny):
    """transformers' hidden_states[i] is the residual stream entering layer i, as kestrel's capture_hidden
    keeps it; the padded, length-sorted training set holds each row's own states."""
    model = load_model(tiny.path, torch.float32, "cpu")
    ids = tiny.rows[0]
    harness = Harness(model, num_requests=1)
    batch = harness.batch([ids])
    batch.capture_hidden = tiny.layers
    with torch.no_grad():
        kestrel_last = model(batch.input_ids, batch.positions, batch)
    last, aux = trainer.target_states(tiny.target, torch.tensor([ids]), None, tiny.layers)
    assert aux.shape == (1, len(ids), 3 * HIDDEN)
    torch.testing.assert_close(aux[0], batch.captured_hidden, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(last[0], kestrel_last, atol=1e-5, rtol=1e-5)

    data = tiny.data
    assert data.lengths.tolist() == sorted(map(len, tiny.rows))
    for r in (0, len(tiny.rows) - 1):
        n = int(data.lengths[r])
        row = data.tokens[r, :n]
        _, alone = trainer.target_states(tiny.target, row[None], None, tiny.layers)
        torch.testing.assert_close(data.aux[r, :n].float(), alone[0].half().float())
        assert not data.aux[r, n:].any() and not data.feats[r, n:].any()  # padding is zeros


# ---- training against serving ----------------------------------------------------------------------
def test_the_reloaded_head_drafts_what_the_trained_head_does(tiny, tmp_path):
    head, objective, config, info = new_head(tiny)
    assert info["draft_vocab_size"] == DRAFT_VOCAB and not head.identity_vocab
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    for _ in range(3):  # trained weights, not the initial ones
        opt.zero_grad()
        fixed_loss(head, objective, tiny.data).backward()
        opt.step()
    trainer.save_head(head, config, tmp_path / "head")

    saved = json.loads((tmp_path / "head" / "config.json").read_text())
    assert saved["architectures"] == ["LlamaForCausalLMEagle3"] and saved["num_hidden_layers"] == 1
    assert saved["draft_vocab_size"] == DRAFT_VOCAB and saved["target_hidden_size"] == HIDDEN
    assert saved["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in tiny.layers]
    tensors = load_file(tmp_path / "head" / "model.safetensors")
    assert {"fc.weight", "norm.weight", "lm_head.weight", "midlayer.self_attn.q_proj.weight",
            "midlayer.mlp.up_proj.weight"} <= set(tensors) and not any("qkv_proj" in n for n in tensors)
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool

    lm_head = tiny.target.lm_head.weight
    parts = TargetParts(tiny.target.model.embed_tokens, lambda h: F.linear(h, lm_head).float())
    shipped = load_eagle_head(tmp_path / "head", "EAGLE3", parts, num_target_layers=LAYERS, max_positions=64,
                              dtype=torch.float32, device="cpu")
    assert shipped.target_hidden_layers == tiny.layers
    assert torch.equal(shipped.d2t, head.d2t) and not shipped.identity_vocab

    # The trained head with its weights rounded as the checkpoint stores them (bf16).
    rounded = copy.deepcopy(head)
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.bfloat16().float())
    data, vocab = tiny.data, head.d2t + torch.arange(DRAFT_VOCAB)
    with torch.no_grad():
        (hidden, logits), = trainer.draft_passes(shipped, data.tokens, data.aux.float(), 1)
        (own_hidden, own_logits), = trainer.draft_passes(rounded, data.tokens, data.aux.float(), 1)
        draft_logits = eagle3_training.draft_logits(rounded, own_hidden)
    torch.testing.assert_close(hidden, own_hidden, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits, own_logits, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(logits[..., vocab], draft_logits, atol=1e-4, rtol=1e-5)
    outside = torch.ones(VOCAB, dtype=torch.bool).index_fill(0, vocab, False)
    assert torch.isneginf(logits[..., outside]).all()  # target ids outside the draft vocabulary are never drafted


def test_training_attention_matches_serving(tiny):
    """Pass 1 (DraftChains over target features) equals a DRAFT_EXTEND-like prefill through kestrel's
    torch_native backend; pass 2 at entry t equals a decode step at position t+1 after that prefill."""
    head = new_head(tiny)[0].eval()
    data, row, t = tiny.data, len(tiny.rows) - 1, 8
    n = int(data.lengths[row])
    tokens, aux = data.tokens[row:row + 1, :n], data.aux[row:row + 1, :n].float()
    with torch.no_grad():
        (hidden1, logits1), (hidden2, logits2) = trainer.draft_passes(head, tokens, aux, 2)
        harness = Harness(head, num_requests=1)
        batch = harness.batch([tokens[0, 1:t + 2].tolist()])  # positions 0..t read tokens 1..t+1
        extend_hidden, extend_logits = head(batch.input_ids, batch.positions,
                                            head.project_target_hidden(aux[0, :t + 1]), batch)
        batch = harness.batch([[int(tokens[0, t + 2])]], ForwardMode.DECODE)
        decode_hidden, decode_logits = head(batch.input_ids, batch.positions, extend_hidden[t:t + 1], batch)
    torch.testing.assert_close(hidden1[0, :t + 1], extend_hidden, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits1[0, :t + 1], extend_logits, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(hidden2[0, t], decode_hidden[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits2[0, t], decode_logits[0], atol=1e-4, rtol=1e-5)


def target_entropy(data, vocab: torch.Tensor, lm_head: torch.Tensor, unroll: int) -> float:
    """The soft cross-entropy's floor: the entropy of the target's restricted distribution, averaged as
    `losses` averages."""
    total = 0.0
    for k in range(1, unroll + 1):
        mask = trainer.pass_mask(data.first, data.lengths, k, data.tokens.shape[1] - k)
        logp = F.log_softmax(data.feats[:, k:][mask].float() @ lm_head[vocab].T, -1)
        total += -(logp.exp() * logp).sum(-1).mean().item() / unroll
    return total


def test_training_steps_lower_the_loss(tiny):
    head, objective, _, _ = new_head(tiny)
    data, vocab = tiny.data, head.d2t + torch.arange(DRAFT_VOCAB)
    floor = target_entropy(data, vocab, tiny.target.lm_head.weight, unroll=3)
    with torch.no_grad():
        before = fixed_loss(head, objective, data, unroll=3).item() - floor  # KL to the target's distribution
    args = SimpleNamespace(lr=3e-3, seed=0, threads=1, warmup=5, batch_size=4, feature_noise=0.0, bf16=False,
                           unroll=3, reg_weight=1.0, log_every=100)
    threads = torch.get_num_threads()
    trained = trainer.train(head, objective, [data], args, trainer.Clock(3.0), 1.0)  # ~3 s of steps
    torch.set_num_threads(threads)
    with torch.no_grad():
        after = fixed_loss(head, objective, data, unroll=3).item() - floor
    assert trained["steps"] >= 5, trained
    assert 0 < after < 0.5 * before, (floor, before, after)

"""Train an EAGLE head by self-distillation on a CPU or a GPU (`--device`): `demo-eagle` for the bundled
`demo` model, or a head for a real chat model (`--target`, a GGUF file or Hugging Face folder; the head is
not shipped).

    python scripts/train_eagle_head.py --bf16               # < 10 minutes on 2 cores, writes kestrel/assets/demo-eagle
    python scripts/train_eagle_head.py --time-budget 120 --out /tmp/eagle   # a quick run
    python scripts/train_eagle_head.py --target SmolLM2-135M-Instruct.Q4_1.gguf --out ~/.cache/kestrel-smol-eagle \
        --threads 1 --prompts 256 --gen-tokens 96 --time-budget 1200           # docs/demo-model.md

The head (kestrel.models.llama_eagle.EagleHead: fc on [embedding, feature], one decoder layer without
input norm, demo's own lm_head) learns to predict demo's next feature (its last hidden state after the
final norm) and demo's next-token distribution, from two kinds of text, both scored by demo itself:
windows of demo's training corpus (the stdlib files of scripts/train_demo_model.py, held-out files
excluded) and demo's own sampled and greedy continuations of corpus prompts (what it sees when serving).
demo's embedding and lm_head are frozen and shared, as in serving. Loss per position: smooth-L1 to the
next feature + soft cross-entropy to demo's next-token distribution; `--unroll 2` also trains the second
drafted token on the head's own feature (as drafting steps after the first run).

Every phase runs against one wall-clock budget (`--time-budget`, default 520 s): data collection stops
early if the machine is slow, training stops when its share is spent (the learning-rate schedule
follows elapsed time), so the run ends in time on a shared machine. The head is saved in bf16 with the
public EAGLE checkpoint names, reloaded through kestrel's loader, and evaluated on the held-out files:
top-1 agreement of the head with demo (teacher-forced features: the first drafted token; the head's own
feature: the second) and the mean accept length greedy chain drafting would get on held-out prompts.

A chat target (any `--target` but demo) trains on its own answers instead: chat prompts
(scripts/eagle_chat_data.py) answered by the target through kestrel's Engine (on `--device`), half greedy,
half sampled; the losses count the answer positions only (the prompt is context). Its evaluation runs
kestrel's Engine, greedy, on held-out prompts, with and without the head (chain 3/1/4, tree 5/4/8): the
accept lengths and whether the outputs are the plain greedy ones; then the head's top-1 agreement with
the target on those greedy answers.

`--variant eagle3` trains an EAGLE-3 head (kestrel.models.llama_eagle.Eagle3Head) on the same data, for
either kind of target; what differs lives in scripts/eagle3_training.py. The head reads `fc` of three
target layers' inputs, has its own norm and lm_head over a draft vocabulary (`--draft-vocab-size`, the
target ids the training answers use most) and learns the target's next-token distribution over that
vocabulary only (no feature loss), over `--unroll 3` passes by default: passes after the first read the
head's own output, as drafting does (EAGLE-3's training-time test).
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import random
import shlex
import sys
import sysconfig
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parents[1]
# When each phase must end, as shares of --time-budget; evaluation (~40 s on 2 cores) follows training.
# The chat target's first phase is its answers (kestrel's engine); its evaluation, kestrel runs, follows.
ENDS = {"demo": {"own continuations": 0.12, "features": 0.32, "training": 0.88},
        "chat": {"own continuations": 0.42, "features": 0.55, "training": 0.97}}
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import eagle3_training  # noqa: E402  (the EAGLE-3 head: aux hidden states, draft vocabulary, loss, checkpoint)
import eagle_chat_data as chat_data_module  # noqa: E402  (prompts, answers and measurement for a chat target)
import train_demo_model as demo_training  # noqa: E402  (corpus, held-out files, tokenization)

from kestrel.assets import resolve_model_path  # noqa: E402
from kestrel.models.arch_config import parse_arch_config  # noqa: E402
from kestrel.models.llama_eagle import DraftHead, EagleHead, TargetParts, load_eagle_head  # noqa: E402


def log(*parts: object) -> None:
    print(*parts, flush=True)


class Clock:
    """Seconds since start, and each phase's deadline as a share of the budget."""

    def __init__(self, budget: float) -> None:
        self.start, self.budget = time.time(), budget

    def elapsed(self) -> float:
        return time.time() - self.start

    def left_until(self, share: float) -> float:
        return self.budget * share - self.elapsed()


class DraftChains:
    """Attention backend that drafts a chain from every position of `num_windows` windows at once.

    Pass 1 reads demo's features at every position, causally (as DRAFT_EXTEND does; its entry t also
    drafts the first token after the root x[t+1]). Pass k > 1 holds the k-th drafted token of each
    chain: entry t attends to pass 1's keys up to t (the draft's KV cache at its root) and to its own
    chain's entries of passes 2..k, as draft decode does when serving. The passes' keys stay here."""

    name = "draft_chains"

    def __init__(self, num_windows: int) -> None:
        self.num_windows = num_windows
        self.passes: list[tuple[torch.Tensor, torch.Tensor]] = []

    def forward(self, q, k, v, layer, batch):
        b, group, scale = self.num_windows, layer.num_heads // layer.num_kv_heads, layer.scaling

        def heads(x, n):  # [T, n * D] -> [B, heads, len, D], KV heads repeated to meet the query heads
            x = x.view(b, -1, n, layer.head_dim).transpose(1, 2)
            return x if n == layer.num_heads else x.repeat_interleave(group, dim=1)

        q = heads(q, layer.num_heads)
        self.passes.append((heads(k, layer.num_kv_heads), heads(v, layer.num_kv_heads)))
        (k1, v1), chain = self.passes[0], self.passes[1:]
        n, context_len = q.shape[2], k1.shape[2]
        context = torch.einsum("bhtd,bhsd->bhts", q, k1) * scale
        later = torch.arange(context_len, device=q.device) > torch.arange(n, device=q.device)[:, None]
        context = context.masked_fill(later, float("-inf"))
        own = [(q * ki[:, :, :n]).sum(-1, keepdim=True) * scale for ki, _ in chain]
        p = torch.cat([context, *own], dim=-1).softmax(-1)
        out = p[..., :context_len] @ v1
        for i, (_, vi) in enumerate(chain):
            out = out + p[..., context_len + i, None] * vi[:, :, :n]
        return out.transpose(1, 2).reshape(-1, layer.num_heads * layer.head_dim)


def draft_passes(head, tokens: torch.Tensor, feats: torch.Tensor, num_passes: int, logits: bool = True):
    """tokens [B, L] and the target's hidden states the head reads [B, L, ...] (`TrainingSet.head_inputs`)
    -> for each pass k = 1..num_passes, the head's (features, logits or None) of shape [B, L - k, ...].
    Entry t of pass k is at position t+k-1 and reads token t+k with the target's feature t (k = 1: those
    hidden states through `project_target_hidden`, as serving reads them) or pass k-1's entry t (k > 1):
    it drafts token t+k+1."""
    b = tokens.shape[0]
    batch = SimpleNamespace(attn_backend=DraftChains(b))
    out, inputs = [], head.project_target_hidden(feats[:, :-1])
    for k in range(1, num_passes + 1):
        n = tokens.shape[1] - k
        positions = torch.arange(k - 1, k - 1 + n, device=tokens.device).repeat(b)
        hidden = head.hidden_states(tokens[:, k:].flatten(), positions, inputs[:, :n].flatten(0, 1), batch)
        out.append((hidden.view(b, n, -1), head.compute_logits(hidden).view(b, n, -1) if logits else None))
        inputs = out[-1][0]
    return out


def pass_mask(first: torch.Tensor, lengths: torch.Tensor, k: int, n: int) -> torch.Tensor:
    """[B, n]: which entries of pass k draft a token of an answer: entry t sits at position t+k-1, which
    must be at or after the row's first draft root (`first`: the prompt's last position; 0 for corpus
    windows), and its target, the feature at t+k, must be a real token of the row (t+k < `lengths`)."""
    t = torch.arange(n, device=first.device)
    return (t + k - 1 >= first[:, None]) & (t + k < lengths[:, None])


# ---- data ------------------------------------------------------------------------------------------
@dataclass
class TrainingSet:
    """Right-padded token rows [N, L], the target's final-normed last hidden state at every position
    [N, L, H] (its next-token distribution, through its lm_head; EAGLE's feature too), each row's first
    draft root (`first`: the prompt's last position; 0 for corpus windows, where every position is one)
    and its length; for EAGLE-3, the inputs of the target layers the head reads [N, L, 3 H] (`aux`).
    Hidden states are float16, to halve memory; padding is zeros."""

    tokens: torch.Tensor
    feats: torch.Tensor
    first: torch.Tensor
    lengths: torch.Tensor
    aux: torch.Tensor | None = None

    @property
    def head_inputs(self) -> torch.Tensor:
        """What the head's first drafting pass reads (`draft_passes`)."""
        return self.feats if self.aux is None else self.aux


def target_states(target, ids: torch.Tensor, mask: torch.Tensor | None, layers: tuple[int, ...] | None):
    """The target's final-normed last hidden state [B, L, H] and what the head reads: that same state
    (EAGLE, `layers` None) or the inputs of target layers `layers` (EAGLE-3)."""
    out = target.model(input_ids=ids, attention_mask=mask, output_hidden_states=layers is not None)
    last = out.last_hidden_state
    return last, last if layers is None else eagle3_training.aux_hidden(out.hidden_states, layers)


@torch.no_grad()
def target_features(target, rows: list[list[int]], first: list[int], batch_size: int, clock: Clock, share: float,
                    pad: int = 0, layers: tuple[int, ...] | None = None) -> TrainingSet | None:
    """The target's hidden states (`TrainingSet`) at every position of each row, rows taken shortest
    first (so a batch pads little); stops when the phase's time share is spent (the set holds the rows
    it finished; None if none). `layers`: EAGLE-3's aux layers."""
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
    width, hidden, device = max(map(len, rows), default=0), target.config.hidden_size, target.device
    # Batches are written into place: no second copy of the largest tensors (EAGLE-3's aux states of a
    # chat target run to gigabytes). Rows never reached are never written, so their pages stay untouched.
    tokens = torch.full((len(rows), width), pad, device=device)
    feats = torch.empty(len(rows), width, hidden, dtype=torch.float16, device=device)
    aux = None if layers is None else torch.empty(len(rows), width, len(layers) * hidden, dtype=torch.float16,
                                                  device=device)
    done = 0
    for i in range(0, len(order), batch_size):
        if clock.left_until(share) <= 0:
            break
        chunk = order[i:i + batch_size]
        w = max(len(rows[j]) for j in chunk)
        ids = torch.tensor([rows[j] + [pad] * (w - len(rows[j])) for j in chunk], device=device)
        mask = torch.tensor([[1] * len(rows[j]) + [0] * (w - len(rows[j])) for j in chunk], device=device)
        last, inputs = target_states(target, ids, mask, layers)
        rows_done = slice(i, i + len(chunk))
        tokens[rows_done, :w] = ids
        for dest, value in [(feats, last)] + ([(aux, inputs)] if aux is not None else []):
            dest[rows_done, :w] = torch.where(mask.bool()[..., None], value, 0).half()
            dest[rows_done, w:] = 0
        done += len(chunk)
    if not done:
        return None
    kept, w = order[:done], len(rows[order[done - 1]])  # the longest row done is the last
    return TrainingSet(tokens[:done, :w], feats[:done, :w], torch.tensor([first[j] for j in kept], device=device),
                       torch.tensor([len(rows[j]) for j in kept], device=device),
                       None if aux is None else aux[:done, :w])


@torch.no_grad()
def own_continuations(target, stream: torch.Tensor, args, clock: Clock, share: float, gen: torch.Generator):
    """demo's continuations of random corpus prompts: half sampled (temperature 0.8), half greedy."""
    outs = []
    while clock.left_until(share) > 0:
        starts = torch.randint(0, len(stream) - args.prompt_len, (args.gen_batch, 1), generator=gen)
        prompts = stream[starts + torch.arange(args.prompt_len)].to(target.device)
        sample = len(outs) % 2 == 0
        out = target.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=args.gen_tokens,
                              min_new_tokens=args.gen_tokens, do_sample=sample, temperature=0.8 if sample else None,
                              top_k=None, top_p=None, pad_token_id=demo_training.PAD)
        outs.append(out)
    return torch.cat(outs).cpu() if outs else torch.empty(0, args.prompt_len + args.gen_tokens, dtype=torch.long)


# ---- training --------------------------------------------------------------------------------------
# An objective: (the head's outputs at drafted positions [P, H], the target's final-normed hidden state
# at the drafted token's position [P, H], measure?) -> (loss terms, with `measure` the top-1 agreement
# with the target's greedy token, else None). EAGLE-3's: eagle3_training.objective.
Objective = Callable[[torch.Tensor, torch.Tensor, bool], tuple[dict[str, torch.Tensor], float | None]]


def eagle_objective(head: EagleHead, lm_head_weight: torch.Tensor) -> Objective:
    """EAGLE's terms: the target's next feature (smooth-L1, "reg") and its next-token distribution (soft
    cross-entropy, "ce")."""
    def terms(pred: torch.Tensor, next_feat: torch.Tensor, measure: bool) -> tuple[dict, float | None]:
        logits = head.compute_logits(pred)
        with torch.no_grad():
            target_logp = F.log_softmax((next_feat @ lm_head_weight.T).float(), -1)
            agree = (logits.argmax(-1) == target_logp.argmax(-1)).float().mean().item() if measure else None
        return {"reg": F.smooth_l1_loss(pred.float(), next_feat),
                "ce": -(target_logp.exp() * F.log_softmax(logits.float(), -1)).sum(-1).mean()}, agree

    return terms


def losses(head, objective: Objective, tokens, inputs, feats, first, lengths, unroll: int, measure: bool):
    """Each of `objective`'s terms, averaged over the answer tokens (pass_mask) drafted in `unroll` passes
    and over the passes; with `measure`, pass 1's top-1 agreement too (an argmax over the vocabulary: only
    on logged steps). `inputs`: what pass 1 reads (`TrainingSet.head_inputs`), `feats`: the target's
    final-normed hidden states."""
    totals, agree = {}, None
    for k, (pred, _) in enumerate(draft_passes(head, tokens, inputs, unroll, logits=False), start=1):
        mask = pass_mask(first, lengths, k, pred.shape[1])
        terms, hits = objective(pred[mask], feats[:, k:][mask], measure and k == 1)
        if k == 1:
            agree = hits
        for name, value in terms.items():
            totals[name] = totals.get(name, 0.0) + value
    return {name: total / unroll for name, total in totals.items()}, agree


class ThreadPicker:
    """On a shared machine two threads can be slower than one (they wait for each other behind other
    processes): every `every` steps, time one step with each count and keep the faster."""

    def __init__(self, most: int, every: int = 60) -> None:
        self.choices, self.every, self.best, self.times = sorted({1, most}), every, most, {}

    def before(self, step: int) -> None:
        trial = step % self.every
        torch.set_num_threads(self.choices[trial - 1] if 1 <= trial <= len(self.choices) else self.best)
        self.started = time.time()

    def after(self, step: int) -> None:
        trial = step % self.every
        if 1 <= trial <= len(self.choices):
            self.times[self.choices[trial - 1]] = time.time() - self.started
            if trial == len(self.choices):
                self.best = min(self.times, key=self.times.get)


def train(head, objective: Objective, sets, args, clock: Clock, share: float) -> dict:
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(args.seed + 2)
    threads = ThreadPicker(args.threads)
    begin, end = clock.elapsed(), clock.budget * share
    step, tokens_seen = 0, 0
    weights = torch.tensor([float(s.lengths.sum()) for s in sets])  # sample by tokens
    while clock.elapsed() < end:
        threads.before(step)
        progress = (clock.elapsed() - begin) / max(1e-6, end - begin)
        lr = args.lr * min(1.0, (step + 1) / args.warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(progress, 1))))
        for group in opt.param_groups:
            group["lr"] = lr
        data = sets[int(torch.multinomial(weights, 1, generator=gen))]
        rows = torch.randint(0, len(data.tokens), (args.batch_size,), generator=gen).to(data.tokens.device)
        length = int(data.lengths[rows].max())  # rows are right-padded: cut the columns no row uses
        clean = data.feats[rows, :length].float()
        inputs = clean if data.aux is None else data.aux[rows, :length].float()
        if args.feature_noise:  # robustness to the head's own features, which drafting reads after pass 1
            noise = args.feature_noise * torch.randn(inputs[:, :-1].shape, generator=gen).to(inputs.device)
            inputs = torch.cat([inputs[:, :-1] + noise, inputs[:, -1:]], 1)
        logged = (step + 1) % args.log_every == 0
        with torch.autocast(inputs.device.type, dtype=torch.bfloat16, enabled=args.bf16):
            terms, agree = losses(head, objective, data.tokens[rows, :length], inputs, clean, data.first[rows],
                                  data.lengths[rows], args.unroll, logged)
        loss = sum(args.reg_weight * value if name == "reg" else value for name, value in terms.items())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        threads.after(step)
        step += 1
        tokens_seen += int((data.lengths[rows] - 1 - data.first[rows]).sum())
        if logged:
            log(f"  step {step} {' '.join(f'{name} {value.item():.4f}' for name, value in terms.items())} "
                f"top-1 {agree:.3f} lr {lr:.2e} "
                f"{tokens_seen / (clock.elapsed() - begin):,.0f} positions/s, {threads.best} thread(s), "
                f"{clock.elapsed():.0f}s")
    torch.set_num_threads(args.threads)
    return {"steps": step, "positions_trained": tokens_seen, "seconds": round(clock.elapsed() - begin, 1)}


# ---- saving and evaluation -------------------------------------------------------------------------
def public_tensors(head: DraftHead) -> dict[str, torch.Tensor]:
    """The head's weights under the public checkpoint names (merged projections split back), in bf16;
    integer buffers (EAGLE-3's d2t) as they are."""
    out = {}
    for name, tensor in head.state_dict().items():
        module_name, _, leaf = name.rpartition(".")
        owner, _, kind = module_name.rpartition(".")
        parts = [(part, shard) for part, (merged, shard) in head.stacked_params.items() if merged == kind]
        module = head.get_submodule(module_name)
        for part, shard in parts:
            out[f"{owner}.{part}.{leaf}"] = module.shard(tensor, shard)
        if not parts:
            out[name] = tensor
    return {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).detach().cpu().contiguous()
            for k, v in out.items()}


def save_head(head: DraftHead, config: dict, out: Path) -> None:
    """config.json and model.safetensors in the public layout of the head's variant (EAGLE-3's adds t2d)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors = public_tensors(head)
    save_file(tensors if head.variant == "EAGLE" else eagle3_training.checkpoint_tensors(head, tensors),
              out / "model.safetensors")


@torch.no_grad()
def agreement(head, lm_head_weight, data: TrainingSet) -> dict:
    """Top-1 agreement with the target's greedy next token on held-out rows (their answers: pass_mask),
    for the first and the second drafted token of a chain (the second drafted on the head's own feature)."""
    hits, counts = [0, 0], [0, 0]
    for i in range(0, len(data.tokens), 16):
        target_next = (data.feats[i:i + 16].float() @ lm_head_weight.T).argmax(-1)  # the target's greedy tokens
        inputs = data.head_inputs[i:i + 16].float()
        for k, (_, logits) in enumerate(draft_passes(head, data.tokens[i:i + 16], inputs, 2), start=1):
            mask = pass_mask(data.first[i:i + 16], data.lengths[i:i + 16], k, logits.shape[1])
            hits[k - 1] += (logits.argmax(-1) == target_next[:, k:])[mask].sum().item()
            counts[k - 1] += mask.sum().item()
    return {"draft_step_1_top1": round(hits[0] / counts[0], 4), "draft_step_2_top1": round(hits[1] / counts[1], 4),
            "positions": counts[0]}


@torch.no_grad()
def chain_accept_length(head, target, prompts: torch.Tensor, new_tokens: int, steps: tuple[int, ...]) -> dict:
    """Mean tokens per verify round (accepted drafts + the bonus) that greedy chain speculation with
    k draft steps commits while demo greedily continues held-out prompts. Exact: each chain is drafted
    with the attention serving uses, on tokens equal to the drafted ones wherever those are accepted."""
    prompts = prompts.to(target.device)
    out = target.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, pad_token_id=demo_training.PAD)
    _, inputs = target_states(target, out, None, head.target_hidden_layers)
    # correct[k-1][row][t]: the k-th token drafted for the root at t+1 is demo's greedy token t+k+1.
    correct = [(logits[:, :-1].argmax(-1) == out[:, k + 1:]).tolist()
               for k, (_, logits) in enumerate(draft_passes(head, out, inputs, max(steps)), start=1)]
    length, result = out.shape[1], {}
    for k in steps:
        rounds = committed = 0
        for row in range(len(out)):
            root = prompts.shape[1]  # the round's root: committed by the last round, no feature yet
            while root < length - 1:
                depth = min(k, length - 1 - root)
                accepted = next((i for i in range(depth) if not correct[i][row][root - 1]), depth)
                step = min(accepted + 1, length - 1 - root)  # the accepted drafts and the bonus token
                rounds, committed, root = rounds + 1, committed + step, root + step
        result[f"chain_{k}_steps"] = round(committed / rounds, 3)
    return result


def head_config(target_config: dict) -> dict:
    """An EAGLE-1 config: the target's LlamaConfig with one layer (the public heads are saved this way)."""
    keep = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "rms_norm_eps", "rope_parameters", "rope_theta", "max_position_embeddings", "vocab_size", "hidden_act",
            "bos_token_id", "eos_token_id", "pad_token_id")
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 1, "bias": True,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            **{k: target_config[k] for k in keep if k in target_config}}


def new_head(args, target, tok, target_config: dict, sets: list[TrainingSet], layers: tuple[int, ...] | None,
             train_lm_head: torch.Tensor) -> tuple[DraftHead, Objective, dict, dict]:
    """The head to train, its objective, its checkpoint config and what to record of it: an EAGLE head,
    or (`layers` given) an EAGLE-3 head over a draft vocabulary of the answer tokens the loss counts."""
    config = head_config(target_config)
    parts = TargetParts(target.model.embed_tokens, lambda h: F.linear(h, train_lm_head))
    if layers is None:
        head = EagleHead(parse_arch_config(config), parts, fc_bias=True,
                         max_positions=config["max_position_embeddings"]).to(target.device)
        return head, eagle_objective(head, train_lm_head), config, {}
    # The drafted tokens: token t+1 of every position t where pass 1 drafts an answer token.
    counted = torch.cat([s.tokens[:, 1:][pass_mask(s.first, s.lengths, 1, s.tokens.shape[1] - 1)] for s in sets]).cpu()
    eos = target_config.get("eos_token_id")
    special = {*tok.all_special_ids, *(eos if isinstance(eos, list) else [eos] if eos is not None else [])}
    vocab = eagle3_training.draft_vocab(counted, args.draft_vocab_size, target.config.vocab_size, special)
    config = eagle3_training.head_config(config, len(vocab), target.config.hidden_size, layers)
    head = eagle3_training.build_head(config, parts, vocab, target.model.norm.weight, target.lm_head.weight,
                                      layers).to(target.device)
    info = {"draft_vocab_size": len(vocab), "target_hidden_layers": list(layers),
            "draft_vocab_answer_coverage": round(torch.isin(counted, vocab).float().mean().item(), 4)}
    log(f"draft vocabulary: {len(vocab):,} of {target.config.vocab_size:,} target ids, "
        f"{info['draft_vocab_answer_coverage']:.1%} of the {len(counted):,} answer tokens; the head reads the "
        f"inputs of target layers {list(layers)}")
    return head, eagle3_training.objective(head, train_lm_head, vocab.to(target.device)), config, info


# ---- targets ---------------------------------------------------------------------------------------
def load_target(name: str, device: str):
    """`demo` (the bundled model), a GGUF file, a folder holding one, or a Hugging Face folder ->
    (its path as kestrel takes it, the transformers model in float32, frozen; its tokenizer; its config)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kestrel.hf_config import read_hf_config
    from kestrel.models.gguf import gguf_file

    path = resolve_model_path(name)
    gguf = gguf_file(path)
    where = dict(pretrained_model_name_or_path=str(gguf.parent), gguf_file=gguf.name) if gguf else \
        dict(pretrained_model_name_or_path=str(path))
    target = AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32).eval().requires_grad_(False).to(device)
    return str(path), target, AutoTokenizer.from_pretrained(**where), read_hf_config(str(path))


def demo_data(target, tok, args, clock: Clock, ends: dict, gen: torch.Generator, layers: tuple[int, ...] | None):
    """demo's training sets (its own continuations of corpus prompts; corpus windows) and its held-out
    windows, and what they hold. `layers`: EAGLE-3's aux layers (`target_features`)."""
    files, _ = demo_training.collect_corpus(Path(sysconfig.get_paths()["stdlib"]))
    held_out = {f: files.pop(f) for f in demo_training.HELD_OUT}
    names = sorted(files)
    random.Random(args.seed).shuffle(names)
    needed = args.corpus_windows * (args.window + 1) * 4  # characters, at ~3.6 per token
    chosen, chars = [], 0
    for name in names:
        chosen.append(files[name])
        chars += len(files[name])
        if chars >= needed:
            break
    stream = torch.tensor([t for d in demo_training.encode_docs(tok, chosen) for t in d])
    starts = torch.randperm(len(stream) - args.window - 1, generator=gen)[:args.corpus_windows]
    corpus_windows = stream[starts[:, None] + torch.arange(args.window + 1)]
    log(f"corpus: {len(chosen)} of {len(files)} training files, {len(stream):,} tokens ({clock.elapsed():.0f}s)")

    own = own_continuations(target, stream, args, clock, ends["own continuations"], gen)
    log(f"demo's own continuations: {len(own)} x {own.shape[1]} tokens ({clock.elapsed():.0f}s)")
    sets = []
    for label, windows in (("own continuations", own), ("corpus windows", corpus_windows)):
        data = target_features(target, windows.tolist(), [0] * len(windows), 16, clock, ends["features"],
                               layers=layers)
        if data is not None:
            sets.append(data)
        log(f"features: {0 if data is None else len(data.tokens)} {label} ({clock.elapsed():.0f}s)")
    if not sets:
        raise SystemExit("no features computed within the time budget: raise --time-budget")

    docs = demo_training.encode_docs(tok, list(held_out.values()))
    held = torch.tensor([t for d in docs for t in d])
    n_windows = min(96, len(held) // (args.window + 1))
    held_windows = held[:n_windows * (args.window + 1)].view(n_windows, args.window + 1)
    prompt_starts = torch.linspace(0, len(held) - 64, 16).long()
    info = {"own_continuation_windows": len(own), "corpus_windows": len(corpus_windows),
            "held_out_files": list(demo_training.HELD_OUT)}
    return sets, (held_windows, held[prompt_starts[:, None] + torch.arange(48)]), info


def chat_data(target_path: str, target, tok, args, clock: Clock, ends: dict, layers: tuple[int, ...] | None):
    """The target's own answers to chat prompts (scripts/eagle_chat_data.py) as one training set, the
    held-out prompts, and what they hold. `layers`: EAGLE-3's aux layers (`target_features`)."""
    train_prompts, held_prompts = chat_data_module.chat_prompts(args.prompts, args.held_out_prompts, args.seed)
    rows = chat_data_module.chat_ids(tok, train_prompts)
    answered = chat_data_module.engine_answers(target_path, rows, args.gen_tokens, args.gen_batch,
                                               clock.start + clock.budget * ends["own continuations"], args.seed,
                                               args.device)
    answer_tokens = sum(len(a) - len(p) for a, p in zip(answered, rows))
    log(f"{len(answered)} of {len(rows)} prompts answered by the target, {answer_tokens:,} answer tokens "
        f"({clock.elapsed():.0f}s)")
    first = [len(p) - 1 for p in rows[:len(answered)]]
    data = target_features(target, answered, first, 16, clock, ends["features"], pad=tok.pad_token_id or 0,
                           layers=layers)
    if data is None:
        raise SystemExit("no features computed within the time budget: raise --time-budget")
    log(f"features: {len(data.tokens)} answers ({clock.elapsed():.0f}s)")
    info = {"prompt_source": "stdlib docstring summaries in coding requests + written TASKS x TOPICS "
                             "(scripts/eagle_chat_data.py)",
            "answers": len(data.tokens), "answer_tokens": int((data.lengths - 1 - data.first).sum()),
            "held_out_prompts": held_prompts}
    return [data], chat_data_module.chat_ids(tok, held_prompts), info


@torch.no_grad()
def evaluate_chat(shipped, target_path: str, target, lm_head_weight, held_rows, out_dir: Path, args) -> dict:
    """kestrel's engine, greedy, on the held-out prompts: without speculation and with the head (accept
    lengths, outputs equal?); then the head's top-1 agreement on those greedy answers."""
    measured, plain = chat_data_module.measure_speculation(target_path, out_dir, shipped.variant, held_rows,
                                                           args.measure_tokens, args.device)
    rows = [p + a for p, a in zip(held_rows, plain)]
    data = target_features(target, rows, [len(p) - 1 for p in held_rows], 16, Clock(1e9), 1.0,
                           layers=shipped.target_hidden_layers)
    return {**agreement(shipped, lm_head_weight, data), "kestrel_greedy": measured}


# ---- main ------------------------------------------------------------------------------------------
def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default="demo",
                   help="demo, or a chat model: a GGUF file, a folder holding one, or a Hugging Face folder")
    p.add_argument("--out", type=Path, default=None, help="where the head goes (demo: kestrel/assets/demo-eagle)")
    p.add_argument("--time-budget", type=float, default=520.0,
                   help="seconds for the phases up to the end of training, which leaves evaluation (~40-80 s) "
                        "inside 10 minutes")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu",
                   help="where the target answers, its features are computed and the head trains (e.g. cuda)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--window", type=int, default=256, help="demo: tokens per corpus window")
    p.add_argument("--corpus-windows", type=int, default=4000, help="demo: at most this many corpus windows")
    p.add_argument("--prompt-len", type=int, default=32, help="demo: tokens per corpus prompt")
    p.add_argument("--prompts", type=int, default=384, help="chat target: training prompts")
    p.add_argument("--held-out-prompts", type=int, default=20, help="chat target: held-out prompts")
    p.add_argument("--measure-tokens", type=int, default=64, help="chat target: new tokens per held-out answer")
    p.add_argument("--gen-tokens", type=int, default=None,
                   help="new tokens per continuation (demo, default 96) or answer (chat target, default 128)")
    p.add_argument("--gen-batch", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=8, help="windows per training step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--variant", choices=("eagle", "eagle3"), default="eagle",
                   help="the head: EAGLE-1 (served as EAGLE) or EAGLE-3 (served as EAGLE3)")
    p.add_argument("--draft-vocab-size", type=int, default=None,
                   help=f"eagle3: target ids the head can draft (default {eagle3_training.DEFAULT_DRAFT_VOCAB}, capped "
                        "at the target's vocabulary, which it then maps one to one)")
    p.add_argument("--unroll", type=int, default=None,
                   help="draft passes trained per step (2: also the second drafted token, on the head's own feature). "
                        "Default: eagle 1 (at this budget 1 scored better than 2: twice the positions), eagle3 3")
    p.add_argument("--reg-weight", type=float, default=1.0, help="eagle: weight of the feature loss (EAGLE: 1)")
    p.add_argument("--feature-noise", type=float, default=None,
                   help="std of noise added to the features pass 1 reads (default: eagle 0.05, eagle3 0: its later "
                        "passes train on its own features)")
    p.add_argument("--bf16", action="store_true",
                   help="train under bf16 autocast (~1.5x faster on CPUs with AMX / AVX512-BF16)")
    p.add_argument("--log-every", type=int, default=25)
    args = p.parse_args(argv)
    demo, eagle3 = args.target == "demo", args.variant == "eagle3"
    if args.out is None:
        if not demo:
            p.error("--out is required for a target other than demo (and must not be inside the package)")
        if eagle3:
            p.error("--out is required for --variant eagle3 (kestrel/assets/demo-eagle holds demo's EAGLE head)")
        args.out = REPO / "kestrel" / "assets" / "demo-eagle"
    if args.gen_tokens is None:
        args.gen_tokens = 96 if demo else 128
    if args.draft_vocab_size is not None and not eagle3:
        p.error("--draft-vocab-size is for --variant eagle3 (an EAGLE head drafts over the target's vocabulary)")
    if args.draft_vocab_size is None and eagle3:
        args.draft_vocab_size = eagle3_training.DEFAULT_DRAFT_VOCAB
    if eagle3 and args.draft_vocab_size < 1:
        p.error(f"--draft-vocab-size must be at least 1, got {args.draft_vocab_size}")
    if args.unroll is None:
        args.unroll = 3 if eagle3 else 1
    if args.unroll < 1:
        p.error(f"--unroll must be at least 1, got {args.unroll}")
    if args.feature_noise is None:
        args.feature_noise = 0.0 if eagle3 else 0.05
    return args


def describe_device(device: str) -> str:
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(torch.device(device))
    return platform.processor() or "cpu"


def main(argv=None) -> None:
    args = parse_args(argv)
    command = "python " + shlex.join([Path(sys.argv[0]).as_posix(), *(sys.argv[1:] if argv is None else argv)])
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    clock = Clock(args.time_budget)
    demo = args.target == "demo"
    ends = ENDS["demo" if demo else "chat"]
    target_path, target, tok, target_config = load_target(args.target, args.device)
    lm_head_weight = target.lm_head.weight.detach()
    log(f"command: {command}\nPython {platform.python_version()}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, budget {args.time_budget:.0f}s, target {target_path}")

    # EAGLE-3's head reads these target layers' inputs; EAGLE's the target's last hidden state (None).
    layers = eagle3_training.aux_layers(target.config.num_hidden_layers) if args.variant == "eagle3" else None
    gen = torch.Generator().manual_seed(args.seed)
    if demo:
        sets, held, data_info = demo_data(target, tok, args, clock, ends, gen, layers)
    else:
        sets, held, data_info = chat_data(target_path, target, tok, args, clock, ends, layers)

    # Under autocast the lm_head would be cast to bf16 at every matmul: cast it once.
    train_lm_head = lm_head_weight.to(torch.bfloat16) if args.bf16 else lm_head_weight
    head, objective, config, head_info = new_head(args, target, tok, target_config, sets, layers, train_lm_head)
    log(f"head: {sum(p.numel() for p in head.parameters()):,} parameters; training until "
        f"{args.time_budget * ends['training']:.0f}s")
    trained = train(head, objective, sets, args, clock, ends["training"])
    parts = TargetParts(target.model.embed_tokens, lambda h: F.linear(h, lm_head_weight).float())
    log(f"trained: {trained}")

    save_head(head, config, args.out)
    shipped = load_eagle_head(args.out, head.variant, parts, num_target_layers=target.config.num_hidden_layers,
                              max_positions=config["max_position_embeddings"], dtype=torch.float32, device=args.device)

    if demo:
        held_windows, prompts = held
        held_data = target_features(target, held_windows.tolist(), [0] * len(held_windows), 16, clock, 10.0,
                                    layers=layers)
        results = agreement(shipped, lm_head_weight, held_data)
        log(f"held-out top-1 agreement with demo: {results} ({clock.elapsed():.0f}s)")
        results.update(chain_accept_length(shipped, target, prompts, new_tokens=96, steps=(1, 3, 5)))
        log(f"greedy chain accept length on held-out prompts: {results} ({clock.elapsed():.0f}s)")
    else:
        results = evaluate_chat(shipped, target_path, target, lm_head_weight, held, args.out, args)
        log(f"held-out evaluation: {json.dumps(results)} ({clock.elapsed():.0f}s)")

    info = {"command": command, "python": platform.python_version(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "device": describe_device(args.device), "target": args.target,
            "variant": args.variant, **head_info,
            "training": trained, **data_info, "evaluation": results, "wall_seconds": round(clock.elapsed(), 1),
            "args": {k: str(v) for k, v in vars(args).items()}}
    (args.out / "training_info.json").write_text(json.dumps(info, indent=2) + "\n")
    log(f"saved {args.out} in {clock.elapsed():.0f}s")


if __name__ == "__main__":
    main()

"""Train kestrel's bundled demo models (`demo`, `demo-draft`) on the Python standard library's source.

    python scripts/train_demo_model.py --device cuda            # or --device cpu (slow: shrink the steps)
    python scripts/train_demo_model.py --evaluate-only          # CPU: re-evaluate kestrel/assets, run kestrel

Training, in order, each step logged: collect every `.py` file of the stdlib folder (site-packages and
the machine-specific `_sysconfigdata*` excluded; files that are not UTF-8 skipped), hold out HELD_OUT,
train a byte-level BPE tokenizer on the rest, train the target (`demo`) on the files plus chat examples
(docstring summary -> function), distil the draft (`demo-draft`) from the target, save both as HF
folders in bf16 with `training_info.json` (command, Python, corpus fingerprint, held-out files,
evaluation) and evaluate them. The evaluation is the held-out perplexity of both models against an
add-one unigram model on the same tokenizer, and how often the draft's greedy next token is the
target's. `--evaluate-only` recomputes it for saved folders and adds what needs kestrel: tokens/s of
greedy generation on this machine and greedy samples.

Seeds are fixed (model init, batch order); GPU kernels may still differ in the last bits between runs.
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import platform
import random
import shlex
import subprocess
import sys
import sysconfig
import textwrap
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|user|>", "<|assistant|>", "<|system|>"]
BOS, EOS, PAD = 0, 1, 2  # ids of the first three special tokens (the trainer adds them first)
# `<|role|>content<|eos|>` per message. With tools, a system turn lists them and says how to call one;
# an assistant's calls are Hermes-style `<tool_call>` blocks (kestrel serve --tool-call-parser hermes).
CHAT_TEMPLATE = r"""{{ bos_token }}
{%- if tools %}
{{- '<|system|>You may call these tools. To call one, answer with\n<tool_call>\n{"name": <the tool\'s name>, "arguments": <its arguments as a JSON object>}\n</tool_call>\nTools:\n' }}
{%- for tool in tools %}{{ tool | tojson }}{{ '\n' }}{% endfor %}
{{- eos_token }}
{%- endif %}
{%- for message in messages %}
{{- '<|' + message['role'] + '|>' + message['content'] }}
{%- for call in message.tool_calls or [] %}
{%- if not loop.first or message['content'] %}{{ '\n' }}{% endif %}
{{- '<tool_call>\n{"name": ' + call.function.name | tojson + ', "arguments": ' + call.function.arguments | tojson + '}\n</tool_call>' }}
{%- endfor %}
{{- eos_token }}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"""
# Fixed files (present in CPython 3.9 to 3.13) never seen by the tokenizer or the models: library
# modules and tests of several kinds, ~2% of the corpus.
HELD_OUT = (
    "bisect.py", "colorsys.py", "csv.py", "dataclasses.py", "fractions.py", "graphlib.py", "heapq.py",
    "pprint.py", "sched.py", "shlex.py", "string.py", "textwrap.py", "asyncio/queues.py",
    "concurrent/futures/thread.py", "email/quoprimime.py", "http/cookies.py", "json/decoder.py",
    "json/encoder.py", "logging/handlers.py", "urllib/parse.py", "wsgiref/headers.py",
    "xml/dom/minidom.py", "test/test_bisect.py", "test/test_colorsys.py", "test/test_graphlib.py",
    "test/test_heapq.py", "test/test_pprint.py", "test/test_sched.py", "test/test_shlex.py",
    "test/test_textwrap.py",
)
SAMPLE_PROMPTS = ("def fibonacci(n):", "import os\n", "class Stack:")
DEFAULT_SHAPES = {"demo": "6x384", "demo-draft": "2x320"}  # layers x hidden size


def llama_shape(spec: str) -> dict[str, int]:
    """LlamaConfig sizes from "LAYERSxHIDDEN": heads of 64, grouped in threes for the keys and
    values where the head count allows, and a SwiGLU width of 8/3 hidden (rounded up to 32)."""
    layers, hidden = (int(v) for v in spec.lower().split("x"))
    heads = hidden // 64
    if heads < 1 or hidden % 64:
        raise ValueError(f"hidden size must be a multiple of 64, got {spec!r}")
    return dict(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                num_key_value_heads=heads // 3 if heads % 3 == 0 else heads,
                intermediate_size=32 * math.ceil(hidden * 8 / 3 / 32))


def log(*parts: object) -> None:
    print(*parts, flush=True)


# ---- corpus ----------------------------------------------------------------------------------
def collect_corpus(stdlib: Path) -> tuple[dict[str, str], list[str]]:
    """Relative path -> text of every corpus file (sorted), and the files skipped as not UTF-8."""
    files, skipped = {}, []
    for path in sorted(stdlib.rglob("*.py")):
        rel = path.relative_to(stdlib).as_posix()
        if {"site-packages", "dist-packages", "__pycache__"} & set(path.parts) or path.name.startswith(
                "_sysconfigdata"):
            continue
        try:
            files[rel] = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            skipped.append(rel)
    missing = [f for f in HELD_OUT if f not in files]
    if missing:
        raise SystemExit(f"held-out files missing from the stdlib at {stdlib}: {missing}")
    return files, skipped


def fingerprint(files: dict[str, str]) -> str:
    h = hashlib.sha256()
    for rel, text in files.items():
        h.update(rel.encode() + b"\0" + text.encode() + b"\0")
    return h.hexdigest()


def chat_examples(files: dict[str, str]) -> list[list[dict[str, str]]]:
    """One user/assistant exchange per documented function: the docstring's first line asks, the
    function's source answers. Gives `kestrel serve`'s chat endpoint something it has seen."""
    chats = []
    for text in files.values():
        try:
            with warnings.catch_warnings():  # invalid escapes etc. in old files warn on newer Pythons
                warnings.simplefilter("ignore")
                tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue  # e.g. lib2to3's Python 2 test data
        lines = text.splitlines(keepends=True)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            doc = ast.get_docstring(node)
            summary = doc.strip().split("\n")[0].strip() if doc else ""
            first = node.decorator_list[0].lineno if node.decorator_list else node.lineno
            if not 10 <= len(summary) <= 200 or node.end_lineno - first >= 40:
                continue
            source = textwrap.dedent("".join(lines[first - 1:node.end_lineno]))
            chats.append([{"role": "user", "content": summary}, {"role": "assistant", "content": source}])
    return chats


# ---- tokenizer -------------------------------------------------------------------------------
def train_tokenizer(texts: list[str], vocab_size: int, context: int):
    """Byte-level BPE: every byte has a token, so any text round-trips; encode() prepends <|bos|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS[:3]] == [BOS, EOS, PAD]
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B", special_tokens=[("<|bos|>", BOS)])
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>",
        additional_special_tokens=SPECIAL_TOKENS[3:], clean_up_tokenization_spaces=False,
        model_max_length=context)
    hf.chat_template = CHAT_TEMPLATE
    return hf


def encode_docs(tok, texts: list[str]) -> list[list[int]]:
    """Each text as <|bos|> text <|eos|>: files start where prompts start, and end where they end."""
    return [[BOS, *e.ids, EOS] for e in tok.backend_tokenizer.encode_batch(texts, add_special_tokens=False)]


# ---- models ----------------------------------------------------------------------------------
def new_model(shape: str, vocab_size: int, context: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, max_position_embeddings=context, tie_word_embeddings=True,
                         rms_norm_eps=1e-5, initializer_range=0.02, bos_token_id=BOS, eos_token_id=EOS,
                         pad_token_id=PAD, **llama_shape(shape))
    return LlamaForCausalLM(config)


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warmup, then cosine down to a tenth of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def train(model, stream: torch.Tensor, args, steps: int, peak_lr: float, monitor: torch.Tensor,
          teacher=None) -> None:
    """AdamW on random windows of the token stream; with `teacher`, the loss is KL(teacher || model)."""
    device = torch.device(args.device)
    model.to(device).train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=peak_lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")
    gen = torch.Generator().manual_seed(args.seed + (1 if teacher is not None else 0))
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    start, window = time.time(), torch.arange(args.context + 1, device=device)
    stream = stream.to(device)
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, peak_lr, args.warmup)
        offsets = torch.randint(0, len(stream) - len(window), (args.batch_size, 1), generator=gen)
        batch = stream[offsets.to(device) + window]
        inputs, targets = batch[:, :-1], batch[:, 1:]
        with autocast:
            logits = model(input_ids=inputs).logits.float().flatten(0, 1)
            if teacher is None:
                loss = F.cross_entropy(logits, targets.flatten())
            else:
                with torch.no_grad():
                    target_logp = F.log_softmax(teacher(input_ids=inputs).logits.float().flatten(0, 1), -1)
                loss = F.kl_div(F.log_softmax(logits, -1), target_logp, log_target=True, reduction="batchmean")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if (step + 1) % args.log_every == 0 or step + 1 == steps:
            elapsed = time.time() - start
            tps = (step + 1) * args.batch_size * args.context / elapsed
            log(f"  step {step + 1}/{steps} loss {loss.item():.4f} lr {opt.param_groups[0]['lr']:.2e} "
                f"{tps:,.0f} tok/s {elapsed:.0f}s")
        if (step + 1) % args.monitor_every == 0 or step + 1 == steps:
            log(f"  step {step + 1}: held-out cross-entropy (monitoring only) {monitor_loss(model, monitor):.4f}")
    model.eval()


@torch.no_grad()
def monitor_loss(model, windows: torch.Tensor) -> float:
    """Mean next-token loss on a fixed batch of held-out windows; never used to choose anything."""
    model.eval()
    device = next(model.parameters()).device
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
        x = windows.to(device)
        loss = F.cross_entropy(model(input_ids=x[:, :-1]).logits.float().flatten(0, 1), x[:, 1:].flatten())
    model.train()
    return loss.item()


def save_folder(model, tok, folder: Path) -> None:
    """An HF folder in bf16 (halves the package); kestrel and transformers cast it on load."""
    from transformers import GenerationConfig

    folder.mkdir(parents=True, exist_ok=True)
    model.to("cpu", torch.bfloat16).save_pretrained(folder)
    GenerationConfig(bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD).save_pretrained(folder)
    tok.save_pretrained(folder)
    model.float()  # keeps the bf16-rounded weights: the draft learns from exactly the shipped target


# ---- evaluation ------------------------------------------------------------------------------
@torch.no_grad()
def score(model, doc: list[int], context: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Negative log-likelihood and greedy prediction for each of doc[1:], one row per token.

    Long documents are read in windows of `context` tokens; after the first window each window
    scores only its last half, so every scored token sees at least half a context before it.
    """
    ids = torch.tensor(doc, device=device)
    nlls, preds, pos = [], [], 1
    while pos < len(doc):
        end = min(len(doc), context + 1 if pos == 1 else pos + context // 2)
        begin = max(0, end - context - 1)
        logits = model(input_ids=ids[None, begin:end - 1]).logits[0, pos - begin - 1:].float()
        nlls.append(F.cross_entropy(logits, ids[pos:end], reduction="none"))
        preds.append(logits.argmax(-1))
        pos = end
    return torch.cat(nlls).cpu(), torch.cat(preds).cpu()


def evaluate(folders: dict[str, Path], held_out: dict[str, str], train_docs: list[list[int]], context: int,
             device: str) -> dict:
    """Perplexity of each model and of the unigram baseline on the held-out files (float32 weights as
    shipped), bits per byte, and the draft/target greedy next-token agreement."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folders["demo"])
    docs = encode_docs(tok, list(held_out.values()))
    n_bytes = sum(len(t.encode()) for t in held_out.values())
    targets = torch.cat([torch.tensor(d[1:]) for d in docs])
    counts = torch.bincount(torch.tensor([t for d in train_docs for t in d[1:]]), minlength=len(tok)).double()
    unigram_logp = torch.log((counts + 1) / (counts.sum() + len(tok)))  # add-one smoothing
    results = {"held_out_files": len(held_out), "held_out_tokens": len(targets), "held_out_bytes": n_bytes}
    nll = {"unigram": -unigram_logp[targets].sum().item()}
    preds = {}
    for name, folder in folders.items():
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device).eval()
        scored = [score(model, d, context, device) for d in docs]
        nll[name] = torch.cat([s[0] for s in scored]).double().sum().item()
        preds[name] = torch.cat([s[1] for s in scored])
    for name, total in nll.items():
        results[name] = {"perplexity": round(math.exp(total / len(targets)), 3),
                         "bits_per_byte": round(total / math.log(2) / n_bytes, 4)}
    results["draft_target_greedy_agreement"] = round((preds["demo"] == preds["demo-draft"]).double().mean().item(), 4)
    return results


def kestrel_figures(folders: dict[str, Path], new_tokens: int = 256) -> dict:
    """Greedy samples of `demo` and greedy decode speed of both models through kestrel on this CPU."""
    sys.path.insert(0, str(REPO))  # this checkout's kestrel, installed or not
    from kestrel import Engine, SamplingParams

    cpuinfo = Path("/proc/cpuinfo")
    names = [line.split(":", 1)[1].strip() for line in (cpuinfo.read_text().splitlines() if cpuinfo.exists() else [])
             if line.startswith("model name")]
    figures: dict = {"cpu": names[0] if names else platform.machine(), "threads": torch.get_num_threads()}
    for name, folder in folders.items():
        with Engine(model=str(folder), device="cpu", dtype="float32") as engine:
            if name == "demo":
                greedy = SamplingParams(max_new_tokens=96, temperature=0.0)
                figures["samples"] = {p: engine.generate(p, greedy)[0].text for p in SAMPLE_PROMPTS}
            engine.generate(SAMPLE_PROMPTS[0], SamplingParams(max_new_tokens=8, temperature=0.0))  # warm-up
            fixed = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
            start = time.perf_counter()
            out = engine.generate(SAMPLE_PROMPTS[0], fixed)[0]
            figures[f"{name}_tokens_per_s"] = round(len(out.token_ids) / (time.perf_counter() - start), 1)
    # The whole command, as a user runs it: start-up, loading and 64 new tokens.
    cmd = [sys.executable, "-m", "kestrel.cli", "generate", "--model", str(folders["demo"]),
           "--prompt", SAMPLE_PROMPTS[0], "--device", "cpu"]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, cwd=REPO)
    figures["kestrel_generate_wall_s"] = round(time.perf_counter() - start, 2)
    return figures


# ---- main ------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--out", type=Path, default=REPO / "kestrel" / "assets",
                   help="folder that receives demo/ and demo-draft/")
    p.add_argument("--stdlib", type=Path, default=None,
                   help="a copy of a stdlib folder (default: this interpreter's stdlib)")
    p.add_argument("--stdlib-python", default=None, help="the Python version --stdlib comes from")
    p.add_argument("--evaluate-only", action="store_true", help="evaluate the folders in --out, add kestrel figures")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target-shape", default=DEFAULT_SHAPES["demo"], help="LAYERSxHIDDEN of demo")
    p.add_argument("--draft-shape", default=DEFAULT_SHAPES["demo-draft"], help="LAYERSxHIDDEN of demo-draft")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--target-steps", type=int, default=3000)
    p.add_argument("--draft-steps", type=int, default=2000)
    p.add_argument("--target-lr", type=float, default=1.5e-3)
    p.add_argument("--draft-lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--monitor-every", type=int, default=500)
    args = p.parse_args(argv)
    if (args.stdlib is None) != (args.stdlib_python is None):
        p.error("--stdlib and --stdlib-python go together: say which Python the copied stdlib is from")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    command = "python " + shlex.join([Path(sys.argv[0]).as_posix(), *(sys.argv[1:] if argv is None else argv)])
    if args.threads:
        torch.set_num_threads(args.threads)
    stdlib = args.stdlib or Path(sysconfig.get_paths()["stdlib"])
    stdlib_python = args.stdlib_python or platform.python_version()
    log(f"command: {command}")
    log(f"running on Python {platform.python_version()}, torch {torch.__version__}, device {args.device}"
        + (f" ({torch.cuda.get_device_name()})" if args.device.startswith("cuda") else ""))
    t0 = time.time()
    files, skipped = collect_corpus(stdlib)
    held_out = {f: files.pop(f) for f in HELD_OUT}
    log(f"corpus: Python {stdlib_python} stdlib at {stdlib}: {len(files)} training files "
        f"({sum(map(len, files.values())):,} chars), {len(held_out)} held out, skipped as not UTF-8: {skipped}")
    log(f"corpus sha256 (training files): {fingerprint(files)}")
    log(f"held-out files: {', '.join(HELD_OUT)}")
    folders = {name: args.out / name for name in DEFAULT_SHAPES}

    if args.evaluate_only:
        from transformers import AutoTokenizer

        info_path = folders["demo"] / "training_info.json"
        info = json.loads(info_path.read_text())
        tok = AutoTokenizer.from_pretrained(folders["demo"])
        results = evaluate(folders, held_out, encode_docs(tok, list(files.values())), args.context, args.device)
        results["kestrel"] = kestrel_figures(folders)
        results.update(command=command, python=platform.python_version(), torch=torch.__version__,
                       stdlib_sha256=fingerprint(files))
        log(json.dumps(results, indent=2))
        info["evaluate_only"] = results
        for folder in folders.values():
            (folder / "training_info.json").write_text(json.dumps(info, indent=2) + "\n")
        return

    random.seed(args.seed)
    torch.manual_seed(args.seed)
    tok = train_tokenizer(list(files.values()), args.vocab_size, args.context)
    log(f"tokenizer: {len(tok)} tokens ({time.time() - t0:.0f}s)")
    chats = chat_examples(files)
    chat_texts = [tok.apply_chat_template(c, tokenize=False) for c in chats]
    train_docs = encode_docs(tok, list(files.values()))
    # The rendered chats already hold their special tokens (as text, which the tokenizer matches).
    chat_docs = [e.ids for e in tok.backend_tokenizer.encode_batch(chat_texts, add_special_tokens=False)]
    docs = train_docs + chat_docs
    random.Random(args.seed).shuffle(docs)
    stream = torch.tensor([t for d in docs for t in d], dtype=torch.long)
    file_tokens = sum(map(len, train_docs))
    log(f"training stream: {len(stream):,} tokens = {file_tokens:,} from files "
        f"({sum(map(len, files.values())) / file_tokens:.2f} chars/token) + {len(stream) - file_tokens:,} "
        f"from {len(chats)} chat examples ({time.time() - t0:.0f}s)")
    held_docs = encode_docs(tok, list(held_out.values()))
    held_stream = torch.tensor([t for d in held_docs for t in d])
    n_windows = min(32, len(held_stream) // (args.context + 1))
    monitor = held_stream[:n_windows * (args.context + 1)].view(n_windows, args.context + 1)

    def epochs(steps: int) -> float:
        return steps * args.batch_size * args.context / len(stream)

    torch.manual_seed(args.seed)
    target = new_model(args.target_shape, len(tok), args.context)
    log(f"demo: {sum(p.numel() for p in target.parameters()):,} parameters, {args.target_steps} steps "
        f"x {args.batch_size} x {args.context} tokens ({epochs(args.target_steps):.1f} epochs)")
    train(target, stream, args, args.target_steps, args.target_lr, monitor)
    save_folder(target, tok, folders["demo"])
    log(f"saved {folders['demo']} ({time.time() - t0:.0f}s)")

    torch.manual_seed(args.seed + 1)
    draft = new_model(args.draft_shape, len(tok), args.context)
    log(f"demo-draft: {sum(p.numel() for p in draft.parameters()):,} parameters, distilled from demo, "
        f"{args.draft_steps} steps ({epochs(args.draft_steps):.1f} epochs)")
    target.to(args.device)
    train(draft, stream, args, args.draft_steps, args.draft_lr, monitor, teacher=target)
    save_folder(draft, tok, folders["demo-draft"])
    log(f"saved {folders['demo-draft']} ({time.time() - t0:.0f}s)")

    del target, draft
    results = evaluate(folders, held_out, train_docs, args.context, args.device)
    log(json.dumps(results, indent=2))
    info = {"command": command, "device": args.device, "python": platform.python_version(),
            "torch": torch.__version__, "stdlib_python": stdlib_python, "stdlib_sha256": fingerprint(files),
            "training_files": len(files), "skipped_not_utf8": skipped, "held_out": list(HELD_OUT),
            "chat_examples": len(chats), "training_stream_tokens": len(stream),
            "train_minutes": round((time.time() - t0) / 60, 1), "evaluation": results}
    for folder in folders.values():
        (folder / "training_info.json").write_text(json.dumps(info, indent=2) + "\n")
    log(f"done in {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()

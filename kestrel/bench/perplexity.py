"""Perplexity of a text through the engine: the quality check of FP8 KV and FP8 weights.

    python -m kestrel.bench.perplexity                       # demo, on demo's held-out files
    python -m kestrel.bench.perplexity --compare             # auto, FP8 KV, FP8 weights, both: ratios to auto
    kestrel bench perplexity --model PATH --text a.txt b.txt --kv-cache-dtype fp8_e4m3 --json ppl.json

Method. Each text is one document, tokenized as the model reads a file (the tokenizer's encoding, so
`<|bos|>` first for demo, then the tokenizer's EOS token), and every token after the first is scored:
perplexity = exp(mean negative log-likelihood). A document longer than the context is read in windows
of at most `context - 1` tokens (the longest prompt the engine takes); after the first, each window scores
only its last half, so every scored token sees at least half a window before it (demo's own evaluation,
`scripts/train_demo_model.py`, reads its held-out files the same way). Each window is one request with
`prompt_logprobs=0, max_new_tokens=0`: the engine's own prompt logprobs (docs/evaluation.md), computed
from the prefill's logits, so the numbers are those of the serving path, backends and options included.

Why this exercises the FP8 KV pool. Every attention backend first stores a chunk's new K/V in the pool
and then attends over what the pool holds, the chunk's own keys included (torch_native and sdpa gather
and dequantize the request's slots; the Triton extend kernel loads its keys from the pool buffers), so
every score already passes through FP8-rounded keys and values. On top of that the tool prefills in
chunks (`--chunked-prefill-size`, 256 unless given: four chunks per full window), so the later chunks
of a window attend over K/V written to the pool by earlier steps, as a cached prefix or a long decode
reads them. Decode-kernel numerics are not covered: the scored tokens are all prompt tokens.

Default text: the 30 stdlib files that demo's training held out (`training_info.json`'s `held_out`:
never seen by its tokenizer or weights; no test scores them), read from the running interpreter's
standard library. Their sha256 is printed, since another Python's copies of the files may differ.
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import json
import math
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kestrel.bench.common import engine_from_args, report
from kestrel.cli import add_engine_flags
from kestrel.core.sampling_params import SamplingParams

DEFAULT_CHUNK = 256
# Issue 16's goals for --compare: perplexity with FP8 KV / FP8 weights at most 1 % / 3 % above auto's.
KV_GOAL, WEIGHTS_GOAL = 1.01, 1.03


@dataclass(frozen=True)
class Window:
    """A prompt of doc[begin:end] that scores tokens [first, end) (each given every token before it)."""

    begin: int
    end: int
    first: int


def windows(length: int, span: int) -> list[Window]:
    """Windows of at most `span` tokens that score tokens 1 .. length - 1 of a document once each; after
    the first, each scores its last span // 2 tokens, so each scored token sees >= span - span // 2 before it."""
    if span < 2:
        raise ValueError(f"a window must hold at least 2 tokens, got {span}")
    out, first = [], 1
    while first < length:
        end = min(length, span if first == 1 else first + span // 2)
        out.append(Window(max(0, end - span), end, first))
        first = end
    return out


def held_out_texts() -> dict[str, str]:
    """demo's held-out files (path relative to the stdlib -> text) from the running interpreter's stdlib."""
    from kestrel.assets import resolve_model_path

    names = json.loads((Path(resolve_model_path("demo")) / "training_info.json").read_text())["held_out"]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    missing = [n for n in names if not (stdlib / n).is_file()]
    if missing:
        raise FileNotFoundError(f"demo's held-out files {missing} are not in this Python's stdlib ({stdlib}); "
                                f"pass --text FILE ... instead")
    return {n: (stdlib / n).read_text(encoding="utf-8") for n in names}


def documents(tokenizer, texts: list[str]) -> list[list[int]]:
    """Each text as the model reads a file: the tokenizer's encoding (BOS if it adds one), then its EOS."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    # verbose=False: a file longer than the context is expected here (it is read in windows).
    return [ids for text in texts if len(ids := tokenizer.encode(text, verbose=False) + eos) >= 2]


def score(engine, docs: list[list[int]], span: int | None = None) -> tuple[float, int]:
    """(sum of the negative log-likelihoods, tokens scored) of every token after each document's first,
    from the engine's prompt logprobs over windows of at most `span` tokens (default: the longest prompt)."""
    span = span or engine.max_req_len - 1
    jobs = [(doc, w) for doc in docs for w in windows(len(doc), span)]
    params = SamplingParams(max_new_tokens=0, prompt_logprobs=0)
    outs = engine.generate(prompt_token_ids=[doc[w.begin:w.end] for doc, w in jobs], sampling_params=params,
                           use_tqdm=False)
    logprobs = []
    for (_, w), out in zip(jobs, outs):
        # Entry j holds the logprob of prompt token j given tokens 0 .. j - 1 (entry 0 has none).
        logprobs += [lp for lp, _ in out.meta["prompt_token_logprobs"][w.first - w.begin:]]
    return -math.fsum(logprobs), len(logprobs)


def measure(args: argparse.Namespace, options: dict, docs_of, span: int | None) -> dict:
    """Perplexity of the engine that the flags in `args`, `options` replacing some, ask for; `docs_of(tokenizer)`
    gives the token documents."""
    with engine_from_args(args, **options) as engine:
        docs = docs_of(engine.tokenizer)
        start = time.perf_counter()
        nll, tokens = score(engine, docs, span)
        seconds = time.perf_counter() - start
        c = engine.config
        result = {"model": c.model.model, "device": str(engine.device), "dtype": c.model.dtype,
                  "kv_cache_dtype": c.cache.kv_cache_dtype, "quantization": c.model.quantization,
                  "attention_backend": engine.runner.attn_backend.name,
                  "chunked_prefill_size": c.scheduler.chunked_prefill_size, "window": span or engine.max_req_len - 1,
                  "documents": len(docs), "tokens": tokens, "nll_sum": nll, "perplexity": math.exp(nll / tokens),
                  "seconds": seconds, "tokens_per_s": tokens / seconds}
    del engine
    gc.collect()  # the next variant's engine sizes its KV pool from the free GPU memory
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def variants(args: argparse.Namespace) -> list[tuple[str, dict, float | None]]:
    """The runs: the flags as given, or with --compare auto / FP8 KV / FP8 weights / both."""
    if not args.compare:
        return [("as given", {}, None)]
    kv = args.kv_cache_dtype if args.kv_cache_dtype not in (None, "auto") else "fp8_e4m3"
    return [("auto", {"kv_cache_dtype": "auto", "quantization": None}, None),
            (f"{kv} KV", {"kv_cache_dtype": kv, "quantization": None}, KV_GOAL),
            ("fp8 weights", {"kv_cache_dtype": "auto", "quantization": "fp8"}, WEIGHTS_GOAL),
            (f"{kv} KV + fp8 weights", {"kv_cache_dtype": kv, "quantization": "fp8"}, None)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_flags(parser)
    parser.add_argument("--text", nargs="+", default=None,
                        help="text files, one document each (default: demo's held-out stdlib files)")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="read only this many tokens of the documents in all, from the first (a quick run)")
    parser.add_argument("--window", type=int, default=None,
                        help="tokens per window (default: the longest prompt the engine takes, context - 1)")
    parser.add_argument("--compare", action="store_true",
                        help="run auto, FP8 KV (--kv-cache-dtype, fp8_e4m3 by default), FP8 weights and both; "
                             "print each perplexity's ratio to auto")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    if args.model is None:
        args.model = "demo"
    if args.chunked_prefill_size is None:
        args.chunked_prefill_size = DEFAULT_CHUNK
    if args.max_tokens is not None and args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    texts = {p: Path(p).read_text(encoding="utf-8") for p in args.text} if args.text else held_out_texts()
    digest = hashlib.sha256()
    for name, text in texts.items():
        digest.update(name.encode() + b"\0" + text.encode() + b"\0")

    def docs_of(tokenizer) -> list[list[int]]:
        if tokenizer is None:
            raise ValueError(f"{args.model} has no tokenizer: perplexity needs one to read the text")
        docs, left = [], args.max_tokens or sys.maxsize
        for doc in documents(tokenizer, list(texts.values())):
            if left < 2:
                break
            docs.append(doc[:left])
            left -= len(docs[-1])
        return docs

    results, rows = [], []
    for name, options, goal in variants(args):
        result = {"variant": name, **measure(args, options, docs_of, args.window)}
        auto = results[0]["perplexity"] if results else result["perplexity"]
        result["ratio_to_first"] = result["perplexity"] / auto
        result["goal_ratio"] = goal
        results.append(result)
        rows.append((f"{name}: perplexity", f"{result['perplexity']:.4f}"))
        if args.compare and results[0] is not result:
            met = goal is not None and result["ratio_to_first"] <= goal
            verdict = "" if goal is None else f"  (goal <= {goal:.2f}: {'met' if met else 'MISSED'})"
            rows.append((f"{name}: ratio to auto", f"{result['ratio_to_first']:.4f}{verdict}"))
        rows.append((f"{name}: tokens, seconds", f"{result['tokens']:,}, {result['seconds']:.1f} s"))
    first = results[0]
    head = [("model / device / dtype", f"{first['model']} / {first['device']} / {first['dtype']}"),
            ("text", ", ".join(args.text) if args.text else f"demo's {len(texts)} held-out stdlib files "
                                                              f"(Python {sys.version.split()[0]})"),
            ("text sha256", digest.hexdigest()[:16]),
            ("window / chunked prefill", f"{first['window']} / {first['chunked_prefill_size']}"),
            ("attention backend", first["attention_backend"])]
    report("perplexity", head + rows, {"text_sha256": digest.hexdigest(), "runs": results}, args.json)


if __name__ == "__main__":
    main()

"""Speculative decoding: what it buys, per batch size, against plain decoding on the same engine flags.

    kestrel bench spec demo --json spec_demo.json          # demo + demo-eagle / demo-draft: tok/s, accept length
    kestrel bench spec llama8b --json spec_llama8b.json    # Llama-3.1-8B shape, dummy weights, EAGLE-3-shaped head
    kestrel bench spec demo --profile round.txt            # also the kernels of 5 rounds at batch 1
    kestrel bench spec --smoke                             # demo on CPU, batch 1 and 2, 8 tokens: checks the code
    kestrel bench spec chat --model SmolLM2-135M-Instruct.Q4_1.gguf --speculative-algorithm EAGLE3 \
        --speculative-draft-model-path HEAD --prompts-file HEAD/training_info.json   # a chat model and its head

`demo`: greedy generation of `--output-len` tokens for each `--batch-sizes` of Python prompts (held-out
stdlib files the demo models never trained on), plain and with each speculative variant (speculation forced
on at every batch size, so the table shows where it loses), median of `--repeats` timed runs after a
warm-up; tok/s counts output tokens, L is the mean tokens a verify round commits.

`chat`: a chat model (`--model`) and its EAGLE or EAGLE-3 head (`--speculative-algorithm`,
`--speculative-draft-model-path`), greedy answers of up to `--output-len` tokens (stopping at the model's
end of turn, as served) to the prompts of `--prompts-file` (a JSON list of strings, or the
`held_out_prompts` of the `training_info.json` that scripts/train_eagle_head.py writes beside a head),
each rendered through the model's chat template and cycled to fill the batch: plain, then the head as a
3/1/4 chain and a 5/4/8 tree; tok/s counts the tokens generated, and each variant says whether its
answers equal plain greedy decoding's.

`llama8b` (CUDA): per batch size, the plain decode step and one speculative round (mean wall time of
engine steps run back to back, as they run in service; also the median synchronised step), and inside the
round the GPU time of the target's forwards (verify), of the draft phase and of the draft extend (CUDA
events), for chains and trees of 4, 8 and 16 tokens; from them the speedup each accept length L would
give: L x decode step / round. Random weights accept next to nothing, so only the timings are measured.

Each part's engine flags are defaults: any engine flag given replaces them (a variant's speculative flags
are set on top). `--profile PATH` (kestrel.bench.profile) profiles `--profile-rounds` rounds at batch 1 of
the variant marked `profiled` below (the 5/4/8 tree in both parts), after its timings.
"""
from __future__ import annotations

import argparse
import gc
import inspect
import json
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kestrel.bench.common import engine_from_args, now, report, sync
from kestrel.bench.profile import add_profile_flag, profiled
from kestrel.cli import add_engine_flags
from kestrel.core.sampling_params import SamplingParams
from kestrel.engine.tokenizer import apply_chat_template
from kestrel.speculative.draft_worker import DraftWorker

HELD_OUT = ["textwrap", "heapq", "bisect", "colorsys", "fractions", "graphlib", "shlex", "string", "sched",
            "pprint", "csv", "dataclasses"]


@dataclass(frozen=True)
class Variant:
    name: str
    options: dict = field(default_factory=dict)  # speculative flags by config field name; {}: plain decoding
    profiled: bool = False


DEMO_VARIANTS = [
    Variant("plain"),
    Variant("EAGLE demo-eagle 5/4/8", dict(speculative_algorithm="EAGLE", speculative_draft_model_path="demo-eagle"),
            profiled=True),
    Variant("EAGLE demo-eagle 3/1/4", dict(speculative_algorithm="EAGLE", speculative_draft_model_path="demo-eagle",
                                           speculative_num_steps=3, speculative_eagle_topk=1,
                                           speculative_num_draft_tokens=4)),
    Variant("STANDALONE demo-draft 3/1/4", dict(speculative_algorithm="STANDALONE",
                                                speculative_draft_model_path="demo-draft")),
]
CHAT_SHAPES = {"chain 3/1/4": (3, 1, 4), "tree 5/4/8": (5, 4, 8)}  # (steps, topk, draft tokens)
LLAMA8B_SHAPES = [((3, 1, 4), False), ((5, 4, 8), True), ((5, 4, 16), False)]  # (steps, topk, tokens), profiled
# Each part's engine flags, used where the command line gives none.
PART_FLAGS = {
    "demo": dict(model="demo", device="cuda", dtype="bfloat16", max_running_requests=64, cuda_graph_max_bs=64,
                 disable_radix_cache=True, max_total_tokens=100_000),
    "chat": dict(device="cuda", dtype="bfloat16", max_running_requests=64, cuda_graph_max_bs=64,
                 disable_radix_cache=True),
    "llama8b": dict(model="kestrel/assets/configs/llama-3.1-8b", load_format="dummy", device="cuda",
                    dtype="bfloat16", max_total_tokens=65536, max_running_requests=32, cuda_graph_max_bs=32,
                    disable_radix_cache=True),
}
PART_SETTINGS = {"demo": dict(batch_sizes=[1, 8, 32, 64], output_len=128, repeats=3, rounds=20),
                 "chat": dict(batch_sizes=[1, 8, 32], output_len=128, repeats=3, rounds=20),
                 "llama8b": dict(batch_sizes=[1, 8, 32], output_len=128, repeats=3, rounds=20)}
SMOKE_FLAGS = dict(device="cpu", dtype="float32", max_total_tokens=8192)
SMOKE_SETTINGS = dict(batch_sizes=[1, 2], output_len=8, repeats=1, rounds=2)


def held_out_prompts(n: int, tokenizer, length: int = 96) -> list[list[int]]:
    ids = []
    for name in HELD_OUT:
        ids += tokenizer.encode(inspect.getsource(__import__(name)), verbose=False)
    step = max(1, (len(ids) - length) // n)
    return [ids[i * step:i * step + length] for i in range(n)]


def timed_generate(engine, prompts: list[list[int]], params: SamplingParams, repeats: int) -> tuple[float, list]:
    engine.generate(prompt_token_ids=prompts[:2], sampling_params=params, use_tqdm=False)  # warm-up (Triton, cuBLAS)
    times, outs = [], None
    for _ in range(repeats):
        start = now(engine.device)
        outs = engine.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        times.append(now(engine.device) - start)
    return statistics.median(times), outs


def free_device() -> None:
    """Give the previous engine's weights, KV pool and graphs back before the next one sizes its pool."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def speculative(options: dict) -> dict:
    """A variant's flags, speculation forced on at every batch size of the run."""
    return options | {"speculative_disable_batch_size": 1000} if options else {}


def demo(args: argparse.Namespace) -> list[dict]:
    params = SamplingParams(max_new_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    rows, plain_tps = [], {}
    for variant in DEMO_VARIANTS:
        with engine_from_args(args, **speculative(variant.options)) as engine:
            prompts = held_out_prompts(max(args.batch_sizes), engine.tokenizer)
            for bs in args.batch_sizes:
                seconds, outs = timed_generate(engine, prompts[:bs], params, args.repeats)
                tps = bs * args.output_len / seconds
                accept = None
                if variant.options:
                    rounds = sum(o.meta["spec_verify_ct"] for o in outs)
                    accept = sum(o.meta["spec_accept_length"] * o.meta["spec_verify_ct"] for o in outs) / rounds
                else:
                    plain_tps[bs] = tps
                rows.append(dict(variant=variant.name, batch=bs, tok_s=round(tps, 1), seconds=round(seconds, 3),
                                 accept_length=round(accept, 3) if accept else None,
                                 speedup=round(tps / plain_tps[bs], 3)))
                print(rows[-1], flush=True)
            if variant.profiled and args.profile:
                profile_rounds(engine, args.profile, args.profile_rounds)
        del engine
        free_device()
    return rows


def chat_prompts(path: str, tokenizer) -> list[list[int]]:
    """The prompts of `path` (a JSON list of strings, or an object with `held_out_prompts`), each as one
    user turn through the model's chat template, ready for the answer."""
    data = json.loads(Path(path).read_text())
    texts = data["held_out_prompts"] if isinstance(data, dict) else data
    if not texts or not all(isinstance(t, str) for t in texts):
        raise ValueError(f"{path}: expected a non-empty JSON list of prompt strings (or held_out_prompts)")
    return [apply_chat_template(tokenizer, [{"role": "user", "content": t}]) for t in texts]


def chat(args: argparse.Namespace) -> list[dict]:
    if not (args.speculative_algorithm and args.speculative_draft_model_path and args.prompts_file):
        raise ValueError("the chat part needs --speculative-algorithm, --speculative-draft-model-path (the head) "
                         "and --prompts-file")
    params = SamplingParams(max_new_tokens=args.output_len, temperature=0.0)
    head = dict(speculative_algorithm=args.speculative_algorithm,
                speculative_draft_model_path=args.speculative_draft_model_path)
    variants = [Variant("plain", dict(speculative_algorithm=None, speculative_draft_model_path=None))] + [
        Variant(f"{args.speculative_algorithm} {name}", speculative(head | dict(
            speculative_num_steps=steps, speculative_eagle_topk=topk, speculative_num_draft_tokens=tokens)))
        for name, (steps, topk, tokens) in CHAT_SHAPES.items()]
    rows, plain = [], {}
    for variant in variants:
        with engine_from_args(args, **variant.options) as engine:
            prompts = chat_prompts(args.prompts_file, engine.tokenizer)
            for bs in args.batch_sizes:
                batch = [prompts[i % len(prompts)] for i in range(bs)]
                seconds, outs = timed_generate(engine, batch, params, args.repeats)
                tokens = [o.token_ids for o in outs]
                accept = None
                if variant.name == "plain":
                    plain[bs] = (sum(map(len, tokens)) / seconds, tokens)
                else:
                    rounds = sum(o.meta["spec_verify_ct"] for o in outs)
                    accept = sum(o.meta["spec_accept_length"] * o.meta["spec_verify_ct"] for o in outs) / rounds
                tps = sum(map(len, tokens)) / seconds
                rows.append(dict(variant=variant.name, batch=bs, tok_s=round(tps, 1), seconds=round(seconds, 3),
                                 tokens=sum(map(len, tokens)), accept_length=round(accept, 3) if accept else None,
                                 speedup=round(tps / plain[bs][0], 3), same_as_plain=tokens == plain[bs][1]))
                print(rows[-1], flush=True)
        del engine
        free_device()
    return rows


def eagle3_head_folder(root: Path) -> str:
    """A config-only EAGLE-3 head for Llama-3.1-8B, shaped as the public one (32k draft vocabulary)."""
    config = dict(architectures=["LlamaForCausalLMEagle3"], model_type="llama", hidden_size=4096,
                  intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                  num_hidden_layers=1, vocab_size=128256, draft_vocab_size=32000, target_hidden_size=4096,
                  rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072, hidden_act="silu")
    (root / "config.json").write_text(json.dumps(config))
    return str(root)


def step_times(engine, bs: int, rounds: int) -> dict:
    """At batch `bs`: the median synchronised wall time of a decode step (or round), the mean step time
    when steps are not synchronised (plain decoding then overlaps host and device), and the CUDA-event
    times of the forwards inside: the target's (verify), the draft phase, the draft extend."""
    params = SamplingParams(max_new_tokens=2 * rounds + 8, temperature=0.0, ignore_eos=True)
    rids = [engine.add_request(prompt_token_ids=[(37 * i + j) % 30000 + 100 for j in range(512)],
                               sampling_params=params) for i in range(bs)]
    while engine.scheduler.waiting or engine.scheduler.chunked:
        engine.step()
    for _ in range(3):
        engine.step()
    worker = engine.spec_worker if isinstance(engine.spec_worker, DraftWorker) else None  # NGRAM: no draft forwards
    runners = [engine.runner] + ([worker.runner] if worker else [])
    draft_events: list = []
    if worker:
        draft = worker.lanes.draft

        def timed_draft(*draft_args):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            tree = draft(*draft_args)
            end.record()
            draft_events.append((start, end))
            return tree
        worker.lanes.draft = timed_draft
    for runner in runners:
        runner.forward_events = []
    walls = []
    for _ in range(rounds):
        start = now(engine.device)
        engine.step()
        walls.append(now(engine.device) - start)
    gpu = [[s.elapsed_time(e) for s, e in events] for events in [r.forward_events for r in runners] + [draft_events]]
    for runner in runners:
        runner.forward_events = None
    start = now(engine.device)
    for _ in range(rounds):
        engine.step()
    unsynced = (now(engine.device) - start) / rounds
    if worker:
        worker.lanes.draft = draft
    engine.discard(rids)
    med = lambda xs: round(statistics.median(xs), 3) if xs else None  # noqa: E731
    return dict(synced_ms=med([w * 1e3 for w in walls]), unsynced_ms=round(unsynced * 1e3, 3), target_gpu_ms=med(gpu[0]),
                extend_gpu_ms=med(gpu[1]) if worker else None, draft_gpu_ms=med(gpu[2]) if worker else None)


def profile_rounds(engine, path: str, rounds: int) -> None:
    """`rounds` speculative rounds at batch 1, after a few unprofiled ones, profiled into `path`."""
    params = SamplingParams(max_new_tokens=8 * rounds + 16, temperature=0.0, ignore_eos=True)
    rid = engine.add_request(prompt_token_ids=[(7 * j) % 30000 + 100 for j in range(512)], sampling_params=params)
    for _ in range(4):
        engine.step()
    sync(engine.device)
    with profiled(path, engine):
        for _ in range(rounds):
            engine.step()
    engine.discard([rid])


def llama8b(args: argparse.Namespace) -> list[dict]:
    if not torch.cuda.is_available():
        raise ValueError("the llama8b part times forwards with CUDA events: it needs a CUDA GPU (the demo part runs "
                         "on CPU with --device cpu)")
    rows = []
    with engine_from_args(args) as engine:
        plain = {bs: step_times(engine, bs, args.rounds) for bs in args.batch_sizes}
    del engine
    free_device()
    print("plain decode", plain, flush=True)
    head = eagle3_head_folder(Path(tempfile.mkdtemp()))
    for (steps, topk, tokens), profile_this in LLAMA8B_SHAPES:
        shape = dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=head, speculative_num_steps=steps,
                     speculative_eagle_topk=topk, speculative_num_draft_tokens=tokens)
        with engine_from_args(args, **speculative(shape)) as engine:
            for bs in args.batch_sizes:
                t = step_times(engine, bs, args.rounds)
                # Against plain decoding as it runs (overlapped), not its synchronised steps.
                decode = plain[bs]["unsynced_ms"]
                row = dict(shape=f"{steps}/{topk}/{tokens}", batch=bs, decode_ms=decode,
                           decode_synced_ms=plain[bs]["synced_ms"], round_ms=t["unsynced_ms"],
                           round_synced_ms=t["synced_ms"],
                           verify_gpu_ms=t["target_gpu_ms"], draft_gpu_ms=t["draft_gpu_ms"],
                           draft_step_gpu_ms=round(t["draft_gpu_ms"] / (steps - 1), 3),
                           draft_extend_gpu_ms=t["extend_gpu_ms"],
                           # A round commits at most steps + 1 tokens. Rounds back to back, as they run.
                           **{f"speedup_at_L{L}": round(L * decode / t["unsynced_ms"], 2) if L <= steps + 1 else None
                              for L in (2, 3, 4, 5)})
                rows.append(row)
                print(row, flush=True)
            if profile_this and args.profile:
                profile_rounds(engine, args.profile, args.profile_rounds)
        del engine
        free_device()
    return rows


PARTS = {"demo": demo, "chat": chat, "llama8b": llama8b}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="kestrel bench spec", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", nargs="?", choices=list(PARTS), default="demo",
                        help="demo (default): the demo model and its drafts; chat: a chat model and its head on "
                             "--prompts-file; llama8b: an 8B shape, timings only")
    add_engine_flags(parser)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=None, help="default: demo 1 8 32 64, "
                                                                                 "llama8b 1 8 32")
    parser.add_argument("--output-len", type=int, default=None, help="demo: new tokens per request (default 128)")
    parser.add_argument("--repeats", type=int, default=None, help="demo: timed runs per figure, median (default 3)")
    parser.add_argument("--rounds", type=int, default=None, help="llama8b: timed steps per figure (default 20)")
    parser.add_argument("--profile-rounds", type=int, default=5, help="rounds that --profile covers")
    parser.add_argument("--smoke", action="store_true", help="demo on CPU in float32, batch 1 and 2, 8 new tokens, "
                                                             "one repeat: checks the code in a minute")
    parser.add_argument("--prompts-file", default=None, help="chat: a JSON list of prompts, or a head's "
                                                             "training_info.json (its held_out_prompts)")
    parser.add_argument("--json", default=None, help="write the rows here")
    add_profile_flag(parser)
    known = parser.parse_known_args(argv)[0]
    # The part's engine flags (and with --smoke the CPU ones) as defaults: flags on the command line win.
    parser.set_defaults(**PART_FLAGS[known.part] | (SMOKE_FLAGS if known.smoke else {}))
    args = parser.parse_args(argv)
    for name, value in (PART_SETTINGS[args.part] | (SMOKE_SETTINGS if args.smoke else {})).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    started = time.monotonic()
    rows = PARTS[args.part](args)
    keys = list(rows[0])
    print("\n" + " | ".join(keys))
    for row in rows:
        print(" | ".join(str(row[k]) for k in keys))
    report(f"speculative decoding, {args.part}", [("rows", len(rows)), ("seconds", time.monotonic() - started)],
           {"part": args.part, "rows": rows}, args.json)


if __name__ == "__main__":
    main()

"""`kestrel generate | serve | bench | explain`: argparse flags built from EngineConfig's fields."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import typing

from kestrel.config import SECTIONS, VLLM_NAMES, EngineConfig

# Flags whose help is worth more than the field name.
HELP = {
    "model": "Hugging Face model folder, a GGUF file (or a folder holding one), or a bundled model: demo (default), "
             "demo-draft",
    "device": "auto, cpu or cuda",
    "dtype": "auto, float32, float16 or bfloat16",
    "max_total_tokens": "KV pool size in tokens (default: from GPU memory; 32768 on CPU)",
    "page_size": "tokens per KV page (default: 1, or 128 for DeepSeek-V4, whose compressed KV blocks need it)",
    "chunked_prefill_size": "prefill tokens per step; -1 disables chunking (vLLM's --max-num-batched-tokens counts "
                            "a step's decode tokens too; here they come on top)",
    "context_length": "longest prompt + output in tokens (default: the model's max_position_embeddings)",
    "mem_fraction_static": "share of GPU memory for the weights and the KV pool (default 0.85)",
    "max_running_requests": "most requests decoding at once (default: 1024 on GPU, 64 on CPU)",
    "kv_cache_dtype": "auto (the model dtype), fp8_e4m3 or fp8_e5m2: the KV cache in FP8, half the bytes of bf16 "
                      "(DeepSeek-V4: fp8_e4m3 only, packed 584 B entries, docs/design/deepseek-v4.md §6)",
    "quantization": "fp8: linear weights in FP8 (block-scaled e4m3; a float checkpoint is quantized at load). "
                    "Default: what the checkpoint holds",
    "enable_piecewise_cuda_graph": "replay CUDA graphs between the attention calls of prefill (EXTEND) and "
                                   "MIXED steps of Llama-family models on CUDA (docs/cuda-graphs.md)",
    "piecewise_cuda_graph_max_tokens": "largest step, in new tokens, that piecewise CUDA graphs serve "
                                       "(default 2048); larger steps run eagerly",
    "attention_backend": "attention backend for both phases (e.g. torch_native)",
    "triton_decode_split": "uniform (default) or length: how the Triton decode kernel splits keys over programs; "
                           "length cuts each request into chunks of equal size (docs/benchmarks.md)",
    "speculative_algorithm": "EAGLE, EAGLE3, NEXTN, STANDALONE or NGRAM (as SGLang spells them)",
    "speculative_draft_model_path": "the draft: an EAGLE/EAGLE-3 head or a small LM folder, or a bundled name "
                                    "(demo-eagle, demo-draft); NEXTN defaults to the target",
    "speculative_num_steps": "draft depth (set all three of steps/topk/draft tokens, or none for SGLang's choice)",
    "speculative_eagle_topk": "branching of the draft tree (1: a chain); NGRAM: the largest branching",
    "speculative_num_draft_tokens": "tree nodes sent to verify, the root included",
    "speculative_disable_batch_size": "stop speculating above this many running requests (default 32)",
    "speculative_draft_attention_backend": "one attention backend for every phase of the draft model",
    "speculative_attention_mode": "prefill or decode: which half serves TARGET_VERIFY and DRAFT_EXTEND",
    "grammar_compile_timeout": "seconds a structured-output request waits for its grammar to compile (off the "
                               "engine loop) before it fails with a 400 (default: 30)",
    "grammar_max_length": "longest grammar text (JSON schema, regex, EBNF, structural tag) compiled, in characters; "
                          "a longer one is a 400 (default: 200000)",
    "tp_size": "tensor-parallel ranks: one process (and GPU) each, the model's heads, MLP and vocabulary split "
               "over them (docs/parallelism.md)",
    "ep_size": "ranks the routed experts of a MoE model (DeepSeek-V4) are split over: 1 or --tp-size",
    "nnodes": "machines the --tp-size ranks are spread over (default 1)",
    "node_rank": "this machine's place among --nnodes; node 0 serves HTTP, the others run their ranks only",
    "dist_init_addr": "host:port of node 0's rendezvous, reachable from every node (needed with --nnodes > 1)",
    "max_request_bytes": "largest request body in bytes; larger ones get 413 (default: 4 MiB)",
    "max_queued_requests": "engine requests held beyond --max-running-requests; past it, 503 with Retry-After "
                           "(default: 1024)",
    "shutdown_timeout": "seconds running requests get to finish after SIGTERM before they are aborted (default: 30)",
    "request_read_timeout": "seconds a client has to send a request's headers, and between two reads of its "
                            "body; past them the connection is closed, 408 mid-body (default: 30)",
    "tokenizer_pool_size": "processes tokenizing long prompts off the event loop (default: 2)",
    "tool_call_parser": "the format of the model's tool calls, to parse them and force them (tool_choice): "
                        "llama3, qwen25 or hermes (also the bundled demo's); default: no tool calls",
}


# vLLM's flags for our options, accepted as aliases (shown beside ours in --help).
VLLM_FLAGS = {ours: "--" + theirs.replace("_", "-") for theirs, ours in VLLM_NAMES.items()}


def _field_type(field: dataclasses.Field) -> type:
    """The argparse type of a field: `int | None` -> int, `str` -> str."""
    hint = typing.get_type_hints(FIELD_OWNER[field.name])[field.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


FIELD_OWNER = {f.name: klass for klass in SECTIONS.values() for f in dataclasses.fields(klass)}


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field, with SGLang's spelling (--max-total-tokens), and vLLM's where it
    differs (--max-model-len; `VLLM_FLAGS`, and --[no-]enable-prefix-caching)."""
    parser.add_argument("--device", default="auto", help=HELP["device"])
    for klass in SECTIONS.values():
        for field in dataclasses.fields(klass):
            flag = "--" + field.name.replace("_", "-")
            names = [flag, "--model-path"] if field.name == "model" else [flag]
            names += [VLLM_FLAGS[field.name]] if field.name in VLLM_FLAGS else []
            kind = _field_type(field)
            if kind is bool:
                parser.add_argument(*names, dest=field.name, action="store_true", help=HELP.get(field.name))
            else:
                parser.add_argument(*names, dest=field.name, type=kind, default=None, help=HELP.get(field.name))
            if field.name == "disable_radix_cache":
                parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                                    help="vLLM's spelling: --no-enable-prefix-caching is --disable-radix-cache "
                                         "(prefix caching is on by default)")


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    # `is` comparisons: 0 (e.g. --port 0) is a value, only an absent flag (None / unset bool) is not.
    flat = {name: value for name in EngineConfig.flat_fields()
            if (value := getattr(args, name, None)) is not None and value is not False}
    if (positional := getattr(args, "model_tag", None)) is not None:  # `kestrel serve MODEL`, as `vllm serve MODEL`
        if flat.get("model", positional) != positional:
            raise ValueError(f"the model is given twice, as {positional!r} and --model {flat['model']!r}; give one")
        flat["model"] = positional
    prefix_caching = getattr(args, "enable_prefix_caching", None)
    if prefix_caching is not None:
        if prefix_caching and flat.get("disable_radix_cache"):
            raise ValueError("--enable-prefix-caching and --disable-radix-cache contradict each other; give one")
        flat["disable_radix_cache"] = not prefix_caching
    return EngineConfig.from_flat(**flat)


def _generate(args: argparse.Namespace) -> int:
    from kestrel import Engine, SamplingParams

    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    with Engine(config=config_from_args(args)) as engine:
        if args.prompt_token_ids is not None:
            try:
                ids = [int(t) for t in args.prompt_token_ids.split(",")]
            except ValueError:
                raise ValueError(f"--prompt-token-ids takes comma-separated integers, got {args.prompt_token_ids!r}")
            out = engine.generate(prompt_token_ids=[ids], sampling_params=params, use_tqdm=False)[0]
        elif engine.tokenizer is None:
            raise ValueError(f"{engine.config.model.model} has no tokenizer to read --prompt with: pass --tokenizer PATH (a "
                             "model folder or GGUF file that has one, or `demo`), or --prompt-token-ids 1,2,3")
        else:
            out = engine.generate(args.prompt, params, use_tqdm=False)[0]  # one prompt: no bar
    print(out.text if engine.tokenizer is not None else " ".join(map(str, out.token_ids)))
    return 0


def _serve(args: argparse.Namespace) -> int:
    from kestrel.server.launch import ServerStartError, serve
    from kestrel.server.process_exit import skip_teardown_on_exit

    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (the format of the model's tool calls: "
                         "llama3, qwen25 or hermes)")
    try:
        code = serve(config_from_args(args), served_model_names=args.served_model_name or ())
    except ServerStartError as e:
        print(f"kestrel: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    skip_teardown_on_exit(code)  # the server stopped everything it started: the rest would only take seconds
    return code


def _explain(args: argparse.Namespace) -> int:
    from kestrel.attention.explain import explain_plan

    print(explain_plan(config_from_args(args).resolve()))
    return 0


BENCHES = {"one-batch": "kestrel.bench.one_batch", "offline": "kestrel.bench.offline",
           "serving": "kestrel.bench.serving", "closed-loop": "kestrel.bench.closed_loop",
           "perplexity": "kestrel.bench.perplexity", "grammar": "kestrel.bench.grammar"}


def configure_logging(level: str | None) -> None:
    logging.basicConfig(level=getattr(logging, (level or "info").upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _run(command, *args) -> int:
    """Run a command; bad options or a missing model end with a one-line error and exit code 2."""
    try:
        return command(*args)
    except (ValueError, FileNotFoundError) as e:
        print(f"kestrel: error: {e}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    """`kestrel generate | serve | explain` (`kestrel bench` has a parser per benchmark)."""
    parser = argparse.ArgumentParser(prog="kestrel", description="a compact LLM serving engine")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one prompt, offline")
    add_engine_flags(gen)
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt")
    prompt.add_argument("--prompt-token-ids", help="comma-separated token ids instead of text (a model without a "
                                                   "tokenizer; the output is then printed as token ids too)")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--seed", type=int, default=None)
    srv = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API (and SGLang's native /generate)")
    srv.add_argument("model_tag", nargs="?", metavar="MODEL", help="the model, as --model gives it")
    add_engine_flags(srv)
    srv.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                     help="the model names clients may send (a request that names none gets the first); "
                          "/v1/models lists them (default: the model as given)")
    srv.add_argument("--enable-auto-tool-choice", action="store_true",
                     help="vLLM's switch for tool_choice 'auto'; kestrel serves it whenever --tool-call-parser is "
                          "set, and, as vLLM, refuses this flag without one")
    explain = sub.add_parser("explain", help="print the resolved attention plan without loading weights")
    add_engine_flags(explain)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        if len(argv) < 2 or argv[1] not in BENCHES:
            print(f"usage: kestrel bench {{{','.join(BENCHES)}}} [flags]", file=sys.stderr)
            return 2
        import importlib

        return _run(lambda: importlib.import_module(BENCHES[argv[1]]).main(argv[2:]) or 0)
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    return _run({"generate": _generate, "serve": _serve, "explain": _explain}[args.command], args)


if __name__ == "__main__":
    sys.exit(main())

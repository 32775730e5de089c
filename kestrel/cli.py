"""`kestrel generate | serve | bench | explain`: argparse flags built from EngineConfig's fields."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import typing

from kestrel.config import SECTIONS, EngineConfig, cli_flag
from kestrel.config_resolve import resolve_config

# --help lists the sections in this order, each under its name.
SECTION_TITLES = {"model": "model", "cache": "KV cache", "scheduler": "scheduler", "attention": "attention",
                  "speculative": "speculative decoding", "cuda_graph": "CUDA graphs", "parallel": "parallelism",
                  "server": "server", "lora": "LoRA"}


def _argparse_type(owner: type, field: dataclasses.Field) -> type:
    """The argparse type of a field: `int | None` -> int, `str` -> str."""
    hint = typing.get_type_hints(owner)[field.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def add_engine_flags(parser: argparse.ArgumentParser) -> dict[str, argparse._ArgumentGroup]:
    """One flag per option of EngineConfig (`kestrel.config.option`), with SGLang's spelling
    (--max-total-tokens) and the field's aliases (vLLM's --max-model-len, ...; and --[no-]enable-prefix-caching),
    in one argument group per section, returned by section name. Fields that resolution decides have no flag."""
    groups = {sec: parser.add_argument_group(f"{title} options", SECTIONS[sec].__doc__.split("\n")[0])
              for sec, title in SECTION_TITLES.items()}
    for name, (section, field) in EngineConfig.options().items():
        group = groups[field.metadata["group"] or section]
        names = [cli_flag(name)] + [cli_flag(alias) for alias in field.metadata["aliases"]]
        kind = _argparse_type(SECTIONS[section] if section else EngineConfig, field)
        if kind is bool:
            group.add_argument(*names, dest=name, action="store_true", help=field.metadata["help"])
        elif typing.get_origin(kind) is tuple:  # a list of values: --lora-paths a=/x b=/y
            group.add_argument(*names, dest=name, nargs="+", type=str, default=None, help=field.metadata["help"])
        else:
            # Choices show as the metavar; the subsystem that reads the field refuses others, with its reason.
            choices = field.metadata["choices"]
            group.add_argument(*names, dest=name, type=kind, default=None, help=field.metadata["help"],
                               metavar="{" + ",".join(choices) + "}" if choices else None)
        if name == "disable_radix_cache":
            group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                               help="vLLM's spelling: --no-enable-prefix-caching is --disable-radix-cache "
                                    "(prefix caching is on by default)")
    return groups


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
                         "llama3, qwen25, hermes or gpt-oss)")
    config = config_from_args(args)
    try:
        if config.parallel.dp_size > 1:
            from kestrel.deploy.dp_launch import serve_dp
            from kestrel.deploy.gateway import GatewayNotFound

            try:
                return serve_dp(config, served_model_names=args.served_model_name or ())
            except GatewayNotFound as e:
                raise ServerStartError(str(e)) from None
        code = serve(config, served_model_names=args.served_model_name or ())
    except ServerStartError as e:
        print(f"kestrel: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    skip_teardown_on_exit(code)  # the server stopped everything it started: the rest would only take seconds
    return code


def _explain(args: argparse.Namespace) -> int:
    from kestrel.attention.explain import explain_plan

    print(explain_plan(resolve_config(config_from_args(args))))
    return 0


BENCHES = {"one-batch": "kestrel.bench.one_batch", "offline": "kestrel.bench.offline",
           "serving": "kestrel.bench.serving", "cpu-serving": "kestrel.bench.cpu_serving",
           "closed-loop": "kestrel.bench.closed_loop", "perplexity": "kestrel.bench.perplexity",
           "grammar": "kestrel.bench.grammar", "spec": "kestrel.bench.spec"}


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
    prompt.add_argument("--prompt", help="the prompt text, tokenized as it is (no chat template)")
    prompt.add_argument("--prompt-token-ids", help="comma-separated token ids instead of text (a model without a "
                                                   "tokenizer; the output is then printed as token ids too)")
    sampling = gen.add_argument_group("sampling options")
    sampling.add_argument("--max-new-tokens", type=int, default=64, help="most tokens to generate (default 64)")
    sampling.add_argument("--temperature", type=float, default=0.0, help="0 (default) samples greedily")
    sampling.add_argument("--top-p", type=float, default=1.0,
                          help="sample from the fewest tokens whose probabilities add up to this (default 1: all)")
    sampling.add_argument("--top-k", type=int, default=-1,
                          help="sample from this many most likely tokens (default -1: all)")
    sampling.add_argument("--seed", type=int, default=None, help="seed of this request's draws (default: random)")
    srv = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API (and SGLang's native /generate)")
    srv.add_argument("model_tag", nargs="?", metavar="MODEL", help="the model, as --model gives it")
    server = add_engine_flags(srv)["server"]
    server.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                        help="the model names clients may send (a request that names none gets the first); "
                             "/v1/models lists them (default: the model as given)")
    server.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="vLLM's switch for tool_choice 'auto'; kestrel serves it whenever --tool-call-parser "
                             "is set, and, as vLLM, refuses this flag without one")
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

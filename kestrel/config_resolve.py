"""Resolution: every automatic choice of an EngineConfig (device, dtype, sizes, attention backends) made
once, and every value validated, by asking the subsystems that own them.

The resolved config carries what was decided (the checkpoint's config.json, the attention backend pair),
so nothing after resolution decides it again.
"""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from kestrel import envs
from kestrel.config import EngineConfig, ServerConfig

logger = logging.getLogger(__name__)


def resolve_config(config: EngineConfig) -> EngineConfig:
    """Fill every automatic choice and validate; returns a new, resolved config (`config` itself when
    it is resolved already)."""
    if config.resolved:
        return config
    import torch

    from kestrel.assets import resolve_model_path
    from kestrel.attention.decisions import extend_prefix_reuse, library_requirements
    from kestrel.attention.registry import attention_backends
    from kestrel.cache.kv_events_config import parse_kv_events_config
    from kestrel.distributed.resolve import check_parallel
    from kestrel.hf_config import read_hf_config
    from kestrel.lora.resolve import resolve_lora
    from kestrel.quant.resolve import resolve_quantization
    from kestrel.speculative.draft_backends import draft_backend_plan
    from kestrel.speculative.resolve import resolve_speculative

    if not config.model.model:
        raise ValueError("model is required: a Hugging Face model folder")
    model_path = resolve_model_path(config.model.model)
    hf = read_hf_config(model_path)
    _check_hf_config(model_path, hf)
    device = config.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available; use device='cpu'")
    on_gpu = device != "cpu"
    quantization = resolve_quantization(config.model.quantization, config.cache.kv_cache_dtype, hf, device)

    dtype = _checked_choice(config.model, "dtype")
    if dtype == "auto":
        ckpt = str(hf.get("torch_dtype") or hf.get("dtype") or "float32")
        dtype = ("bfloat16" if ckpt == "float32" else ckpt) if on_gpu else "float32"
    context_length, hf = _resolve_context_length(config.model.context_length, hf)

    c = config.cache
    page_size = _resolve_page_size(c.page_size, hf)
    if c.max_total_tokens is not None and c.max_total_tokens < page_size:
        raise ValueError(f"max_total_tokens must be >= page_size ({page_size}), got {c.max_total_tokens}")
    mem_fraction = c.mem_fraction_static
    if mem_fraction is not None and not 0 < mem_fraction < 1:
        raise ValueError(f"mem_fraction_static must be in (0, 1), got {mem_fraction}")
    max_total_tokens = c.max_total_tokens
    if not on_gpu and max_total_tokens is None:
        max_total_tokens = 32768  # CPU: no memory probe, a fixed pool that fits any test model
    kv_events = parse_kv_events_config(c.kv_events_config) if c.kv_events_config is not None else None
    cache = dataclasses.replace(c, page_size=page_size, max_total_tokens=max_total_tokens,
                                mem_fraction_static=mem_fraction if mem_fraction else 0.85, kv_events=kv_events)

    s = config.scheduler
    if s.max_running_requests is not None and s.max_running_requests < 1:
        raise ValueError(f"max_running_requests must be >= 1, got {s.max_running_requests}")
    if not s.grammar_compile_timeout > 0:  # also catches NaN
        raise ValueError(f"grammar_compile_timeout must be > 0 seconds, got {s.grammar_compile_timeout}")
    if s.grammar_max_length < 1:
        raise ValueError(f"grammar_max_length must be >= 1 characters, got {s.grammar_max_length}")
    if s.schedule_conservativeness < 0:
        raise ValueError(f"schedule_conservativeness must be >= 0, got {s.schedule_conservativeness}")
    chunk = s.chunked_prefill_size
    if chunk is None:
        chunk = 8192 if on_gpu else 2048
    if chunk != -1 and chunk < 1:
        raise ValueError(f"chunked_prefill_size must be -1 (off) or >= 1, got {chunk}")
    for name in ("itl_target_ms", "ttft_target_ms"):
        target = getattr(s, name)
        if target is not None and not target > 0:
            raise ValueError(f"{name} must be > 0 milliseconds (or unset), got {target}")
    profile = s.step_cost_profile_steps
    if profile is None:
        profile = 12 if on_gpu and s.itl_target_ms is not None else 0  # the model serves the ITL target only
    if profile < 0:
        raise ValueError(f"step_cost_profile_steps must be >= 0 (0 skips the profile), got {profile}")
    if profile and s.itl_target_ms is None:
        raise ValueError("step_cost_profile_steps seeds the step-cost model that only --itl-target-ms uses; set a "
                         "target, or leave the profile unset")
    scheduler = dataclasses.replace(
        s, chunked_prefill_size=chunk, max_running_requests=s.max_running_requests or (1024 if on_gpu else 64),
        step_cost_profile_steps=profile)

    speculative = resolve_speculative(config.speculative, model_path, hf)
    if config.cuda_graph.cuda_graph_max_bs < 1:
        raise ValueError(f"cuda_graph_max_bs must be >= 1, got {config.cuda_graph.cuda_graph_max_bs}")
    if config.cuda_graph.piecewise_cuda_graph_max_tokens < 1:
        raise ValueError("piecewise_cuda_graph_max_tokens must be >= 1, got "
                         f"{config.cuda_graph.piecewise_cuda_graph_max_tokens}")
    _check_server(config.server)
    _checked_choice(config.attention, "triton_decode_split")
    check_parallel(config.parallel, hf, device, speculative, quantization)
    lora = resolve_lora(config.lora, quantization, config.parallel.tp_size)
    out = dataclasses.replace(
        config, device=device, cache=cache, scheduler=scheduler, speculative=speculative, lora=lora,
        model=dataclasses.replace(config.model, model=model_path, dtype=dtype, context_length=context_length,
                                  quantization=quantization, hf_config=hf,
                                  tokenizer=config.model.tokenizer and resolve_model_path(config.model.tokenizer)),
        resolved=True)
    # Unknown or unavailable backends fail here, at start-up; the pair is read from here on.
    out = dataclasses.replace(out, attention=dataclasses.replace(out.attention, backends=attention_backends(out)))
    draft_backend_plan(out)  # so do draft backends that cannot serve a draft mode
    _check_library_floors(library_requirements(out))
    if not extend_prefix_reuse(out):
        # The prefill backend cannot attend over a cached prefix: no radix reuse, no chunking.
        out = dataclasses.replace(
            out, cache=dataclasses.replace(out.cache, disable_radix_cache=True),
            scheduler=dataclasses.replace(out.scheduler, chunked_prefill_size=-1))
    return out


def _checked_choice(section: Any, name: str) -> str:
    """A field whose closed set of values the config declares (and no subsystem owns), checked."""
    value = getattr(section, name)
    choices = next(f for f in dataclasses.fields(section) if f.name == name).metadata["choices"]
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
    return value


def _resolve_page_size(page_size: int | None, hf: dict[str, Any]) -> int:
    """The given page size, checked against the model's KV layout; unset: 1, or the layout's block
    ratio (128 for DeepSeek-V4, whose compressed entries each cover 128 positions of one page)."""
    from kestrel.models.registry import kv_page_multiple

    if page_size is not None and page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    multiple = kv_page_multiple(hf)
    if page_size is None:
        if multiple > 1:
            logger.info("page_size %d: this model's KV layout stores blocks of up to %d positions, and a block "
                        "must not straddle two pages", multiple, multiple)
        return multiple
    if page_size % multiple:
        raise ValueError(f"page_size must be a multiple of {multiple} for this model's compressed KV blocks, got "
                         f"{page_size}; use --page-size {multiple} or leave it unset")
    return page_size


# Where config.json states the positions a model was built for (DeepSeek's native spelling: max_seq_len).
_MAX_POSITION_KEYS = ("max_position_embeddings", "max_seq_len")


def _resolve_context_length(asked: int | None, hf: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """The context length, and `hf` as the model should be built for it. A length past the checkpoint's
    positions is refused (its rope tables end there, and the model was not trained past them), unless
    the user opts in with KESTREL_ALLOW_LONG_CONTEXT=1 for a scaled rope, which is made to stretch:
    then the positions in `hf` become the context length, so the rope tables cover it."""
    context_length = asked or int(hf.get("max_position_embeddings", 2048))
    key = next((k for k in _MAX_POSITION_KEYS if hf.get(k)), None)
    max_pos = int(hf[key]) if key else context_length
    if context_length < 1:
        raise ValueError(f"context_length must be >= 1, got {context_length}")
    if key is None or context_length <= max_pos:
        return context_length, hf
    too_long = (f"context_length={context_length} is longer than the model's {max_pos} positions "
                f"({key} in its config.json)")
    rope = _rope_scaling_type(hf)
    if rope is None:
        raise ValueError(f"{too_long}: its rope is not scaled, so positions past {max_pos} were never trained "
                         "(KESTREL_ALLOW_LONG_CONTEXT=1 applies to scaled ropes only); "
                         f"set context_length <= {max_pos}")
    if not envs.allow_long_context():
        raise ValueError(f"{too_long}; set context_length <= {max_pos}, or, to run its {rope!r} rope past them on "
                         "purpose, set the environment variable KESTREL_ALLOW_LONG_CONTEXT=1")
    logger.warning("%s; running its %r rope past them, as KESTREL_ALLOW_LONG_CONTEXT=1 asks: outputs past %d "
                   "tokens may be wrong", too_long, rope, max_pos)
    params_key = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    params = dict(hf.get(params_key) or {})
    # A llama3 rope without it falls back to the model's positions, which change here.
    params.setdefault("original_max_position_embeddings", max_pos)
    return context_length, {**hf, key: context_length, params_key: params}


def _rope_scaling_type(hf: dict[str, Any]) -> str | None:
    """The rope scaling of a config.json ("linear", "llama3", "yarn", ...); None for a plain rope."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if isinstance(params.get("compress"), dict):  # DeepSeek-V4 (HF spelling) scales its compressed layers' rope
        params = params["compress"]
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in (None, "default"):
        return kind
    return "yarn" if float(hf.get("rope_factor", 1.0)) != 1.0 else None  # DeepSeek-V4's native spelling


def _check_server(server: ServerConfig) -> None:
    if server.max_request_bytes < 1024:
        raise ValueError(f"max_request_bytes must be >= 1024, got {server.max_request_bytes}")
    if server.max_queued_requests < 0:
        raise ValueError(f"max_queued_requests must be >= 0, got {server.max_queued_requests}")
    if not server.shutdown_timeout >= 0:  # also catches NaN
        raise ValueError(f"shutdown_timeout must be >= 0 seconds, got {server.shutdown_timeout}")
    if not server.request_read_timeout > 0:  # also catches NaN
        raise ValueError(f"request_read_timeout must be > 0 seconds, got {server.request_read_timeout}")
    if server.tokenizer_pool_size < 1:
        raise ValueError(f"tokenizer_pool_size must be >= 1, got {server.tokenizer_pool_size}")
    if server.responses_store_size < 0:
        raise ValueError(f"responses_store_size must be >= 0, got {server.responses_store_size}")
    if server.tool_call_parser is not None:
        from kestrel.server.tool_parsers import tool_parser

        tool_parser(server.tool_call_parser)  # an unknown name fails here, at start-up
    if server.reasoning_parser is not None:
        from kestrel.server.reasoning_parsers import reasoning_parser

        reasoning_parser(server.reasoning_parser)
    # harmony's tool calls and reasoning are one format: the tool parser reads what the reasoning parser
    # leaves, and without it the analysis channel would have nowhere to go.
    if server.tool_call_parser == "gpt-oss" and server.reasoning_parser != "gpt-oss":
        raise ValueError("--tool-call-parser gpt-oss needs --reasoning-parser gpt-oss: harmony's analysis channel "
                         "is the reasoning, which the tool calls are read after")
    if server.reasoning_parser == "gpt-oss" and server.tool_call_parser not in (None, "gpt-oss"):
        raise ValueError(f"--reasoning-parser gpt-oss reads harmony, whose tool calls only --tool-call-parser "
                         f"gpt-oss reads, not {server.tool_call_parser}")


def _check_library_floors(floors: dict[str, str]) -> None:
    from importlib.metadata import version

    def parts(v: str) -> tuple[int, ...]:
        return tuple(int(p) for p in v.split("+")[0].split(".")[:2] if p.isdigit())

    for package, floor in floors.items():
        have = version(package)
        if parts(have) < parts(floor):
            raise ValueError(f"the attention backend needs {package} >= {floor}, found {have}")


def _check_hf_config(model: str, hf: dict[str, Any]) -> None:
    """Check a Llama-family config's sizes now, so that an inconsistent one fails at start-up in one line
    naming the file (not deep in transformers or the model's construction)."""
    from kestrel.models.arch_config import check_sizes
    from kestrel.models.gguf import gguf_file
    from kestrel.models.registry import needs_dsv4_attention

    if needs_dsv4_attention(hf.get("architectures") or []):
        return  # its config is parsed (and checked) while resolving its KV page size
    try:
        check_sizes(hf)
    except ValueError as e:
        raise ValueError(f"{gguf_file(model) or Path(model) / 'config.json'}: {e}") from None

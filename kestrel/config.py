"""EngineConfig: every knob in frozen dataclasses, resolved once.

`EngineConfig.from_flat(**kwargs)` accepts the flat names users know from SGLang's flags
(`max_total_tokens=...`); `resolve()` makes every automatic choice (device, dtype, sizes) and
validates, returning a new object. Constructors receive the section they need, never a global.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kestrel import envs

logger = logging.getLogger(__name__)

DTYPES = ("auto", "float32", "float16", "bfloat16")
TRITON_DECODE_SPLITS = ("uniform", "length")


@dataclass(frozen=True)
class ModelConfig:
    model: str = "demo"  # a Hugging Face model folder, a GGUF file (or a folder of one), or a bundled model's name
    tokenizer: str | None = None  # defaults to the model folder
    dtype: str = "auto"
    load_format: str = "auto"
    context_length: int | None = None  # defaults to the checkpoint's max_position_embeddings
    # Linear weights in FP8 ("fp8": block-scaled e4m3, activations per token); unset: what the checkpoint
    # holds (an FP8 checkpoint loads as fp8). kestrel.quant.resolve checks it.
    quantization: str | None = None
    # config.json as read once by resolve(); everything after reads this copy.
    hf_config: dict[str, Any] | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class CacheConfig:
    page_size: int | None = None  # tokens per KV page; unset: the smallest the model's KV layout allows
    max_total_tokens: int | None = None  # KV pool size in tokens; on CUDA derived from memory if unset
    mem_fraction_static: float | None = None  # share of GPU memory for weights + KV pool
    disable_radix_cache: bool = False
    kv_cache_dtype: str = "auto"  # auto (the model dtype), fp8_e4m3 or fp8_e5m2 (kestrel.quant.kv)


@dataclass(frozen=True)
class SchedulerConfig:
    max_running_requests: int | None = None
    chunked_prefill_size: int | None = None  # new prefill tokens per step; -1 disables chunking
    enable_mixed_chunk: bool = False  # run prefill chunks and decodes in one MIXED batch
    random_seed: int | None = None  # seeds the draw of per-request seeds for requests without one
    # Overlap scheduling: schedule and launch step N+1 while step N runs on the device, so host work
    # hides behind the GPU. Outputs are the same either way; turn it off to debug.
    disable_overlap_schedule: bool = False
    # Admission keeps room for the running requests' future tokens, scaled by this (0 reserves nothing):
    # the exact peak for requests that must run to max_new_tokens (ignore_eos, no stop condition), and
    # (max_new_tokens - generated) x a ratio that starts at 0.7 and decays for the others.
    schedule_conservativeness: float = 1.0
    # Structured outputs: a request waits (unscheduled) while its grammar compiles off the engine loop;
    # past this many seconds it fails (a 400 from the server). Longer grammar texts are refused at once.
    grammar_compile_timeout: float = 30.0
    grammar_max_length: int = 200_000


@dataclass(frozen=True)
class AttentionConfig:
    """Inputs of `kestrel.attention.registry.attention_backends()`, the only reader of the three backend
    fields; the registry's Triton factory reads `triton_decode_split`."""

    attention_backend: str | None = None
    prefill_attention_backend: str | None = None
    decode_attention_backend: str | None = None
    # How the Triton decode kernel splits a batch's keys over programs: "uniform" (every request in the
    # same number of chunks, from the batch size) or "length" (chunks of equal size, each request cut by
    # its own length; kestrel.attention.triton.decode). Uniform until the H200 measurement
    # (scripts/bench_decode_mixed.py) says otherwise.
    triton_decode_split: str = "uniform"


@dataclass(frozen=True)
class SpeculativeConfig:
    """SGLang's speculative flags; `kestrel.speculative.resolve.resolve_speculative` fills and checks them."""

    speculative_algorithm: str | None = None  # EAGLE, EAGLE3, NEXTN, STANDALONE or NGRAM
    speculative_draft_model_path: str | None = None  # a folder or bundled name; NEXTN: the target's
    # Draft depth, branching and tree size sent to verify (root included): all three or none.
    speculative_num_steps: int | None = None
    speculative_eagle_topk: int | None = None
    speculative_num_draft_tokens: int | None = None
    # Above this many running requests the engine decodes without speculating. A verify carries
    # num_draft_tokens tokens per request, so it stops being a memory-bound step (where extra tokens
    # are nearly free) once batch x draft tokens reaches a few hundred: about 32 requests of 8 tokens
    # for an 8B model on an H200 (~200 FLOPs per weight byte). Unmeasured yet (issue 14 asks for the
    # H200 figure); set it higher to keep speculating, or 1 to speculate only for a lone request.
    speculative_disable_batch_size: int = 32
    speculative_draft_attention_backend: str | None = None
    speculative_attention_mode: str = "prefill"  # which half serves TARGET_VERIFY / DRAFT_EXTEND


@dataclass(frozen=True)
class CudaGraphConfig:
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int = 256  # decode batches up to this size replay a captured graph
    # EXTEND / MIXED forwards of up to piecewise_cuda_graph_max_tokens new tokens replay captured graphs
    # between their attention calls (kestrel.runner.piecewise_graph); off until measured on serving loads.
    enable_piecewise_cuda_graph: bool = False
    piecewise_cuda_graph_max_tokens: int = 2048


@dataclass(frozen=True)
class ParallelConfig:
    """SGLang's parallel flags; `kestrel.distributed.resolve.check_parallel` validates them."""

    tp_size: int = 1  # tensor-parallel ranks, one process (and GPU) each
    ep_size: int = 1  # ranks the routed experts of a MoE model are split over: 1 or tp_size
    nnodes: int = 1  # machines the tp_size ranks are spread over (tp_size / nnodes each)
    node_rank: int = 0  # this machine's place; node 0 runs rank 0 (the scheduler and the server)
    dist_init_addr: str | None = None  # host:port of rank 0's rendezvous; needed with nnodes > 1
    # Torch compute threads of the engine on a CPU device, shared among the tensor-parallel ranks;
    # unset: OMP_NUM_THREADS if set, else chosen from the usable cores (kestrel.engine.cpu_threads).
    cpu_threads: int | None = None


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    log_level: str = "info"
    # A larger body gets 413 before it is read. 4 MiB holds about a million tokens of English text, or
    # a batch of 500k token ids, and bounds what one request can make the HTTP process hold.
    max_request_bytes: int = 4 * 2**20
    # Engine requests (prompts x n) the server holds beyond --max-running-requests, from the moment
    # their body is parsed; past it a request gets 503 with Retry-After, so no queue grows unbounded.
    max_queued_requests: int = 1024
    # On SIGTERM, seconds running requests get to finish before they are aborted.
    shutdown_timeout: float = 30.0
    # Seconds a client has to send a request's headers (from connecting, or from the previous
    # response) and between two reads of its body; past them the connection is closed (408 mid-body).
    request_read_timeout: float = 30.0
    # Processes that tokenize (and apply chat templates to) long prompts off the event loop.
    tokenizer_pool_size: int = 2
    # The format of the model's tool calls (SGLang's names: llama3, qwen25, hermes); None: no tools.
    tool_call_parser: str | None = None


SECTIONS = {
    "model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig, "attention": AttentionConfig,
    "speculative": SpeculativeConfig, "cuda_graph": CudaGraphConfig, "parallel": ParallelConfig,
    "server": ServerConfig,
}
# vLLM's names of the same options (as flags too: --max-model-len), so vLLM users' settings carry over.
VLLM_NAMES = {"max_model_len": "context_length", "max_num_seqs": "max_running_requests",
              "max_num_batched_tokens": "chunked_prefill_size", "gpu_memory_utilization": "mem_fraction_static",
              "tensor_parallel_size": "tp_size"}
FLAT_ALIASES = {"model_path": "model", **VLLM_NAMES}


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    cuda_graph: CudaGraphConfig = field(default_factory=CudaGraphConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    device: str = "auto"
    resolved: bool = False

    @classmethod
    def flat_fields(cls) -> dict[str, str]:
        """Flat name → section name ("" for top-level fields)."""
        names = {f.name: sec for sec, klass in SECTIONS.items() for f in dataclasses.fields(klass)}
        names["device"] = ""
        return names

    @classmethod
    def from_flat(cls, **kwargs: Any) -> "EngineConfig":
        where = cls.flat_fields()
        per_section: dict[str, dict[str, Any]] = {sec: {} for sec in SECTIONS}
        top: dict[str, Any] = {}
        for key, value in kwargs.items():
            key = FLAT_ALIASES.get(key, key)
            if key not in where:
                raise TypeError(f"unknown engine option {key!r}; valid options: {', '.join(sorted(where))}")
            (top if where[key] == "" else per_section[where[key]])[key] = value
        sections = {sec: SECTIONS[sec](**vals) for sec, vals in per_section.items()}
        return cls(**sections, **top)

    def resolve(self) -> "EngineConfig":
        """Fill every automatic choice and validate; returns a new, resolved config."""
        if self.resolved:
            return self
        import torch

        from kestrel.assets import resolve_model_path
        from kestrel.attention.decisions import extend_prefix_reuse, library_requirements
        from kestrel.attention.registry import attention_backends
        from kestrel.distributed.resolve import check_parallel
        from kestrel.quant.resolve import resolve_quantization
        from kestrel.speculative.draft_backends import draft_backend_plan
        from kestrel.speculative.resolve import resolve_speculative

        if not self.model.model:
            raise ValueError("model is required: a Hugging Face model folder")
        model_path = resolve_model_path(self.model.model)
        hf = read_hf_config(model_path)
        check_hf_config(model_path, hf)
        device = self.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {device!r}")
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device={device!r} but CUDA is not available; use device='cpu'")
        on_gpu = device != "cpu"
        quantization = resolve_quantization(self.model.quantization, self.cache.kv_cache_dtype, hf, device)

        dtype = self.model.dtype
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
        if dtype == "auto":
            ckpt = str(hf.get("torch_dtype") or hf.get("dtype") or "float32")
            dtype = ("bfloat16" if ckpt == "float32" else ckpt) if on_gpu else "float32"
        context_length, hf = _resolve_context_length(self.model.context_length, hf)

        c = self.cache
        page_size = _resolve_page_size(c.page_size, hf)
        if c.max_total_tokens is not None and c.max_total_tokens < page_size:
            raise ValueError(f"max_total_tokens must be >= page_size ({page_size}), got {c.max_total_tokens}")
        mem_fraction = c.mem_fraction_static
        if mem_fraction is not None and not 0 < mem_fraction < 1:
            raise ValueError(f"mem_fraction_static must be in (0, 1), got {mem_fraction}")
        max_total_tokens = c.max_total_tokens
        if not on_gpu and max_total_tokens is None:
            max_total_tokens = 32768  # CPU: no memory probe, a fixed pool that fits any test model
        cache = dataclasses.replace(c, page_size=page_size, max_total_tokens=max_total_tokens,
                                    mem_fraction_static=mem_fraction if mem_fraction else 0.85)

        s = self.scheduler
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
        scheduler = dataclasses.replace(
            s, chunked_prefill_size=chunk, max_running_requests=s.max_running_requests or (1024 if on_gpu else 64))

        speculative = resolve_speculative(self.speculative, model_path, hf)
        if self.cuda_graph.cuda_graph_max_bs < 1:
            raise ValueError(f"cuda_graph_max_bs must be >= 1, got {self.cuda_graph.cuda_graph_max_bs}")
        if self.cuda_graph.piecewise_cuda_graph_max_tokens < 1:
            raise ValueError("piecewise_cuda_graph_max_tokens must be >= 1, got "
                             f"{self.cuda_graph.piecewise_cuda_graph_max_tokens}")
        _check_server(self.server)
        if self.attention.triton_decode_split not in TRITON_DECODE_SPLITS:
            raise ValueError(f"triton_decode_split must be one of {', '.join(TRITON_DECODE_SPLITS)}, "
                             f"got {self.attention.triton_decode_split!r}")
        check_parallel(self.parallel, hf, device, speculative, quantization)
        out = dataclasses.replace(
            self, device=device, cache=cache, scheduler=scheduler, speculative=speculative,
            model=dataclasses.replace(self.model, model=model_path, dtype=dtype, context_length=context_length,
                                      quantization=quantization, hf_config=hf,
                                      tokenizer=self.model.tokenizer and resolve_model_path(self.model.tokenizer)),
            resolved=True)
        attention_backends(out)  # unknown or unavailable backends fail here, at start-up
        draft_backend_plan(out)  # so do draft backends that cannot serve a draft mode
        _check_library_floors(library_requirements(out))
        if not extend_prefix_reuse(out):
            # The prefill backend cannot attend over a cached prefix: no radix reuse, no chunking.
            out = dataclasses.replace(
                out, cache=dataclasses.replace(out.cache, disable_radix_cache=True),
                scheduler=dataclasses.replace(out.scheduler, chunked_prefill_size=-1))
        return out


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
    if server.tool_call_parser is not None:
        from kestrel.server.tool_parsers import tool_parser

        tool_parser(server.tool_call_parser)  # an unknown name fails here, at start-up


def _check_library_floors(floors: dict[str, str]) -> None:
    from importlib.metadata import version

    def parts(v: str) -> tuple[int, ...]:
        return tuple(int(p) for p in v.split("+")[0].split(".")[:2] if p.isdigit())

    for package, floor in floors.items():
        have = version(package)
        if parts(have) < parts(floor):
            raise ValueError(f"the attention backend needs {package} >= {floor}, found {have}")


def read_hf_config(model: str) -> dict[str, Any]:
    """config.json of a Hugging Face folder, or its equivalent for a GGUF file (kestrel.models.gguf)."""
    from kestrel.models.gguf import gguf_file, read_gguf_config

    if (gguf := gguf_file(model)) is not None:
        return read_gguf_config(gguf)
    path = Path(model) / "config.json"
    if not path.is_file():
        raise ValueError(f"model {model!r} is not a Hugging Face model folder (nor a GGUF file): {path} not found")
    return read_json_config(path)


def read_json_config(path: Path) -> dict[str, Any]:
    """A config.json as a dict; ValueError naming the file when it is not a JSON object."""
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object, not a {type(config).__name__}")
    return config


def check_hf_config(model: str, hf: dict[str, Any]) -> None:
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

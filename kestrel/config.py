"""EngineConfig: every knob in frozen dataclasses, plain data.

Each user-facing field declares its help text and, where the set is closed, its choices (`option`); its
group in `kestrel --help` is its section. `kestrel.cli` builds the flags from these declarations, and
`EngineConfig.from_flat(**kwargs)` accepts the same flat names (SGLang's, `max_total_tokens=...`, and
vLLM's where they differ). Fields that resolution decides are `decided`: never flags.
`kestrel.config_resolve.resolve_config` makes every automatic choice and validates; this module imports
no subsystem, so every subsystem may import it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


def option(default: Any, help: str, *, choices: tuple[str, ...] = (), aliases: tuple[str, ...] = (),
           group: str = "") -> Any:
    """A field users set: a flag (`--page-size`) and a flat name of `from_flat`. `choices`: the closed set
    of values, shown in --help (the subsystem that reads the field refuses others); `aliases`: other
    projects' names for it, accepted as flags and flat names too; `group`: its section in --help, when
    that is not the section the field lives in."""
    return field(default=default, metadata={"help": help, "choices": choices, "aliases": aliases, "group": group})


def decided() -> Any:
    """A field resolution fills in, read by everything after it; never a flag nor a flat name."""
    return field(default=None, compare=False, repr=False, metadata={"decided": True})


def is_option(f: dataclasses.Field) -> bool:
    return "help" in f.metadata


def cli_flag(name: str) -> str:
    """The command-line flag of the option `name` (kestrel serve --max-running-requests)."""
    return "--" + name.replace("_", "-")


@dataclass(frozen=True)
class BackendPair:
    """Canonical registry names of the attention backends of the two halves; never None."""

    prefill: str
    decode: str


@dataclass(frozen=True)
class ModelConfig:
    """what to load, in which precision, and on which device"""

    model: str = option("demo", "a Hugging Face model folder, a GGUF file (or a folder holding one), or a bundled "
                                "model: demo (default), demo-draft", aliases=("model_path",))
    tokenizer: str | None = option(None, "the tokenizer's folder (or GGUF file, or bundled name), when it is not "
                                         "the model's")
    dtype: str = option("auto", "the model's dtype; auto: the checkpoint's on GPU (bfloat16 for a float32 one), "
                                "float32 on CPU", choices=("auto", "float32", "float16", "bfloat16"))
    load_format: str = option("auto", "auto: read the checkpoint's weights; dummy: random weights from config.json "
                                      "alone (benchmarks of a config-only folder)", choices=("auto", "dummy"))
    context_length: int | None = option(None, "longest prompt + output in tokens (default: the model's "
                                              "max_position_embeddings)", aliases=("max_model_len",))
    quantization: str | None = option(None, "fp8: linear weights in FP8 (block-scaled e4m3, activations per token; "
                                            "a float checkpoint is quantized at load); awq / gptq: 4-bit weights, from such "
                                            "a checkpoint only. Default: what the checkpoint holds",
                                        choices=("fp8", "awq", "gptq"))
    # config.json as read once by resolution; everything after reads this copy.
    hf_config: dict[str, Any] | None = decided()


@dataclass(frozen=True)
class CacheConfig:
    """the KV cache: its pool, pages and prefix reuse"""

    page_size: int | None = option(None, "tokens per KV page (default: 1, or 128 for DeepSeek-V4, whose compressed "
                                         "KV blocks must not straddle two pages)")
    max_total_tokens: int | None = option(None, "KV pool size in tokens (default: from GPU memory; 32768 on CPU)")
    mem_fraction_static: float | None = option(None, "share of GPU memory for the weights and the KV pool "
                                                     "(default 0.85)", aliases=("gpu_memory_utilization",))
    disable_radix_cache: bool = option(False, "do not reuse the KV of prompt prefixes across requests")
    disable_window_rings: bool = option(False, "keep full-context K/V in sliding-window layers (gpt-oss), masked "
                                               "past the window, instead of a per-request ring: about twice the KV "
                                               "bytes per token, but prompt prefixes are reused (rings turn radix "
                                               "reuse off)")
    kv_cache_dtype: str = option("auto", "auto (the model dtype), fp8_e4m3 or fp8_e5m2: the KV cache in FP8, half "
                                         "the bytes of bf16 (DeepSeek-V4: fp8_e4m3 only, its packed 584-byte "
                                         "entries, docs/design/deepseek-v4.md §6)", choices=("auto", "fp8_e4m3", "fp8_e5m2"))
    kv_events_config: str | None = option(None, "vLLM's JSON for publishing KV-cache events over ZeroMQ, e.g. "
                                                "'{\"enable_kv_cache_events\": true, \"endpoint\": \"tcp://*:5557\", "
                                                "\"replay_endpoint\": \"tcp://*:5558\"}' (docs/kv-events.md; default: "
                                                "no events)")
    # kv_events_config as parsed and checked by resolution (a kestrel.cache.kv_events_config.KVEventsConfig).
    kv_events: Any = decided()


@dataclass(frozen=True)
class SchedulerConfig:
    """which requests run each step, and how much of each"""

    max_running_requests: int | None = option(None, "most requests decoding at once (default: 1024 on GPU, 64 on "
                                                    "CPU)", aliases=("max_num_seqs",))
    chunked_prefill_size: int | None = option(None, "prefill tokens per step; -1 disables chunking (vLLM's "
                                                    "--max-num-batched-tokens counts a step's decode tokens too; "
                                                    "here they come on top)", aliases=("max_num_batched_tokens",))
    enable_mixed_chunk: bool = option(False, "run prefill chunks and decodes in one MIXED batch")
    # Latency targets (docs/scheduling.md): prefill chunks are sized from a step-cost model the engine
    # fits from its own steps, so that running decodes keep their pace while prompts wait.
    itl_target_ms: float | None = option(None, "inter-token latency the running requests should see while "
                                               "prompts are prefilled: each step's prefill is sized to keep them "
                                               "within it (default: none, prefill steps take --chunked-prefill-size)")
    ttft_target_ms: float | None = option(None, "time to first token the goodput counters check; waiting 4 "
                                                "targets raises a request one priority level, ahead of shorter "
                                                "prompts (default: none; waiting ages as if it were 2000)")
    step_cost_profile_steps: int | None = option(None, "synthetic steps timed at start-up to seed the step-cost "
                                                       "model; 0 skips it (the model then learns from the first "
                                                       "steps served) (default: 12 on GPU with --itl-target-ms, else 0)")
    random_seed: int | None = option(None, "seeds the draw of per-request seeds for requests without one")
    # Overlap scheduling: schedule and launch step N+1 while step N runs on the device, so host work
    # hides behind the GPU.
    disable_overlap_schedule: bool = option(False, "schedule each step only after the previous one finished on "
                                                   "the device (outputs are the same; for debugging)")
    # Admission reserves the exact peak for requests that must run to max_new_tokens (ignore_eos, no stop
    # condition), and (max_new_tokens - generated) x a ratio that starts at 0.7 and decays for the others.
    schedule_conservativeness: float = option(1.0, "scale of the KV room admission keeps for running requests' "
                                                   "future tokens; 0 reserves nothing (default 1)")
    # A request waits (unscheduled) while its grammar compiles off the engine loop.
    grammar_compile_timeout: float = option(30.0, "seconds a structured-output request waits for its grammar to "
                                                  "compile (off the engine loop) before it fails with a 400 "
                                                  "(default: 30)")
    grammar_max_length: int = option(200_000, "longest grammar text (JSON schema, regex, EBNF, structural tag) "
                                              "compiled, in characters; a longer one is a 400 (default: 200000)")


@dataclass(frozen=True)
class AttentionConfig:
    """the attention backends of the two halves: torch_native, triton, sdpa or dsv4 (`kestrel explain` prints
    the plan)

    The three backend fields are inputs of `kestrel.attention.registry.resolve_sources`, their only
    reader; resolution stores its answer in `backends`, which everything after reads."""

    attention_backend: str | None = option(None, "attention backend of both halves, prefill and decode "
                                                 "(default: dsv4 for DeepSeek-V4, else triton on CUDA, torch_native "
                                                 "on CPU)")
    prefill_attention_backend: str | None = option(None, "attention backend of the prefill half (EXTEND and MIXED "
                                                         "steps); overrides --attention-backend")
    decode_attention_backend: str | None = option(None, "attention backend of the decode half (DECODE steps); "
                                                        "overrides --attention-backend")
    # Uniform until the H200 measurement (scripts/bench_decode_mixed.py) says otherwise.
    triton_decode_split: str = option("uniform", "how the Triton decode kernel splits keys over programs: uniform "
                                                 "(every request in as many chunks, from the batch size) or length "
                                                 "(chunks of equal size, each request cut by its own length; "
                                                 "docs/benchmarks.md)", choices=("uniform", "length"))
    backends: BackendPair | None = decided()


@dataclass(frozen=True)
class SpeculativeConfig:
    """speculative decoding, with SGLang's flags

    `kestrel.speculative.resolve.resolve_speculative` fills and checks them."""

    speculative_algorithm: str | None = option(None, "the way drafts are made, as SGLang spells it (default: no "
                                                     "speculative decoding)",
                                               choices=("EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM"))
    speculative_draft_model_path: str | None = option(None, "the draft: an EAGLE/EAGLE-3 head or a small LM "
                                                            "folder, or a bundled name (demo-eagle, demo-draft); "
                                                            "NEXTN defaults to the target")
    speculative_num_steps: int | None = option(None, "draft depth (set all three of steps/topk/draft tokens, or "
                                                     "none for SGLang's choice)")
    speculative_eagle_topk: int | None = option(None, "branching of the draft tree (1: a chain); NGRAM: the largest "
                                                      "branching")
    speculative_num_draft_tokens: int | None = option(None, "tree nodes sent to verify, the root included")
    # A verify carries num_draft_tokens tokens per request, so it stops being a memory-bound step (where
    # extra tokens are nearly free) once batch x draft tokens reaches a few hundred: about 32 requests of
    # 8 tokens for an 8B model on an H200 (~200 FLOPs per weight byte). Unmeasured yet.
    speculative_disable_batch_size: int = option(32, "stop speculating above this many running requests "
                                                     "(default 32; 1: speculate only for a lone request)")
    speculative_draft_attention_backend: str | None = option(None, "one attention backend for every phase of the "
                                                                   "draft model (default: the target's halves)")
    speculative_attention_mode: str = option("prefill", "which half serves TARGET_VERIFY and DRAFT_EXTEND",
                                             choices=("prefill", "decode"))


@dataclass(frozen=True)
class CudaGraphConfig:
    """decode steps (and optionally prefill steps) replayed from captured CUDA graphs (docs/cuda-graphs.md)"""

    disable_cuda_graph: bool = option(False, "run every step eagerly, capturing no CUDA graph")
    cuda_graph_max_bs: int = option(256, "decode batches up to this size replay a captured graph (default 256)")
    # Off until measured on serving loads.
    enable_piecewise_cuda_graph: bool = option(False, "replay CUDA graphs between the attention calls of prefill "
                                                      "(EXTEND) and MIXED steps of Llama-family models on CUDA")
    piecewise_cuda_graph_max_tokens: int = option(2048, "largest step, in new tokens, that piecewise CUDA graphs "
                                                        "serve (default 2048); larger steps run eagerly")


@dataclass(frozen=True)
class ParallelConfig:
    """tensor, expert and data parallelism over GPUs and machines (docs/parallelism.md, docs/deployment.md)

    `kestrel.distributed.resolve.check_parallel` validates them."""

    tp_size: int = option(1, "tensor-parallel ranks: one process (and GPU) each, the model's heads, MLP and "
                             "vocabulary split over them", aliases=("tensor_parallel_size",))
    ep_size: int = option(1, "ranks the routed experts of a MoE model are split over: 1 or --tp-size")
    dp_size: int = option(1, "data-parallel replicas: `kestrel serve` starts this many servers (each its own engine, "
                             "--tp-size GPUs each, on ports --port+1..) behind the SGLang model gateway on --port, "
                             "with its cache-aware policy (docs/deployment.md; needs kestrel[gateway])",
                          aliases=("data_parallel_size",))
    nnodes: int = option(1, "machines the --tp-size ranks are spread over (default 1)")
    node_rank: int = option(0, "this machine's place among --nnodes; node 0 serves HTTP, the others run their "
                               "ranks only")
    dist_init_addr: str | None = option(None, "host:port of node 0's rendezvous, reachable from every node "
                                              "(needed with --nnodes > 1)")
    cpu_threads: int | None = option(None, "torch compute threads of the engine on a CPU device, shared among "
                                           "the tensor-parallel ranks (default: OMP_NUM_THREADS if set, else all "
                                           "usable cores up to 3, one fewer up to 8, two fewer above; docs/cpu.md)")


@dataclass(frozen=True)
class ServerConfig:
    """the HTTP server"""

    host: str = option("127.0.0.1", "address to listen on (default 127.0.0.1; 0.0.0.0 for every interface)")
    port: int = option(30000, "port to listen on (default 30000; 0 picks a free one)")
    api_key: str | None = option(None, "the key clients must send as `Authorization: Bearer KEY` (default: none "
                                       "needed)")
    log_level: str = option("info", "debug, info, warning or error (default info)")
    # 4 MiB holds about a million tokens of English text, or a batch of 500k token ids, and bounds what
    # one request can make the HTTP process hold.
    max_request_bytes: int = option(4 * 2**20, "largest request body in bytes; larger ones get 413 (default: "
                                               "4 MiB)")
    # Counted from the moment a request's body is parsed, so no queue grows unbounded.
    max_queued_requests: int = option(1024, "engine requests (prompts x n) held beyond --max-running-requests; "
                                            "past it, 503 with Retry-After (default: 1024)")
    shutdown_timeout: float = option(30.0, "seconds running requests get to finish after SIGTERM before they are "
                                           "aborted (default: 30)")
    request_read_timeout: float = option(30.0, "seconds a client has to send a request's headers, and between two "
                                               "reads of its body; past them the connection is closed, 408 "
                                               "mid-body (default: 30)")
    tokenizer_pool_size: int = option(2, "processes tokenizing (and applying chat templates to) long prompts off "
                                         "the event loop (default: 2)")
    tool_call_parser: str | None = option(None, "the format of the model's tool calls, to parse them and force them "
                                                "(tool_choice), as SGLang names them (the bundled demo's is "
                                                "hermes); default: no tool calls",
                                          choices=("llama3", "qwen25", "hermes", "gpt-oss"))
    responses_store_size: int = option(1000, "responses the Responses API keeps in memory for previous_response_id "
                                             "and GET /v1/responses/{id}, the least recently used dropped "
                                             "first; 0 keeps none (default: 1000)")
    # A step is short (chunked prefill bounds it; CUDA graphs were captured before readiness, which the
    # clock starts from), but the first steps of a new shape may compile Triton kernels for tens of
    # seconds; a minute separates those from a hang.
    health_stall_timeout: float = option(60.0, "seconds the engine may hold requests without its loop advancing "
                                               "before /health answers 503 (a hung engine whose process lives); "
                                               "0 turns the check off (default: 60)")
    reasoning_parser: str | None = option(None, "the format of the model's reasoning, returned as reasoning_content "
                                                "of chat answers apart from the content (docs/reasoning.md); "
                                                "gpt-oss with --tool-call-parser gpt-oss; default: none (the "
                                                "reasoning is content)", choices=("deepseek-r1", "qwen3", "gpt-oss"))
    score_template: str | None = option(None, "the prompt /v1/rerank and /v1/score give a decoder reranker, with "
                                              "{query} and {document} (the text, or a file holding it); default: "
                                              "Qwen3-Reranker's (docs/apis.md)")
    score_tokens: str = option("yes,no", "the reranker's two answer tokens: the score is the first's probability "
                                         "against the second's at the prompt's end (default: yes,no)")


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters served over the base model, picked per request (docs/lora.md)"""

    enable_lora: bool = option(False, "serve LoRA adapters: those of --lora-paths, and any loaded later through "
                                      "POST /v1/load_lora_adapter")
    lora_paths: tuple[str, ...] | None = option(None, "adapters loaded at start-up, each NAME=PATH (a PEFT folder: "
                                                      "adapter_config.json + adapter_model.safetensors) or a PATH "
                                                      "named by its folder")
    max_loras_per_batch: int = option(8, "distinct adapters one batch may mix: the GPU pool's slots; a request "
                                         "whose adapter finds no free slot waits (default 8)")
    max_loaded_loras: int | None = option(None, "adapters held in host memory at once, loading past it is refused "
                                                "(default: no limit)")
    max_lora_rank: int | None = option(None, "largest adapter rank the pool holds (default: the largest of 16 "
                                             "and the ranks of --lora-paths)")
    lora_target_modules: tuple[str, ...] | None = option(None, "projections adapters may target, of q_proj k_proj "
                                                               "v_proj o_proj gate_proj up_proj down_proj (default: "
                                                               "all of them)")


SECTIONS = {
    "model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig, "attention": AttentionConfig,
    "speculative": SpeculativeConfig, "cuda_graph": CudaGraphConfig, "parallel": ParallelConfig,
    "server": ServerConfig, "lora": LoRAConfig,
}


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
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    device: str = option("auto", "auto (cuda when a GPU is present), cpu, cuda or cuda:N", group="model")
    resolved: bool = field(default=False, metadata={"decided": True})

    @classmethod
    def options(cls) -> dict[str, tuple[str, dataclasses.Field]]:
        """Every field users set, by flat name: (its section, "" for a top-level field; the field)."""
        found = {f.name: (sec, f) for sec, klass in SECTIONS.items() for f in dataclasses.fields(klass)
                 if is_option(f)}
        found.update((f.name, ("", f)) for f in dataclasses.fields(cls) if is_option(f))
        return found

    @classmethod
    def flat_fields(cls) -> dict[str, str]:
        """Flat name → section name ("" for top-level fields), of the fields users set."""
        return {name: sec for name, (sec, _) in cls.options().items()}

    @classmethod
    def aliases(cls) -> dict[str, str]:
        """Other projects' names (vLLM's max_model_len, SGLang's model_path) → ours."""
        return {alias: name for name, (_, f) in cls.options().items() for alias in f.metadata["aliases"]}

    @classmethod
    def from_flat(cls, **kwargs: Any) -> "EngineConfig":
        where, aliases = cls.flat_fields(), cls.aliases()
        per_section: dict[str, dict[str, Any]] = {sec: {} for sec in SECTIONS}
        top: dict[str, Any] = {}
        for key, value in kwargs.items():
            key = aliases.get(key, key)
            if key not in where:
                raise TypeError(f"unknown engine option {key!r}; valid options: {', '.join(sorted(where))}")
            (top if where[key] == "" else per_section[where[key]])[key] = value
        sections = {sec: SECTIONS[sec](**vals) for sec, vals in per_section.items()}
        return cls(**sections, **top)

"""Attention backend registry and the resolver of the three attention fields.

`resolve_sources()` is the only code that reads `AttentionConfig.attention_backend` (the base). Config
resolution calls `attention_backends()` once and keeps its pair in `AttentionConfig.backends`: everything
after reads the resolved half it needs from there (see `decisions.py`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from kestrel import envs
from kestrel.config import BackendPair

if TYPE_CHECKING:
    from kestrel.cache.kv_memory import KVPools
    from kestrel.cache.req_to_token import ReqToTokenPool
    from kestrel.config import EngineConfig

ALIASES: dict[str, str] = {}

# The automatic prefill half on CUDA. "sdpa" prefills one 8k-token prompt 1.24x faster on the H200, but
# with it as the default a serving run of short prompts (which never take its fast path) gave 4.6 % less
# throughput than Triton on the same machine, for reasons not found yet (docs/benchmarks.md): so Triton,
# and `--prefill-attention-backend sdpa` for long-prompt workloads.
CUDA_AUTO_PREFILL_BACKEND = "triton"


@dataclass(frozen=True)
class BackendEntry:
    """A registered backend.

    `factory(pools, req_to_token, config)` returns (effective name, backend): the name of what it
    really built, which is also the backend's stamp. `unavailable(config)` returns why the backend
    cannot run for this device/model, or None. The capability flags feed `decisions.py`.
    """

    factory: Callable[["KVPools", "ReqToTokenPool", "EngineConfig"], tuple[str, object]]
    unavailable: Callable[["EngineConfig"], str | None]
    extend_prefix: bool = True  # extend can start after a cached prefix (radix reuse, chunked prefill)
    triton_kernels: bool = False  # runs Triton kernels, so shared Triton kernels may run beside it
    library: tuple[str, str] | None = None  # (package, minimum version) the backend needs
    cuda_graph: bool = False  # its decode path can be captured (no host reads of per-batch values)
    # Its speculative forwards (verify, draft extend, the draft's decode lanes) can be captured too.
    cuda_graph_spec: bool = True
    # As the prefill half it may run eagerly between piecewise CUDA graphs (kestrel.runner.piecewise_graph):
    # it reads q/k/v of the real tokens from the graphs' static buffers, and the metadata it builds for
    # the batch stays valid across the segments. Only the backend measured that way says so.
    piecewise_cuda_graph: bool = False
    serves: frozenset[str] = field(default_factory=lambda: frozenset({"prefill", "decode"}))
    # The models' attention kinds it serves (`ATTENTION_KINDS`); a model runs only on a backend that
    # serves its kind. A backend serving several builds the form its KV pools call for (the factory
    # reads `pools.layout`), under one stamp.
    attention_kinds: frozenset[str] = frozenset({"mha"})
    # Serves layers with attention sinks (a per-head logit in the softmax denominator: gpt-oss) and
    # per-layer sliding windows; a model with sinks runs only on such a backend.
    attention_sinks: bool = False
    # What it can serve for a draft model (kestrel.speculative.draft_backends): "decode", the multi-step draft
    # decode (each step's lanes attend to the prefix and their own earlier draft tokens), and "extend".
    draft_modes: frozenset[str] = field(default_factory=lambda: frozenset({"decode", "extend"}))


REGISTRY: dict[str, BackendEntry] = {}

# A model's attention, by what its layers hand the backend and what its KV pools hold:
ATTENTION_KINDS = {
    "mha": "per-head K/V (multi-head, grouped-query and multi-query attention)",
    "mla": "Multi-head Latent Attention (one compressed latent per token, DeepSeek-V3)",
    "dsv4": "DeepSeek-V4's window + compressed sparse attention",
}
MHA_AND_MLA = frozenset({"mha", "mla"})


def register(name: str, **entry_fields):
    def wrap(factory):
        REGISTRY[name] = BackendEntry(factory, **entry_fields)
        return factory
    return wrap


# ---- backends ------------------------------------------------------------------------------------
@register("torch_native", unavailable=lambda config: None, attention_sinks=True, attention_kinds=MHA_AND_MLA)
def _torch_native(pools, req_to_token, config):
    if pools.layout.latent:
        from kestrel.attention.mla.torch_native import TorchNativeMLABackend

        return "torch_native", TorchNativeMLABackend(pools, req_to_token, name="torch_native")
    from kestrel.attention.torch_native import TorchNativeBackend

    return "torch_native", TorchNativeBackend(pools, req_to_token, name="torch_native")


def _triton_unavailable(config: "EngineConfig") -> str | None:
    try:
        import triton  # noqa: F401
    except ImportError:
        return "the triton package is not installed (pip install 'kestrel[triton]')"
    if config.device == "cpu" and not envs.triton_interpret():
        return "triton kernels need a CUDA device (or TRITON_INTERPRET=1 for the slow CPU interpreter)"
    return None


@register("triton", unavailable=_triton_unavailable, triton_kernels=True, library=("triton", "3.1"), cuda_graph=True,
          piecewise_cuda_graph=True, attention_sinks=True)
def _triton(pools, req_to_token, config):
    from kestrel.attention.triton.decode import LengthAwareSplit
    from kestrel.attention.triton_backend import TritonBackend

    cpu = config.device == "cpu"
    split = None
    if config.attention.triton_decode_split == "length":
        # The interpreter's test sequences are a few dozen tokens: chunks of 8 keys give them several.
        split = LengthAwareSplit(min_chunk=8) if cpu else LengthAwareSplit()
    return "triton", TritonBackend(pools, req_to_token, upcast=cpu, name="triton", decode_split=split)


def _sdpa_unavailable(config: "EngineConfig") -> str | None:
    return _triton_unavailable(config) if config.device != "cpu" else None  # on CUDA its fallback is Triton


# On CUDA the fallback is the Triton backend, so the flags are Triton's: the shared Triton kernels run
# beside it, and what a CUDA graph captures (decode batches, verify trees, draft extends) never takes the
# SDPA path (`sdpa.takes_fast_path`). Off CUDA the fallback is torch_native and neither flag is read.
# Layers with sinks go to the fallback, which serves them.
@register("sdpa", unavailable=_sdpa_unavailable, triton_kernels=True, cuda_graph=True, attention_sinks=True)
def _sdpa(pools, req_to_token, config):
    from kestrel.attention.sdpa import SdpaBackend

    on_cuda = config.device != "cpu"
    _, fallback = REGISTRY["triton" if on_cuda else "torch_native"].factory(pools, req_to_token, config)
    return "sdpa", SdpaBackend(pools, req_to_token, fallback, on_cuda=on_cuda, name="sdpa")


# Chunked prefill works (a step resumes from the per-request state); radix reuse does not, which the
# model's KV layout says (`prefix_cache_unsupported`). CUDA graphs: DECODE steps only (a plan with static
# sizes, `StepPlan.decode`); every other mode builds its plan from the host lengths and runs eagerly.
@register("dsv4", unavailable=lambda config: None, attention_kinds=frozenset({"dsv4"}), cuda_graph=True,
          cuda_graph_spec=False)
def _dsv4(pools, req_to_token, config):
    from kestrel.attention.dsv4 import DSV4Backend

    return "dsv4", DSV4Backend(pools, req_to_token, name="dsv4")


# ---- resolution ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class HalfSource:
    """Where a half's name came from, for `kestrel explain`."""

    name: str
    field: str  # the config field that supplied it, or "default"
    given: str | None  # the name as written, before alias mapping


def canonical(name: str) -> str:
    """Map an alias to its canonical name; raise ValueError listing the valid names if unknown."""
    name = ALIASES.get(name, name)
    if name not in REGISTRY:
        valid = sorted(REGISTRY) + sorted(ALIASES)
        raise ValueError(f"unknown attention backend {name!r}; valid choices: {', '.join(valid)}")
    return name


def _model_needs_sinks(config: "EngineConfig") -> bool:
    from kestrel.models.registry import needs_attention_sinks

    return needs_attention_sinks(config.model.hf_config.get("architectures") or [])


def model_attention_kind(config: "EngineConfig") -> str:
    """The target's `ATTENTION_KINDS` entry, from the config.json that resolution read (`config` is
    resolved, or being resolved)."""
    from kestrel.models.registry import attention_kind

    return attention_kind(config.model.hf_config.get("architectures") or [])


def draft_attention_kind(config: "EngineConfig") -> str:
    """The draft model's kind: a NEXTN draft is the target's own MTP layer, so the target's; an EAGLE
    head is Llama-shaped; a STANDALONE draft is whatever its own config.json says."""
    algorithm = config.speculative.speculative_algorithm
    if algorithm == "NEXTN":
        return model_attention_kind(config)
    if algorithm == "STANDALONE":
        from kestrel.hf_config import read_hf_config
        from kestrel.models.registry import attention_kind

        draft_hf = read_hf_config(config.speculative.speculative_draft_model_path)
        return attention_kind(draft_hf.get("architectures") or [])
    return "mha"


def default_backend(config: "EngineConfig", phase: str) -> str:
    """dsv4 for DeepSeek-V4; else on CUDA with Triton installed, Triton where it serves the model's
    attention kind (the prefill half: `CUDA_AUTO_PREFILL_BACKEND`); the portable reference everywhere else."""
    kind = model_attention_kind(config)
    if kind == "dsv4":
        return "dsv4"
    if config.device != "cpu" and REGISTRY["triton"].unavailable(config) is None:
        name = CUDA_AUTO_PREFILL_BACKEND if phase == "prefill" else "triton"
        if kind in REGISTRY[name].attention_kinds:
            return name
    return "torch_native"


def resolve_sources(config: "EngineConfig") -> tuple[HalfSource, HalfSource]:
    """Each half = its own field, else the base, else the default for this device and model. Each
    half's backend must serve the model's attention kind (`ATTENTION_KINDS`)."""
    a = config.attention
    kind = model_attention_kind(config)
    halves = []
    for phase, own_field in (("prefill", "prefill_attention_backend"), ("decode", "decode_attention_backend")):
        own = getattr(a, own_field)
        if own is not None:
            given, source = own, own_field
        elif a.attention_backend is not None:
            given, source = a.attention_backend, "attention_backend"
        else:
            given, source = None, "default"
        name = canonical(given) if given is not None else default_backend(config, phase)
        entry = REGISTRY[name]
        reason = entry.unavailable(config)
        if reason is not None:
            raise ValueError(f"attention backend {name!r} (from {source}) cannot run here: {reason}")
        if phase not in entry.serves:
            raise ValueError(f"attention backend {name!r} (from {source}) cannot serve {phase}")
        _check_model_fit(name, source, kind, _model_needs_sinks(config))
        halves.append(HalfSource(name, source, given))
    return halves[0], halves[1]


def _check_model_fit(name: str, source: str, kind: str, sinks_model: bool) -> None:
    """Each half's backend must serve the model's attention kind (DeepSeek-V4's sparse attention on a
    V4 backend only, MLA on an MLA-capable one, per-head K/V on one that serves it), and a model with
    attention sinks and per-layer windows (gpt-oss) must run on a backend that serves them."""
    entry = REGISTRY[name]
    if kind not in entry.attention_kinds:
        fitting = ", ".join(sorted(n for n, e in REGISTRY.items() if kind in e.attention_kinds))
        served = "; ".join(ATTENTION_KINDS[k] for k in sorted(entry.attention_kinds))
        raise ValueError(f"attention backend {name!r} (from {source}) cannot serve this model's attention, "
                         f"{ATTENTION_KINDS[kind]}: it serves {served}; use one of: {fitting}")
    if sinks_model and not entry.attention_sinks:
        fitting = ", ".join(sorted(n for n, e in REGISTRY.items() if e.attention_sinks and kind in e.attention_kinds))
        raise ValueError(f"attention backend {name!r} (from {source}) cannot serve attention sinks, which this "
                         f"model's layers have; use one of: {fitting}")


def attention_backends(config: "EngineConfig") -> BackendPair:
    """Decide the pair (config resolution's call; everything after reads `config.attention.backends`)."""
    prefill, decode = resolve_sources(config)
    return BackendPair(prefill=prefill.name, decode=decode.name)


def draft_attention_backends(config: "EngineConfig") -> BackendPair:
    """The draft model's pair: its override for both halves if set, else the target's resolved pair."""
    override = config.speculative.speculative_draft_attention_backend
    if override is None:
        return config.attention.backends
    name = canonical(override)
    reason = REGISTRY[name].unavailable(config)
    if reason is not None:
        raise ValueError(f"draft attention backend {name!r} cannot run here: {reason}")
    _check_model_fit(name, "speculative_draft_attention_backend", draft_attention_kind(config),
                     _model_needs_sinks(config))
    return BackendPair(prefill=name, decode=name)


def create_backend(name: str, pools: "KVPools", req_to_token: "ReqToTokenPool", config: "EngineConfig"):
    effective, backend = REGISTRY[canonical(name)].factory(pools, req_to_token, config)
    assert backend.name == effective, f"factory for {name!r} stamped {backend.name!r} but reported {effective!r}"
    return backend

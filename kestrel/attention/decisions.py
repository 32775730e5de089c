"""Every decision in kestrel that depends on the attention backend, each reading the half it needs.

Each reads the pair that config resolution decided (`config.attention.backends`, so `config` is
resolved); nothing here (or anywhere but the resolver) reads the base `attention_backend` field: a
launch may set only `--prefill-attention-backend` or only `--decode-attention-backend`, and the base is
then unset. `DECISIONS` is the table `kestrel explain` prints and the tests pin.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from kestrel.attention.hybrid import serving_half
from kestrel.attention.registry import REGISTRY
from kestrel.core.forward_mode import ForwardMode

if TYPE_CHECKING:
    from kestrel.config import EngineConfig


def extend_prefix_reuse(config: "EngineConfig") -> bool:
    """Radix prefix reuse and chunked prefill need an extend kernel that attends over a cached
    prefix: a prefill-phase feature, so the prefill half decides."""
    return REGISTRY[config.attention.backends.prefill].extend_prefix


def shared_triton_kernel(config: "EngineConfig") -> bool:
    """A Triton kernel that runs in both phases (the rope kernel) is used only when *both* halves are
    Triton-capable. Each half is looked up by its resolved name, never by a possibly-None field, so
    an unset field can never answer "supported"."""
    pair = config.attention.backends
    return REGISTRY[pair.prefill].triton_kernels and REGISTRY[pair.decode].triton_kernels


def library_requirements(config: "EngineConfig") -> dict[str, str]:
    """Version floors of the libraries any half names (package → minimum version)."""
    pair = config.attention.backends
    return {lib: floor for name in {pair.prefill, pair.decode}
            if (lib_floor := REGISTRY[name].library) for lib, floor in [lib_floor]}


def cuda_graph_backends(config: "EngineConfig") -> list[str]:
    """CUDA graphs capture the decode half, plus the prefill half when it serves TARGET_VERIFY
    (speculative decoding with speculative_attention_mode=prefill)."""
    pair = config.attention.backends
    names = [pair.decode]
    verify_half = serving_half(ForwardMode.TARGET_VERIFY, config.speculative.speculative_attention_mode)
    if config.speculative.speculative_algorithm is not None and verify_half == "prefill":
        names.append(pair.prefill)
    return list(dict.fromkeys(names))


def piecewise_graph_prefill(config: "EngineConfig") -> bool:
    """Piecewise CUDA graphs serve EXTEND and MIXED forwards, which the prefill half attends: it must be
    one that runs between the captured segments (the registry's `piecewise_cuda_graph`)."""
    return REGISTRY[config.attention.backends.prefill].piecewise_cuda_graph


@dataclass(frozen=True)
class Decision:
    name: str
    reads: str  # which half it reads
    used_by: str
    fn: Callable[["EngineConfig"], Any]


DECISIONS = [
    Decision("extend_prefix_reuse", "prefill", "resolve_config: radix cache + chunked prefill", extend_prefix_reuse),
    Decision("shared_triton_kernel", "both", "ModelRunner: Triton rope kernel or torch rope", shared_triton_kernel),
    Decision("library_requirements", "any", "resolve_config: version floor guard", library_requirements),
    Decision("cuda_graph_backends", "decode (+prefill when it serves verify)", "CUDA-graph capture set",
             cuda_graph_backends),
    Decision("piecewise_graph_prefill", "prefill", "ModelRunner: piecewise CUDA graphs for EXTEND / MIXED",
             piecewise_graph_prefill),
]

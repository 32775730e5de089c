"""Attention backend registry and the resolver of the three attention fields.

`attention_backends()` is the only code that reads `AttentionConfig.attention_backend` (the base):
everything else asks for the resolved half it needs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from kestrel.cache.kv_pool import KVPool
    from kestrel.cache.req_to_token import ReqToTokenPool
    from kestrel.config import EngineConfig

ALIASES = {"sdpa": "torch_native"}


@dataclass(frozen=True)
class BackendEntry:
    """`factory(kv_pool, req_to_token)` returns (effective name, backend); `unavailable(config)` a reason or None."""

    factory: Callable[["KVPool", "ReqToTokenPool"], tuple[str, object]]
    unavailable: Callable[["EngineConfig"], str | None]


REGISTRY: dict[str, BackendEntry] = {}


def register(name: str, unavailable: Callable[["EngineConfig"], str | None] = lambda config: None):
    def wrap(factory):
        REGISTRY[name] = BackendEntry(factory, unavailable)
        return factory
    return wrap


@register("torch_native")
def _torch_native(kv_pool, req_to_token):
    from kestrel.attention.torch_native import TorchNativeBackend

    return "torch_native", TorchNativeBackend(kv_pool, req_to_token)


@dataclass(frozen=True)
class AttentionBackends:
    """Canonical backend names for the two halves; never None."""

    prefill: str
    decode: str


def canonical(name: str) -> str:
    """Map an alias to its canonical name; raise ValueError listing the valid names if unknown."""
    name = ALIASES.get(name, name)
    if name not in REGISTRY:
        valid = sorted(REGISTRY) + sorted(ALIASES)
        raise ValueError(f"unknown attention backend {name!r}; valid choices: {', '.join(valid)}")
    return name


def default_backend(config: "EngineConfig") -> str:
    return "torch_native"


def attention_backends(config: "EngineConfig") -> AttentionBackends:
    """Each half = its own field, else the base, else the default for this device and model."""
    a = config.attention
    base = a.attention_backend
    halves = []
    for own in (a.prefill_attention_backend, a.decode_attention_backend):
        name = canonical(own or base or default_backend(config))
        reason = REGISTRY[name].unavailable(config)
        if reason is not None:
            raise ValueError(f"attention backend {name!r} cannot run here: {reason}")
        halves.append(name)
    return AttentionBackends(prefill=halves[0], decode=halves[1])


def create_backend(name: str, kv_pool: "KVPool", req_to_token: "ReqToTokenPool"):
    effective, backend = REGISTRY[canonical(name)].factory(kv_pool, req_to_token)
    backend.name = effective
    return backend

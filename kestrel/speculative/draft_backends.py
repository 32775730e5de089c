"""The draft model's attention backends (docs/design/speculative-decoding.md §4,
docs/design/attention-backends.md §6).

From the draft resolution (`registry.draft_attention_backends`: the override for every phase, else the
target's pair) one factory builds:
- the multi-step draft-decode container: one backend per draft forward of a round, from the decode
  half. A round drafts `num_steps` tree levels; a feature draft (EAGLE) gets the first from the top-k
  its last DRAFT_EXTEND left, so it runs `num_steps - 1` forwards (no container when `num_steps <= 1`),
  a STANDALONE draft runs `num_steps`;
- the draft-extend backend, from the half `speculative_attention_mode` names.
A backend that cannot serve a draft mode is refused when the config resolves, never at the first
request. Every product carries the stamp of what it really is (what its registry factory reports), and
the container's stamp is its children's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kestrel.attention.registry import REGISTRY, create_backend, draft_attention_backends
from kestrel.speculative.resolve import DRAFT_MODEL_ALGORITHMS, draft_forwards

if TYPE_CHECKING:
    from kestrel.config import EngineConfig


@dataclass(frozen=True)
class DraftBackendPlan:
    """Canonical names of the draft backends and where each came from (for `kestrel explain`)."""

    decode: str | None  # every draft-decode child's backend; None: no container (num_steps <= 1)
    decode_steps: int  # children of the container
    extend: str
    decode_source: str
    extend_source: str


class MultiStepDraftBackend:
    """One attention backend per draft-decode forward of a round: step i runs on `attn_backends[i]`, so
    each step keeps its own per-batch metadata (and, on CUDA, its own captured graph)."""

    def __init__(self, attn_backends: list[Any]) -> None:
        names = {b.name for b in attn_backends}
        if len(names) != 1:
            raise ValueError(f"a multi-step draft backend needs children of one backend, got {sorted(names)}")
        self.attn_backends = attn_backends
        self.name = names.pop()

    def __len__(self) -> int:
        return len(self.attn_backends)


@dataclass
class DraftBackends:
    decode: MultiStepDraftBackend | None
    extend: Any  # an AttentionBackend


def draft_backend_plan(config: "EngineConfig") -> DraftBackendPlan | None:
    """The draft backends `config` asks for (resolved), or None when its algorithm runs no draft model.

    Raises ValueError when a backend cannot serve its draft mode, naming the backends that can."""
    spec = config.speculative
    algorithm = spec.speculative_algorithm
    if algorithm not in DRAFT_MODEL_ALGORITHMS:
        return None
    pair = draft_attention_backends(config)
    override = spec.speculative_draft_attention_backend
    extend_half = "decode" if spec.speculative_attention_mode == "decode" else "prefill"

    given = f"from --speculative-draft-attention-backend {override!r}" if override is not None else None
    decode_source = given or "the target's decode half"
    extend_source = given or (f"the target's {extend_half} half "
                              f"(speculative_attention_mode={spec.speculative_attention_mode})")

    decode_steps = draft_forwards(spec)
    decode = pair.decode if decode_steps > 0 else None
    extend = pair.prefill if extend_half == "prefill" else pair.decode
    for mode, name, where in (("decode", decode, "decode"), ("extend", extend, "draft-extend")):
        if name is not None and mode not in REGISTRY[name].draft_modes:
            able = sorted(n for n, e in REGISTRY.items() if mode in e.draft_modes)
            raise ValueError(f"{algorithm} is not supported in {where} attention backend {name}; backends that "
                             f"serve draft {mode}: {', '.join(able)} (--speculative-draft-attention-backend)")
    return DraftBackendPlan(decode=decode, decode_steps=decode_steps if decode else 0, extend=extend,
                            decode_source=decode_source, extend_source=extend_source)


def create_draft_backends(config: "EngineConfig", pools: Any, req_to_token: Any,
                          lane_table: Any = None) -> DraftBackends:
    """Build the draft model's backends over its KV pools (`pools`, passed to the registry factories
    as they are) and the shared `req_to_token`; the draft-decode children read the lanes' rows
    (`lane_table`, kestrel.speculative.draft_lanes) when given."""
    plan = draft_backend_plan(config)
    if plan is None:
        raise ValueError(f"speculative_algorithm={config.speculative.speculative_algorithm} runs no draft model, "
                         "so it has no draft attention backends")
    decode = None
    if plan.decode is not None:
        decode = MultiStepDraftBackend([create_backend(plan.decode, pools, lane_table or req_to_token, config)
                                        for _ in range(plan.decode_steps)])
    return DraftBackends(decode=decode, extend=create_backend(plan.extend, pools, req_to_token, config))

"""The resolved attention plan in words, and the request features the engine refuses with it:
`kestrel explain` prints it, start-up logs it at debug level."""
from __future__ import annotations

from typing import TYPE_CHECKING

from kestrel.attention.decisions import DECISIONS, cuda_graph_backends
from kestrel.attention.hybrid import serving_half
from kestrel.attention.registry import ATTENTION_KINDS, ALIASES, default_backend, model_attention_kind, resolve_sources
from kestrel.core.forward_mode import ForwardMode
from kestrel.engine.feature_rules import explain_rules

if TYPE_CHECKING:
    from kestrel.config import EngineConfig


def explain_plan(config: "EngineConfig") -> str:
    """`config` must be resolved. Loads no weights."""
    prefill, decode = resolve_sources(config)
    spec_mode = config.speculative.speculative_attention_mode
    kind = model_attention_kind(config)
    lines = [f"model: {config.model.model}  device: {config.device}  dtype: {config.model.dtype}",
             f"attention kind: {kind} ({ATTENTION_KINDS[kind]})", "", "attention halves:"]
    for half, src in (("prefill", prefill), ("decode", decode)):
        if src.field == "default":
            why = f"default for device {config.device} (no field set)"
        else:
            why = f"from --{src.field.replace('_', '-')} {src.given!r}"
            if src.given in ALIASES:
                why += f" (alias of {ALIASES[src.given]!r})"
        lines.append(f"  {half:<8} {src.name:<14} {why}")
    lines.append(f"  wrapper  {'hybrid: each batch routed by forward mode' if prefill.name != decode.name else 'none: one backend serves every mode'}")
    lines += ["", "forward modes:"]
    for mode in ForwardMode:
        half = serving_half(mode, spec_mode)
        name = prefill.name if half == "prefill" else decode.name
        note = f"  (speculative_attention_mode={spec_mode})" if mode is ForwardMode.TARGET_VERIFY else ""
        lines.append(f"  {mode.name:<14} -> {half} half: {name}{note}")
    lines += _speculative_lines(config)
    graphs = cuda_graph_backends(config)
    graph_note = "" if config.device != "cpu" else "  (CUDA graphs are not used on cpu)"
    lines += ["", f"cuda-graph capture set: {', '.join(graphs)}{graph_note}", "", "decisions (reads → answer):"]
    for d in DECISIONS:
        lines.append(f"  {d.name:<22} reads {d.reads:<40} -> {d.fn(config)!r}   [{d.used_by}]")
    lines.append(f"\n(default backends for this device: prefill {default_backend(config, 'prefill')}, "
                 f"decode {default_backend(config, 'decode')})")
    lines += [""] + explain_rules(config)
    return "\n".join(lines)


def _speculative_lines(config: "EngineConfig") -> list[str]:
    """The draft side of the plan, when an algorithm is set: its shape and the draft backends."""
    from kestrel.speculative.draft_backends import draft_backend_plan

    spec = config.speculative
    if spec.speculative_algorithm is None:
        return []
    lines = ["", f"speculative decoding: {spec.speculative_algorithm}  steps {spec.speculative_num_steps}, "
             f"topk {spec.speculative_eagle_topk}, draft tokens {spec.speculative_num_draft_tokens}; "
             f"off above {spec.speculative_disable_batch_size} running requests"]
    plan = draft_backend_plan(config)
    if plan is None:
        return lines + ["  draft backends: none (NGRAM drafts from the request's tokens, no draft model)"]
    lines.append(f"  draft model: {spec.speculative_draft_model_path}")
    if plan.decode is None:
        lines.append(f"  draft decode   none           (speculative_num_steps={spec.speculative_num_steps}: "
                     "the draft extend's top-k is the only level)")
    else:
        lines.append(f"  draft decode   {plan.decode:<14} x{plan.decode_steps} (one per draft step), {plan.decode_source}")
    lines.append(f"  draft extend   {plan.extend:<14} {plan.extend_source}")
    return lines

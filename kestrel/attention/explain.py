"""The resolved attention plan in words: `kestrel explain` prints it, start-up logs it at debug level."""
from __future__ import annotations

from typing import TYPE_CHECKING

from kestrel.attention.decisions import DECISIONS, cuda_graph_backends
from kestrel.attention.hybrid import serving_half
from kestrel.attention.registry import ALIASES, default_backend, resolve_sources
from kestrel.core.forward_mode import ForwardMode

if TYPE_CHECKING:
    from kestrel.config import EngineConfig


def explain_plan(config: "EngineConfig") -> str:
    """`config` must be resolved. Loads no weights."""
    prefill, decode = resolve_sources(config)
    spec_mode = config.speculative.speculative_attention_mode
    lines = [f"model: {config.model.model}  device: {config.device}  dtype: {config.model.dtype}", "",
             "attention halves:"]
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
    graphs = cuda_graph_backends(config)
    graph_note = "" if config.device != "cpu" else "  (CUDA graphs are not used on cpu)"
    lines += ["", f"cuda-graph capture set: {', '.join(graphs)}{graph_note}", "", "decisions (reads → answer):"]
    for d in DECISIONS:
        lines.append(f"  {d.name:<22} reads {d.reads:<40} -> {d.fn(config)!r}   [{d.used_by}]")
    lines.append(f"\n(default backend for this device: {default_backend(config)})")
    return "\n".join(lines)

"""Checkpoint tensors of a layer's routed experts -> the stacked `Experts` parameters of this rank.

A checkpoint stores experts either one tensor per expert and projection (`{e}.gate_proj.weight`:
Qwen-MoE; `{e}.w1.weight`: Mixtral, DeepSeek) or stacked over the experts (`gate_up_proj` [E, 2I, H],
`down_proj` [E, H, I]: transformers' own layout; gpt-oss ships other layouts: `StackedLayout.convert`
turns them into these). `ExpertCheckpoint` says which names a family uses; `load_expert_tensor`
places one tensor (this rank's experts and slice of their width only; another rank's experts are
not even read).

Quantised tensors come as a weight and its scale (`QuantizedPair`); whichever comes first waits for
the other, and the pair is dequantised to float before it is placed: `ExpertLoader.place` is the one
place dequantised expert weights enter the model. FP8 with 128 x 128 block scales (`weight_scale_inv`)
is known here; another format adds its pair to `ExpertCheckpoint.quantized`."""
from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kestrel.quant.fp8 import dequantize_blocks, is_fp8

if TYPE_CHECKING:
    from kestrel.layers.moe.experts import Experts

# A part of an expert: where it goes in the stacked parameters.
PARTS = ("gate", "up", "down", "gate_bias", "up_bias", "down_bias")


@dataclass(frozen=True)
class StackedLayout:
    """A tensor of all experts [E, ...]: the parts it holds ("gate_up": gate rows then up rows, as
    `w13`; "down"; "gate_up_bias"; "down_bias") after `convert` turns it into kestrel's layout."""

    holds: str
    convert: Callable[[torch.Tensor], torch.Tensor] = lambda t: t


@dataclass(frozen=True)
class QuantizedPair:
    """A quantised tensor `<base><weight_suffix>` and its scales `<base><scale_suffix>`, dequantised
    together into the float tensor `<base><loaded_suffix>`. `quantized(t)` says whether a tensor with
    the weight suffix is quantised (a float one loads as it is)."""

    weight_suffix: str
    scale_suffix: str
    loaded_suffix: str
    dequantize: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    quantized: Callable[[torch.Tensor], bool] = lambda t: True


FP8_BLOCKS = QuantizedPair(".weight", ".weight_scale_inv", ".weight", dequantize_blocks, lambda t: is_fp8(t.dtype))
TRANSFORMERS_STACKED = {"gate_up_proj": StackedLayout("gate_up"), "down_proj": StackedLayout("down")}


@dataclass(frozen=True)
class ExpertCheckpoint:
    """How a family's checkpoint names a layer's routed experts, relative to the experts module:
    per expert `{e}.{gate}.weight`, `{e}.{up}.weight`, `{e}.{down}.weight` (and `.bias`), or the
    stacked tensors of `stacked`; quantised as one of `quantized`."""

    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"
    stacked: Mapping[str, StackedLayout] = field(default_factory=lambda: dict(TRANSFORMERS_STACKED))
    quantized: tuple[QuantizedPair, ...] = (FP8_BLOCKS,)

    def supported(self) -> str:
        scales = ", ".join(f"{q.weight_suffix} with {q.scale_suffix}" for q in self.quantized)
        return (f"per expert {{e}}.{self.gate}|{self.up}|{self.down}.weight|bias (float, or quantised: {scales}), "
                f"or stacked {', '.join(self.stacked)}")


QWEN_EXPERTS = ExpertCheckpoint()
MIXTRAL_EXPERTS = ExpertCheckpoint("w1", "w3", "w2")


def interleaved_gate_up(t: torch.Tensor) -> torch.Tensor:
    """[E, H, 2I] with gate and up columns alternating (gpt-oss) -> [E, 2I, H], gate rows then up rows."""
    return torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1).transpose(1, 2)


def interleaved_gate_up_bias(t: torch.Tensor) -> torch.Tensor:
    """[E, 2I] alternating gate and up -> gate then up."""
    return torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1)


def transposed(t: torch.Tensor) -> torch.Tensor:
    """[E, I, H] (x @ W layout, gpt-oss's down_proj) -> [E, H, I]."""
    return t.transpose(1, 2)


class ExpertLoader:
    """Places checkpoint tensors into one `Experts` module; bookkeeping keys "e{expert}.{part}" (global
    expert ids) name what was filled, so a missing expert shows which."""

    def __init__(self, experts: Experts, fmt: ExpertCheckpoint) -> None:
        self.experts, self.fmt = experts, fmt
        names = "|".join(re.escape(n) for n in (fmt.gate, fmt.up, fmt.down))
        self._per_expert = re.compile(rf"^(\d+)\.({names})\.(weight|bias)$")
        self._waiting: dict[str, tuple[str, torch.Tensor]] = {}  # base name -> (which half, tensor)

    def expected_keys(self) -> set[str]:
        parts = PARTS if self.experts.b13 is not None else PARTS[:3]
        first = self.experts.first
        return {f"e{e}.{p}" for e in range(first, first + self.experts.count) for p in parts}

    def load(self, name: str, read: Callable[[], torch.Tensor]) -> list[str] | None:
        """Place checkpoint tensor `name` (relative to the experts module; `read()` gives it): the keys
        filled ([] for another rank's expert, or half of a quantised pair), None for a name it does not
        know. Raises ValueError for a known name of the wrong shape."""
        for q in self.fmt.quantized:
            if name.endswith(q.scale_suffix):
                return self._pair(name.removesuffix(q.scale_suffix), q, "scale", read)
        if (remote := self._remote(name)) is not None:
            return remote
        tensor = read()
        for q in self.fmt.quantized:
            if name.endswith(q.weight_suffix) and q.quantized(tensor):
                return self._pair(name.removesuffix(q.weight_suffix), q, "weight", lambda: tensor)
        return self.place(name, tensor)

    def _remote(self, name: str) -> list[str] | None:
        """[] for a per-expert tensor of another rank's expert (never read), else None."""
        m = self._per_expert.match(name)
        if m is None or self.experts.holds(int(m.group(1))) or int(m.group(1)) >= self.experts.num_experts:
            return None
        return []

    def _pair(self, base: str, q: QuantizedPair, half: str, read: Callable[[], torch.Tensor]) -> list[str] | None:
        if (remote := self._remote(base + q.loaded_suffix)) is not None:
            return remote
        tensor = read()
        other = self._waiting.pop(base, None)
        if other is None:
            self._waiting[base] = (half, tensor)
            return []
        weight, scale = (tensor, other[1]) if half == "weight" else (other[1], tensor)
        return self.place(base + q.loaded_suffix, q.dequantize(weight, scale.float()))

    def unpaired(self) -> list[str]:
        """Halves of quantised pairs whose other half never came."""
        return [f"{base} ({half} without its pair)" for base, (half, _) in self._waiting.items()]

    def place(self, name: str, value: torch.Tensor) -> list[str] | None:
        """Copy a float (or dequantised) tensor into this rank's stacked parameters; the keys filled."""
        experts = self.experts
        m = self._per_expert.match(name)
        if m is not None:
            expert, proj, kind = int(m.group(1)), m.group(2), m.group(3)
            if expert >= experts.num_experts:
                return None
            part = {self.fmt.gate: "gate", self.fmt.up: "up", self.fmt.down: "down"}[proj]
            if kind == "bias":
                part += "_bias"
            self._copy(name, part, value[None], slice(expert - experts.first, expert - experts.first + 1))
            return [f"e{expert}.{part}"]
        layout = self.fmt.stacked.get(name)
        if layout is None:
            return None
        value = layout.convert(value)
        mine = slice(experts.first, experts.first + experts.count)
        if value.shape[0] != experts.num_experts:
            raise ValueError(f"{name}: {value.shape[0]} experts stacked, the model has {experts.num_experts}")
        value = value[mine]
        local = slice(0, experts.count)
        if layout.holds in ("gate_up", "gate_up_bias"):
            suffix = "_bias" if layout.holds == "gate_up_bias" else ""
            gate, up = value.chunk(2, dim=1)
            self._copy(name, "gate" + suffix, gate, local)
            self._copy(name, "up" + suffix, up, local)
            parts = ["gate" + suffix, "up" + suffix]
        else:
            self._copy(name, layout.holds, value, local)
            parts = [layout.holds]
        return [f"e{e}.{p}" for e in range(mine.start, mine.stop) for p in parts]

    @torch.no_grad()
    def _copy(self, name: str, part: str, value: torch.Tensor, local: slice) -> None:
        """value [n, ...] of `part` at full width -> this rank's slice of the width, experts `local`."""
        experts, shard = self.experts, self.experts.shard
        width = slice(shard.inter_start, shard.inter_start + shard.inter)
        inter, full = shard.inter, experts.intermediate_size
        hidden = experts.w2.shape[1]
        n = local.stop - local.start
        targets = {
            "gate": (experts.w13[local, :inter], (n, full, hidden), lambda v: v[:, width]),
            "up": (experts.w13[local, inter:], (n, full, hidden), lambda v: v[:, width]),
            "down": (experts.w2[local], (n, hidden, full), lambda v: v[:, :, width]),
        }
        if experts.b13 is not None:
            targets |= {
                "gate_bias": (experts.b13[local, :inter], (n, full), lambda v: v[:, width]),
                "up_bias": (experts.b13[local, inter:], (n, full), lambda v: v[:, width]),
                "down_bias": (experts.b2[local], (n, hidden), lambda v: v),
            }
        if part not in targets:
            raise ValueError(f"{name}: the checkpoint has expert biases; this model's experts have none")
        target, shape, narrow = targets[part]
        if tuple(value.shape) != shape:
            raise ValueError(f"{name}: checkpoint shape {tuple(value.shape[1:]) if n == 1 else tuple(value.shape)} "
                             f"!= model shape {shape[1:] if n == 1 else shape}")
        target.copy_(narrow(value))  # casts to the parameter's dtype, moves to its device

"""DeepSeek-V4 checkpoints -> the model's parameters, dequantised to the compute dtype
(docs/design/deepseek-v4.md §1.3).

Two namings: DeepSeek's native one (`embed.weight`, `layers.N.attn.wq_a.weight`, `.scale` for block
scales, `ffn.experts.E.w1.weight`, `mtp.0.*`), which is the model's own, and transformers' (`model.`
prefix, `self_attn.q_a_proj`, `mlp.experts.gate_up_proj` stacked, `.weight_scale_inv`), including the
mix its save_pretrained writes (native names under `model.`, `attn.norm` for the kv norm).
Quantised weights: FP8 e4m3 with one scale per 128 x 128 block (fp32 or ue8m0), and FP4 e2m1 packed
two per byte (low nibble first) with one e8m0 scale per 32 inputs (the routed experts of V4-Flash).
A weight and its scale may sit in different shards: whichever comes first waits for the other.
"""
from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Iterable

import torch
from torch import nn

from kestrel.distributed.parallel_state import ParallelState
from kestrel.layers.moe.experts import Experts
from kestrel.quant.fp8 import dequantize_blocks

logger = logging.getLogger(__name__)

FP4_BLOCK = 32
# e2m1 code -> value (bit 3 is the sign).
_FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

# transformers' names -> native names, applied in order to a name without its "model." prefix.
_HF_RENAMES = [
    (r"^embed_tokens\.", "embed."), (r"^hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
    (r"\.input_layernorm\.", ".attn_norm."), (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.attn_hc\.(fn|base|scale)$", r".hc_attn_\1"), (r"\.ffn_hc\.(fn|base|scale)$", r".hc_ffn_\1"),
    (r"\.self_attn\.compressor\.indexer\.scorer\.", ".attn.indexer."),
    (r"\.self_attn\.compressor\.indexer\.q_b_proj\.", ".attn.indexer.wq_b."),
    (r"\.self_attn\.compressor\.indexer\.", ".attn.indexer.compressor."),
    (r"\.self_attn\.", ".attn."),
    (r"\.q_a_proj\.", ".wq_a."), (r"\.q_a_norm\.", ".q_norm."), (r"\.q_b_proj\.", ".wq_b."),
    (r"\.o_a_proj\.", ".wo_a."), (r"\.o_b_proj\.", ".wo_b."), (r"\.attn\.sinks$", ".attn.attn_sink"),
    (r"compressor\.kv_proj\.", "compressor.wkv."), (r"compressor\.gate_proj\.", "compressor.wgate."),
    (r"compressor\.position_bias$", "compressor.ape"), (r"compressor\.kv_norm\.", "compressor.norm."),
    (r"\.attn\.kv_proj\.", ".attn.wkv."),
    (r"\.mlp\.", ".ffn."),
    (r"\.experts\.gate_up_proj$", ".experts.w13"), (r"\.experts\.down_proj$", ".experts.w2"),
    (r"\.shared_experts\.gate_proj\.", ".shared_experts.w1."), (r"\.shared_experts\.up_proj\.", ".shared_experts.w3."),
    (r"\.shared_experts\.down_proj\.", ".shared_experts.w2."),
    # What transformers' save_pretrained writes: native names under "model.", but its reverse of the
    # load-time rename ".norm." -> ".kv_norm." turns the attention's kv_norm into "attn.norm".
    (r"\.attn\.norm\.", ".attn.kv_norm."),
]
_EXPERT = re.compile(r"^(.*\.ffn\.experts)\.(\d+)\.(w[123])\.weight$")
_ANY_EXPERT = re.compile(r"\.ffn\.experts\.(\d+)\.")  # an expert's weight or scale
# Copies of the shared embedding / head that some MTP exports carry.
_SHARED_COPIES = re.compile(r"^mtp\.\d+\.(emb\.tok_emb|head)\.weight$")


def native_name(name: str) -> str:
    """The native name of a checkpoint tensor in either naming (scale suffixes kept)."""
    if name.startswith("lm_head."):  # transformers' head sits outside "model."
        return "head." + name.removeprefix("lm_head.")
    if name.startswith("model."):
        name = name.removeprefix("model.")
        for pattern, repl in _HF_RENAMES:
            name = re.sub(pattern, repl, name)
    # The MoE layer's name for the selection-only bias (kestrel/layers/moe/routers.py), in both namings.
    return re.sub(r"\.ffn\.gate\.bias$", ".ffn.gate.e_score_correction_bias", name)


def is_remote_expert(name: str, n_routed_experts: int, parallel: ParallelState) -> bool:
    """Whether checkpoint tensor `name` (either naming) is one routed expert's (weight or scale) that
    another expert-parallel rank holds."""
    m = _ANY_EXPERT.search(native_name(name))
    if m is None or parallel.ep_size == 1:
        return False
    count = n_routed_experts // parallel.ep_size
    return int(m.group(1)) // count != parallel.ep_rank


def _scale_target(name: str) -> str | None:
    """The weight a block-scale tensor belongs to, or None if `name` is not a scale."""
    for suffix in (".weight_scale_inv", ".scale"):
        if name.endswith(suffix):
            return name.removesuffix(suffix) + ".weight"
    return None


def dequantize(weight: torch.Tensor, scale: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """float32 [*shape] from an FP8 (128 x 128 blocks) or packed FP4 (32-input blocks) weight."""
    scale = scale.float()
    if weight.dtype == torch.float8_e4m3fn:
        return dequantize_blocks(weight, scale)
    if weight.dtype in (torch.int8, torch.uint8, torch.float4_e2m1fn_x2):
        packed = weight.view(torch.uint8)
        codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)  # low nibble is the even element
        values = torch.tensor(_FP4_VALUES)[codes.long()]
        if values.shape != shape:
            raise ValueError(f"FP4 weight unpacks to {tuple(values.shape)}, the model expects {tuple(shape)}")
        return values * scale.repeat_interleave(FP4_BLOCK, -1)[..., :values.shape[-1]]
    raise ValueError(f"a block scale came with a {weight.dtype} weight; expected float8_e4m3fn or packed FP4")


def _stacked_keys(name: str, experts: int) -> list[str] | None:
    """Bookkeeping keys ("prefix.w1#e") of a whole stacked expert tensor; None for other names."""
    for suffix, parts in ((".experts.w13", ("w1", "w3")), (".experts.w2", ("w2",))):
        if name.endswith(suffix):
            prefix = name.removesuffix(suffix.split(".")[-1]).rstrip(".")
            return [f"{prefix}.{p}#{e}" for e in range(experts) for p in parts]
    return None


def _target(name: str, state: dict[str, torch.Tensor],
            first_expert: dict[str, int]) -> tuple[list[str], torch.Tensor] | None:
    """(bookkeeping keys, tensor view to copy into) for a native-named weight, or None if unknown.
    `first_expert`: each experts module's first global expert id (expert parallelism; else 0)."""
    m = _EXPERT.match(name)
    if m:  # one expert's w1 / w3 / w2: a slice of the stacked tensor (its local index)
        prefix, part = m.group(1), m.group(3)
        expert = int(m.group(2)) - first_expert.get(prefix, 0)
        stacked = state.get(f"{prefix}.w2" if part == "w2" else f"{prefix}.w13")
        if stacked is None or not 0 <= expert < stacked.shape[0]:
            return None
        view = stacked[expert] if part == "w2" else stacked[expert].chunk(2, dim=0)[0 if part == "w1" else 1]
        return [f"{prefix}.{part}#{expert}"], view
    tensor = state.get(name)
    if tensor is None:
        return None
    return _stacked_keys(name, tensor.shape[0]) or [name], tensor


def _expected_keys(state: dict[str, torch.Tensor]) -> set[str]:
    return {k for name, t in state.items() for k in (_stacked_keys(name, t.shape[0] if t.dim() else 0) or [name])}


@torch.no_grad()
def load_v4_checkpoint(model: nn.Module, tensors: Iterable[tuple[str, torch.Tensor]], source: str) -> None:
    """Copy (name, tensor) pairs of either naming into `model`, dequantising block-quantised weights.

    A checkpoint without any MTP tensor (transformers does not keep them) loads with the MTP layer
    removed; anything else missing or unexpected raises ValueError listing the names.
    """
    state = model.state_dict(keep_vars=True)
    state = {k: v.data for k, v in state.items()}
    parallel = model.parallel
    n_experts = model.config.n_routed_experts
    first_expert = {name: m.first for name, m in model.named_modules() if isinstance(m, Experts)}
    loaded: set[str] = set()
    unexpected: list[str] = []
    waiting_weight: dict[str, torch.Tensor] = {}
    waiting_scale: dict[str, torch.Tensor] = {}

    def place(name: str, tensor: torch.Tensor, scale: torch.Tensor | None) -> None:
        target = _target(name, state, first_expert)
        if target is None:
            unexpected.append(name)
            return
        keys, view = target
        stacked = name.rpartition(".")[0]
        if stacked in first_expert and tensor.shape[0] != view.shape[0]:  # all experts stacked: ours only
            rows = slice(first_expert[stacked], first_expert[stacked] + view.shape[0])
            tensor, scale = tensor[rows], (scale[rows] if scale is not None else None)
        value = tensor if scale is None else dequantize(tensor, scale, view.shape)
        if value.shape != view.shape:
            raise ValueError(f"{name}: checkpoint shape {tuple(value.shape)} != model shape {tuple(view.shape)}")
        view.copy_(value)  # casts to the parameter's dtype, moves to its device
        loaded.update(keys)

    for raw_name, tensor in tensors:
        name = native_name(raw_name)
        if _SHARED_COPIES.match(name) or is_remote_expert(name, n_experts, parallel):
            continue
        owner = _scale_target(name)
        if owner is not None:
            if owner in waiting_weight:
                place(owner, waiting_weight.pop(owner), tensor)
            else:
                waiting_scale[owner] = tensor
        elif tensor.dtype in (torch.float8_e4m3fn, torch.int8, torch.uint8, torch.float4_e2m1fn_x2):
            if name in waiting_scale:
                place(name, tensor, waiting_scale.pop(name))
            else:
                waiting_weight[name] = tensor
        else:
            place(name, tensor, None)
    unexpected += [f"{n} (quantised, no scale)" for n in waiting_weight]
    unexpected += [f"{n} (scale without its weight)" for n in waiting_scale]
    missing = sorted(_expected_keys(state) - loaded)
    mtp_missing = [k for k in missing if k.startswith("mtp.")]
    if mtp_missing and not any(k.startswith("mtp.") for k in loaded):
        logger.warning("%s has no MTP layer; loading without it (no NEXTN drafting)", source)
        model.mtp = nn.ModuleList()
        model.config = dataclasses.replace(model.config, num_nextn_predict_layers=0)
        missing = [k for k in missing if not k.startswith("mtp.")]
    if missing or unexpected:
        raise ValueError(f"checkpoint at {source} does not match DeepseekV4ForCausalLM: "
                         f"missing {missing}, unexpected {sorted(unexpected)}")


@torch.no_grad()
def fill_dummy(model: nn.Module) -> None:
    """`--load-format dummy`: small random weights, the same on every load (fixed-seed generator);
    norm weights and mHC scales 1, biases and sinks 0, hash tables spreading tokens over experts."""
    device = next(model.parameters()).device
    gen = torch.Generator(device).manual_seed(0)
    for name, param in model.named_parameters():
        if param.dim() >= 2:
            param.normal_(0.0, 0.02, generator=gen)
        else:
            param.fill_(1.0 if name.endswith(("norm.weight", "_scale")) else 0.0)
    for name, buf in model.named_buffers():
        if name.endswith("tid2eid"):
            vocab, k = buf.shape
            experts = model.config.n_routed_experts
            buf.copy_((torch.arange(vocab, device=device)[:, None] * k + torch.arange(k, device=device)) % experts)

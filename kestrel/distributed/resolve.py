"""Validation of the parallel flags against the model and the other options, once, at config resolve."""
from __future__ import annotations

from typing import Any

from kestrel.config import ParallelConfig, SpeculativeConfig


def check_parallel(par: ParallelConfig, hf: dict[str, Any], device: str, speculative: SpeculativeConfig,
                   quantization: str | None) -> None:
    """Raise ValueError for flags that do not fit together or do not fit the model."""
    from kestrel.models.registry import model_class, needs_dsv4_attention

    tp, ep = par.tp_size, par.ep_size
    if tp < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp}")
    if ep not in (1, tp):
        raise ValueError(f"ep_size must be 1 or tp_size ({tp}): the routed experts are split over the "
                         f"tensor-parallel ranks; got {ep}")
    if par.cpu_threads is not None and par.cpu_threads < 1:
        raise ValueError(f"cpu_threads must be >= 1 (or unset: chosen from the usable cores), got {par.cpu_threads}")
    if par.dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {par.dp_size}")
    if par.dp_size > 1 and par.nnodes > 1:
        raise ValueError("dp_size > 1 with nnodes > 1 is not supported: --dp-size starts its replicas on this machine; "
                         "for replicas on several machines start a server on each and one gateway in front "
                         "(docs/deployment.md)")
    if par.nnodes < 1 or tp % par.nnodes:
        raise ValueError(f"nnodes must be >= 1 and divide tp_size ({tp}), got {par.nnodes}")
    if not 0 <= par.node_rank < par.nnodes:
        raise ValueError(f"node_rank must be in [0, nnodes={par.nnodes}), got {par.node_rank}")
    if par.nnodes > 1 and not par.dist_init_addr:
        raise ValueError("with nnodes > 1, dist_init_addr (host:port of node 0, reachable from every node) is "
                         "required")
    dsv4 = needs_dsv4_attention(hf.get("architectures") or [])
    if ep > 1 and not model_class(hf.get("architectures") or []).has_routed_experts:
        raise ValueError(f"ep_size {ep} splits the routed experts of a MoE model; this model has none")
    if tp == 1:
        return
    if device.startswith("cuda"):
        import torch

        have = torch.cuda.device_count()
        if tp // par.nnodes > have:
            raise ValueError(f"tp_size {tp} over {par.nnodes} node(s) needs {tp // par.nnodes} GPUs per node; "
                             f"this machine has {have}")
    if speculative.speculative_algorithm is not None:
        raise ValueError("speculative decoding with tensor parallelism (tp_size > 1) is not supported yet; "
                         "unset speculative_algorithm or serve with tp_size 1")
    if quantization is not None:
        raise ValueError(f"quantization {quantization!r} (also a quantized checkpoint's: FP8, AWQ, GPTQ) with tensor parallelism "
                         "(tp_size > 1) is not supported yet; serve a float checkpoint or use tp_size 1")
    if dsv4:
        if ep != tp:
            raise ValueError(f"DeepSeek-V4 shards only its routed experts across ranks for now (expert "
                             f"parallelism; attention and the rest are replicated): set ep_size = tp_size = {tp}")
        return
    heads = int(hf.get("num_attention_heads", 0))
    kv_heads = int(hf.get("num_key_value_heads") or heads)
    inter = int(hf.get("intermediate_size", 0))
    if heads % tp:
        raise ValueError(f"tp_size {tp} must divide the model's num_attention_heads ({heads})")
    if kv_heads % tp and tp % kv_heads:
        raise ValueError(f"tp_size {tp} and the model's num_key_value_heads ({kv_heads}) must divide one "
                         "another (fewer KV heads than ranks are replicated)")
    # a MoE layer checks its own widths as it is built
    if inter % tp and not model_class(hf.get("architectures") or []).has_routed_experts:
        raise ValueError(f"tp_size {tp} must divide the model's intermediate_size ({inter})")

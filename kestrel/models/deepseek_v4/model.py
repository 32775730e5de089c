"""DeepSeek-V4 for causal LM over flat token streams (input_ids [T], positions [T], a ForwardBatch).

Parameter names are DeepSeek's native checkpoint names (`embed.weight`, `layers.N.attn.wq_a.weight`,
`layers.N.hc_attn_fn`, `mtp.0.e_proj.weight`, ...), except that routed experts are stacked per layer
(`ffn.experts.w13`, `ffn.experts.w2`); `loading.py` maps both checkpoint spellings onto them.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from kestrel.cache.kv_layout import KVLayout
from kestrel.core.forward_batch import ForwardBatch
from kestrel.distributed.parallel_state import ParallelState
from kestrel.layers.kernels import Kernels
from kestrel.layers.norm import RMSNorm
from kestrel.models.base import CausalLM
from kestrel.models.deepseek_v4.block import V4Block
from kestrel.models.deepseek_v4.config import V4Config, parse_v4_config
from kestrel.models.deepseek_v4.kv_layout import v4_kv_layout
from kestrel.models.deepseek_v4.loading import fill_dummy, is_remote_expert, load_v4_checkpoint
from kestrel.models.deepseek_v4.mhc import hc_head, hc_site_params
from kestrel.models.deepseek_v4.mtp import MTPLayer


class DeepseekV4ForCausalLM(CausalLM):
    """forward: input_ids [T], positions [T] -> final hidden [T, d] (hc_head, then norm);
    compute_logits: hidden [N, d] -> float32 logits [N, vocab]. `forward_streams` returns the
    pre-hc_head streams [T, hc_mult, d] instead: the MTP layer's input (`draft_forward`). A batch
    that asks for `capture_hidden == (num_hidden_layers,)` (the input of the layer after the last: the
    MTP layer's) gets those streams, flat [T, hc_mult * d], as its `captured_hidden`. It reads its own
    checkpoint (`loading.py`); its prefills run eagerly; no EAGLE head drafts for it (NEXTN does)."""

    parse_config = staticmethod(parse_v4_config)
    loads_own_checkpoint = True
    has_routed_experts = True

    def __init__(self, cfg: V4Config, kernels: Kernels = Kernels(), parallel: ParallelState = ParallelState()) -> None:
        super().__init__(cfg, parallel)
        # V4 runs its own torch ops but for its norms and rope: on CUDA (`triton_elementwise`) the RMSNorms take
        # the fused Triton norm and the rope and the attention's head norm V4's kernels (triton_ops.py), one
        # launch each where torch takes ~8.
        fused = kernels.triton_elementwise
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            V4Block(cfg, i, cfg.compress_ratios[i], hash_routing=i < cfg.num_hash_layers, parallel=parallel,
                    fused=fused)
            for i in range(cfg.num_hidden_layers))
        hc_site_params(self, "hc_head", cfg, head=True)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, use_triton=fused)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.mtp = nn.ModuleList(MTPLayer(cfg, parallel) for _ in range(cfg.num_nextn_predict_layers))

    def kv_layout(self, dtype: torch.dtype, speculative_tokens: int = 1) -> KVLayout:
        """The main layers' KV; a NEXTN draft's pools hold the MTP layer's (`mtp_kv_layout`)."""
        return v4_kv_layout(self.config, dtype, speculative_tokens)

    def input_embedding(self) -> nn.Module:
        return self.embed

    def load_checkpoint(self, tensors: Iterable[tuple[str, torch.Tensor]], source: str) -> None:
        load_v4_checkpoint(self, tensors, source)

    def skips_checkpoint_tensor(self, name: str) -> bool:
        """Another expert-parallel rank's routed expert: not even read from the file."""
        return self.parallel.ep_size > 1 and is_remote_expert(name, self.config.n_routed_experts, self.parallel)

    def fill_dummy(self) -> None:
        fill_dummy(self)

    def forward_streams(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        X = self.embed(input_ids).unsqueeze(1).repeat(1, self.config.hc_mult, 1)  # every stream starts at E[id]
        for layer in self.layers:
            X = layer(X, input_ids, positions, batch)
        return X

    def final_hidden(self, X: torch.Tensor) -> torch.Tensor:
        return self.norm(hc_head(X, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, self.config))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        X = self.forward_streams(input_ids, positions, batch)
        if batch.capture_hidden:
            if batch.capture_hidden != (self.config.num_hidden_layers,):
                raise ValueError(f"DeepSeek-V4 returns only the MTP layer's input streams (capture_hidden = "
                                 f"({self.config.num_hidden_layers},)), not layers {batch.capture_hidden}")
            batch.captured_hidden = X.flatten(1)
        return self.final_hidden(X)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.head.weight).float()

    def draft_forward(self, streams: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor,
                      batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP layer at positions t: target streams at t [T, hc_mult, d] (or flat [T, hc_mult * d])
        and the tokens at t + 1 -> (logits for t + 2 [T, vocab], the MTP's own pre-hc_head streams,
        which a further draft step takes as its `streams`)."""
        X = self.mtp_streams(streams, next_ids, positions, batch)
        return self.mtp_logits(X), X

    def mtp_streams(self, streams: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor,
                    batch: ForwardBatch) -> torch.Tensor:
        """The MTP layer's pre-hc_head streams [T, hc_mult, d] (see `draft_forward`)."""
        if not len(self.mtp):
            raise ValueError("this DeepSeek-V4 checkpoint has no MTP layer (num_nextn_predict_layers = 0)")
        streams = streams.view(streams.shape[0], self.config.hc_mult, self.config.hidden_size)
        return self.mtp[0](streams, next_ids, self.embed(next_ids), positions, batch)

    def mtp_logits(self, X: torch.Tensor) -> torch.Tensor:
        """The MTP layer's streams [N, hc_mult, d] (or flat) -> its float32 logits [N, vocab]."""
        X = X.view(X.shape[0], self.config.hc_mult, self.config.hidden_size)
        return self.compute_logits(self.mtp[0].final_hidden(X))

"""The mixture-of-experts sublayer every MoE model uses.

Interface
---------
    from kestrel.layers.moe import MoE, MoEConfig, RouterConfig, ExpertActivation
    moe = MoE(MoEConfig(hidden_size, intermediate_size, RouterConfig(kind, num_experts, top_k, ...),
                        ExpertActivation(kind, limit, alpha), expert_bias=..., shared_intermediate_size=...,
                        shared_expert_gate=...), parallel, checkpoint=ExpertCheckpoint(...))
    y = moe(x, input_ids)        # x [T, H] -> [T, H] in x's dtype, already summed over the ranks

- config.py: `MoEConfig`, `RouterConfig` (kinds "softmax_topk" [Qwen-MoE, Mixtral], "topk_softmax"
  [gpt-oss], "biased_topk" [DeepSeek-V3/V4: scoring func, correction bias, groups], "hash" [DeepSeek-V4]),
  `ExpertActivation` ("silu", "clamped_silu" [DeepSeek-V4], "gpt_oss").
- routers.py: `Router` (`weight` [E, H] float32, `bias` [E] with a logit bias, `e_score_correction_bias`,
  buffer `tid2eid`): x -> (ids [T, k] int64, weights [T, k] float32).
- experts.py: `Experts`: this rank's experts stacked, `w13` [count, 2I, H] (gate rows, then up rows),
  `w2` [count, H, I], with `expert_bias` `b13` [count, 2I] and `b2` [count, H]. EP: experts
  `first .. first + count - 1` of `num_experts / ep_size`; TP of the experts: each expert's width I
  split over the `tp_size / ep_size` ranks that share it.
- shared.py: `SharedExpert` (`w1` gate, `w3` up, `w2` down), split like the experts' width.
- activation.py: the gated activations in torch; fused_moe.py and gemv_moe.py compute the same in Triton.
- paths.py: the four compute paths ("loop", "every", "fused", "gemv") and `choose_path` (thresholds there);
  `MoE.routed_path(x)` says which a forward takes, `MoE.add_routed(x, ids, weights, out, path)` runs one.
  `FUSED_DECODE_ROUTE` and `takes_decode_route`: whether a "gemv" forward runs the whole layer as the fused
  decode route, `MoE.forward_decode(x)` (route_kernels.py's Triton router, gemv_moe.py's GEMVs and combine).
- route_kernels.py: `route`, the "softmax_topk" and "topk_softmax" routers as two Triton kernels.
- loading.py: checkpoint tensors -> the stacked parameters. `ExpertCheckpoint` names a family's expert
  tensors (per expert `{e}.gate_proj.weight`..., `QWEN_EXPERTS`; `{e}.w1.weight`..., `MIXTRAL_EXPERTS`;
  stacked tensors with a `StackedLayout.convert` to kestrel's layout: `interleaved_gate_up`,
  `interleaved_gate_up_bias`, `transposed` for gpt-oss) and its quantised pairs (`QuantizedPair`: FP8
  128 x 128 blocks built in; an MXFP4 pair `_blocks` + `_scales` goes in `ExpertCheckpoint.quantized`).
  `Experts.tensor_loader()` is what `kestrel.models.loader.copy_checkpoint` hands the tensors under the
  experts module to; `ExpertLoader.place` is where float or dequantised expert weights enter.

The sum over ranks is one all-reduce, in `MoE.forward`: every rank's routed partial (its experts, its
slice of their width), the shared expert's slices (added by expert-parallel rank 0 of those holding
the same slice) and the down biases (added by the rank holding the first slice of the width).
"""
from kestrel.layers.moe.config import ExpertActivation, MoEConfig, RouterConfig
from kestrel.layers.moe.layer import MoE

__all__ = ["ExpertActivation", "MoE", "MoEConfig", "RouterConfig"]

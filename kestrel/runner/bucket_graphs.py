"""CUDA graphs of a whole function of batch-shaped tensors, one per batch-size bucket.

A speculative round runs many small kernels around its forwards (top-k, tree building, acceptance);
launched one by one they cost more than the draft's forwards. `BucketGraphs` captures such a function
(the model forwards inside included) for each bucket; a call copies the inputs into the static
buffers of the smallest bucket that holds the batch, fills the rest with the inputs' padding values
and replays. The function must read only its inputs and tensors that live as long as the graphs.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from kestrel.runner.graph_capture import CapturedGraphs, batch_size_buckets, bucket_for


class BucketGraphs:
    def __init__(self, fn: Callable[..., Sequence[torch.Tensor]], inputs: Callable[[int], list[torch.Tensor]],
                 pad_values: Sequence[int | float], max_bs: int, device: torch.device) -> None:
        """`inputs(bs)`: example inputs for a batch of `bs` (dim 0 is the batch); `pad_values`: what each
        input holds in the rows past the batch."""
        self.buckets = batch_size_buckets(max_bs)
        self.max_bs = max_bs
        self.pad_values = pad_values
        self.static: dict[int, list[torch.Tensor]] = {}
        self.graphs = CapturedGraphs(device)  # by bucket: the function's outputs on its static inputs
        with torch.inference_mode():
            for bs in reversed(self.buckets):  # largest first (CapturedGraphs)
                static = self.static[bs] = [t.clone() for t in inputs(bs)]
                self.graphs.warm_up(lambda: fn(*static))
                self.graphs.capture(bs, lambda: fn(*static))

    def can_run(self, bs: int) -> bool:
        return bs <= self.max_bs

    def __call__(self, *inputs: torch.Tensor) -> list[torch.Tensor]:
        """The function's outputs for the batch (views of the static outputs: read them before the next
        call)."""
        bs = inputs[0].shape[0]
        bucket = bucket_for(self.buckets, bs)
        for buf, x, pad in zip(self.static[bucket], inputs, self.pad_values):
            buf[:bs].copy_(x)
            if bucket > bs:
                buf[bs:].fill_(pad)
        return [out[:bs] for out in self.graphs.replay(bucket)]

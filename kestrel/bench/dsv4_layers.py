"""One DeepSeek-V4 attention layer against a dense-attention layer of the same width, at one context.

The V4 side is the model's own `V4Attention` module run through the `dsv4` backend over a KV memory built
from the model's layout, exactly as a step of the engine runs it: q path (wq_a, q_norm, wq_b, per-head
norm, rope), the K=V projection, the window ring, the compressor(s) and, on ratio-4 layers, the indexer,
the softmax over window + compressed entries with the sink, the inverse rope and the grouped output
projection (wo_a, wo_b).

The dense side is the same module's weights with everything sparse replaced by full causal attention:
the same q path, K=V projection, ropes and output projection; one K=V head of head_dim (MQA, as V4's),
every earlier position's entry in a contiguous per-request cache [batch, context, D] (no page gather: the
best case for SDPA); attention by torch SDPA through the fastest kernel that runs (each is tried).

Both are timed per call; the state's values stay as written (zeros before the step), since neither
side's work depends on them. Every timed call re-runs the same step (same positions, same slots).
"""
from __future__ import annotations

import warnings
from statistics import median

import torch
import torch.nn.functional as F

from kestrel.attention.dsv4 import DSV4Backend
from kestrel.bench.common import graph_ms, timed_ms
from kestrel.cache.kv_memory import KVMemory
from kestrel.core.forward_batch import ForwardBatch
from kestrel.core.forward_mode import ForwardMode


class LayerContext:
    """`batch` requests holding `context` positions each in a KV memory built from the model's layout
    (pages from the allocator, `req_to_token` filled), and the steps that re-run one of their steps."""

    def __init__(self, model: torch.nn.Module, batch: int, context: int, page_size: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        pages = -(-context // page_size)
        self.memory = KVMemory([model.kv_layout(dtype)], batch * pages * page_size, page_size, batch, context, device)
        self.backend = DSV4Backend(self.memory.pools[0], self.memory.req_to_token)
        self.rows = []
        table = self.memory.req_to_token.table
        for _ in range(batch):
            row = self.memory.req_to_token.alloc()
            table[row, :context] = self.memory.allocator.alloc_for(0, context, 0).to(device)
            self.rows.append(row)
        self.device = device

    def step(self, batch: int, prefix: int, extend: int, host_lengths: bool = True) -> ForwardBatch:
        """The step of the first `batch` requests that processes positions [prefix, prefix + extend);
        without `host_lengths`, a decode step as a CUDA graph sees it (lengths on the device only)."""
        rows = self.rows[:batch]
        table = self.memory.req_to_token.table
        dev = self.device
        seq = prefix + extend
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE if extend == 1 else ForwardMode.EXTEND,
            input_ids=torch.zeros(batch * extend, dtype=torch.int64, device=dev),
            positions=torch.arange(prefix, seq, device=dev).repeat(batch),
            out_cache_loc=table[rows, prefix:seq].flatten(),
            req_pool_indices=torch.tensor(rows, device=dev), seq_lens=torch.full((batch,), seq, device=dev),
            prefix_lens=torch.full((batch,), prefix, device=dev), extend_lens=torch.full((batch,), extend, device=dev),
            seq_lens_cpu=[seq] * batch if host_lengths else None,
            prefix_lens_cpu=[prefix] * batch if host_lengths else None,
            extend_lens_cpu=[extend] * batch if host_lengths else None,
            max_extend=extend, logits_indices=torch.arange(1, batch + 1, device=dev) * extend - 1,
            attn_backend=self.backend)


def v4_layer_ms(attn: torch.nn.Module, ctx: LayerContext, batch: int, prefix: int, extend: int,
                iters: int, plan_built: bool = True) -> list[float]:
    """`V4Attention.forward` for one step. The backend's per-step metadata (host lengths, copied to the
    device) is set before each call, untimed: the engine sets it once per step for all layers. The
    step's index plan is built by the first layer that needs each part and shared by the others: with
    `plan_built`, an untimed call of the layer builds it first (any later layer of a real step);
    without, the timed call builds it (what the first layer of each kind pays once per step)."""
    fb = ctx.step(batch, prefix, extend)
    gen = torch.Generator(ctx.device).manual_seed(0)
    x = torch.randn(batch * extend, attn.wq_a.in_features, generator=gen, device=ctx.device,
                    dtype=attn.wq_a.weight.dtype)

    def before() -> None:
        ctx.backend.init_forward_metadata(fb)
        if plan_built:
            attn(x, fb.positions, fb)

    with torch.inference_mode():
        return timed_ms(lambda: attn(x, fb.positions, fb), ctx.device, iters, before=before)


def v4_layer_graph_ms(attn: torch.nn.Module, ctx: LayerContext, batch: int, prefix: int,
                      iters: int) -> dict[str, float]:
    """`V4Attention.forward` for one decode step as the engine's decode graph runs it: the static-sizes
    plan (`StepPlan.decode`, from device lengths), replayed from a CUDA graph. `layer_ms`: the layer
    with the plan's parts already built (by an earlier layer of the step); `with_plan_ms`: the plan's
    construction and the layer in one graph (what the first layer of its kind costs)."""
    fb = ctx.step(batch, prefix, 1, host_lengths=False)
    gen = torch.Generator(ctx.device).manual_seed(0)
    x = torch.randn(batch, attn.wq_a.in_features, generator=gen, device=ctx.device, dtype=attn.wq_a.weight.dtype)

    def with_plan() -> None:
        ctx.backend.init_forward_metadata(fb)
        attn(x, fb.positions, fb)

    with torch.inference_mode():
        fresh = median(graph_ms(with_plan, ctx.device, iters))
        with_plan()  # the parts the layer needs, built once outside the graph below
        built = median(graph_ms(lambda: attn(x, fb.positions, fb), ctx.device, iters))
    return {"layer_ms": built, "with_plan_ms": fresh}


# ---- the dense layer --------------------------------------------------------------------------------
def _sdpa_backends() -> list[tuple[str, object]]:
    from torch.nn.attention import SDPBackend

    names = ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION", "MATH")
    return [(n.lower(), getattr(SDPBackend, n)) for n in names if hasattr(SDPBackend, n)]


class DenseLayer:
    """V4Attention's weights as a dense-attention layer (module docstring); `forward(x, prefix, extend)`
    for `batch` requests that all sit at the same positions."""

    def __init__(self, attn: torch.nn.Module, batch: int, context: int, device: torch.device) -> None:
        self.attn = attn
        self.batch = batch
        self.cache = torch.zeros(batch, context, attn.head_dim, dtype=attn.wkv.weight.dtype, device=device)
        self.kernel: tuple | None = None  # (label, SDPA backend, copy_keys, tile), chosen by `pick_kernel`

    def projections(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = self.attn
        q = a.wq_b(a.q_norm(a.wq_a(x))).unflatten(-1, (a.heads, a.head_dim))
        q = q * torch.rsqrt(q.float().pow(2).mean(-1, keepdim=True) + a.eps).to(q.dtype)
        return a.rope(q, positions), a.rope(a.kv_norm(a.wkv(x)), positions)

    def output(self, out: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        a = self.attn
        out = a.rope(out, positions, inverse=True)
        groups = out.flatten(1).unflatten(-1, (a.groups, -1))
        wo_a = a.wo_a.weight.unflatten(0, (a.groups, -1))
        return a.wo_b(torch.einsum("tgk,gok->tgo", groups, wo_a).flatten(1))

    def core(self, q: torch.Tensor, prefix: int, extend: int, kernel, copy_keys: bool = False,
             tile: int | None = None) -> torch.Tensor:
        """q [batch * extend, H, D] over the cache's positions [0, prefix + extend) -> the same shape.
        `copy_keys`: a prefill hands SDPA the one K=V head copied to H heads, for kernels that refuse
        the broadcast view (the copy is timed with it). `tile`: a prefill runs in query tiles of this
        many, each with its explicit causal mask (the math kernel, whose logits of a whole chunk at 32k
        would not fit)."""
        from torch.nn.attention import sdpa_kernel

        B, H, D = self.batch, self.attn.heads, self.attn.head_dim
        keys = self.cache[:, None, :prefix + extend]  # [B, 1, S, D]: the one K=V head
        with sdpa_kernel(kernel):
            if extend == 1:
                # Decode: every head's query sees all keys of the one head, so the heads are the query rows
                # of one MQA head (no mask, no K expanded to H heads).
                out = F.scaled_dot_product_attention(q.view(B, 1, H, D), keys, keys, scale=self.attn.scale)
                return out.view(B * extend, H, D)
            from torch.nn.attention.bias import causal_lower_right

            qh = q.view(B, extend, H, D).transpose(1, 2)
            kh = keys.expand(B, H, prefix + extend, D)
            kh = kh.contiguous() if copy_keys else kh
            if tile is None:
                out = F.scaled_dot_product_attention(qh, kh, kh, scale=self.attn.scale,
                                                     attn_mask=causal_lower_right(extend, prefix + extend))
            else:
                k_pos = torch.arange(prefix + extend, device=q.device)
                q_pos = prefix + torch.arange(extend, device=q.device)
                out = torch.cat([F.scaled_dot_product_attention(
                    qh[:, :, a:a + tile], kh, kh, scale=self.attn.scale,
                    attn_mask=k_pos[None, :] <= q_pos[a:a + tile, None]) for a in range(0, extend, tile)], dim=2)
            return out.transpose(1, 2).reshape(B * extend, H, D)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, prefix: int, extend: int) -> torch.Tensor:
        q, kv = self.projections(x, positions)
        self.cache[:, prefix:prefix + extend] = kv.view(self.batch, extend, -1)
        return self.output(self.core(q, prefix, extend, *self.kernel[1:]), positions)

    def pick_kernel(self, q: torch.Tensor, prefix: int, extend: int, iters: int) -> tuple[float, dict[str, object]]:
        """Time `core` through every SDPA kernel and keep the fastest that runs: (its ms, per kernel the
        ms or why it did not run). A kernel that refuses the broadcast K is retried with K copied."""
        device = q.device
        tried: dict[str, object] = {}
        kernels: dict[str, tuple] = {}
        # Bytes of one query's fp32 logits over all heads and keys: the math kernel materialises them.
        row_bytes = self.batch * self.attn.heads * (prefix + extend) * 4
        for name, kernel in _sdpa_backends():
            tile = None
            if name == "math" and extend > 1 and row_bytes * extend > 16 * 2**30:
                tile = max(1, 2 * 2**30 // row_bytes)
            for copy_keys in (False, True) if extend > 1 else (False,):
                label = name + (f" (query tiles of {tile})" if tile else "") + \
                    (f" (K copied to {self.attn.heads} heads)" if copy_keys else "")
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        tried[label] = median(timed_ms(
                            lambda: self.core(q, prefix, extend, kernel, copy_keys, tile), device, iters))
                    kernels[label] = (label, kernel, copy_keys, tile)
                    break
                except (RuntimeError, NotImplementedError, torch.OutOfMemoryError) as e:
                    tried[label] = f"unavailable: {str(e).splitlines()[0][:160]}"
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
        if not kernels:
            raise RuntimeError(f"no SDPA kernel ran this dense attention: {tried}")
        best = min(kernels, key=lambda k: tried[k])
        self.kernel = kernels[best]
        return tried[best], tried


def dense_layer_ms(attn: torch.nn.Module, batch: int, context: int, prefix: int, extend: int,
                   iters: int, graph: bool = False) -> dict[str, object]:
    """The dense layer's step at [prefix, prefix + extend): sublayer ms, SDPA-only ms (the fastest
    kernel), the shared projections alone (q path, K=V path, output; no attention), what each SDPA
    kernel did; with `graph` (CUDA), also the sublayer replayed from a CUDA graph (`graph_sublayer_ms`)."""
    device = attn.wq_a.weight.device
    dense = DenseLayer(attn, batch, context, device)
    gen = torch.Generator(device).manual_seed(0)
    x = torch.randn(batch * extend, attn.wq_a.in_features, generator=gen, device=device, dtype=attn.wq_a.weight.dtype)
    positions = torch.arange(prefix, prefix + extend, device=device).repeat(batch)
    with torch.inference_mode():
        q, _ = dense.projections(x, positions)
        core, tried = dense.pick_kernel(q, prefix, extend, iters)
        sublayer = timed_ms(lambda: dense.forward(x, positions, prefix, extend), device, iters)
        projections = timed_ms(lambda: dense.output(dense.projections(x, positions)[0], positions), device, iters)
        graphed = median(graph_ms(lambda: dense.forward(x, positions, prefix, extend), device, iters)) if graph else None
    return {"sublayer_ms": median(sublayer), "sdpa_ms": core, "projections_ms": median(projections),
            "sdpa_kernel": dense.kernel[0], "sdpa_kernels_tried": tried, "graph_sublayer_ms": graphed}

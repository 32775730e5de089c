"""Engine: offline generation in-process, and the facade the server's engine process drives.

It validates and queues requests, runs steps (the step loop, step_loop.py, owns what a step does),
reports what each request got, formats outputs and owns the lifecycle of tokenizer, scheduler,
model runner, speculative worker and tensor-parallel ranks."""
from __future__ import annotations

import gc
import itertools
import logging
import numbers
import random
import time
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as wait_futures
from typing import Any, Callable, Iterable

import torch

from kestrel import envs
from kestrel.cache.kv_events_publisher import open_kv_event_log
from kestrel.cache.radix import TOKEN_SPACE, RadixCache
from kestrel.config import EngineConfig
from kestrel.config_resolve import resolve_config
from kestrel.core.outputs import EngineStats, RequestOutput, StepInfo
from kestrel.core.request import Request
from kestrel.core.sampling_params import SamplingParams
from kestrel.distributed.parallel_state import ParallelState, rank_device
from kestrel.distributed.ranks import TPRanks
from kestrel.engine.detokenizer import OutputText
from kestrel.engine.device_step import DeviceStep
from kestrel.engine.feature_rules import check_request
from kestrel.engine.grammar import GrammarBackend, GrammarLimits, GrammarState
from kestrel.engine.scheduler import Scheduler
from kestrel.engine.step_loop import StepLoop
from kestrel.engine.step_profile import profile_step_cost
from kestrel.engine.tokenizer import eos_token_ids, load_tokenizer
from kestrel.progress import progress_bar
from kestrel.runner.build import build_runner
from kestrel.runner.model_runner import triton_on_device
from kestrel.sampling.sampler import Sampler
from kestrel.speculative.worker import create_worker

logger = logging.getLogger(__name__)

# A step with nothing to run but grammars compiling waits this long for one of them (then returns, so
# a caller such as the server's loop can take new requests in).
GRAMMAR_WAIT_S = 0.02


class Engine:
    """`Engine(model=path, device="cpu", dtype="float32", **engine_options)`; see EngineConfig for options."""

    def __init__(self, model: str | None = None, config: EngineConfig | None = None, *,
                 clock: Callable[[], float] = time.perf_counter, **kwargs: Any) -> None:
        """`clock`: the step clock, what step times (the step-cost model's, the step hooks') and queue
        times are measured with."""
        if config is None:
            config = EngineConfig.from_flat(**({"model": model} if model else {}), **kwargs)
        elif model or kwargs:
            raise TypeError("pass either config or model/engine options, not both")
        self.config = config = resolve_config(config)
        if config.parallel.node_rank > 0:
            raise ValueError("node_rank > 0 runs only that node's tensor-parallel ranks, not an engine: start it "
                             "with `kestrel serve --node-rank N ...` (node 0 runs the engine)")
        if logger.isEnabledFor(logging.DEBUG):
            from kestrel.attention.explain import explain_plan

            logger.debug("attention plan:\n%s", explain_plan(config))

        # ---- tokenizer ---------------------------------------------------------------------
        self.tokenizer = load_tokenizer(config.model.tokenizer or config.model.model, required=False)
        self.eos_token_ids = eos_token_ids(config.model.model, self.tokenizer, config.model.hf_config)

        # ---- tensor parallelism: this node's other ranks, then the group ------------------------
        self.device = rank_device(config, 0)
        self.ranks: TPRanks | None = None  # None at tp_size 1: no process group, nothing extra per step
        if config.parallel.tp_size > 1:
            self.ranks = TPRanks(config, self.eos_token_ids, self.device)
        parallel = self.ranks.parallel if self.ranks is not None else ParallelState()

        # ---- model, KV memory and runner (every rank builds them the same way) -----------------
        try:
            parts = build_runner(config, self.device, parallel)
        except Exception as e:
            if self.ranks is not None:  # a rank that failed to load breaks the group's first collective: name it
                raise self.ranks.fatal(e) from e
            raise
        except BaseException:
            if self.ranks is not None:
                self.ranks.stop()
            raise
        config = self.config = parts.config
        model, draft, self.kv_memory, self.runner = parts.model, parts.draft, parts.kv_memory, parts.runner
        self.vocab_size = model.config.vocab_size
        sched, alloc, future_tokens = config.scheduler, self.kv_memory.allocator, parts.future_tokens

        # ---- scheduling and sampling -------------------------------------------------------
        self.kv_events = open_kv_event_log(config.cache.kv_events, config.cache.page_size, envs.kv_events_hash_seed())
        if self.kv_events is not None and config.cache.disable_radix_cache:
            logger.warning("KV-cache events are on but prefix caching is off (--disable-radix-cache, or a KV layout "
                           "that cannot reuse prefixes): no block will be published")
        self.radix = RadixCache(alloc, config.cache.page_size, disabled=config.cache.disable_radix_cache,
                                events=self.kv_events)
        pair_keys = draft is not None and draft.uses_features  # radix keys (token, next token): request_kv.cache_key
        if pair_keys and self.vocab_size > TOKEN_SPACE and not config.cache.disable_radix_cache:
            raise ValueError(f"a feature draft with prefix caching needs a vocabulary of at most {TOKEN_SPACE} "
                             f"tokens (this model has {self.vocab_size}); pass --disable-radix-cache")
        self.scheduler = Scheduler(sched, alloc, self.radix, self.kv_memory.req_to_token, self.eos_token_ids,
                                   self.kv_memory.max_req_len, pair_keys=pair_keys,
                                   clock=clock, lora=parts.lora)
        self.lora = parts.lora
        self.sampler = Sampler(triton_argmax=triton_on_device(config))
        self._seed_rng = random.Random(sched.random_seed)
        self._arrivals = itertools.count()
        self._texts = self.scheduler.finisher.texts  # rid -> OutputText, for requests with stop strings
        self._reqs: dict[str, Request] = {}
        self._streamed: dict[str, int] = {}  # rid -> output tokens already returned by step_deltas()
        self.grammars: GrammarBackend | None = None  # made by the first request with a grammar
        self._compiling: list[Request] = []  # added, not scheduled: waiting for their grammar to compile
        # EAGLE, EAGLE-3, NEXTN, STANDALONE or NGRAM: one worker behind the step loop's seam
        self.spec_worker = create_worker(config, self.runner, draft, self.kv_memory, future_tokens,
                                         self.eos_token_ids)
        device_step = DeviceStep(self.runner, self.sampler, self.vocab_size, self.eos_token_ids, self.device)
        self.loop = StepLoop(config, self.scheduler, device_step, self.spec_worker, self.ranks, clock)
        if sched.step_cost_profile_steps:
            profile_step_cost(self, sched.step_cost_profile_steps)

    @property
    def max_req_len(self) -> int:
        """A prompt must be shorter; prompt + output never exceeds it (context length and KV pool)."""
        return self.kv_memory.max_req_len

    # ---- requests ------------------------------------------------------------------------------
    def add_request(self, prompt: str | None = None, prompt_token_ids: list[int] | None = None,
                    sampling_params: SamplingParams | dict[str, Any] | None = None, rid: str | None = None,
                    lora_name: str | None = None) -> str:
        """Validate and queue one request; returns its id. Raises ValueError on bad input. `sampling_params`:
        a SamplingParams, or SGLang's dict of its fields. `lora_name`: a loaded LoRA adapter to run with
        (LoRANotFoundError, a ValueError, when there is none)."""
        if self.loop is None:
            raise RuntimeError("this engine is shut down (it has let go of its model and KV pool): start a new one")
        if isinstance(sampling_params, dict):
            sampling_params = SamplingParams.from_dict(sampling_params)
        params = sampling_params or SamplingParams()
        lora = self._lora_adapter(lora_name)
        params.validate(self.vocab_size)
        check_request(self.config, params)
        if (prompt is None) == (prompt_token_ids is None):
            raise ValueError("give exactly one of prompt (text) or prompt_token_ids")
        if prompt is not None:
            if self.tokenizer is None:
                raise ValueError("this model folder has no tokenizer: pass prompt_token_ids")
            prompt_token_ids = self.tokenizer.encode(prompt)
        ids = list(prompt_token_ids)
        if not ids:
            raise ValueError("the prompt is empty: give at least one token")
        # numpy / torch integer scalars are fine too; they become plain ints.
        if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) and 0 <= t < self.vocab_size
                   for t in ids):
            raise ValueError(f"prompt_token_ids must be integers in [0, {self.vocab_size})")
        ids = [int(t) for t in ids]
        limit = self.max_req_len
        if len(ids) >= limit:
            raise ValueError(f"the prompt has {len(ids)} tokens; it must be shorter than the context "
                             f"length ({limit} tokens, the smaller of context_length and the KV pool)")
        pool = self.kv_memory.allocator.size
        if len(ids) + params.max_new_tokens > pool:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds the "
                             f"KV pool ({pool} tokens); lower max_new_tokens")
        grammar = self._grammar_state(params)
        arrival = next(self._arrivals)
        rid = rid if rid is not None else f"req-{arrival}"
        if rid in self._reqs:
            raise ValueError(f"request id {rid!r} is already in use")
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        req = Request(rid=rid, prompt_ids=ids, params=params, seed=seed, arrival=arrival, grammar=grammar, lora=lora)
        self._reqs[rid] = req
        if self.tokenizer is not None and params.stop_strs:
            # Stop strings need the text as it grows; other requests are detokenized once, at the end.
            self._texts[rid] = OutputText(self.tokenizer, ids, params)
        if self.scheduler.finish_if_done(req):  # nothing to generate or to score, or an empty grammar
            return rid
        if grammar is not None and grammar.waiting:
            self._compiling.append(req)
        else:
            self.scheduler.add(req)
        return rid

    def _lora_adapter(self, name: str | None):
        if name is None:
            return None
        if self.lora is None:
            raise ValueError(f"the request names LoRA adapter {name!r}, but this engine serves none: start it with "
                             f"--enable-lora")
        return self.lora.get(name)

    # ---- LoRA adapters ---------------------------------------------------------------------------
    def load_lora_adapter(self, name: str, path: str) -> None:
        """Load a PEFT adapter folder under `name`; LoRAAdapterError (a ValueError) when it cannot be served."""
        if self.lora is None:
            raise ValueError("this engine serves no LoRA adapters: start it with --enable-lora")
        self.lora.load(name, path)

    def unload_lora_adapter(self, name: str) -> None:
        """Forget an adapter; requests already running with it finish with it."""
        if self.lora is None:
            raise ValueError("this engine serves no LoRA adapters: start it with --enable-lora")
        self.lora.unload(name)

    def lora_adapters(self) -> dict[str, str]:
        """Loaded adapters: name -> path."""
        return {} if self.lora is None else {n: a.path for n, a in self.lora.adapters.items()}

    def _admit_compiled(self) -> list[Request]:
        """Queue the requests whose grammar has compiled, and finish with "error" those whose grammar
        failed or timed out (returned, with `req.grammar.error` set, so the server answers 400). With
        nothing else to run, first wait a little for a compile (no busy loop while one runs)."""
        if not self._compiling:
            return []
        if not self.loop.has_work():
            wait_futures([r.grammar.compiled for r in self._compiling], GRAMMAR_WAIT_S, FIRST_COMPLETED)
        failed, still = [], []
        for req in self._compiling:
            if not req.grammar.poll():
                still.append(req)
            elif req.grammar.error is not None:
                self.scheduler.finish(req, "error", error=str(req.grammar.error))
                failed.append(req)
            elif self.scheduler.finish_if_done(req):  # a grammar of the empty string only
                failed.append(req)  # ended at once: reported like a failure, with its reason "stop"
            else:
                self.scheduler.add(req)
        self._compiling = still
        return failed

    def _grammar_state(self, params: SamplingParams) -> GrammarState | None:
        """The request's grammar matcher (compiled once per grammar); None without one. Raises ValueError."""
        if params.grammar is None:
            return None
        if self.tokenizer is None:
            raise ValueError(f"{params.grammar[0]} needs a tokenizer to compile against; this model folder has none")
        if self.grammars is None:
            sched = self.config.scheduler
            limits = GrammarLimits(sched.grammar_compile_timeout, sched.grammar_max_length)
            try:
                self.grammars = GrammarBackend(self.tokenizer, self.vocab_size, self.eos_token_ids, limits,
                                               pinned=self.device.type == "cuda")
            except Exception as e:  # xgrammar cannot read this tokenizer: no grammar can be served
                raise ValueError(f"{params.grammar[0]} cannot be served: xgrammar does not take this model's "
                                 f"tokenizer ({type(e).__name__}: {e})") from e
            self.loop.grammars = self.grammars
        return self.grammars.state(params)

    def abort(self, rid: str) -> bool:
        for req in self._compiling:
            if req.rid == rid:
                self._compiling.remove(req)
                self.scheduler.finish(req, "abort")
                return True
        aborted = self.scheduler.abort(rid) is not None
        if self.kv_events is not None:
            self.kv_events.end_step()  # its prefix went into the cache now, not in the next step
        return aborted

    def flush_cache(self) -> bool:
        """Drop every cached prefix (SGLang's /flush_cache); only while no request is queued or running.
        Returns whether it flushed."""
        if self.has_work() or self.radix.protected_size():
            return False
        self.radix.flush()
        if self.kv_events is not None:
            self.kv_events.end_step()
        return True

    # ---- steps -------------------------------------------------------------------------------
    def has_work(self) -> bool:
        return self.loop.has_work() or bool(self._compiling)

    def step(self) -> list[Request]:
        """Run one batch (see StepLoop); returns the requests that got a token or finished in this step,
        each once, those whose grammar failed to compile included. Under tensor parallelism a failed step
        raises RankFailedError; `shutdown()` still works after it."""
        done = self._admit_compiled()
        stepped = self.loop.step()
        if self.kv_events is not None:
            self.kv_events.end_step()
        return list(dict.fromkeys(done + stepped))

    def add_step_hook(self, hook: Callable[[StepInfo], None]) -> None:
        """Call `hook(StepInfo)` after every step that ran a batch (benchmarks record steps with it)."""
        self.loop.hooks.append(hook)

    def remove_step_hook(self, hook: Callable[[StepInfo], None]) -> None:
        self.loop.hooks.remove(hook)

    def stats(self) -> EngineStats:
        sched, alloc = self.scheduler, self.kv_memory.allocator
        evictable = self.radix.evictable_size()
        return EngineStats(
            num_running=len(sched.running) + (sched.chunked is not None),
            num_waiting=len(sched.waiting) + len(self._compiling),
            num_used_tokens=alloc.size - alloc.available_size() - evictable, num_evictable_tokens=evictable,
            max_total_tokens=alloc.size, num_retractions=sched.num_retractions)

    def request(self, rid: str) -> Request | None:
        """The live state of a request this engine still tracks (read it, do not change it)."""
        return self._reqs.get(rid)

    def step_deltas(self, touched: Iterable[str] = ()) -> list[tuple[Request, int]]:
        """One step (when there is work) for a caller that streams, such as the server's engine process.

        Returns (request, start) for every request that got tokens or finished: its new tokens are
        `req.output_ids[start:]` (its logprobs, the same slice). `touched` names the requests added or
        aborted since the previous call, so that those finished without running (aborted, or
        max_new_tokens=0) are reported too. A finished request is reported once, then forgotten.
        """
        reqs = self.step() if self.has_work() else []
        stepped = set(map(id, reqs))
        for rid in touched:
            req = self._reqs.get(rid)
            if req is not None and req.finished and id(req) not in stepped:
                reqs.append(req)
                stepped.add(id(req))
        news = []
        for req in reqs:
            try:
                news.append(self._report(req))
            except Exception as e:  # noqa: BLE001 - a bug in this bookkeeping costs its request only
                logger.exception("reporting request %s failed; it finishes with an error", req.rid)
                news.append(self.fail_request(req, e))
        return news

    def _report(self, req: Request) -> tuple[Request, int]:
        start = self._streamed.get(req.rid, 0)
        if req.finished:
            self._streamed.pop(req.rid, None)
            self.pop(req.rid)
        else:
            self._streamed[req.rid] = len(req.output_ids)
        return req, start

    def fail_request(self, req: Request, error: Exception) -> tuple[Request, int]:
        """After a bug in the bookkeeping around a step (reporting a request's news, outside the forward
        that `step` guards): finish `req` with finish_reason "error", free its KV and forget it, as a
        failed step would. Returns its last report for `step_deltas`' caller: no new tokens, the finish."""
        self.scheduler.fail(req, error)
        self._streamed.pop(req.rid, None)
        self._texts.pop(req.rid, None)
        self._reqs.pop(req.rid, None)
        return req, len(req.output_ids)

    def fail_all(self, error: Exception) -> list[tuple[Request, int]]:
        """`fail_request` for every request the engine holds: after a bug whose reach is unknown (the
        caller's loop failed outside any one request), the engine is left empty and can serve again."""
        self.loop.drop_inflight()  # writes and slots of a batch that may never have run
        return [self.fail_request(req, error) for req in list(self._reqs.values())]

    def generate(self, prompts: str | list[str] | None = None,
                 sampling_params: SamplingParams | dict[str, Any] | list[SamplingParams | dict[str, Any]] | None = None,
                 prompt_token_ids: list[int] | list[list[int]] | None = None,
                 use_tqdm: bool = True, lora_name: str | list[str | None] | None = None) -> list[RequestOutput]:
        """Run prompts (text, or token ids) to completion; outputs in input order. `use_tqdm`: a progress
        bar of finished prompts, drawn only when stderr is a terminal. `lora_name`: the LoRA adapter of
        every prompt, or one per prompt (None: the base model)."""
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("give exactly one of prompts or prompt_token_ids")
        if prompts is not None:
            items: list[dict[str, Any]] = [{"prompt": p} for p in ([prompts] if isinstance(prompts, str) else prompts)]
        else:
            single = prompt_token_ids and isinstance(prompt_token_ids[0], numbers.Integral)
            items = [{"prompt_token_ids": p} for p in ([prompt_token_ids] if single else prompt_token_ids)]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(items)
        if len(params) != len(items):
            raise ValueError(f"got {len(params)} sampling_params for {len(items)} prompts")
        loras = lora_name if isinstance(lora_name, list) else [lora_name] * len(items)
        if len(loras) != len(items):
            raise ValueError(f"got {len(loras)} lora_name entries for {len(items)} prompts")
        rids = []
        try:
            for item, p, lora in zip(items, params, loras):
                rids.append(self.add_request(sampling_params=p, lora_name=lora, **item))
        except ValueError:
            for rid in rids:  # a bad prompt rejects the whole call; the others are not left behind
                self.abort(rid)
                self.pop(rid)
            raise
        reqs = [self._reqs[rid] for rid in rids]
        with progress_bar(len(rids), "Processed prompts", "prompt", enabled=use_tqdm) as bar:
            while (done := sum(r.finished for r in reqs)) < len(rids):
                bar.update(done - bar.n)
                self.step()
                # A grammar that fails to compile (or in time) rejects the whole call, as a bad prompt does.
                rejected = next((r.grammar.error for r in reqs if r.grammar is not None and r.grammar.error), None)
                if rejected is not None:
                    for rid in rids:
                        self.abort(rid)
                        self.pop(rid)
                    raise rejected
            bar.update(done - bar.n)
        return [self.output(self.pop(rid)) for rid in rids]

    def pop(self, rid: str) -> Request:
        """Forget a request (finished, or aborted first) and return its final state."""
        self._texts.pop(rid, None)
        return self._reqs.pop(rid)

    def discard(self, rids: list[str]) -> None:
        """Abort these requests, step until the engine is idle, and forget them (a benchmark's or a
        profile's requests, whose outputs nobody reads)."""
        for rid in rids:
            self.abort(rid)
        while self.has_work():
            self.step()
        for rid in rids:
            self.pop(rid)

    def output(self, req: Request) -> RequestOutput:
        text = ""
        if self.tokenizer is not None:
            state = self._texts.get(req.rid)
            if state is None:  # the request never streamed through this engine's loop
                state = OutputText(self.tokenizer, req.prompt_ids, req.params)
                state.add(req.output_ids)
            state.finish()
            text = state.text
            if state.matched_stop is not None and req.matched_stop is None:
                req.finish_reason, req.matched_stop = "stop", state.matched_stop
        meta: dict[str, Any] = {
            "id": req.rid, "prompt_tokens": len(req.prompt_ids), "completion_tokens": len(req.output_ids),
            "cached_tokens": req.cached_tokens, "finish_reason": req.finish_reason, "matched_stop": req.matched_stop,
        }
        if req.error is not None:
            meta["error"] = req.error
        if req.params.logprobs is not None:
            meta["output_token_logprobs"] = list(zip(req.output_logprobs, req.output_ids))
            meta["output_top_logprobs"] = req.output_top_logprobs
        if req.spec_accept_counts:
            meta.update(spec_verify_ct=req.spec_rounds, spec_accept_length=req.spec_accept_length,
                        spec_accept_histogram=req.spec_accept_histogram)
        if req.params.prompt_logprobs is not None:  # the first prompt token has nothing to be scored on
            meta["prompt_token_logprobs"] = list(zip([None] + req.prompt_logprobs, req.prompt_ids))
            meta["prompt_top_logprobs"] = [None] + req.prompt_top_logprobs
        if req.params.pooling is not None:  # the embedding, or the scores of pooling.score_token_ids
            meta["pooled"] = req.pooled
        return RequestOutput(text=text, token_ids=list(req.output_ids), meta=meta, finished=req.finished)

    # ---- lifecycle -----------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Abort every request and forget them, stop the tensor-parallel ranks and let go of the model, the
        KV pool and the CUDA graphs (the engine cannot step after that); safe to call at any time, also
        after a failed step, and more than once."""
        if self.loop is None:  # shut down already
            return
        if self.ranks is not None:
            self.ranks.stop()
        self.loop.inflight = None
        for rid in list(self._reqs):
            self.abort(rid)
        if self.grammars is not None:
            self.grammars.shutdown()
        if self.kv_events is not None:
            self.kv_events.close()
            self.kv_events = None
        self._reqs.clear()
        self._texts.clear()
        self._streamed.clear()
        self._release_device_memory()

    def _release_device_memory(self) -> None:
        """Device memory goes back now, not when the last reference to the engine dies: a caller may keep
        the engine bound long after (a `with` block's name lives on), and the parts reference one another,
        so only a full garbage collection, which Python runs rarely, would free them. A second engine
        started in the same process would then find the first one's KV pool still taken."""
        device = self.device
        self.loop = self.spec_worker = self.scheduler = self.radix = self.runner = self.kv_memory = self.lora = None
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Iterable[Any]) -> None:
        self.shutdown()

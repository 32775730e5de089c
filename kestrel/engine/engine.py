"""Engine: offline generation in-process. Owns tokenizer, scheduler, model runner and sampler."""
from __future__ import annotations

import dataclasses
import itertools
import logging
import numbers
import random
import time
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from kestrel.cache.radix import RadixCache
from kestrel.config import EngineConfig
from kestrel.config_resolve import resolve_config
from kestrel.core.batch import ScheduledBatch
from kestrel.core.forward_mode import ForwardMode
from kestrel.core.outputs import EngineStats, RequestOutput, StepInfo
from kestrel.core.request import Request
from kestrel.core.sampling_params import SamplingParams, UnsupportedParamError
from kestrel.engine import prompt_logprobs
from kestrel.engine.detokenizer import OutputText
from kestrel.engine.grammar import GrammarBackend, GrammarLimits, GrammarState
from kestrel.engine.sampler import PendingSample, Sampler, SamplingBatch, sampled_logits
from kestrel.engine.scheduler import Scheduler
from kestrel.engine.tokenizer import eos_token_ids, load_tokenizer
from kestrel.distributed.parallel_state import ParallelState, rank_device
from kestrel.distributed.ranks import TPRanks
from kestrel.progress import progress_bar
from kestrel.runner.build import build_runner
from kestrel.runner.model_runner import triton_on_device
from kestrel.spec.draft_worker import DraftWorker
from kestrel.spec.ngram_worker import NgramWorker

logger = logging.getLogger(__name__)

# A step with nothing to run but grammars compiling waits this long for one of them (then returns, so
# a caller such as the server's loop can take new requests in).
GRAMMAR_WAIT_S = 0.02


@dataclass
class _Launched:
    """A batch on the device: its sampled requests, their FutureTokens indices, the sample's host copy;
    its prompt logprobs on their way to the host, and the requests it prefilled with nothing to sample.

    Until `sample` is set, the batch's forward is launched but not its sampling (which waits for the
    grammar masks, see `step`): `logits` and `sampling` are its inputs, `futures` are reserved."""

    reqs: list[Request]
    futures: list[int]
    sample: PendingSample | None
    logits: torch.Tensor | None = None
    sampling: SamplingBatch | None = None
    prompt: prompt_logprobs.PendingPromptLogprobs | None = None
    prefill_only: list[Request] = dataclasses.field(default_factory=list)


class Engine:
    """`Engine(model=path, device="cpu", dtype="float32", **engine_options)`; see EngineConfig for options."""

    def __init__(self, model: str | None = None, config: EngineConfig | None = None, **kwargs: Any) -> None:
        if config is None:
            config = EngineConfig.from_flat(**({"model": model} if model else {}), **kwargs)
        elif model or kwargs:
            raise TypeError("pass either config or model/engine options, not both")
        self.config = config = resolve_config(config)
        spec = config.speculative
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
        self.radix = RadixCache(alloc, config.cache.page_size, disabled=config.cache.disable_radix_cache)
        self.scheduler = Scheduler(sched, alloc, self.radix, self.kv_memory.req_to_token, self.eos_token_ids,
                                   self.kv_memory.max_req_len,
                                   recompute_last_match=draft is not None and draft.uses_features)
        self.sampler = Sampler(triton_argmax=triton_on_device(config))
        self._seed_rng = random.Random(sched.random_seed)
        self._arrivals = itertools.count()
        self._texts: dict[str, OutputText] = {}
        self._reqs: dict[str, Request] = {}
        self._streamed: dict[str, int] = {}  # rid -> output tokens already returned by step_deltas()
        self._inflight: _Launched | None = None  # launched batch whose sampled tokens are not applied yet
        self._step_hooks: list[Callable[[StepInfo], None]] = []
        self.grammars: GrammarBackend | None = None  # made by the first request with a grammar
        self._compiling: list[Request] = []  # added, not scheduled: waiting for their grammar to compile
        self.spec_worker: NgramWorker | DraftWorker | None = None
        if spec.speculative_algorithm == "NGRAM":
            self.spec_worker = NgramWorker(self.scheduler, self.runner, spec.speculative_num_steps,
                                           spec.speculative_eagle_topk, spec.speculative_num_draft_tokens,
                                           self.eos_token_ids)
        elif draft is not None:
            self.spec_worker = DraftWorker(config, self.scheduler, self.runner, draft, self.kv_memory, future_tokens,
                                           self.eos_token_ids)
        self.draft_worker = self.spec_worker if draft is not None else None

    @property
    def max_req_len(self) -> int:
        """A prompt must be shorter; prompt + output never exceeds it (context length and KV pool)."""
        return self.kv_memory.max_req_len

    # ---- requests ------------------------------------------------------------------------------
    def add_request(self, prompt: str | None = None, prompt_token_ids: list[int] | None = None,
                    sampling_params: SamplingParams | None = None, rid: str | None = None) -> str:
        """Validate and queue one request; returns its id. Raises ValueError on bad input."""
        params = sampling_params or SamplingParams()
        params.validate(self.vocab_size)
        if self.spec_worker is not None:
            self._check_speculative(params)
        if self.ranks is not None and params.grammar is not None:
            # Its mask is filled on rank 0 after the previous step resolves; the other ranks would need it sent.
            raise UnsupportedParamError(params.grammar[0], f"with tensor parallelism (tp_size > 1), grammars "
                                        f"(json_schema, regex, ebnf, structural_tag) are not supported yet; drop "
                                        f"{params.grammar[0]} or serve with tp_size 1")
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
        req = Request(rid=rid, prompt_ids=ids, params=params, seed=seed, arrival=arrival, grammar=grammar)
        self._reqs[rid] = req
        if self.tokenizer is not None and params.stop_strs:
            # Stop strings need the text as it grows; other requests are detokenized once, at the end.
            self._texts[rid] = OutputText(self.tokenizer, ids, params)
        if params.max_new_tokens == 0 and params.prompt_logprobs is None:
            self.scheduler.finish(req, "length")
        elif grammar is not None and grammar.waiting:
            self._compiling.append(req)
        else:
            self._queue(req)
        return rid

    def _queue(self, req: Request) -> None:
        """Hand a request whose grammar (if any) is compiled to the scheduler."""
        if req.grammar is not None and req.grammar.ended():  # a grammar of the empty string only
            self.scheduler.finish(req, "stop")
        else:
            self.scheduler.add(req)

    def _admit_compiled(self) -> list[Request]:
        """Queue the requests whose grammar has compiled, and finish with "error" those whose grammar
        failed or timed out (returned, with `req.grammar.error` set, so the server answers 400). With
        nothing else to run, first wait a little for a compile (no busy loop while one runs)."""
        if not self._compiling:
            return []
        if not self.scheduler.has_work() and self._inflight is None:
            wait_futures([r.grammar.compiled for r in self._compiling], GRAMMAR_WAIT_S, FIRST_COMPLETED)
        failed, still = [], []
        for req in self._compiling:
            if not req.grammar.poll():
                still.append(req)
            elif req.grammar.error is not None:
                self.scheduler.finish(req, "error", error=str(req.grammar.error))
                failed.append(req)
            else:
                self._queue(req)
                if req.finished:
                    failed.append(req)  # ended at once: reported like a failure, with its reason "stop"
        self._compiling = still
        return failed

    @staticmethod
    def _check_speculative(params: SamplingParams) -> None:
        """UnsupportedParamError naming the first field speculative decoding cannot serve, if any."""
        if params.penalties or params.min_new_tokens:
            # Both change the target's distribution per node by the tokens before it, which differ along
            # the draft tree; not applied there yet.
            field = (params.penalties or ["min_new_tokens"])[0]
            raise UnsupportedParamError(field, "with speculative decoding, repetition/frequency/presence penalties "
                                        f"and min_new_tokens are not supported; unset {field} or serve without "
                                        "speculative_algorithm")
        if params.grammar is not None:
            # A grammar's mask depends on the tokens before each node too (one matcher per tree path).
            raise UnsupportedParamError(params.grammar[0], f"with speculative decoding, grammars (json_schema, regex, "
                                        f"ebnf, structural_tag) are not supported yet; drop {params.grammar[0]} or "
                                        "serve without speculative_algorithm")
        if params.prompt_logprobs is not None:
            # A draft's DRAFT_EXTEND after each prefill chunk reads the token after it, which a prompt that
            # is only scored never samples; scoring gains nothing from speculation anyway.
            raise UnsupportedParamError("prompt_logprobs", "with speculative decoding, prompt_logprobs are not "
                                        "supported; serve scoring requests without speculative_algorithm")

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
        return self.grammars.state(params)

    def abort(self, rid: str) -> bool:
        for req in self._compiling:
            if req.rid == rid:
                self._compiling.remove(req)
                self.scheduler.finish(req, "abort")
                return True
        return self.scheduler.abort(rid) is not None

    # ---- the loop ------------------------------------------------------------------------------
    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._inflight is not None or bool(self._compiling)

    def step(self) -> list[Request]:
        """Run one batch; returns the requests that got a token or finished in this step, each once.

        With overlap scheduling (the default) the step launches batch N+1 and then resolves batch N,
        whose host work (stop checks, detokenizing, scheduling the next batch) overlaps batch N+1 on
        the device; a request's token is returned one step after its forward is launched.

        A grammar request's token mask needs its previous token accepted by its matcher, and that
        token belongs to batch N. So a batch N+1 with grammar rows launches its forward, then batch N
        is resolved (its tokens accepted, while the forward runs), then the masks are filled and
        N+1 is sampled: masks are exact, overlap stays on, and no extra device sync is added.

        A step that raises (the scheduler, the forward, the sampler) costs only the request whose data
        fails: a single request finishes with finish_reason "error" and its KV is freed; several are put
        back to run again one by one (`_fail_step`). A request's own host work on its tokens (a stop
        check, its grammar) fails that request alone. Under tensor parallelism a failed step raises
        RankFailedError instead: the ranks may be out of step (or one has died), so the engine cannot
        go on; `shutdown()` still works.
        """
        start = time.perf_counter()
        done: list[Request] = self._admit_compiled()
        batch: ScheduledBatch | None = None
        if self.ranks is not None:
            self.ranks.check()
        try:
            if self._inflight is not None and not self._can_overlap():
                done += self._resolve()
            batch = self.scheduler.schedule(self._decode_tokens())
            launched = None
            if batch is not None and batch.mode is ForwardMode.TARGET_VERIFY:
                done += self._verify(batch)  # resolved in the round itself
            elif batch is not None:
                launched = self._launch(batch)
            if self._inflight is not None:
                done += self._resolve()
            if launched is not None and launched.sampling is not None:  # sampling left for the grammar masks
                self._sample(launched)
            self._inflight = launched
            if launched is not None and self.config.scheduler.disable_overlap_schedule:
                done += self._resolve()
        except Exception as e:  # noqa: BLE001 - a failed step costs only its own requests
            if self.ranks is not None:  # ... except under tensor parallelism: see TPRanks
                self._fail_step(batch, e)
                raise self.ranks.fatal(e) from e
            done += self._fail_step(batch, e)
        if batch is not None and self._step_hooks:
            info = StepInfo(batch.mode.value, batch.batch_size, batch.num_tokens, time.perf_counter() - start)
            for hook in self._step_hooks:
                hook(info)
        # A request can get tokens in two phases of one step: while speculating, the previous step's
        # prefill resolves its first token and its first verify round follows at once (and may finish it).
        return list(dict.fromkeys(done))

    def _fail_step(self, batch: ScheduledBatch | None, error: Exception) -> list[Request]:
        """The requests of the failed batch and of the one in flight (whose tokens may never arrive): one
        alone finishes with an error. Several are put back as suspects (`Scheduler.suspect`), each to run
        its prefill alone, so that only the one whose data fails finishes with an error and the others go
        on with the tokens they would have had. Under tensor parallelism every one finishes with an error
        (the engine stops). The scheduler forgets the half-built step."""
        message = f"{type(error).__name__}: {error}"
        inflight = self._inflight.reqs + self._inflight.prefill_only if self._inflight else []
        reqs = [r for r in dict.fromkeys((batch.reqs if batch is not None else []) + inflight) if not r.finished]
        self._inflight = None
        self.scheduler.kv.drain()  # writes and slots of a batch that never ran
        if len(reqs) > 1 and self.ranks is None:
            logger.warning("an engine step of %d requests failed (%s); each runs again alone to find the one at "
                           "fault", len(reqs), message, exc_info=logger.isEnabledFor(logging.DEBUG))
            for req in reqs:
                self.scheduler.suspect(req)
            return []
        logger.exception("engine step failed; its requests finish with an error")
        for req in reqs:
            self.scheduler.finish(req, "error", error=message)
        return reqs

    def add_step_hook(self, hook: Callable[[StepInfo], None]) -> None:
        """Call `hook(StepInfo)` after every step that ran a batch (benchmarks record steps with it)."""
        self._step_hooks.append(hook)

    def remove_step_hook(self, hook: Callable[[StepInfo], None]) -> None:
        self._step_hooks.remove(hook)

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

    def _can_overlap(self) -> bool:
        # Penalties are computed from the output tokens, so those must be on the host first (for every
        # request the next batch may hold: a prefilling one joins the decodes in a MIXED step); a
        # speculative round needs its requests' tokens to draft from.
        # A suspect's solo step must resolve before the next batch launches, so that a failure in either is
        # its own.
        return not self.config.scheduler.disable_overlap_schedule and self.spec_worker is None and \
            not self.scheduler.suspects and not any(r.params.has_penalties for r in self.scheduler.live())

    def _decode_tokens(self) -> int:
        """New positions per running request in the next decode step: a verify tree while speculating,
        1 above the batch size where speculation stops paying (`speculative_disable_batch_size`)."""
        spec = self.config.speculative
        if self.spec_worker is None or len(self.scheduler.running) > spec.speculative_disable_batch_size:
            return 1
        return self.spec_worker.num_draft

    def _launch(self, batch: ScheduledBatch) -> "_Launched | None":
        """Forward and sample on the device, then commit the batch; nothing here waits for the device.
        With a draft model, the draft's DRAFT_EXTEND over the same positions follows. Grammar rows whose
        previous token is still in flight leave the sampling to `step` (no draft model then: speculative
        decoding refuses grammars)."""
        if self.draft_worker is not None:
            batch.capture_hidden = self.draft_worker.target_capture
        asks = prompt_logprobs.plan(batch)
        batch.full_logits = tuple(ask.index for ask in asks)
        rows = self.scheduler.sampling_rows(batch)
        sampled = [batch.reqs[i] for i in rows]
        logit_rows = rows
        if asks:  # the logits hold every position of the scored chunks: take each request's last
            spans = batch.logit_spans()
            logit_rows = [spans[i][0] + spans[i][1] - 1 for i in rows]
        futures = self.runner.future_tokens.reserve(len(sampled)) if sampled else []
        if self.ranks is not None:  # the other ranks run the same forward and sample the same rows
            self.ranks.step(batch, sampled, logit_rows, futures)
        out = self.runner.forward(batch)
        prompt = prompt_logprobs.launch(out.logits, batch, asks) if asks else None
        launched = None
        if sampled:
            sampling = SamplingBatch.from_requests(sampled, self.vocab_size, self.eos_token_ids, self.device)
            logits = sampled_logits(out.logits, logit_rows)
            launched = _Launched(sampled, futures, None, logits, sampling)
            if self._inflight is None or not any(r.grammar is not None for r in sampled):
                self._sample(launched)
        prefill_only = self.scheduler.commit(batch, sampled, [[f] for f in futures])
        if self.draft_worker is not None:
            self.draft_worker.extend_after(batch, out, rows, futures)
        if prompt is not None or prefill_only:
            launched = launched or _Launched([], [], None)
            launched.prompt, launched.prefill_only = prompt, prefill_only
        return launched

    def _sample(self, launched: _Launched) -> None:
        """Sample a launched batch, its grammar rows masked by their matchers as they are now."""
        sampling = launched.sampling
        live = [i for i, r in enumerate(launched.reqs) if r.grammar is not None and not r.finished]
        if live:
            mask = self.grammars.fill([launched.reqs[i].grammar for i in live])
            sampling.grammar_rows = torch.tensor(live, dtype=torch.int64).to(self.device, non_blocking=True)
            sampling.grammar_mask = mask.to(self.device, non_blocking=True)
        pending = self.sampler.sample(launched.logits, sampling)
        self.runner.future_tokens.write(launched.futures, pending.token_ids)
        launched.sample, launched.logits, launched.sampling = pending, None, None

    def _verify(self, batch: ScheduledBatch) -> list[Request]:
        """A speculative round: its committed tokens (and their logprobs) join the requests at once."""
        before = [len(r.output_ids) for r in batch.reqs]
        verified = self.spec_worker.verify(batch)
        got = set(map(id, self.scheduler.resolve(batch.reqs, verified.tokens)))
        done = []
        for req, start, count, logprobs, top in zip(batch.reqs, before, verified.counts, verified.logprobs,
                                                    verified.top_logprobs):
            req.spec_accept_counts[count] = req.spec_accept_counts.get(count, 0) + 1
            if id(req) not in got:
                continue
            done.append(req)
            try:
                if logprobs is not None:
                    new = len(req.output_ids) - start
                    req.output_logprobs += logprobs[:new]
                    req.output_top_logprobs += top[:new]
                self._check_stop_strings(req, start)
            except Exception as e:  # noqa: BLE001 - this request's own host work: it alone fails
                self._fail_request_work(req, e)
        return done

    def _resolve(self) -> list[Request]:
        """Wait for the in-flight batch's tokens and apply them."""
        launched, self._inflight = self._inflight, None
        done = []
        if launched.sample is not None:
            out = launched.sample.result()
            got = set(map(id, self.scheduler.resolve(launched.reqs, [[t] for t in out.token_ids],
                                                     [[f] for f in launched.futures])))
            for req, logprob, top in zip(launched.reqs, out.logprobs, out.top_logprobs):
                if id(req) not in got:
                    continue
                done.append(req)
                try:
                    if logprob is not None:
                        req.output_logprobs.append(logprob)
                        req.output_top_logprobs.append(top)
                    self._advance_grammar(req)
                    self._check_stop_strings(req, len(req.output_ids) - 1)
                except Exception as e:  # noqa: BLE001 - this request's own host work: it alone fails
                    self._fail_request_work(req, e)
        if launched.prompt is not None:
            launched.prompt.apply()
        for req in launched.prefill_only:
            if not req.finished:  # an aborted one was reported when it was aborted
                self.scheduler.finish(req, "length")
                done.append(req)
        return done

    def _fail_request_work(self, req: Request, error: Exception) -> None:
        """A request's own host work on its new tokens (logprobs, grammar, stop strings) raised: its state
        is half updated, so it finishes with an error; the batch goes on."""
        logger.exception("request %s failed while taking its new tokens; it finishes with an error", req.rid)
        self._finish_with_error(req, error)

    def _finish_with_error(self, req: Request, error: Exception) -> None:
        """finish_reason "error", also over a finish not reported yet (the failure comes after it)."""
        message = f"{type(error).__name__}: {error}"
        if req.finished:
            req.finish_reason, req.matched_stop, req.error = "error", None, message
        else:
            self.scheduler.finish(req, "error", error=message)

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
        self._finish_with_error(req, error)
        self._streamed.pop(req.rid, None)
        self._texts.pop(req.rid, None)
        self._reqs.pop(req.rid, None)
        return req, len(req.output_ids)

    def fail_all(self, error: Exception) -> list[tuple[Request, int]]:
        """`fail_request` for every request the engine holds: after a bug whose reach is unknown (the
        caller's loop failed outside any one request), the engine is left empty and can serve again."""
        self._inflight = None
        self.scheduler.kv.drain()  # writes and slots of a batch that may never have run
        return [self.fail_request(req, error) for req in list(self._reqs.values())]

    def _advance_grammar(self, req: Request) -> None:
        """The request's matcher takes its new token; once the grammar can only end, the request
        finishes ("stop", also over a "length" reached with the same token)."""
        state = req.grammar
        if state is None or (req.finished and req.finish_reason != "length"):  # e.g. stopped at EOS
            return
        token = req.output_ids[-1]
        if not state.accept(token):  # the mask allowed it: only a bug gets here
            if not req.finished:
                self.scheduler.finish(req, "error", error=f"the grammar rejected token {token}")
        elif state.ended():
            if req.finished:
                req.finish_reason, req.matched_stop = "stop", None
            else:
                self.scheduler.finish(req, "stop")

    def _check_stop_strings(self, req: Request, start: int) -> None:
        """Feed the request's new tokens `output_ids[start:]` to its stop-string matcher, one by one; at
        a match, drop the tokens after it (a speculative round commits several) and finish."""
        text = self._texts.get(req.rid)
        if text is None:
            return
        for end in range(start + 1, len(req.output_ids) + 1):
            _, matched = text.add(req.output_ids[end - 1:end])
            if matched is not None and end >= req.params.min_new_tokens:
                del req.output_ids[end:], req.output_logprobs[end:], req.output_top_logprobs[end:]
                if req.finished:
                    req.finish_reason, req.matched_stop = "stop", matched
                else:
                    self.scheduler.finish(req, "stop", matched)
                return

    def generate(self, prompts: str | list[str] | None = None,
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 prompt_token_ids: list[int] | list[list[int]] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run prompts (text, or token ids) to completion; outputs in input order. `use_tqdm`: a progress
        bar of finished prompts, drawn only when stderr is a terminal."""
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
        rids = []
        try:
            for item, p in zip(items, params):
                rids.append(self.add_request(sampling_params=p, **item))
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
        return RequestOutput(text=text, token_ids=list(req.output_ids), meta=meta, finished=req.finished)

    # ---- lifecycle -----------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Abort every request and forget them, and stop the tensor-parallel ranks (the engine cannot
        step after that); safe to call at any time, also after a failed step."""
        if self.ranks is not None:
            self.ranks.stop()
        self._inflight = None
        for rid in list(self._reqs):
            self.abort(rid)
        if self.grammars is not None:
            self.grammars.shutdown()
        self._reqs.clear()
        self._texts.clear()
        self._streamed.clear()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Iterable[Any]) -> None:
        self.shutdown()

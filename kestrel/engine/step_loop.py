"""The step loop: schedule a batch, launch it on the device, sample, and give the requests their tokens.

One `step()` runs one batch. With overlap scheduling (the default) it launches batch N+1 and then
resolves batch N, whose host work (stop checks, detokenizing, scheduling the next batch) overlaps
batch N+1 on the device; a request's token is taken one step after its forward is launched.

A grammar request's token mask needs its previous token accepted by its matcher, and that token
belongs to batch N. So a batch N+1 with grammar rows launches its forward, then batch N is resolved
(its tokens accepted, while the forward runs), then the masks are filled and N+1 is sampled: masks
are exact, overlap stays on, and no extra device sync is added.

A speculative round (TARGET_VERIFY) is resolved within its step: the worker verifies and returns a
commit plan, which the loop commits before the requests take the tokens. Plain and speculative
tokens alike are taken by `Scheduler.resolve`, where `Finishing` decides which requests end.

A step that raises (the scheduler, the forward, the sampler) costs only the request whose data fails:
a single request finishes with finish_reason "error" and its KV is freed; several are put back to run
again one by one (`_fail_step`). A request's own host work on its tokens (a stop check, its grammar)
fails that request alone. Under tensor parallelism a failed step raises RankFailedError instead: the
ranks may be out of step (or one has died), so the engine cannot go on.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch

from kestrel.config import EngineConfig
from kestrel.core.batch import ScheduledBatch
from kestrel.core.forward_mode import ForwardMode
from kestrel.core.outputs import StepInfo
from kestrel.core.request import Request
from kestrel.distributed.ranks import TPRanks
from kestrel.engine import pooling, prompt_logprobs
from kestrel.engine.device_step import DeviceStep, Forwarded
from kestrel.engine.grammar import GrammarBackend
from kestrel.engine.scheduler import Scheduler
from kestrel.engine.step_cost import StepShape
from kestrel.sampling.sampler import PendingSample
from kestrel.speculative.worker import SpeculativeWorker

logger = logging.getLogger(__name__)


@dataclass
class _Launched:
    """A batch on the device: its sampled requests, their FutureTokens indices, the sample's host copy;
    its prompt logprobs and pooling results on their way to the host, and the requests it prefilled with
    nothing to sample.

    Until `sample` is set, the batch's forward is launched but not its sampling (which waits for the
    grammar masks, see the module docstring): `forwarded` holds its inputs, `futures` are reserved."""

    reqs: list[Request]
    futures: list[int]
    sample: PendingSample | None
    forwarded: Forwarded | None = None
    prompt: prompt_logprobs.PendingPromptLogprobs | None = None
    pooled: pooling.PendingPooled | None = None
    prefill_only: list[Request] = dataclasses.field(default_factory=list)
    shape: StepShape | None = None  # what the step-cost model is told the batch's time was spent on
    # For a timed batch that samples nothing (a prompt's middle chunk): marks its end on the device, so
    # that its time is its own and not the next batch's.
    done: "torch.cuda.Event | None" = None


class StepLoop:
    def __init__(self, config: EngineConfig, scheduler: Scheduler, device_step: DeviceStep,
                 spec_worker: SpeculativeWorker | None, ranks: TPRanks | None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        """`clock`: what step times are measured with (the step-cost model's, the step hooks')."""
        self.config = config
        self.clock = clock
        self.scheduler = scheduler
        self.device_step = device_step
        self.runner = device_step.runner
        self.spec_worker = spec_worker
        self.ranks = ranks
        self.grammars: GrammarBackend | None = None  # given by the engine with the first grammar request
        self.inflight: _Launched | None = None  # launched batch whose sampled tokens are not taken yet
        self.hooks: list[Callable[[StepInfo], None]] = []
        # When the previous batch's tokens came (or the loop went busy): a batch's time, for the step-cost
        # model, is what the streams see, from there to its own tokens (with overlap, the next batch's
        # host work is inside it, as it is inside the inter-token gap).
        self._last_tokens_at: float | None = None
        # On the CPU a launch runs the forward before returning, and a step launches one batch: the
        # batch's time is then its step's, from the step's start to its end.
        self._synchronous = self.runner.device.type == "cpu"
        # Only an ITL target reads the model: without one, no step's shape or time is recorded (a
        # benchmark that traces step costs sets it).
        self.timed = config.scheduler.itl_target_ms is not None
        self._waiting_held = False  # the last schedule left requests waiting and prefilled nothing

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self.inflight is not None

    def step(self) -> list[Request]:
        """Run one batch; returns the requests that got a token or finished in this step, each once."""
        start = self.clock()
        done: list[Request] = []
        batch: ScheduledBatch | None = None
        ran = False  # a batch ran and the step did not fail: the step's time is the batch's
        if self.ranks is not None:
            self.ranks.check()
        if self.inflight is None:  # the loop may have been idle: nothing to time before now
            self._last_tokens_at = start
        marks = [start]  # the clock at each phase's end (STEP_PHASES)
        try:
            if self.inflight is not None and (not self._can_overlap() or self._prefill_may_follow()):
                done += self._resolve()
            marks.append(self.clock())
            batch = self.scheduler.schedule(self._decode_tokens())
            # Requests left waiting by a step that prefilled nothing are held back (memory, request
            # slots): until one leaves, the next steps will not prefill either and keep their overlap.
            self._waiting_held = bool(self.scheduler.waiting) and (batch is None or batch.num_prefill == 0)
            marks.append(self.clock())
            launched = None
            if batch is not None and batch.mode is ForwardMode.TARGET_VERIFY:
                done += self._verify(batch)  # resolved in the round itself; not a shape the model knows
                self._last_tokens_at = self.clock()
            elif batch is not None:
                launched = self._launch(batch)
            marks.append(self.clock())
            if self.inflight is not None:
                done += self._resolve()
            if launched is not None and launched.forwarded is not None:
                self._sample(launched)  # left for the grammar masks
            self.inflight = launched
            if launched is not None and self.config.scheduler.disable_overlap_schedule:
                done += self._resolve()
            ran = batch is not None
        except Exception as e:  # noqa: BLE001 - a failed step costs only its own requests
            if self.ranks is not None:  # ... except under tensor parallelism: see TPRanks
                self._fail_step(batch, e)
                raise self.ranks.fatal(e) from e
            done += self._fail_step(batch, e)
        marks.append(self.clock())
        seconds = marks[-1] - start
        if self._synchronous and self.timed and ran and batch.mode is not ForwardMode.TARGET_VERIFY:
            self.scheduler.cost.observe(StepShape.of(batch), seconds)
        if batch is not None and self.hooks:
            info = StepInfo(batch.mode.value, batch.batch_size, batch.num_tokens, seconds,
                            sum(batch.extend_lens[:batch.num_prefill]),
                            tuple(b - a for a, b in zip(marks, marks[1:])) if len(marks) == 5 else ())
            for hook in self.hooks:
                hook(info)
        # A request can get tokens in two phases of one step: while speculating, the previous step's
        # prefill resolves its first token and its first verify round follows at once (and may finish it).
        return list(dict.fromkeys(done))

    def drop_inflight(self) -> None:
        """Forget the batch in flight and the KV changes not sent yet (after a failure outside a step)."""
        self.inflight = None
        self.scheduler.kv.drain()

    # ---- launch ----------------------------------------------------------------------------------
    def _can_overlap(self) -> bool:
        # Penalties are computed from the output tokens, so those must be on the host first (for every
        # request the next batch may hold: a prefilling one joins the decodes in a MIXED step); a
        # speculative round needs its requests' tokens to draft from.
        # A suspect's solo step must resolve before the next batch launches, so that a failure in either is
        # its own.
        return not self.config.scheduler.disable_overlap_schedule and self.spec_worker is None and \
            not self.scheduler.suspects and not any(r.params.has_penalties for r in self.scheduler.live())

    def _prefill_may_follow(self) -> bool:
        """Under an ITL target, whether the next batch may prefill: its launch then keeps the host for
        several ms (attention runs eagerly between the graph pieces), and overlapped, the batch in flight
        would give its tokens to the streams only after that launch: on the H100 the gap before a MIXED
        step came out at the decode step plus the MIXED step (27 ms where each took 9 and 18). Requests
        held back (the last schedule left them waiting and prefilled nothing) do not count: resolving
        first costs every step its overlap, and a saturated server would pay it on each one."""
        # The target, not `timed`: a benchmark traces step costs without one and keeps the overlap.
        return self.config.scheduler.itl_target_ms is not None and \
            (self.scheduler.chunked is not None or (bool(self.scheduler.waiting) and not self._waiting_held))

    def _decode_tokens(self) -> int:
        """New positions per running request in the next decode step (more than 1: a verify tree)."""
        if self.spec_worker is None:
            return 1
        return self.spec_worker.decode_tokens(len(self.scheduler.running))

    def _launch(self, batch: ScheduledBatch) -> _Launched | None:
        """Forward and sample on the device, then commit the batch; nothing here waits for the device.
        With a draft model, the draft's forward over the same positions follows. Grammar rows whose
        previous token is still in flight leave the sampling to `step` (never while speculating: nothing
        overlaps then)."""
        if self.spec_worker is not None:
            batch.capture_hidden = self.spec_worker.target_capture
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
        forwarded = self.device_step.forward(batch, sampled, logit_rows)
        prompt = prompt_logprobs.launch(forwarded.out.logits, batch, asks) if asks else None
        pool_asks = pooling.plan(batch)
        pooled = pooling.launch(forwarded.out, batch, pool_asks) if pool_asks else None
        launched = None
        if sampled:
            launched = _Launched(sampled, futures, None, forwarded)
            if self.inflight is None or not any(r.grammar is not None for r in sampled):
                self._sample(launched)
        prefill_only = self.scheduler.commit(batch, sampled, [[f] for f in futures])
        if self.spec_worker is not None:
            self.spec_worker.after_forward(batch, forwarded.out, rows, futures)
        if prompt is not None or pooled is not None or prefill_only:
            launched = launched or _Launched([], [], None)
            launched.prompt, launched.pooled, launched.prefill_only = prompt, pooled, prefill_only
        if self.timed and not self._synchronous:  # timed when it resolves, as every batch in flight is
            if launched is None:
                launched = _Launched([], [], None)
                launched.done = torch.cuda.Event() if self.runner.device.type == "cuda" else None
                if launched.done is not None:
                    launched.done.record()
            launched.shape = StepShape.of(batch)
        return launched

    def _sample(self, launched: _Launched) -> None:
        """Sample a launched batch, its grammar rows masked by their matchers as they are now."""
        sampling = launched.forwarded.sampling
        live = [i for i, r in enumerate(launched.reqs) if r.grammar is not None and r.grammar.active
                and not r.finished]
        if live:
            mask = self.grammars.fill([launched.reqs[i].grammar for i in live])
            sampling.grammar_rows = torch.tensor(live, dtype=torch.int64).to(self.runner.device, non_blocking=True)
            sampling.grammar_mask = mask.to(self.runner.device, non_blocking=True)
        launched.sample = self.device_step.sample(launched.forwarded, launched.futures)
        launched.forwarded = None

    # ---- resolve -------------------------------------------------------------------------------
    def _verify(self, batch: ScheduledBatch) -> list[Request]:
        """A speculative round: the worker's commit plan is committed (the accepted paths keep their KV,
        the other new slots are freed), a draft model catches up, and the requests take the tokens."""
        plan = self.spec_worker.verify(batch)
        self.scheduler.commit(batch, [], [])
        for req, path in zip(batch.reqs, plan.paths):
            self.scheduler.keep_new_slots(req, plan.num_new, path)
        if self.spec_worker.has_draft_kv:  # the rollback's row writes and KV moves go with the draft's forward
            writes, moves, new = self.scheduler.kv.drain()
            assert new.numel() == 0, "nothing is allocated between a verify and its draft extend"
            self.spec_worker.after_commit(batch, plan, writes, moves)
        for req, count in zip(batch.reqs, plan.counts):
            req.spec_accept_counts[count] = req.spec_accept_counts.get(count, 0) + 1
        return self.scheduler.resolve(batch.reqs, plan.tokens, None, plan.logprobs, plan.top_logprobs)

    def _resolve(self) -> list[Request]:
        """Wait for the in-flight batch's tokens and give them to its requests."""
        launched, self.inflight = self.inflight, None
        done = []
        if launched.sample is not None:
            out = launched.sample.result()
            logprobs = [None if lp is None else [lp] for lp in out.logprobs]
            tops = [None if lp is None else [top] for lp, top in zip(out.logprobs, out.top_logprobs)]
            done += self.scheduler.resolve(launched.reqs, [[t] for t in out.token_ids],
                                           [[f] for f in launched.futures], logprobs, tops)
        if launched.prompt is not None:
            launched.prompt.apply()
        if launched.pooled is not None:
            launched.pooled.apply()
        for req in launched.prefill_only:
            if not req.finished:  # an aborted one was reported when it was aborted
                self.scheduler.finish_if_done(req)
                done.append(req)
        if launched.done is not None:
            launched.done.synchronize()
        now = self.clock()
        if launched.shape is not None and self._last_tokens_at is not None:
            self.scheduler.cost.observe(launched.shape, now - self._last_tokens_at)
        self._last_tokens_at = now
        return done

    # ---- failure ---------------------------------------------------------------------------------
    def _fail_step(self, batch: ScheduledBatch | None, error: Exception) -> list[Request]:
        """The requests of the failed batch and of the one in flight (whose tokens may never arrive): one
        alone finishes with an error. Several are put back as suspects (`Scheduler.suspect`), each to run
        its prefill alone, so that only the one whose data fails finishes with an error and the others go
        on with the tokens they would have had. Under tensor parallelism every one finishes with an error
        (the engine stops). The scheduler forgets the half-built step."""
        message = f"{type(error).__name__}: {error}"
        inflight = self.inflight.reqs + self.inflight.prefill_only if self.inflight else []
        reqs = [r for r in dict.fromkeys((batch.reqs if batch is not None else []) + inflight) if not r.finished]
        self.drop_inflight()  # writes and slots of a batch that never ran
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

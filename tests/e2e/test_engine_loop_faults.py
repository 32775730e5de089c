"""A bug in the engine loop's own bookkeeping (reporting a request, outside the forward) costs the requests
it touches, not the engine process: they finish with an error, the others' tokens equal a clean run, the
loop goes on serving and every KV slot comes back. Faults are injected into the real loop and engine."""
from __future__ import annotations

import multiprocessing as mp
import threading

from kestrel import Engine, SamplingParams
from kestrel.server.engine_process import EngineLoop
from kestrel.server.messages import AddRequests, NewRequest, Shutdown, StepOutput
from tests.e2e.conftest import assert_pool_full

PARAMS = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = {name: [3 + i, 40 + 2 * i, 7, 9 + i] for i, name in enumerate("abcdefgh")}


class Fault(RuntimeError):
    pass


def fail_once_for(rid: str, real):
    """`real(req, *args)`, except that it raises once when given request `rid`."""
    armed = [True]

    def faulty(req, *args):
        if req.rid == rid and armed[0]:
            armed[0] = False
            raise Fault(f"injected for {rid}")
        return real(req, *args)

    return faulty


def test_a_bookkeeping_fault_fails_only_the_requests_it_touches(tiny_model, monkeypatch):
    engine = Engine(model=tiny_model("llama"), device="cpu", dtype="float32", max_total_tokens=512)
    outs = engine.generate(prompt_token_ids=list(PROMPTS.values()), sampling_params=PARAMS, use_tqdm=False)
    want = {name: o.token_ids for name, o in zip(PROMPTS, outs)}
    inbox_r, inbox_w = mp.Pipe(duplex=False)
    outbox_r, outbox_w = mp.Pipe(duplex=False)
    loop = EngineLoop(engine, inbox_r, outbox_w)
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()

    def serve(names: str) -> dict[str, tuple[list[int], str]]:
        inbox_w.send(AddRequests(names, [NewRequest(n, PROMPTS[n], PARAMS) for n in names]))
        got: dict[str, list[int]] = {n: [] for n in names}
        done: dict[str, tuple[list[int], str]] = {}
        while len(done) < len(names):
            assert outbox_r.poll(60), "the engine loop stopped answering"
            msg = outbox_r.recv()
            for delta in msg.deltas if isinstance(msg, StepOutput) else []:
                assert delta.rid not in done, f"{delta.rid} reported after its finish"
                got[delta.rid] += delta.token_ids
                if delta.finished:
                    done[delta.rid] = (got[delta.rid], delta.finish_reason)
        return done

    # A fault while reporting one request, in the engine (step_deltas) and in the loop (its delta).
    monkeypatch.setattr(engine, "_report", fail_once_for("b", engine._report))
    monkeypatch.setattr(loop, "_delta", fail_once_for("c", loop._delta))
    done = serve("abcd")
    assert {n: reason for n, (_, reason) in done.items()} == {"a": "length", "b": "error", "c": "error", "d": "length"}
    assert done["a"][0] == want["a"] and done["d"][0] == want["d"]
    # A fault in the step as a whole: what it reached is unknown, so the requests in the engine fail.
    step_deltas = engine.step_deltas
    calls = []

    def failing_third_call(touched=()):
        calls.append(1)
        if len(calls) == 3:
            raise Fault("injected in the step")
        return step_deltas(touched)

    monkeypatch.setattr(engine, "step_deltas", failing_third_call)
    assert {reason for _, reason in serve("ef").values()} == {"error"}
    monkeypatch.setattr(engine, "step_deltas", step_deltas)
    # ... and the loop serves on, with the same tokens as a clean run.
    assert serve("gh") == {n: (want[n], "length") for n in "gh"}
    # Nothing the faults touched is left behind: no request, no KV slot.
    assert not engine.scheduler.live()
    assert_pool_full(engine)
    inbox_w.send(Shutdown())
    thread.join(30)
    assert not thread.is_alive()
    assert engine.runner is None  # the shut-down engine let go of its model and KV pool


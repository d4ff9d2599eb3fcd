"""The micro-batching update engine (service.engine), without Redis or HTTP."""

from __future__ import annotations

import asyncio

import pytest
import torch
from mpflow.operators.models import make_model
from mpflow.operators.models.priors import prior_from_spec
from mpflow.operators.updaters import get_updater
from mpflow.operators.updaters.smc import SMCUpdater
from mpflow.service.engine.update_engine import UpdateEngine, batch_key

PRIOR = prior_from_spec({"type": "gaussian", "mean": [0.0, 0.0], "cov": [[1.0, 0.0], [0.0, 1.0]]})


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, int]] = []

    def __call__(self, method: str, family: str, batch: int, seconds: float) -> None:
        assert seconds >= 0
        self.calls.append((method, family, batch))


def run_streams(engine: UpdateEngine, n_streams: int, steps: int, updater=None) -> list:
    """n_streams concurrent streams, each applying ``steps`` observations in order; their final states."""
    updater = updater or get_updater("smc")
    model = make_model("linear_gaussian", None, 2)
    obs = [torch.tensor([0.5 * k, -0.25 * k]) for k in range(1, steps + 1)]

    async def stream(i: int):
        state = updater.init(PRIOR, model, 32, seed=i)
        for o in obs:
            res = await engine.update(updater, ("smc", None), "smc", model, state, o + i)
            state = res.state
        return state

    async def main():
        await engine.start()
        try:
            return await asyncio.gather(*(stream(i) for i in range(n_streams)))
        finally:
            await engine.stop()

    return asyncio.run(main())


def test_batched_results_equal_unbatched_and_order_is_kept():
    on, off = Recorder(), Recorder()
    batched = run_streams(UpdateEngine(max_batch_size=8, max_wait_ms=20, observer=on), 8, 3)
    alone = run_streams(UpdateEngine(batching=False, observer=off), 8, 3)
    assert sum(b for *_, b in on.calls) == 24 and len(on.calls) < 24  # stacked calls
    assert max(b for *_, b in on.calls) > 1
    assert [b for *_, b in off.calls] == [1] * 24
    assert all(m == "smc" and f == "linear_gaussian" for m, f, _ in on.calls)
    for a, b in zip(batched, alone, strict=True):
        assert int(a.step) == 3  # every step applied once, in order
        assert torch.allclose(a.particles, b.particles, atol=1e-5)
        assert torch.allclose(a.log_evidence, b.log_evidence, atol=1e-6)
        assert torch.equal(a.rng, b.rng)  # each stream drew exactly its own random numbers


def test_batch_size_is_capped():
    rec = Recorder()
    run_streams(UpdateEngine(max_batch_size=3, max_wait_ms=50, observer=rec), 7, 1)
    assert max(b for *_, b in rec.calls) <= 3 and sum(b for *_, b in rec.calls) == 7


class Picky(SMCUpdater):
    """Refuses observations over 100 — to check that one bad stream does not fail its batch-mates."""

    seen: list[int] = []

    def update(self, state, obs, model):
        self.seen.append(state.batch_size)
        if bool((obs > 100).any()):
            raise ValueError("observations: too large")
        return super().update(state, obs, model)


def test_a_failing_stream_fails_alone():
    engine = UpdateEngine(max_batch_size=8, max_wait_ms=50)
    updater = Picky()
    updater.seen = []
    model = make_model("linear_gaussian", None, 2)

    async def main():
        await engine.start()
        try:
            jobs = [
                engine.update(updater, "picky", "smc", model, updater.init(PRIOR, model, 8, i), torch.tensor(o))
                for i, o in enumerate([[0.0, 1.0], [500.0, 0.0], [1.0, 1.0]])
            ]
            return await asyncio.gather(*jobs, return_exceptions=True)
        finally:
            await engine.stop()

    ok1, bad, ok2 = asyncio.run(main())
    assert isinstance(bad, ValueError) and str(bad) == "observations: too large"
    assert int(ok1.state.step) == 1 and int(ok2.state.step) == 1
    assert updater.seen == [3, 1, 1, 1]  # the stacked call failed; each stream was re-run on its own


def test_batch_key_separates_what_cannot_be_stacked():
    smc, kal = get_updater("smc"), get_updater("kalman")
    lg2 = make_model("linear_gaussian", None, 2)
    lg2_k1 = make_model("linear_gaussian", {"H": [[1.0, 0.0]]}, 2)
    s = smc.init(PRIOR, lg2, 16, 0)
    o = torch.zeros(2)
    k = batch_key(("smc", None), lg2, s, o)
    assert k == batch_key(("smc", None), lg2, smc.init(PRIOR, lg2, 16, 5), o)  # seeds do not matter
    assert k != batch_key(("smc", None), lg2, smc.init(PRIOR, lg2, 32, 0), o)  # N
    assert k != batch_key(("smc", None), lg2_k1, s, torch.zeros(1))  # H's shape / obs shape
    assert k != batch_key(("kalman", None), lg2, kal.init(PRIOR, lg2, 16, 0), o)  # method and extras


def test_engine_must_run_and_arguments_are_checked():
    with pytest.raises(ValueError, match=r"^max_batch_size"):
        UpdateEngine(max_batch_size=0)
    engine = UpdateEngine()
    model = make_model("linear_gaussian", None, 2)
    state = get_updater("smc").init(PRIOR, model, 8, 0)

    async def main():
        with pytest.raises(RuntimeError, match="not running"):
            await engine.update(get_updater("smc"), "k", "smc", model, state, torch.zeros(2))

    asyncio.run(main())


def test_after_hooks_run_on_the_worker_per_stream_and_fail_alone():
    """Each job's ``after`` hook sees its own row of the batched step on the worker thread; a hook that raises
    fails its stream only (the batch-mates keep their results and hooks)."""
    import threading

    updater, model = get_updater("smc"), make_model("linear_gaussian", None, 2)
    threads: list[str] = []

    def after(res):
        threads.append(threading.current_thread().name)
        if float(res.state.log_evidence[0]) == 0.0:  # never: a step always adds evidence
            raise AssertionError("after saw the pre-step state")
        return float(res.state.particles.mean())

    def failing(res):
        raise ValueError("observations[0]: refused by the hook")

    async def main():
        rec = Recorder()
        engine = UpdateEngine(max_batch_size=8, max_wait_ms=50, observer=rec)
        await engine.start()
        try:
            states = [updater.init(PRIOR, model, 32, seed=i) for i in range(4)]
            hooks = [after, failing, after, after]
            return rec, await asyncio.gather(
                *(
                    engine.update(updater, ("smc", None), "smc", model, s, torch.tensor([1.0, -1.0]), after=h)
                    for s, h in zip(states, hooks, strict=True)
                ),
                return_exceptions=True,
            )
        finally:
            await engine.stop()

    rec, results = asyncio.run(main())
    assert max(b for *_, b in rec.calls) > 1  # they were stacked
    assert isinstance(results[1], ValueError) and "refused by the hook" in str(results[1])
    for r in (results[0], results[2], results[3]):
        assert r.after == pytest.approx(float(r.state.particles.mean()))
    assert threads and all(t.startswith("mpflow-update") for t in threads)

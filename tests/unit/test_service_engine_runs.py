"""Run jobs of the update engine (service.engine, "Runs"): many steps of one stream in one hop to the worker, bounded
by the run's slice, stopped by a failing step, and not in the way of other streams' steps."""

from __future__ import annotations

import asyncio
import time

import torch
from mpflow.operators.models import make_model
from mpflow.operators.models.priors import prior_from_spec
from mpflow.operators.updaters import get_updater
from mpflow.service.engine.stepping import row_views
from mpflow.service.engine.update_engine import RUN_FLOATS, RUN_STEPS, UpdateEngine, run_length

PRIOR = prior_from_spec({"type": "gaussian", "mean": [0.0, 0.0], "cov": [[1.0, 0.0], [0.0, 1.0]]})
MODEL = make_model("linear_gaussian", None, 2)


def test_run_length_is_bounded_by_steps_and_memory():
    assert run_length(256, 1, 1000) == RUN_STEPS
    assert run_length(256, 1, 5) == 5
    assert run_length(65536, 64, 1000) == 1  # one step of a heavy stream is a run of its own
    assert run_length(4096, 64, 1000) * 4096 * 64 <= RUN_FLOATS


class FailsAt:
    """An updater that raises on its ``k``-th call (1-based), else runs ``inner``."""

    def __init__(self, inner, k: int):
        self.inner, self.k, self.calls = inner, k, 0

    def update(self, state, obs, model):
        self.calls += 1
        if self.calls == self.k:
            raise ValueError("injected")
        return self.inner.update(state, obs, model)


def _run(coro_fn):
    async def main():
        engine = UpdateEngine(summarise=row_views)
        await engine.start()
        try:
            return await coro_fn(engine)
        finally:
            await engine.stop()

    return asyncio.run(main())


def test_a_run_equals_single_steps_and_stops_at_a_failing_step():
    kalman = get_updater("kalman")
    obs = [torch.tensor([0.1 * k, -0.2 * k]) for k in range(10)]
    start = kalman.init(PRIOR, MODEL, 16, seed=0)

    async def scenario(engine):
        run = await engine.update_run(kalman, "kalman", start, [(MODEL, o) for o in obs])
        state = start
        for o in obs[: len(run.steps)]:
            state = (await engine.update(kalman, ("kalman", None), "kalman", MODEL, state, o)).state
        failing = await engine.update_run(FailsAt(kalman, 4), "kalman", start, [(MODEL, o) for o in obs])
        return run, state, failing

    run, state, failing = _run(scenario)
    assert 1 <= len(run.steps) <= 10 and run.error is None
    assert all(r.summary is not None and r.summary[1] for r in run.steps)  # summarised and checked, every step
    assert [int(r.state.step[0]) for r in run.steps] == list(range(1, len(run.steps) + 1))
    assert torch.equal(run.steps[-1].state.extras["mean"], state.extras["mean"])
    if len(run.steps) >= 4:  # the slice did not end the run first
        assert len(failing.steps) == 3 and isinstance(failing.error, ValueError)


def test_a_single_step_of_another_stream_does_not_wait_for_a_long_run():
    """A 2000-step request of one stream and one step of another, submitted together: the single step is answered
    after at most a few slices, long before the request's steps are all done."""
    smc = get_updater("smc")
    obs = [torch.tensor([0.01 * k, 0.0]) for k in range(2000)]

    async def scenario(engine):
        long_state = smc.init(PRIOR, MODEL, 64, seed=1)

        async def long_request():
            state, left = long_state, [(MODEL, o) for o in obs]
            while left:
                run = await engine.update_run(smc, "smc", state, left)
                state, left = run.steps[-1].state, left[len(run.steps) :]
            return time.monotonic()

        async def single():
            await asyncio.sleep(0.05)  # once the long request holds the lane
            t0 = time.monotonic()
            other = smc.init(PRIOR, MODEL, 64, seed=2)
            await engine.update(smc, ("smc", None), "smc", MODEL, other, obs[0])
            return t0, time.monotonic()

        return await asyncio.gather(long_request(), single())

    long_done, (asked, answered) = _run(scenario)
    assert answered < long_done  # answered while the long request was still running

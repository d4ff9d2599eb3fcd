"""The update engine's lanes (service.engine, service.lanes): a heavy step does not hold a light one."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import torch
from mpflow.operators.models import make_model
from mpflow.operators.models.priors import prior_from_spec
from mpflow.operators.updaters.smc import SMCUpdater
from mpflow.service.engine.lanes import FAST, HEAVY_STEP_SHARE, SLOW, SLOW_LANE_NICE, LaneLimits
from mpflow.service.engine.update_engine import UpdateEngine
from mpflow.service.streams.costs import Cost

PRIOR = prior_from_spec({"type": "gaussian", "mean": [0.0, 0.0], "cov": [[1.0, 0.0], [0.0, 1.0]]})
MODEL = make_model("linear_gaussian", None, 2)
OBS = torch.tensor([0.5, -0.5])


class Slow(SMCUpdater):
    """An smc step that first blocks for ``hold`` seconds (a sleep, so the GIL is free as in torch's kernels)."""

    def __init__(self, hold: float) -> None:
        super().__init__()
        self.hold = hold
        self.threads: list[str] = []
        self.nice: list[int] = []

    def update(self, state, obs, model):
        self.threads.append(threading.current_thread().name)
        self.nice.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        time.sleep(self.hold)
        return super().update(state, obs, model)


#: a budget of one request for these tests: 1e6 operations, 1e6 bytes
LIMITS = LaneLimits(1e6, 1e6)
LIGHT, HEAVY = Cost(1e3, 1e3), Cost(0.4e6, 1e3)


def test_the_lane_is_read_off_the_price_of_either_budget():
    edge = HEAVY_STEP_SHARE * 1e6
    assert LIMITS.lane_of(Cost(edge, 0.0)) == FAST and LIMITS.lane_of(Cost(edge * 1.01, 0.0)) == SLOW
    assert LIMITS.lane_of(Cost(0.0, edge * 1.01)) == SLOW  # bytes alone make a step heavy
    assert LIMITS.lane_of(None) == FAST  # an unpriced job is light
    assert LaneLimits().lane_of(Cost(2e9, 0.0)) == SLOW and LaneLimits().lane_of(Cost(1e9, 0.0)) == FAST
    assert LaneLimits().seconds(Cost(2.5e10, 0.0)) == 1.0


def test_a_batch_stacks_jobs_only_within_its_lanes_cap():
    """Seven same-key steps queued together on the slow lane, priced 0.4, 0.4, 0.4, 1.5, 0.3, 0.3, 0.3 of the
    budget: one call takes 0.4 + 0.4 (a third would make 1.2), then 0.4 alone (the next is over the cap), then the
    job over the cap alone, then the three of 0.3 together — never more than one budget per call."""
    sizes: list[int] = []
    engine = UpdateEngine(max_wait_ms=50, limits=LIMITS, observer=lambda m, f, b, s: sizes.append(b))
    updater = Slow(0.0)
    prices = [0.4, 0.4, 0.4, 1.5, 0.3, 0.3, 0.3]

    async def work():
        states = [updater.init(PRIOR, MODEL, 64, 64) for _ in prices]
        jobs = [
            engine.update(updater, "key", "smc", MODEL, s, OBS, price=Cost(p * 1e6, 0.0))
            for s, p in zip(states, prices, strict=True)
        ]
        return await asyncio.gather(*jobs)

    run(engine, work)
    assert sizes == [2, 1, 1, 3]


def test_light_jobs_stack_up_to_the_batch_size():
    sizes: list[int] = []
    engine = UpdateEngine(max_wait_ms=50, max_batch_size=4, limits=LIMITS, observer=lambda m, f, b, s: sizes.append(b))
    updater = Slow(0.0)

    async def work():
        states = [updater.init(PRIOR, MODEL, 64, 64) for _ in range(6)]
        return await asyncio.gather(*(engine.update(updater, "k", "smc", MODEL, s, OBS, price=LIGHT) for s in states))

    run(engine, work)
    assert sizes == [4, 2]


def run(engine: UpdateEngine, work):
    """``await work()`` with the engine started (and stopped after)."""

    async def main():
        await engine.start()
        try:
            return await work()
        finally:
            await engine.stop()

    return asyncio.run(main())


def step(engine: UpdateEngine, updater: Slow, n: int, announced=None):
    """One step of a new N-particle stream of ``updater`` (its batch key: the updater's identity), priced heavy at
    N ≥ 512."""
    price = HEAVY if n >= 512 else LIGHT
    state = updater.init(PRIOR, MODEL, n, n)
    return engine.update(updater, id(updater), "smc", MODEL, state, OBS, announced, price=price)


#: the highest nice value Linux allows: a thread already there (a run under ``nice -n 19``) cannot be lowered further
MAX_NICE = 19


def test_a_light_step_is_not_queued_behind_a_heavy_one():
    """The heavy step (slow lane, held 3 s) is submitted first; the light step (fast lane) finishes while the heavy
    one is still on — on a thread of its own — and the busy report names the heavy job while it runs. No wall-clock
    bound: on loaded cores (a run under ``nice -n 19``) the light step may take long, but not as long as a step
    queued behind the heavy one, which would only start once the heavy one is done."""
    engine = UpdateEngine(max_wait_ms=0, limits=LIMITS)
    heavy, light = Slow(3.0), Slow(0.0)

    async def work():
        big = asyncio.create_task(step(engine, heavy, 512))
        while not engine.busy():  # the heavy step is on its worker
            await asyncio.sleep(0.01)
        busy = engine.busy()
        await step(engine, light, 8)
        during = engine.busy()  # the light step is done: is the heavy one still on?
        await big
        return busy, during

    busy, during = run(engine, work)
    assert [b.lane for b in busy] == [SLOW] and "N = 512, d = 2" in busy[0].what
    assert [b.lane for b in during] == [SLOW], "the light step waited for the heavy one"
    assert heavy.threads[0].startswith("mpflow-update-slow") and light.threads[0].startswith("mpflow-update-fast")
    # the slow lane yields the CPU first — by SLOW_LANE_NICE, up to the ceiling a niced run starts near
    assert heavy.nice[0] == min(light.nice[0] + SLOW_LANE_NICE, MAX_NICE)
    assert light.nice[0] == MAX_NICE or heavy.nice[0] > light.nice[0]
    assert engine.busy() == []


def test_a_heavy_requests_announced_steps_do_not_hold_a_light_step():
    """A light request (its own step announced) is dispatched at once while a heavy request still has announced
    steps to come: those steps can only join the slow lane's batches, so the fast lane does not wait for them —
    for them it would wait max_wait (5 s here, which the heavy step itself waits for its own; well above any
    scheduling delay of loaded cores)."""
    engine = UpdateEngine(max_wait_ms=5_000, limits=LIMITS)
    heavy, light = Slow(0.0), Slow(0.0)

    async def work():
        with engine.expect(5) as heavy_steps:
            await step(engine, heavy, 512, heavy_steps)  # 4 more to come
            with engine.expect(1) as light_step:
                t0 = time.monotonic()
                await step(engine, light, 8, light_step)
                return time.monotonic() - t0

    assert run(engine, work) < 2.5  # not max_wait (5 s)

"""UpdateEngine.expect: the dispatcher waits for announced jobs, and only for them (service.engine)."""

from __future__ import annotations

import asyncio
import time

import torch
from mpflow.operators.models import make_model
from mpflow.operators.models.priors import prior_from_spec
from mpflow.operators.updaters import get_updater
from mpflow.service.engine.update_engine import UpdateEngine

PRIOR = prior_from_spec({"type": "gaussian", "mean": [0.0, 0.0], "cov": [[1.0, 0.0], [0.0, 1.0]]})
MODEL = make_model("linear_gaussian", None, 2)
UPDATER = get_updater("smc")
LONG_WAIT_MS = 5000.0  # a batch that waited for its deadline would take this long


def _submit(engine: UpdateEngine, seed: int, announced=None):
    state = UPDATER.init(PRIOR, MODEL, 16, seed=seed)
    return engine.update(UPDATER, "smc", "smc", MODEL, state, torch.tensor([0.5, -0.5]), announced)


def _run(body, sizes: list[int]) -> float:
    engine = UpdateEngine(max_batch_size=8, max_wait_ms=LONG_WAIT_MS, observer=lambda m, f, b, s: sizes.append(b))

    async def main() -> float:
        await engine.start()
        try:
            t0 = time.monotonic()
            await body(engine)
            return time.monotonic() - t0
        finally:
            await engine.stop()

    return asyncio.run(main())


def test_an_announced_lone_job_does_not_wait_for_the_batch_to_fill() -> None:
    sizes: list[int] = []

    async def body(engine: UpdateEngine) -> None:
        with engine.expect(1) as announced:
            res = await _submit(engine, 0, announced)
        assert int(res.state.step) == 1

    assert _run(body, sizes) < LONG_WAIT_MS / 1000 / 2
    assert sizes == [1]


def test_the_batch_waits_for_announced_jobs_and_joins_them() -> None:
    sizes: list[int] = []

    async def body(engine: UpdateEngine) -> None:
        async def late(announced) -> None:
            await asyncio.sleep(0.05)  # e.g. still reading its stream from the store
            await _submit(engine, 1, announced)

        with engine.expect(1) as a, engine.expect(1) as b:
            await asyncio.gather(_submit(engine, 0, a), late(b))

    assert _run(body, sizes) < LONG_WAIT_MS / 1000 / 2
    assert sizes == [2]  # the first job waited for the announced second one


def test_a_closed_announcement_releases_the_wait() -> None:
    sizes: list[int] = []

    async def body(engine: UpdateEngine) -> None:
        async def gives_up() -> None:
            with engine.expect(1):
                await asyncio.sleep(0.05)  # e.g. a 409: nothing submitted

        with engine.expect(1) as a:
            await asyncio.gather(_submit(engine, 0, a), gives_up())

    assert _run(body, sizes) < LONG_WAIT_MS / 1000 / 2
    assert sizes == [1]

"""The watchdog (service.watchdog): a blocked event loop and a worker past its deadline are named, then clear."""

from __future__ import annotations

import asyncio
import time

from mpflow.service.engine import watchdog as wd
from mpflow.service.engine.update_engine import Busy


def test_a_blocked_loop_is_named_while_blocked_and_for_the_hold_after(monkeypatch):
    monkeypatch.setattr(wd, "LAG_HOLD_SECONDS", 0.5)
    ticks: list[tuple[float, dict[str, float]]] = []

    async def main():
        dog = wd.Watchdog(
            asyncio.get_running_loop(),
            list,
            loop_lag_limit=0.2,
            worker_deadline=10,
            beat=0.02,
            on_tick=lambda lag, busy: ticks.append((lag, busy)),
        )
        dog.start()
        try:
            await asyncio.sleep(0.2)
            healthy = dog.problems()
            time.sleep(0.6)  # the loop blocked: the watchdog's beats wait
            await asyncio.sleep(0.05)
            after = dog.problems()
            await asyncio.sleep(0.8)  # past the hold
            return healthy, after, dog.problems()
        finally:
            dog.stop()

    healthy, after, cleared = asyncio.run(main())
    assert healthy == [] and cleared == []
    assert len(after) == 1 and "event loop lagged" in after[0] and "MPFLOW_LOOP_LAG_LIMIT_SECONDS" in after[0]
    assert max(lag for lag, _ in ticks) > 0.4  # the gauge saw it
    assert set(ticks[0][1]) == {"fast", "slow", "aux"}


def test_a_worker_past_its_deadline_is_named_with_its_job():
    jobs: list[Busy] = []

    async def main():
        dog = wd.Watchdog(asyncio.get_running_loop(), lambda: jobs, loop_lag_limit=5, worker_deadline=0.3, beat=0.02)
        jobs.append(Busy("slow", time.monotonic(), "smc on linear_gaussian, N = 65536, d = 64, 1 stream(s)"))
        early = dog.problems()
        await asyncio.sleep(0.4)
        late = dog.problems()
        jobs.clear()
        return early, late, dog.problems()

    early, late, done = asyncio.run(main())
    assert early == [] and done == []
    assert len(late) == 1 and "slow worker" in late[0] and "N = 65536, d = 64" in late[0]
    assert "MPFLOW_WORKER_DEADLINE_SECONDS" in late[0]


def test_the_watchdog_gauges_are_exported():
    from mpflow.service.api.metrics import Metrics

    metrics = Metrics()
    metrics.observe_watchdog(0.5, {"fast": 0.0, "slow": 2.0, "aux": 0.0})
    text = metrics.render().decode()
    assert "mpflow_event_loop_lag_seconds 0.5" in text
    assert 'mpflow_worker_busy_seconds{worker="slow"} 2.0' in text

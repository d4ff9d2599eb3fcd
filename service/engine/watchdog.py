"""The watchdog behind a truthful ``/readyz``: is the event loop answering, and is any compute worker stuck?

A stuck event loop cannot check itself, so the watchdog is a thread. Every :data:`BEAT_SECONDS` it posts a beat to
the loop (``call_soon_threadsafe``) and notes when the loop ran it. The loop's *lag* is the age of a beat not yet
run, or else how late the last beat ran: near 0 on a healthy loop, seconds while one callback holds it (a large
response encoded in one go, a long computation on the loop). Each tick it also reads what the update engine's
workers are on (:meth:`~mpflow.service.engine.update_engine.UpdateEngine.busy`: the two lanes' workers and the auxiliary
threads) and how long they have been on it.

The service is *stuck* while

* the loop's lag exceeds ``loop_lag_limit`` seconds (``MPFLOW_LOOP_LAG_LIMIT_SECONDS``), or did within the last
  :data:`LAG_HOLD_SECONDS` (a loop that lagged a moment ago is likely to again; a probe that finally gets an
  answer should not be told "ready" by the very loop that made it wait), or
* a worker has been on one job longer than ``worker_deadline`` seconds (``MPFLOW_WORKER_DEADLINE_SECONDS``).

:meth:`Watchdog.problems` names each (``/readyz`` answers 503 with them, so a load balancer stops sending this
replica work until they clear); the gauges ``mpflow_event_loop_lag_seconds`` and ``mpflow_worker_busy_seconds``
(lane) show the figures behind them. ``/healthz`` stays a liveness answer: a slow replica is not a dead one.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

from mpflow.service.engine.update_engine import Busy

#: how often the watchdog beats and checks (seconds)
BEAT_SECONDS = 0.25
#: how long a lag beyond the limit keeps the service not ready after it ended (seconds)
LAG_HOLD_SECONDS = 5.0
#: the lanes every scrape shows, busy or not
WORKERS = ("fast", "slow", "aux")


class Watchdog:
    """A daemon thread watching ``loop`` and the jobs ``busy()`` reports (module docstring); ``on_tick(lag, busy
    seconds by worker)`` is called after each check (the metrics' gauges)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        busy: Callable[[], list[Busy]],
        *,
        loop_lag_limit: float,
        worker_deadline: float,
        on_tick: Callable[[float, dict[str, float]], None] | None = None,
        beat: float = BEAT_SECONDS,
    ) -> None:
        self.loop = loop
        self.busy = busy
        self.loop_lag_limit = loop_lag_limit
        self.worker_deadline = worker_deadline
        self.on_tick = on_tick
        self.beat = beat
        self._sent: float | None = None  # when the beat not yet run was posted
        self._last_lag = 0.0
        self._lagged_at: float | None = None  # when a lag beyond the limit was last seen
        self._worst_lag = 0.0  # the worst lag of the current episode
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mpflow-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5.0)

    # ------------------------------------------------------------------ on the watchdog thread
    def _run(self) -> None:
        while not self._stop.wait(self.beat):
            self.check()

    def check(self) -> None:
        """One tick: post a beat if the last one ran, measure the lag, report it and the workers' job times."""
        now = time.monotonic()
        sent = self._sent
        if sent is None:
            self._sent = now
            try:
                self.loop.call_soon_threadsafe(self._answered, now)
            except RuntimeError:  # the loop is closed: the app is shutting down
                return
            lag = self._last_lag
        else:
            lag = now - sent  # still waiting for the loop
        if lag > self.loop_lag_limit:
            fresh = self._lagged_at is None or now - self._lagged_at > LAG_HOLD_SECONDS
            self._worst_lag = lag if fresh else max(self._worst_lag, lag)
            self._lagged_at = now
        if self.on_tick is not None:
            jobs = self.busy()
            seconds = dict.fromkeys(WORKERS, 0.0)
            for b in jobs:
                seconds[b.lane] = max(seconds.get(b.lane, 0.0), now - b.since)
            self.on_tick(lag, seconds)

    # ------------------------------------------------------------------ on the event loop
    def _answered(self, sent: float) -> None:
        self._last_lag = time.monotonic() - sent
        self._sent = None

    # ------------------------------------------------------------------ anywhere
    def lag(self) -> float:
        """The loop's lag now (seconds): the age of the beat it has not run, else how late it ran the last."""
        sent = self._sent
        return time.monotonic() - sent if sent is not None else self._last_lag

    def problems(self) -> list[str]:
        """What keeps the service from being ready, one sentence each; empty when nothing does."""
        now = time.monotonic()
        out = []
        lagged_at = self._lagged_at
        if lagged_at is not None and now - lagged_at <= LAG_HOLD_SECONDS:
            out.append(
                f"the event loop lagged {self._worst_lag:.1f} s (limit {self.loop_lag_limit:g} s, "
                f"MPFLOW_LOOP_LAG_LIMIT_SECONDS) {now - lagged_at:.1f} s ago"
            )
        for b in self.busy():
            if now - b.since <= self.worker_deadline:
                continue
            out.append(
                f"the {b.lane} worker has been on one job for {now - b.since:.1f} s (deadline "
                f"{self.worker_deadline:g} s, MPFLOW_WORKER_DEADLINE_SECONDS): {b.what}"
            )
        return out


__all__ = ["BEAT_SECONDS", "LAG_HOLD_SECONDS", "WORKERS", "Watchdog"]

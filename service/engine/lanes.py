"""Which of the update engine's lanes runs a step, and how many jobs one call may stack: both read off the cost
model's price of the job, the one price of the service (:mod:`mpflow.service.streams.costs`).

The engine (:mod:`mpflow.service.engine.update_engine`) runs each lane's batches on a worker thread of its own, so a
heavy stream's step — seconds of arithmetic at the largest accepted sizes — delays only the other heavy steps, never a
light one (issue 34: one tenant's N = 65536, d = 64 ``smc`` stream raised another tenant's Kalman update p50 from
11 ms to 1.09 s when every step shared one worker).

**The price.** Every job carries its :class:`~mpflow.service.streams.costs.Cost` — floating-point operations and
peak bytes — as the cost model computes it for the request that submitted it (the method's
:meth:`~mpflow.operators.updaters.Updater.step_work` with the family's sub-steps, the p-values, the smoothing window,
the summary and the answer). Operations convert to seconds at :data:`PRICED_FLOPS_PER_SECOND`, the rate at which
the model's constants are fitted against measured CPU seconds (``benchmarks.price_audit``'s ``NOMINAL_RATE``).

**The lane.** A step is heavy when its price takes more than :data:`HEAVY_STEP_SHARE` of either budget of one
request (``MPFLOW_MAX_REQUEST_FLOPS``, ``MPFLOW_MAX_REQUEST_BYTES``): at the defaults 1.25e9 operations, about
50 ms of one core, or 19 MiB. A run job (many steps of one stream) is priced by its dearest step: a run hands its
worker back between steps, never inside one.

**The batch.** A lane stacks jobs of one key only while their summed price stays within the lane's cap: the slow
lane's is one request's budget (a micro-batch of heavy steps holds no more memory, and no more seconds, than one
accepted request may), the fast lane's :data:`FAST_BATCH_SHARE` of it (what a light job may wait behind: about
100 ms of priced work at the defaults). A job over the cap runs alone. The engine's stepping memory is then at most
one budget per lane at once, whatever arrives: docs/API.md "Limits".

The slow lane's worker thread also runs at a lower CPU priority (:func:`lower_priority`: nice
+:data:`SLOW_LANE_NICE` for that thread alone, Linux): when the cores are short, the event loop and the fast lane
get the CPU first, and the slow lane uses what is left — it is never starved while a core is idle.
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass
from typing import Protocol

FAST = "fast"
SLOW = "slow"
LANES = (FAST, SLOW)

#: the rate (priced operations per CPU second) at which the cost model's constants are fitted against measured
#: seconds: ``benchmarks.price_audit.NOMINAL_RATE`` (the loaded side of the reference step's 16–83 Gflop/s)
PRICED_FLOPS_PER_SECOND = 25e9
#: a step whose price takes more than this share of a request's budget (operations or bytes) runs on the slow lane
HEAVY_STEP_SHARE = 0.05
#: the fast lane stacks jobs while their summed price stays within this share of a request's budget
FAST_BATCH_SHARE = 0.1
#: how much nicer (lower CPU priority) the slow lane's worker thread runs than the rest of the process
SLOW_LANE_NICE = 10


class Priced(Protocol):
    """What the lanes read of a job's price (:class:`mpflow.service.streams.costs.Cost`)."""

    flops: float
    bytes: float


@dataclass(frozen=True)
class LaneLimits:
    """The thresholds of the lanes, from one request's budget (``flops``, ``bytes``: the server's
    ``max_request_flops`` and ``max_request_bytes``)."""

    flops: float = 2.5e10
    bytes: float = 384.0 * 2**20

    def share(self, price: Priced) -> float:
        """The larger of the price's shares of the two budgets."""
        return max(price.flops / self.flops, price.bytes / self.bytes)

    def lane_of(self, price: Priced | None) -> str:
        """The lane of a step of this price (None: an unpriced job, light)."""
        return SLOW if price is not None and self.share(price) > HEAVY_STEP_SHARE else FAST

    def batch_cap(self, lane: str) -> float:
        """The largest summed share of the budget one call of ``lane`` may stack (module docstring)."""
        return 1.0 if lane == SLOW else FAST_BATCH_SHARE

    def seconds(self, price: Priced) -> float:
        """The CPU seconds the price buys at :data:`PRICED_FLOPS_PER_SECOND`."""
        return price.flops / PRICED_FLOPS_PER_SECOND


def lower_priority(nice: int = SLOW_LANE_NICE) -> None:
    """Raise the calling thread's nice value by ``nice`` (on Linux ``setpriority`` on a thread id applies to that
    thread only; elsewhere, or where it is refused, nothing changes)."""
    with contextlib.suppress(AttributeError, OSError):
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + nice)


__all__ = [
    "FAST",
    "FAST_BATCH_SHARE",
    "HEAVY_STEP_SHARE",
    "LANES",
    "PRICED_FLOPS_PER_SECOND",
    "SLOW",
    "SLOW_LANE_NICE",
    "LaneLimits",
    "Priced",
    "lower_priority",
]

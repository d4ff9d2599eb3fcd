"""Which of the update engine's lanes runs a step: a fast lane for light steps, a slow lane for heavy ones.

The engine (:mod:`mpflow.service.engine.update_engine`) runs each lane's batches on a worker thread of its own, so a
heavy stream's step — seconds of arithmetic at the largest particle counts — delays only the other heavy steps, never a
light one (issue 34: one tenant's N = 65536, d = 64 ``smc`` stream raised another tenant's Kalman update p50 from
11 ms to 1.09 s when every step shared one worker). Torch releases the GIL inside its kernels, so the two workers
really overlap; the light lane's steps are short, so the heavy lane loses little.

:func:`step_cost` is the one place that prices a step. It is a proxy of the arithmetic of one step of one stream,
in "particle-dimension" units:

    cost = N · d · f(method, N)

with ``f`` = 1 for the methods whose step is linear in the particles (``kalman``, ``enkf``, ``ukf``, ``smc``), a few
for the flows that iterate over the cloud (``gpf``, ``mpf``, ``nvgd``: their integration or optimisation steps),
and N / 64 for ``svgd``, whose kernel is over every pair of particles (O(N² d)). A step at or above
:data:`SLOW_LANE_COST` goes to the slow lane: about N = 4096 particles at d = 64 for ``smc``, tens of milliseconds
of one core. A finer cost model (one that also knows a family's own cost) replaces this function and nothing else.

The slow lane's worker thread also runs at a lower CPU priority (:func:`lower_priority`: nice
+:data:`SLOW_LANE_NICE` for that thread alone, Linux): when the cores are short, the event loop and the fast lane
get the CPU first, and the slow lane uses what is left — it is never starved while a core is idle.
"""

from __future__ import annotations

import contextlib
import os
import threading

FAST = "fast"
SLOW = "slow"
LANES = (FAST, SLOW)

#: a step whose :func:`step_cost` reaches this runs on the slow lane
SLOW_LANE_COST = float(1 << 18)
#: how much nicer (lower CPU priority) the slow lane's worker thread runs than the rest of the process
SLOW_LANE_NICE = 10

#: f(method) of :func:`step_cost` for the methods that iterate over the cloud; the others are linear (1) or svgd
_ITERATING = {"gpf": 4.0, "mpf": 8.0, "nvgd": 8.0}


def step_cost(method: str, num_particles: int, state_dim: int) -> float:
    """The proxy cost of one step of one stream (module docstring)."""
    factor = max(1.0, num_particles / 64.0) if method == "svgd" else _ITERATING.get(method, 1.0)
    return float(num_particles) * float(state_dim) * factor


def lane_of(method: str, num_particles: int, state_dim: int, slow_lane_cost: float = SLOW_LANE_COST) -> str:
    """The lane that runs such a step."""
    return SLOW if step_cost(method, num_particles, state_dim) >= slow_lane_cost else FAST


def lower_priority(nice: int = SLOW_LANE_NICE) -> None:
    """Raise the calling thread's nice value by ``nice`` (on Linux ``setpriority`` on a thread id applies to that
    thread only; elsewhere, or where it is refused, nothing changes)."""
    with contextlib.suppress(AttributeError, OSError):
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + nice)


__all__ = ["FAST", "LANES", "SLOW", "SLOW_LANE_COST", "SLOW_LANE_NICE", "lane_of", "lower_priority", "step_cost"]

"""Where a request's tensor work runs: on the event loop, or on the update engine's auxiliary threads.

An observation step runs on the engine's worker (micro-batched with other streams'), and so does what follows it
for that stream (:mod:`mpflow.service.engine.stepping`). Everything else — decoding a stored state, summaries, draws,
encoding — is placed here. A hop to a thread costs a wake-up and a GIL hand-over, more than the arithmetic of a
small state, so work on a state of at most :data:`INLINE_MAX_ELEMENTS` (particles × state dimension, draws ×
state dimension for draws) stays on the event loop; larger work goes to the auxiliary threads, so that it does not
stall the loop. Small work also goes to the threads while more than one observation request is in flight, when
the loop has their requests to serve (the trade-off is measured by ``benchmarks/service_profile.py``). Work that
may load an operator from disk, or that initialises a stream, always goes to the threads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from mpflow.operators.state import ParticleState
from mpflow.service.engine.update_engine import UpdateEngine

T = TypeVar("T")

#: particles × state dimension (and draws × state dimension) up to which tensor work stays on the event loop
INLINE_MAX_ELEMENTS = 16384


def small(meta: dict[str, Any], draws: int = 0) -> bool:
    """Whether the work on a stream (``meta``: its stored metadata) with ``draws`` draws is small enough to run
    on the event loop."""
    return max(int(meta["num_particles"]), draws) * int(meta["state_dim"]) <= INLINE_MAX_ELEMENTS


class TensorWork:
    """Runs tensor work where it costs the event loop least (module docstring)."""

    def __init__(self, engine: UpdateEngine) -> None:
        self.engine = engine
        self.observing = 0  # observation requests in flight

    @contextmanager
    def observation(self) -> Iterator[None]:
        """Count an observation request as in flight while the block runs."""
        self.observing += 1
        try:
            yield
        finally:
            self.observing -= 1

    async def run(self, meta: dict[str, Any], fn: Callable[..., T], *args: Any, draws: int = 0) -> T:
        """``fn(*args)`` inline for a small state while at most one observation request is in flight, else on
        the auxiliary threads."""
        if small(meta, draws) and self.observing <= 1:
            return fn(*args)
        return await self.engine.run(fn, *args)

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the auxiliary threads, whatever its size (it may load an operator from disk)."""
        return await self.engine.run(fn, *args)

    async def heavy(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the engine's thread for heavy reads (:meth:`UpdateEngine.run_heavy`)."""
        return await self.engine.run_heavy(fn, *args)

    async def decode(self, meta: dict[str, Any], data: bytes) -> ParticleState:
        """The stored state: decoded on the event loop when it is small (a copy of a few kilobytes costs less
        than a thread hop, however busy the loop), else on the auxiliary threads."""
        if small(meta):
            return ParticleState.from_bytes(data)
        return await self.engine.run(ParticleState.from_bytes, data)


__all__ = ["INLINE_MAX_ELEMENTS", "TensorWork", "small"]

"""Reads of a stream's stored state, priced by the state's size and placed so that a large one stalls no one else
(issue 54 item 3: eight readers of an 84 MB state timed out another tenant's store calls and left the server's RSS
at 1.7 GB).

**The summary is kept, not recomputed.** The stream's current summary (what ``GET /v1/streams/{id}`` answers besides
the meta) is the meta field :data:`SUMMARY`, written with the state by the creation, the import and every update's
compare-and-set, so that read — and the live feeds' first document — takes the meta hash and never the state. A
stream stored without one (before summaries were kept) is answered from its state once, priced as below, and the
summary computed is then kept for its version (:meth:`~mpflow.service.store.stream_store.StreamStore.remember`).

**A read is priced before its state is fetched.** :meth:`StateReads.peek` reads the meta and the state's size (the
state itself too when it is at most :data:`~mpflow.service.store.stream_store.INLINE_STATE_BYTES`) in one script; the
read's price is its route's cost (:mod:`mpflow.service.streams.costs`: ``particles_cost``, ``draws_cost``,
``smoothing_cost``, ``forecast_cost``, :func:`snapshot_cost`) with the state's (:func:`state_cost`: fetching and
decoding it, proportional to its size) — :func:`reading`. The route's own part is checked against the budgets as
before (413); the state's part refuses nothing (the stream's creation or import bounded its state already), it
decides where the read runs.

**Where it runs.** A read whose price is more than :data:`~mpflow.service.streams.costs.HEAVY_SHARE` of a budget
is heavy: it waits for the process's heavy-read slot (:data:`HEAVY_READS` at once), then fetches the state (a
plain ``GET`` beside the read script, never through Lua, whose copies of an 84 MB string held Redis 0.45 s),
decodes it and does its work on the engine's heavy-read thread
(:meth:`~mpflow.service.engine.tensor_work.TensorWork.heavy`, at the slow lane's lower CPU priority), and gives the
freed memory back to the system (:func:`give_back_memory`) before the slot is released. So one process holds one
large state being read at a time, concurrent large reads queue behind one another, and the light requests' store
calls, event loop and threads are not theirs to share.
A light read runs as before: its state by the read script, its work inline or on the auxiliary threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from mpflow.service.engine import views
from mpflow.service.engine.lanes import PRICED_FLOPS_PER_SECOND
from mpflow.service.engine.tensor_work import TensorWork
from mpflow.service.errors import not_found
from mpflow.service.settings import Settings
from mpflow.service.store.stream_store import INLINE_STATE_BYTES, StoreUnavailable, StreamStore
from mpflow.service.streams import costs

T = TypeVar("T")

#: the meta field that keeps the stream's current summary (module docstring)
SUMMARY = "summary"
#: heavy reads one process runs at once (module docstring)
HEAVY_READS = 1
#: the work of reading one byte of a stored state — fetching it from the store and decoding it — in priced
#: operations: measured, a GET of an 84 MB state took 0.25 s here and its decode 0.045 s, 0.3 s in all, as long as
#: 7.5e9 operations at :data:`~mpflow.service.engine.lanes.PRICED_FLOPS_PER_SECOND`
STATE_FLOPS_PER_BYTE = 0.3 * PRICED_FLOPS_PER_SECOND / 84e6
#: the work of encoding one byte of a state (``to_bytes``: 0.09 s for 84 MB, measured) and hashing it (HMAC-SHA256)
ENCODE_FLOPS_PER_BYTE = 0.1 * PRICED_FLOPS_PER_SECOND / 84e6


def state_cost(size: int) -> costs.Cost:
    """Reading a stored state of ``size`` bytes: its fetch and decode, and its bytes as fetched and as decoded
    (both held while the read works)."""
    return costs.Cost(STATE_FLOPS_PER_BYTE * size, 2.0 * size)


def reading(size: int, cost: costs.Cost) -> costs.Cost:
    """A read's price: ``cost`` (its route's work) done on the decoded state of ``size`` bytes, held throughout."""
    state = state_cost(size)
    return costs.Cost(state.flops + cost.flops, state.bytes + cost.bytes)


def snapshot_cost(size: int) -> costs.Cost:
    """``GET .../export``'s own work on a state of ``size`` bytes: encoding it again, signed, as the snapshot."""
    return costs.Cost(ENCODE_FLOPS_PER_BYTE * size, 1.0 * size)


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None (another C library)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


_TRIM = _malloc_trim()


def give_back_memory() -> None:
    """Return the C heap's free pages to the system (glibc ``malloc_trim(0)``; nothing elsewhere). After a heavy read
    its freed buffers would otherwise stay in the process's malloc arenas, and the RSS with them (measured: eight
    readers of an 84 MB state left it 0.8 GB above where it was)."""
    if _TRIM is not None:
        _TRIM(0)


@dataclass(frozen=True)
class Peeked:
    """What :meth:`StateReads.peek` read: the stream's meta, its state's size and — when small — its state."""

    tenant: str
    stream_id: str
    meta: dict[str, Any]
    size: int
    data: bytes | None


class StateReads:
    """Prices and places the reads of stored states (module docstring); one per process."""

    def __init__(self, settings: Settings, store: StreamStore, work: TensorWork) -> None:
        self.settings = settings
        self.store = store
        self.work = work
        self._slot = asyncio.Semaphore(HEAVY_READS)
        #: heavy reads done by this process (for tests and operators)
        self.heavy_reads = 0

    async def peek(self, tenant: str, stream_id: str, inline_bytes: int = INLINE_STATE_BYTES) -> Peeked:
        """The stream's meta and its state's size, with its state when at most ``inline_bytes`` (-1: never); 404
        for an unknown stream (or one of another tenant), 422 for an id no stream can have."""
        views.check_id(stream_id)  # 422 for an id no stream can have
        got = await self.store.peek(tenant, stream_id, inline_bytes)
        if got is None:
            raise not_found(stream_id)
        meta, data, size = got
        return Peeked(tenant, stream_id, meta, size, data)

    def heavy(self, price: costs.Cost) -> bool:
        """Whether a read of this price is heavy (module docstring)."""
        return costs.heavy(self.settings, price)

    async def run(
        self,
        peeked: Peeked,
        price: costs.Cost,
        compute: Callable[[dict[str, Any], bytes], T],
        *,
        draws: int = 0,
        off_loop: bool = False,
    ) -> T:
        """``compute(meta, state bytes)`` of the stream ``peeked`` describes, where ``price`` (:func:`reading`) says
        (module docstring). A light read runs it inline for a small state (:meth:`TensorWork.run`, ``draws`` as
        there), or on the auxiliary threads when ``off_loop``; a heavy one in the heavy-read slot."""
        if not self.heavy(price):
            if peeked.data is not None:
                meta, data = peeked.meta, peeked.data
            else:
                meta, data = await views.read(self.store, peeked.tenant, peeked.stream_id)
            if off_loop:
                return await self.work.off_loop(compute, meta, data)
            return await self.work.run(meta, compute, meta, data, draws=draws)
        async with self._slot:
            self.heavy_reads += 1
            try:
                return await self._heavy(peeked, compute)
            finally:
                await self.work.heavy(give_back_memory)

    async def _heavy(self, peeked: Peeked, compute: Callable[[dict[str, Any], bytes], T]) -> T:
        """(in the slot) The state fetched and ``compute`` run on the heavy-read thread; the state's bytes are
        dropped when this returns, before the memory is given back."""
        if peeked.data is not None:
            return await self.work.heavy(compute, peeked.meta, peeked.data)
        meta, data = await views.read(self.store, peeked.tenant, peeked.stream_id)
        return await self.work.heavy(compute, meta, data)

    async def summary(self, peeked: Peeked, summarise: Callable[[dict[str, Any], bytes], dict[str, Any]]) -> Any:
        """(meta, summary) of a stream stored without its summary (module docstring): computed from its state by
        ``summarise(meta, state bytes)`` — priced as a read of it — and kept for the version it was computed from
        (best effort: a store that refuses the write changes nothing)."""
        n, d = int(peeked.meta["num_particles"]), int(peeked.meta["state_dim"])
        price = reading(peeked.size, costs.summary_cost(n, d))
        meta, summary = await self.run(peeked, price, lambda m, data: (m, summarise(m, data)))
        with contextlib.suppress(StoreUnavailable):
            await self.store.remember(peeked.tenant, peeked.stream_id, int(meta["version"]), {SUMMARY: summary})
        return meta, summary


__all__ = [
    "ENCODE_FLOPS_PER_BYTE",
    "HEAVY_READS",
    "STATE_FLOPS_PER_BYTE",
    "SUMMARY",
    "Peeked",
    "StateReads",
    "give_back_memory",
    "reading",
    "snapshot_cost",
    "state_cost",
]

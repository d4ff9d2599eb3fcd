"""Exactly-once observations: the ``seq`` rules of docs/API.md and the compare-and-set loop that applies them.

An observation request is handled as

    read (meta, state, version) → check seq → apply every step in memory → compare-and-set(version)

and answered only after the compare-and-set returned: nothing is half-applied (a multi-step request is one
write) and nothing is acknowledged before the store has it. With ``seq`` given and the stream at ``step``
(:func:`check_seq`):

* ``seq == step + 1``                     → applied;
* ``seq + len(observations) - 1 <= step`` → already applied: 200, ``duplicate: true``, the current state;
* otherwise (a gap or a partial overlap)  → 409 ``seq_conflict``, nothing applied.

If the compare-and-set loses (another writer — another request, replica or worker — wrote first), the stream is
re-read and the same rules decide again (:func:`until_written`): with ``seq`` that answers ``duplicate`` or 409
(the concurrent writer won); without ``seq`` the steps are re-applied on the fresh state (appended in arrival
order). Inside one process requests on one stream also queue on a per-stream lock (:class:`KeyedLocks`), so they
do not spend compute on races they would lose; the compare-and-set is what makes it correct across processes.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable
from contextlib import asynccontextmanager
from typing import TypeVar

from mpflow.service.stream_errors import ConcurrentUpdateError, SeqConflictError

T = TypeVar("T")

#: compare-and-set attempts of one request before it is answered 409 ``concurrent_update``
MAX_WRITE_ATTEMPTS = 50


class Seq(enum.Enum):
    """What an observation request does to a stream (:func:`check_seq`)."""

    APPLY = "apply"
    DUPLICATE = "duplicate"


def check_seq(seq: int | None, count: int, step: int) -> Seq:
    """The ``seq`` rule (module docstring) for ``count`` observations from ``seq`` on a stream at ``step``;
    :class:`~mpflow.service.stream_errors.SeqConflictError` for a gap or a partial overlap."""
    if seq is None:
        return Seq.APPLY
    if seq + count - 1 <= step:
        return Seq.DUPLICATE
    if seq != step + 1:
        raise SeqConflictError(
            f"seq: the stream is at step {step}, so the next seq is {step + 1}; got seq {seq} with {count} "
            "observation(s) (a gap or a partial overlap); nothing was applied"
        )
    return Seq.APPLY


async def until_written(attempt: Callable[[], Awaitable[T | None]], attempts: int = MAX_WRITE_ATTEMPTS) -> T:
    """``attempt()`` — read, decide, apply, compare-and-set — until it returns an answer; it returns None when
    its compare-and-set lost to another writer. :class:`~mpflow.service.stream_errors.ConcurrentUpdateError` after
    ``attempts`` lost races."""
    for _ in range(attempts):
        answer = await attempt()
        if answer is not None:
            return answer
    raise ConcurrentUpdateError("stream: too many concurrent writers on this stream; retry the request")


class KeyedLocks:
    """One asyncio.Lock per key, dropped when no one holds or waits for it."""

    def __init__(self) -> None:
        self._locks: dict[Hashable, tuple[asyncio.Lock, int]] = {}

    @asynccontextmanager
    async def hold(self, key: Hashable) -> AsyncIterator[None]:
        lock, users = self._locks.get(key, (None, 0))
        lock = lock or asyncio.Lock()
        self._locks[key] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[key]
            if users == 1:
                del self._locks[key]
            else:
                self._locks[key] = (lock, users - 1)


__all__ = ["MAX_WRITE_ATTEMPTS", "KeyedLocks", "Seq", "check_seq", "until_written"]

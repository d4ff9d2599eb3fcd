"""The harness's hard deadline (:mod:`tests.harness.deadline`): a hang fails in time and names its place."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.harness.deadline import DeadlineExceededError, run_with_deadline


async def _answer() -> int:
    await asyncio.sleep(0.01)
    return 42


async def _ignores_cancellation() -> None:
    """Sleeps forever and swallows every cancellation: what ``asyncio.wait_for`` would wait on without end (the
    loop is closed with it still pending, so Python reports the task destroyed while pending)."""
    while True:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            continue


async def _worker_hangs_on_an_event() -> None:
    async def waiter(event: asyncio.Event) -> None:
        await event.wait()

    event = asyncio.Event()
    await asyncio.gather(waiter(event), waiter(event))


def test_a_coroutine_done_in_time_gives_its_result():
    assert run_with_deadline(_answer(), deadline=5.0) == 42


def test_an_exception_inside_propagates_as_itself():
    async def boom() -> None:
        raise ValueError("bad input")

    with pytest.raises(ValueError, match="bad input"):
        run_with_deadline(boom(), deadline=5.0)


def test_a_coroutine_that_swallows_its_cancellation_still_fails_at_the_deadline():
    t0 = time.monotonic()
    with pytest.raises(DeadlineExceededError) as info:
        run_with_deadline(_ignores_cancellation(), deadline=0.2, grace=0.2)
    assert time.monotonic() - t0 < 3.0
    assert "_ignores_cancellation" in str(info.value)  # the stack names where it hung


def test_the_stacks_name_every_pending_task():
    with pytest.raises(DeadlineExceededError) as info:
        run_with_deadline(_worker_hangs_on_an_event(), deadline=0.2, grace=0.5)
    message = str(info.value)
    assert message.count("waiter") >= 2 and "_worker_hangs_on_an_event" in message
    assert isinstance(info.value, TimeoutError)

"""Run a coroutine under a hard deadline that says where it was when the deadline passed.

``asyncio.wait_for`` cancels its task at the deadline and then waits for the cancellation to finish, so a coroutine
stuck where a cancellation does not end it (a clean-up awaiting a peer that never answers, a handler that catches
the cancellation) holds the caller past its deadline; ``asyncio.run`` likewise waits for every pending task at
the end. :func:`run_with_deadline` runs the coroutine on a loop of its own; at the deadline it records the stack
of every pending task, cancels them all, waits at most ``grace`` seconds, closes the loop whatever still pends
and raises :class:`DeadlineExceededError` with the stacks — a hang becomes a failure that names its place.
"""

from __future__ import annotations

import asyncio
import io
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class DeadlineExceededError(TimeoutError):
    """The coroutine was not done by the deadline; the message holds every pending task's stack."""


def pending_stacks(loop: asyncio.AbstractEventLoop) -> str:
    """The stack of every task of ``loop`` not done yet, as ``Task.print_stack`` writes it."""
    out = io.StringIO()
    for task in asyncio.all_tasks(loop):
        task.print_stack(file=out)
    return out.getvalue()


def run_with_deadline(coro: Coroutine[Any, Any, T], deadline: float, grace: float = 5.0) -> T:
    """``coro``'s result, run on a new event loop; :class:`DeadlineExceededError` after ``deadline`` seconds (plus at
    most ``grace`` for the cancelled tasks to end), whatever the coroutine is doing (module docstring)."""
    loop = asyncio.new_event_loop()
    try:
        task = loop.create_task(coro)
        loop.run_until_complete(asyncio.wait({task}, timeout=deadline))
        if task.done():
            return task.result()
        stacks = pending_stacks(loop)
        pending = asyncio.all_tasks(loop)
        for t in pending:
            t.cancel()
        loop.run_until_complete(asyncio.wait(pending, timeout=grace))
        raise DeadlineExceededError(f"not done in {deadline:.0f} s; the pending tasks were at:\n{stacks}")
    finally:
        closing = loop.create_task(loop.shutdown_asyncgens())
        loop.run_until_complete(asyncio.wait({closing}, timeout=grace))
        loop.close()

"""Warnings that may repeat on every request, at most once per interval and kind.

A stream whose method keeps failing numerically falls back on every step (:mod:`mpflow.service.streams.service`); one
WARNING per step would flood the log at hundreds of updates per second, while ``mpflow_update_fallbacks_total`` already
counts every one. :class:`ThrottledLog` writes the first warning of a kind, then at most one per ``interval_s``,
saying how many of that kind it left out since the last one it wrote. Meant for one thread (the event loop).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable


class ThrottledLog:
    """``warning(kind, msg, *args)``: logged unless a warning of the same ``kind`` was logged less than
    ``interval_s`` ago; the next one logged carries the count of those left out."""

    def __init__(self, logger: logging.Logger, interval_s: float, clock: Callable[[], float] = time.monotonic):
        if not interval_s >= 0:
            raise ValueError(f"interval_s: must be ≥ 0, got {interval_s!r}")
        self.logger, self.interval_s, self.clock = logger, interval_s, clock
        self._last: dict[Hashable, float] = {}  # kind → when its last warning was written
        self._left_out: dict[Hashable, int] = {}

    def warning(self, kind: Hashable, msg: str, *args: object) -> bool:
        """Log ``msg % args`` at WARNING, or count it as left out; True when it was logged."""
        now = self.clock()
        last = self._last.get(kind)
        if last is not None and now - last < self.interval_s:
            self._left_out[kind] = self._left_out.get(kind, 0) + 1
            return False
        left_out = self._left_out.pop(kind, 0)
        if left_out:
            msg += " (%d more like it in the last %.0f s, not logged)"
            args = (*args, left_out, now - last)
        self._last[kind] = now
        self.logger.warning(msg, *args)
        return True


__all__ = ["ThrottledLog"]

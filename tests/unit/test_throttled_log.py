"""service.throttled_log: a repeating warning is written once per interval and kind, with a count of the rest."""

from __future__ import annotations

import logging

import pytest
from mpflow.service.throttled_log import ThrottledLog


def test_one_warning_per_interval_and_kind_with_the_count_left_out(caplog):
    now = [0.0]
    throttled = ThrottledLog(logging.getLogger("test.throttled"), 60.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="test.throttled"):
        assert throttled.warning("a", "step failed: %s", "x") is True
        for t in (1.0, 30.0, 59.9):
            now[0] = t
            assert throttled.warning("a", "step failed: %s", "x") is False
        assert throttled.warning("b", "other kind") is True  # kinds are independent
        now[0] = 61.0
        assert throttled.warning("a", "step failed: %s", "y") is True
        now[0] = 200.0
        assert throttled.warning("a", "step failed: %s", "z") is True  # nothing left out in between
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        "step failed: x",
        "other kind",
        "step failed: y (3 more like it in the last 61 s, not logged)",
        "step failed: z",
    ]
    assert all(r.levelno == logging.WARNING for r in caplog.records)


def test_interval_must_be_non_negative():
    with pytest.raises(ValueError, match="interval_s"):
        ThrottledLog(logging.getLogger("test"), -1.0)
    zero = ThrottledLog(logging.getLogger("test.zero"), 0.0)
    assert zero.warning("k", "m") and zero.warning("k", "m")  # 0: every warning is written

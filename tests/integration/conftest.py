"""Shared set-up of the integration tests: the real Redis they run against.

``MPFLOW_REDIS_URL``, else redis://127.0.0.1:6379/0. Without a reachable Redis the tests that ask for
``redis_url`` fail under CI (``CI`` set) and are skipped, with the reason, elsewhere.
"""

from __future__ import annotations

import asyncio
import os

import pytest

from tests.harness.server import redis_answers

REDIS_URL = os.environ.get("MPFLOW_REDIS_URL") or "redis://127.0.0.1:6379/0"


@pytest.fixture(scope="module")
def redis_url() -> str:
    """The Redis URL, once it answers a PING (fail under CI, skip elsewhere)."""
    if not asyncio.run(redis_answers(REDIS_URL)):
        reason = f"no Redis reachable at {REDIS_URL} (set MPFLOW_REDIS_URL or start redis-server)"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    return REDIS_URL

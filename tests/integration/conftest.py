"""Shared set-up of the integration tests: the real Redis they run against.

``MPFLOW_REDIS_URL``, else redis://127.0.0.1:6379/0. Without a reachable Redis the tests that ask for
``redis_url`` fail under CI (``CI`` set) and are skipped, with the reason, elsewhere.

``redis_cluster``: a real local Redis Cluster (3 primaries, 3 replicas: :class:`tests.harness.cluster.LocalCluster`),
started once per test session and stopped at its end; without ``redis-server`` ≥ 7 and ``redis-cli`` on PATH the
tests that ask for it fail under CI and are skipped elsewhere.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator

import pytest

from tests.harness.cluster import LocalCluster, cluster_binaries
from tests.harness.server import redis_answers

REDIS_URL = os.environ.get("MPFLOW_REDIS_URL") or "redis://127.0.0.1:6379/0"


def _skip_or_fail(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(reason)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def redis_url() -> str:
    """The Redis URL, once it answers a PING (fail under CI, skip elsewhere)."""
    if not asyncio.run(redis_answers(REDIS_URL)):
        _skip_or_fail(f"no Redis reachable at {REDIS_URL} (set MPFLOW_REDIS_URL or start redis-server)")
    return REDIS_URL


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """A local 3-primary, 3-replica Redis Cluster for the session (every node stopped at its end)."""
    if cluster_binaries() is None:
        _skip_or_fail("a local Redis Cluster needs redis-server >= 7 and redis-cli on PATH")
    with LocalCluster(tmp_path_factory.mktemp("cluster")) as cluster:
        yield cluster

"""Store faults: the state store (an external ``redis-server`` on a spare port, AOF in a temporary dir) stops in
the middle of a load of 20 streams × 100 steps and comes back on the same files.

While it is down the API answers 503 with ``Retry-After`` — no other 5xx — and the clients (service.client:
retries honouring Retry-After, ``seq`` on every request) carry on once it is back. Afterwards every
acknowledged step is stored exactly once: the stored steps equal the acknowledged ones, and the deterministic
``kalman`` streams, replayed offline by the float64 Kalman filter, match the stored mean, covariance and
log-evidence and every acknowledged per-step mean. Three ways to stop: SIGKILL with ``appendfsync always``
(what fsync-before-answer guarantees), a graceful ``SHUTDOWN`` with ``everysec``, and a freeze (SIGSTOP for
longer than the service's Redis timeouts, then SIGCONT). The scenarios are the harness's
(``tests/harness/faults.py``, measured at full size by ``python -m benchmarks.reliability``); one server serves
the three, each with a fresh redis-server on the same port.
"""

from __future__ import annotations

import asyncio

import pytest
from mpflow.service.store.stream_store import StoreOutcomeUnknown, StoreUnavailable, StreamStore

from tests.harness.faults import StoreFaultRig
from tests.harness.server import RedisProcess
from tests.reliability.checks import assert_exactly_once

STREAMS, STEPS, BATCH = 20, 100, 10  # the fault at 40 %: 4 requests a stream before it, 6 after


@pytest.fixture(scope="module")
def rig():
    with StoreFaultRig() as rig:
        yield rig


@pytest.mark.parametrize("mode", ["kill", "shutdown", "freeze"])
def test_store_outage_answers_503_and_loses_nothing(mode, rig, redis_server_binary):
    r = rig.run(mode, streams=STREAMS, steps=STEPS, batch=BATCH)
    total = STREAMS * STEPS
    # the store went down in the middle of the load, and the API said so
    assert 0 < r["acknowledged_at_fault"] < total
    assert r["requests_during_outage"].get("503", 0) > 0
    assert r["probes_during_outage"] > 0
    assert r["probes_not_503"] == 0, r["probe_codes"]
    assert r["probes_503_without_retry_after"] == 0
    # 503 with Retry-After, and no other server error; the server itself stayed up
    assert r["http_503"] > 0
    assert r["http_503_without_retry_after"] == 0
    assert r["http_5xx_other"] == 0, r["error_codes_5xx"]
    assert r["transport_errors"] == 0
    # every acknowledged step is stored, exactly once, and every stream takes its next update
    assert_exactly_once(r, total, BATCH)
    assert r["recovery_s"] is not None


def test_pooled_connections_survive_a_store_restart(tmp_path, redis_server_binary):
    """After Redis restarts, the connections the old server closed are reopened when taken from the pool, not
    failed: the first commands after the restart all succeed (before the fix in service/store/stream_store.py, each idle
    pooled connection failed once — a 503 for a request that arrived after the store was back)."""

    async def main() -> list:
        with RedisProcess(tmp_path / "redis", "always") as redis:
            redis.start()
            store = StreamStore.from_url(redis.url, prefix="restart")
            try:
                await asyncio.gather(*(store.create("t", f"s{i}", {"step": 0}, b"state", 60) for i in range(10)))
                await asyncio.to_thread(redis.kill)
                await asyncio.sleep(0.2)  # the event loop sees the connections close
                await asyncio.to_thread(redis.start)
                return await asyncio.gather(*(store.get("t", f"s{i}") for i in range(10)), return_exceptions=True)
            finally:
                await store.aclose()

    got = asyncio.run(main())
    assert [g for g in got if isinstance(g, BaseException)] == []
    assert all(g is not None and g[1] == b"state" for g in got)  # and the data came back from the AOF


def test_write_without_an_answer_may_have_been_applied(tmp_path, redis_server_binary):
    """A frozen store: a compare-and-set gets no answer and raises StoreOutcomeUnknown (not the plain "nothing
    was applied" StoreUnavailable) — and indeed it is applied once the store wakes. A refused connection is a
    plain StoreUnavailable: nothing was sent."""

    async def main() -> tuple[int, bool]:
        with RedisProcess(tmp_path / "redis", "always") as redis:
            redis.start()
            store = StreamStore.from_url(redis.url, prefix="unknown", timeout=1.0)
            try:
                assert await store.create("t", "s", {"step": 0}, b"v1", 60)
                assert await store.compare_and_set("t", "s", 1, {"step": 1}, b"v2", 60)  # the script is loaded
                redis.freeze()
                with pytest.raises(StoreOutcomeUnknown):
                    await store.compare_and_set("t", "s", 2, {"step": 2}, b"v3", 60)
                redis.thaw()
                version = 0
                for _ in range(50):  # the command sent before the freeze runs when Redis wakes
                    meta, _ = await store.get("t", "s")
                    version = int(meta["version"])
                    if version == 3:
                        break
                    await asyncio.sleep(0.05)
                await asyncio.to_thread(redis.kill)
                await asyncio.sleep(0.2)
                try:
                    await store.compare_and_set("t", "s", 3, {"step": 3}, b"v4", 60)
                except StoreUnavailable as exc:
                    refused_is_plain = not isinstance(exc, StoreOutcomeUnknown)
                else:
                    refused_is_plain = False
                return version, refused_is_plain
            finally:
                await store.aclose()

    version, refused_is_plain = asyncio.run(main())
    assert version == 3  # the write that "failed" was applied
    assert refused_is_plain

"""Reads are priced and placed (issue 54 item 3; :mod:`mpflow.service.streams.state_reads`), against a real server.

``python -m mpflow serve --workers 1`` with two tenants on the local Redis
(:func:`tests.harness.isolation.tenant_server`):

* eight readers of tenant alpha's 84 MB-state stream (``smc``, N = 30000, d = 2, ``smoothing_lag`` 100: accepted at
  creation) for 20 s — three ``GET /v1/streams/{id}``, and ``/smoothed``, ``/export``, ``/particles``, ``/samples``
  and ``/forecast`` — while tenant beta updates a ``kalman`` stream in a loop
  (:func:`tests.harness.attacks.heavy_reads`): beta sees no 5xx and no update slower than 2 s, every read is
  answered 200, and the server's RSS is back within 500 MB of before 10 s later. Before (every read fetched the
  state through the store's Lua script and decoded it, all at once): beta's worst update 3.1 s, readers answered
  503, and the RSS went from 443 MB to 1.2 GB and stayed there;
* a stream stored before summaries were kept (its ``summary`` field removed) is answered from its state, the same
  document, and its summary is kept again;
* the store reads a state larger than what its read script passes through by ``GET``, the same bytes.
"""

from __future__ import annotations

import asyncio
import math
import uuid

import httpx
import psutil
import pytest
import redis
from mpflow.service.store.stream_store import INLINE_STATE_BYTES, StreamStore

from tests.harness.attacks import heavy_reads
from tests.harness.isolation import ALPHA, LOCAL_REDIS, create, gaussian_stream, tenant_server
from tests.harness.server import redis_server_binary

pytestmark = pytest.mark.skipif(redis_server_binary() is None, reason="no Redis")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("heavy_reads") / "server.log"
    with tenant_server(log) as srv:
        yield srv


def rss_of(pid: int) -> int:
    """The resident bytes of the server (and of any worker process it started)."""
    proc = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)] if "redis" not in p.name())


def test_eight_readers_of_an_84_mb_state_do_not_stall_another_tenant_or_keep_memory(server):
    r = heavy_reads(server.url, lambda: rss_of(server.pid))
    assert r["state_mb"] > 80, r  # the stream really is that large
    assert r["light_statuses"] == ["200"], r
    assert r["light_worst_s"] <= 2.0, r
    for path, entry in r["reads"].items():
        assert set(entry["statuses"]) == {"200"}, (path, r)
    assert r["reads"]["/"]["n"] >= 100, r  # the document is read from the meta hash: many reads in 20 s
    assert sum(e["n"] for p, e in r["reads"].items() if p != "/") >= 5, r  # the heavy reads really ran
    assert r["rss_after_mb"] - r["rss_before_mb"] <= 500, r
    assert r["refused"], r


def close(a, b) -> bool:
    """Two JSON documents equal but for float rounding (relative 1e-9)."""
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(close(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(close(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_a_stream_stored_without_its_summary_is_answered_and_keeps_it_again(server):
    prefix = server.env["MPFLOW_REDIS_PREFIX"]
    with httpx.Client(base_url=server.url, headers=ALPHA, timeout=60) as alpha, redis.Redis.from_url(LOCAL_REDIS) as r:
        status, sid = create(alpha, gaussian_stream("smc", 512, 3))
        assert sid is not None, status
        posted = alpha.post(f"/v1/streams/{sid}/observations", json={"seq": 1, "observations": [[0.5, 0.1, -0.2]]})
        assert posted.status_code == 200, posted.text
        kept = alpha.get(f"/v1/streams/{sid}").json()
        meta_key = f"{prefix}:{{alpha:{sid}}}:meta"
        assert r.hexists(meta_key, "summary")
        assert r.hdel(meta_key, "summary") == 1  # as a stream stored before summaries were kept
        recomputed = alpha.get(f"/v1/streams/{sid}")
        # the same summary, to float rounding: recomputed from the state, its sums may run in another order
        assert recomputed.status_code == 200 and close(recomputed.json(), kept)
        assert r.hexists(meta_key, "summary")  # kept again, for that version
        assert close(alpha.get(f"/v1/streams/{sid}").json(), kept)
        listed = alpha.get("/v1/streams").json()["streams"]
        assert [s["stream_id"] for s in listed] == [sid] and "summary" not in listed[0]
        alpha.delete(f"/v1/streams/{sid}")


def test_the_store_reads_a_large_state_by_get_and_prices_it_before():
    async def main() -> None:
        store = StreamStore.from_url(LOCAL_REDIS, prefix=f"heavyreads-{uuid.uuid4().hex[:10]}")
        big, small = b"\x01" * (INLINE_STATE_BYTES + 1), b"\x02" * 100
        try:
            assert await store.create("t", "big", {"step": 0}, big, 60)
            assert await store.create("t", "small", {"step": 0}, small, 60)
            meta, data, size = await store.peek("t", "big")
            assert data is None and size == len(big) and meta["version"] == 1
            assert await store.peek("t", "small") == ({"step": 0, "version": 1}, small, len(small))
            assert (await store.peek("t", "small", inline_bytes=-1))[1:] == (None, len(small))
            assert await store.get("t", "big") == ({"step": 0, "version": 1}, big)
            assert await store.peek("t", "none") is None and await store.get("t", "none") is None
            assert await store.remember("t", "big", 1, {"summary": {"mean": [1.0]}})
            assert not await store.remember("t", "big", 2, {"summary": {"mean": [2.0]}})  # not that version
            assert (await store.get("t", "big"))[0]["summary"] == {"mean": [1.0]}
            assert await store.compare_and_set("t", "big", 1, {"step": 1}, big[:-1] + b"\x03", 60)
            meta, data = await store.get("t", "big")
            assert meta["version"] == 2 and data[-1:] == b"\x03"
        finally:
            keys = [k async for k in store.client.scan_iter(match=f"{store.prefix}:*", count=1000)]
            if keys:
                await store.client.delete(*keys)
            await store.aclose()

    asyncio.run(main())

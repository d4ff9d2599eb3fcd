"""Per-tenant quotas (issue 34, items 6, 8 and 10) against ``python -m mpflow serve`` with API keys on, real Redis
and small quotas: 3 streams, 1.5 MB stored, 2 live feeds and 2 WebSockets per tenant, 3 WebSockets per process.

Each quota answers 429 ``quota_exceeded`` with a ``Retry-After`` of whole seconds and applies nothing (the refused
stream does not exist, nothing is listed, imported or accounted); concurrent creates never pass the quota; a
deleted or expired stream gives its share back; a tenant at its feed or WebSocket cap does not stop another
tenant's; the process's own WebSocket cap answers 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from mpflow.service.store.stream_store import StreamStore
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from tests.harness.server import drop_prefix, serve_as_user
from tests.integration import conftest as integration

redis_url = integration.redis_url

TENANTS = ("A", "B", "C", "D", "E", "F", "G")
KEYS = {t: f"k{t}-" + secrets.token_hex(12) for t in TENANTS}
MAX_BYTES = 1_500_000
#: an smc stream of 16384 particles in 8 dimensions: about 591 kB stored, so two fit in MAX_BYTES and three do not
BIG = {
    "model": {"family": "linear_gaussian"},
    "prior": {"type": "gaussian", "mean": [0.0] * 8, "cov": [[float(i == j) for j in range(8)] for i in range(8)]},
    "method": "smc",
    "num_particles": 16384,
    "seed": 1,
}
SMALL = {
    "model": {"family": "linear_gaussian"},
    "prior": {"type": "gaussian", "mean": [0.0], "cov": [[1.0]]},
    "method": "kalman",
}


@pytest.fixture(scope="module")
def served(redis_url, tmp_path_factory) -> Iterator[tuple[str, str]]:
    prefix = f"mpflowtest-{uuid.uuid4().hex}"
    env = {
        "MPFLOW_API_KEYS": ",".join(f"tenant{t}:{k}" for t, k in KEYS.items()),
        "MPFLOW_REDIS_URL": redis_url,
        "MPFLOW_REDIS_PREFIX": prefix,
        "MPFLOW_MAX_STREAMS_PER_TENANT": "3",
        "MPFLOW_MAX_STORED_BYTES_PER_TENANT": str(MAX_BYTES),
        "MPFLOW_MAX_FEEDS_PER_TENANT": "2",
        "MPFLOW_MAX_WEBSOCKETS_PER_TENANT": "2",
        "MPFLOW_MAX_WEBSOCKETS": "3",
    }
    log_path = tmp_path_factory.mktemp("quotas") / "service.log"
    try:
        with serve_as_user(env, log_path, args=["--workers", "1"]) as s:
            yield s.url, prefix
    finally:
        asyncio.run(drop_prefix(redis_url, prefix))


def client(url: str, tenant: str) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEYS[tenant]}"}, timeout=60)


def assert_quota(r: httpx.Response, what: str) -> int:
    """``r`` is a 429 ``quota_exceeded`` naming ``what``; its ``Retry-After`` (whole seconds, at least 1)."""
    assert r.status_code == 429, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert err["code"] == "quota_exceeded" and what in err["message"], err
    retry = int(r.headers["Retry-After"])
    assert retry >= 1, retry
    return retry


def listed(c: httpx.Client) -> list[str]:
    return sorted(s["stream_id"] for s in c.get("/v1/streams", params={"limit": 100}).json()["streams"])


def accounted(url: str, prefix: str, tenant: str) -> tuple[int, int]:
    """The tenant's (streams, bytes) as the store accounts them, read from Redis."""

    async def read() -> tuple[int, int]:
        store = StreamStore.from_url(url, prefix=prefix)
        try:
            sizes = await store.client.hgetall(f"{prefix}:usage:{{tenant{tenant}}}:sizes")
        finally:
            await store.aclose()
        total = int(sizes.pop(b":total", 0))
        assert total == sum(int(v) for v in sizes.values()), sizes  # the total is the sum of its entries
        return len(sizes), total

    return asyncio.run(read())


def test_streams_per_tenant(served, redis_url):
    url, prefix = served
    with client(url, "A") as a, client(url, "G") as g:
        for i in range(3):
            assert a.post("/v1/streams", json={**SMALL, "stream_id": f"s{i}"}).status_code == 201
        assert_quota(a.post("/v1/streams", json={**SMALL, "stream_id": "s3"}), "streams")
        assert a.get("/v1/streams/s3").status_code == 404 and listed(a) == ["s0", "s1", "s2"]
        assert accounted(redis_url, prefix, "A")[0] == 3
        assert g.post("/v1/streams", json={**SMALL, "stream_id": "s3"}).status_code == 201  # another tenant
        # a 409 (the id exists) at the quota is still a 409, and changes nothing
        assert a.post("/v1/streams", json={**SMALL, "stream_id": "s0"}).status_code in (409, 429)
        assert a.delete("/v1/streams/s1").status_code == 204
        assert accounted(redis_url, prefix, "A")[0] == 2
        assert a.post("/v1/streams", json={**SMALL, "stream_id": "s3"}).status_code == 201
        assert listed(a) == ["s0", "s2", "s3"]
        assert a.post("/v1/streams/s0/observations", json={"observations": [[0.5]]}).status_code == 200


def test_concurrent_creates_never_pass_the_quota(served, redis_url):
    url, prefix = served

    def create(i: int) -> int:
        with client(url, "F") as f:
            return f.post("/v1/streams", json={**SMALL, "stream_id": f"c{i}"}).status_code

    with ThreadPoolExecutor(8) as pool:
        statuses = sorted(pool.map(create, range(8)))
    assert statuses == [201] * 3 + [429] * 5, statuses
    with client(url, "F") as f:
        assert len(listed(f)) == 3
    assert accounted(redis_url, prefix, "F")[0] == 3


def test_stored_bytes_per_tenant(served, redis_url):
    url, prefix = served
    with client(url, "B") as b, client(url, "C") as c:
        first = b.post("/v1/streams", json={**BIG, "stream_id": "big-1"})
        assert first.status_code == 201, first.text[:300]
        snapshot = b.get("/v1/streams/big-1/export").content
        headers = {"Content-Type": "application/octet-stream"}
        assert (
            b.post("/v1/streams:import", params={"stream_id": "big-2"}, content=snapshot, headers=headers).status_code
            == 201
        )
        streams_before, bytes_before = accounted(redis_url, prefix, "B")
        assert MAX_BYTES / 2 < bytes_before <= MAX_BYTES, bytes_before

        # a third one, imported or created: 429, nothing stored, nothing accounted
        refused = b.post("/v1/streams:import", params={"stream_id": "big-3"}, content=snapshot, headers=headers)
        assert_quota(refused, "stored bytes")
        assert_quota(b.post("/v1/streams", json={**BIG, "stream_id": "big-3"}), "stored bytes")
        assert b.get("/v1/streams/big-3").status_code == 404
        assert accounted(redis_url, prefix, "B") == (streams_before, bytes_before)

        # updates that do not grow a stream past the quota still pass; another tenant is not affected
        assert b.post("/v1/streams/big-1/observations", json={"observations": [[0.1] * 8]}).status_code == 200
        assert (
            c.post("/v1/streams:import", params={"stream_id": "big-x"}, content=snapshot, headers=headers).status_code
            == 201
        )

        # a deletion gives its share back
        assert b.delete("/v1/streams/big-2").status_code == 204
        again = b.post("/v1/streams:import", params={"stream_id": "big-3"}, content=snapshot, headers=headers)
        assert again.status_code == 201, again.text[:300]


def test_an_expired_stream_gives_its_bytes_back(served, redis_url):
    url, prefix = served
    with client(url, "E") as e:
        assert e.post("/v1/streams", json={**BIG, "stream_id": "short", "ttl_seconds": 2}).status_code == 201
        assert e.post("/v1/streams", json={**BIG, "stream_id": "long"}).status_code == 201
        retry = assert_quota(e.post("/v1/streams", json={**BIG, "stream_id": "next"}), "stored bytes")
        assert retry <= 3, retry  # the next expiry: "short", in about 2 s
        time.sleep(retry + 1)
        assert e.get("/v1/streams/short").status_code == 404  # Redis expired it
        assert e.post("/v1/streams", json={**BIG, "stream_id": "next"}).status_code == 201
    assert accounted(redis_url, prefix, "E")[0] == 2


def _open_feed(stack: contextlib.ExitStack, c: httpx.Client, sid: str) -> httpx.Response:
    r = stack.enter_context(c.stream("GET", f"/v1/streams/{sid}/events"))
    if r.status_code == 200:
        chunks = r.iter_bytes()
        stack.callback(chunks.close)  # kept open until the stack closes (a dropped iterator closes the stream)
        assert next(chunks).startswith(b"event: stream")  # the first event: the feed is open
    else:
        r.read()
    return r


def test_a_tenant_at_its_feed_quota_does_not_block_another(served):
    url, _ = served
    with client(url, "C") as c, client(url, "D") as d:
        assert c.post("/v1/streams", json={**SMALL, "stream_id": "feed-c"}).status_code == 201
        assert d.post("/v1/streams", json={**SMALL, "stream_id": "feed-d"}).status_code == 201
        with contextlib.ExitStack() as stack:
            held = [_open_feed(stack, c, "feed-c") for _ in range(2)]
            assert [r.status_code for r in held] == [200, 200]
            assert_quota(_open_feed(stack, c, "feed-c"), "live feeds")
            assert _open_feed(stack, d, "feed-d").status_code == 200  # the other tenant's feed opens
        deadline = time.monotonic() + 10  # the server notices the closed feeds within a second or so
        while True:
            with contextlib.ExitStack() as stack:
                if _open_feed(stack, c, "feed-c").status_code == 200:
                    break
            assert time.monotonic() < deadline, "tenant C's feeds were not given back"
            time.sleep(0.5)


def _ws_status(url: str, tenant: str, sid: str) -> tuple[int, dict[str, str]]:
    try:
        with connect(f"{url}/v1/streams/{sid}/ws", additional_headers={"Authorization": f"Bearer {KEYS[tenant]}"}):
            pass
    except InvalidStatus as exc:
        return exc.response.status_code, dict(exc.response.headers)
    return 101, {}


def test_websockets_per_tenant_and_per_process(served):
    url, _ = served
    ws_url = url.replace("http://", "ws://")
    with client(url, "C") as c, client(url, "D") as d:
        for cl, sid in ((c, "ws-c"), (d, "ws-d")):
            assert cl.post("/v1/streams", json={**SMALL, "stream_id": sid}).status_code == 201
    auth = {t: {"Authorization": f"Bearer {KEYS[t]}"} for t in ("C", "D")}
    with contextlib.ExitStack() as stack:
        held = [
            stack.enter_context(connect(f"{ws_url}/v1/streams/ws-c/ws", additional_headers=auth["C"])) for _ in "ab"
        ]
        status, headers = _ws_status(ws_url, "C", "ws-c")
        assert status == 429 and int(headers["retry-after"]) >= 1, (status, headers)
        other = stack.enter_context(connect(f"{ws_url}/v1/streams/ws-d/ws", additional_headers=auth["D"]))
        other.send('{"observations": [[0.3]]}')  # D is not blocked
        assert '"step":1' in other.recv(timeout=30)
        status, headers = _ws_status(ws_url, "D", "ws-d")  # 3 open: the process is full
        assert status == 503 and int(headers["retry-after"]) >= 1, (status, headers)
        held[0].close()
        deadline = time.monotonic() + 10
        while (status := _ws_status(ws_url, "D", "ws-d")[0]) != 101:
            assert status == 503 and time.monotonic() < deadline, status
            time.sleep(0.2)

"""StreamStore against a real Redis (``MPFLOW_REDIS_URL``, else redis://127.0.0.1:6379/0).

Every test works under a fresh random key prefix and deletes its keys afterwards, so it never reads or
touches other data in that database. Without a reachable Redis the tests fail under CI (``CI`` set) and
are skipped, with the reason, elsewhere. Coroutines run under ``asyncio.run`` (no pytest plugin).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import torch
from mpflow.operators.models import make_model
from mpflow.operators.models.priors import prior_from_spec
from mpflow.operators.state import ParticleState
from mpflow.operators.updaters import get_updater
from mpflow.service.store.stream_store import StoreUnavailable, StreamStore

TTL = 600


def run(url: str, body: Callable[[StreamStore], Awaitable[Any]]) -> Any:
    """Run ``body(store)`` on a store with a fresh prefix; delete every key under it afterwards."""

    async def main() -> Any:
        store = StreamStore.from_url(url, prefix=f"mpflowtest-{uuid.uuid4().hex}")
        try:
            return await body(store)
        finally:
            keys = [k async for k in store.client.scan_iter(match=f"{store.prefix}:*", count=1000)]
            if keys:
                await store.client.delete(*keys)
            await store.aclose()

    return asyncio.run(main())


def smc_state(seed: int = 0, n: int = 32) -> ParticleState:
    model = make_model("linear_gaussian", None, 2)
    prior = prior_from_spec({"type": "gaussian", "mean": [0.0, 1.0], "cov": [[1.0, 0.0], [0.0, 2.0]]})
    return get_updater("smc").init(prior, model, n, seed)


def meta_doc(step: int = 0) -> dict[str, Any]:
    return {
        "model": {"family": "linear_gaussian", "params": {}},
        "method": "smc",
        "num_particles": 32,
        "step": step,
        "created_at": "2026-01-01T00:00:00Z",
        "updated_at": "2026-01-01T00:00:00Z",
    }


def test_round_trip_create_get_delete(redis_url):
    state = smc_state(seed=3)
    data = state.to_bytes()

    async def body(store: StreamStore):
        assert await store.get("t1", "s1") is None
        assert await store.create("t1", "s1", meta_doc(), data, TTL)
        meta, got = await store.get("t1", "s1")
        assert meta == {**meta_doc(), "version": 1}
        assert got == data
        back = ParticleState.from_bytes(got)
        assert torch.equal(back.particles, state.particles)
        assert torch.equal(back.rng, state.rng)
        assert await store.get("t2", "s1") is None  # tenant-scoped
        assert await store.delete("t1", "s1")
        assert await store.get("t1", "s1") is None
        assert not await store.delete("t1", "s1")
        assert [k async for k in store.client.scan_iter(match=f"{store.prefix}:*")] == []  # index too

    run(redis_url, body)


def test_create_twice_keeps_the_first(redis_url):
    first, second = smc_state(seed=1).to_bytes(), smc_state(seed=2).to_bytes()
    assert first != second

    async def body(store: StreamStore):
        assert await store.create("t", "s", meta_doc(), first, TTL)
        assert not await store.create("t", "s", {**meta_doc(), "method": "gpf"}, second, TTL)
        meta, data = await store.get("t", "s")
        assert meta["method"] == "smc" and meta["version"] == 1
        assert data == first
        assert await store.count() == 1

    run(redis_url, body)


def test_compare_and_set_versions(redis_url):
    s0 = smc_state()
    s1 = s0.replace(step=s0.step + 1)

    async def body(store: StreamStore):
        assert await store.create("t", "s", meta_doc(), s0.to_bytes(), TTL)
        ok = await store.compare_and_set("t", "s", 1, {"step": 1, "updated_at": "later"}, s1.to_bytes(), TTL)
        assert ok
        meta, data = await store.get("t", "s")
        assert meta["version"] == 2 and meta["step"] == 1 and meta["updated_at"] == "later"
        assert meta["created_at"] == meta_doc()["created_at"]  # merged, not replaced
        assert ParticleState.from_bytes(data).step.item() == 1
        # a stale version changes nothing
        assert not await store.compare_and_set("t", "s", 1, {"step": 7}, s0.to_bytes(), TTL)
        assert await store.get("t", "s") == (meta, data)
        # a caller-supplied version is ignored: the store owns it
        assert await store.compare_and_set("t", "s", 2, {"version": 99}, data, TTL)
        assert (await store.get("t", "s"))[0]["version"] == 3
        # a missing stream is a failed CAS, and the CAS does not create it
        assert not await store.compare_and_set("t", "nope", 1, {"step": 1}, data, TTL)
        assert await store.get("t", "nope") is None

    run(redis_url, body)


async def published(store: StreamStore, name: str, write: Callable[[], Awaitable[Any]]) -> tuple[Any, list[bytes]]:
    """``(write()'s result, the payloads published on channel name while it ran)``, from a real subscription.

    After ``write`` has answered, a sentinel is published on the channel: Redis runs commands one at a time and
    delivers a channel's messages in that order, so every message the write published comes before it — the
    list is complete without waiting on a timeout."""
    sentinel = f"sentinel-{uuid.uuid4().hex}".encode()
    pubsub = store.client.pubsub()
    try:
        await pubsub.subscribe(name)
        assert (await pubsub.get_message(timeout=5))["type"] == "subscribe"
        result = await write()
        assert await store.client.publish(name, sentinel) == 1
        messages: list[bytes] = []
        while (m := await pubsub.get_message(ignore_subscribe_messages=True, timeout=5)) is not None:
            if m["data"] == sentinel:
                return result, messages
            messages.append(m["data"])
        raise AssertionError(f"the sentinel never came; got {messages}")
    finally:
        await pubsub.aclose()


def test_compare_and_set_publishes_its_event_once_and_only_after_a_write(redis_url):
    data = smc_state().to_bytes()
    payload = '{"stream_id":"s","step":1,"per_step":[{"step":1}]}'

    async def body(store: StreamStore):
        name = f"{store.prefix}:events:t:s"
        assert await store.create("t", "s", meta_doc(), data, TTL)

        def cas(version: int, stream_id: str = "s", event: tuple[str, str] | None = (name, payload)):
            return lambda: store.compare_and_set("t", stream_id, version, {"step": version}, data, TTL, event=event)

        # a version mismatch writes nothing and publishes nothing; nor does a missing stream
        assert await published(store, name, cas(7)) == (False, [])
        assert await published(store, name, cas(1, "nope")) == (False, [])
        assert (await store.get("t", "s"))[0]["version"] == 1
        # the write publishes exactly once, the payload as given; without an event, nothing is published
        assert await published(store, name, cas(1)) == (True, [payload.encode()])
        assert await published(store, name, cas(2, event=None)) == (True, [])
        meta, _ = await store.get("t", "s")
        assert meta["version"] == 3 and meta["step"] == 2  # the event did not disturb the meta fields
        # of racing writers from one read, only the winner's event is published
        racers = [store.compare_and_set("t", "s", 3, {"step": i}, data, TTL, event=(name, str(i))) for i in range(20)]
        results, messages = await published(store, name, lambda: asyncio.gather(*racers))
        assert sum(results) == 1 and messages == [str(results.index(True)).encode()]
        with pytest.raises(ValueError):
            await store.compare_and_set("t", "s", 4, {}, data, TTL, event=("", payload))

    run(redis_url, body)


def test_ttl_on_both_keys_and_refreshed(redis_url):
    data = smc_state().to_bytes()

    async def body(store: StreamStore):
        assert await store.create("t", "s", meta_doc(), data, 100)
        meta_key, state_key = store._keys("t", "s")
        for key in (meta_key, state_key):
            assert 0 < await store.client.ttl(key) <= 100
        assert await store.compare_and_set("t", "s", 1, {"step": 1}, data, 5000)
        for key in (meta_key, state_key):
            assert 100 < await store.client.ttl(key) <= 5000

    run(redis_url, body)


def test_concurrent_cas_from_one_read_has_one_winner(redis_url):
    data = smc_state().to_bytes()

    async def body(store: StreamStore):
        assert await store.create("t", "s", meta_doc(), data, TTL)
        meta, _ = await store.get("t", "s")
        results = await asyncio.gather(
            *(store.compare_and_set("t", "s", meta["version"], {"step": i}, data, TTL) for i in range(50))
        )
        assert sum(results) == 1
        final, _ = await store.get("t", "s")
        assert final["version"] == 2
        assert final["step"] == results.index(True)

    run(redis_url, body)


def test_concurrent_read_cas_retry_loses_no_update(redis_url):
    async def increment(store: StreamStore) -> int:
        attempts = 0
        while True:
            attempts += 1
            meta, data = await store.get("t", "s")
            state = ParticleState.from_bytes(data)
            new = state.replace(step=state.step + 1).to_bytes()
            if await store.compare_and_set("t", "s", meta["version"], {"step": meta["step"] + 1}, new, TTL):
                return attempts

    async def body(store: StreamStore):
        assert await store.create("t", "s", meta_doc(), smc_state().to_bytes(), TTL)
        attempts = await asyncio.gather(*(increment(store) for _ in range(50)))
        meta, data = await store.get("t", "s")
        assert meta["step"] == 50 and meta["version"] == 51
        assert ParticleState.from_bytes(data).step.item() == 50
        return sum(attempts)

    total = run(redis_url, body)
    assert total > 50  # the writers really raced (some CAS attempts lost and retried)


def test_list_paginates_every_stream_once_per_tenant(redis_url):
    data = smc_state(n=4).to_bytes()

    async def body(store: StreamStore):
        a_ids = {f"a-{i:02d}" for i in range(23)}
        b_ids = {f"b-{i}" for i in range(5)}
        for sid in sorted(a_ids):
            assert await store.create("A", sid, meta_doc(), data, TTL)
        for sid in sorted(b_ids):
            assert await store.create("B", sid, meta_doc(), data, TTL)
        assert await store.count() == 28

        async def all_pages(tenant: str, limit: int) -> list[str]:
            seen, cursor, pages = [], None, 0
            while True:
                items, cursor = await store.list(tenant, limit, cursor)
                assert len(items) <= limit
                seen += [it["stream_id"] for it in items]
                pages += 1
                assert all(it["method"] == "smc" and it["version"] == 1 for it in items)
                if cursor is None:
                    return seen
                assert pages < 100

        for limit in (1, 5, 23, 100):
            seen = await all_pages("A", limit)
            assert len(seen) == len(set(seen)) == 23 and set(seen) == a_ids
        seen_b = await all_pages("B", 2)
        assert sorted(seen_b) == sorted(b_ids)
        assert await all_pages("C", 10) == []

        # a stream deleted or created between pages: no repeats, nothing already listed lost
        page1, cursor = await store.list("A", 10)
        assert cursor is not None
        assert await store.delete("A", page1[0]["stream_id"])
        assert await store.create("A", "a-new", meta_doc(), data, TTL)
        rest = []
        while cursor is not None:
            items, cursor = await store.list("A", 10, cursor)
            rest += [it["stream_id"] for it in items]
        assert set(rest).isdisjoint(it["stream_id"] for it in page1)
        assert len(page1) + len(rest) == 24 and "a-new" in rest

        # an expired stream (meta key gone, index member left) is skipped and pruned;
        # a re-created id is listed once
        await store.client.delete(*store._keys("A", "a-05"))
        assert await store.create("A", "a-06", meta_doc(), data, TTL) is False
        await store.client.delete(*store._keys("A", "a-07"))
        assert await store.create("A", "a-07", {**meta_doc(), "step": 3}, data, TTL)
        seen = await all_pages("A", 4)
        assert "a-05" not in seen and seen.count("a-07") == 1
        assert len(seen) == len(set(seen)) == 22
        assert await store.client.zcard(store._index("A")) == 22

        with pytest.raises(ValueError, match=r"^cursor"):
            await store.list("A", 5, "not-a-cursor!")
        with pytest.raises(ValueError, match=r"^limit"):
            await store.list("A", 0)

    run(redis_url, body)


def test_names_that_would_break_keys_are_rejected(redis_url):
    async def body(store: StreamStore):
        for bad in ("", "a:b", "a{b}", "a b", "x" * 129, "a*"):
            with pytest.raises(ValueError, match=r"^stream_id"):
                await store.get("t", bad)
            with pytest.raises(ValueError, match=r"^tenant"):
                await store.create(bad, "s", meta_doc(), b"x", TTL)
        with pytest.raises(ValueError, match=r"^ttl"):
            await store.create("t", "s", meta_doc(), b"x", 0)
        assert await store.get("t", "s") is None

    run(redis_url, body)


def test_a_shared_secret_is_set_once_and_every_store_gets_it(redis_url):
    """``shared_secret``: of racing stores (replicas) with different candidates, every one gets the first one kept
    (SET NX), and later calls keep it; no TTL; under another prefix (another deployment), another secret."""

    async def body(store: StreamStore):
        peers = [StreamStore.from_url(redis_url, prefix=store.prefix) for _ in range(4)]
        try:
            got = await asyncio.gather(
                *(s.shared_secret("snapshot-key", bytes([i]) * 32) for i, s in enumerate([store, *peers] * 4))
            )
            assert len(set(got)) == 1 and got[0] in {bytes([i]) * 32 for i in range(20)}
            assert await store.shared_secret("snapshot-key", b"later") == got[0]
            assert await store.client.ttl(f"{store.prefix}:secret:snapshot-key") == -1
            other = StreamStore.from_url(redis_url, prefix=store.prefix + "-other")
            try:
                assert await other.shared_secret("snapshot-key", b"o" * 32) == b"o" * 32
                await other.client.delete(f"{other.prefix}:secret:snapshot-key")
            finally:
                await other.aclose()
            with pytest.raises(ValueError, match=r"^name"):
                await store.shared_secret("a:b", b"x")
        finally:
            for peer in peers:
                await peer.aclose()

    run(redis_url, body)


def test_unreachable_redis_raises_store_unavailable():
    async def body():
        store = StreamStore.from_url("redis://127.0.0.1:1/0", timeout=0.5)
        try:
            assert await store.ping() is False
            with pytest.raises(StoreUnavailable):
                await store.get("t", "s")
            with pytest.raises(StoreUnavailable):
                await store.create("t", "s", meta_doc(), b"x", TTL)
            with pytest.raises(StoreUnavailable):
                await store.compare_and_set("t", "s", 1, {}, b"x", TTL)
            with pytest.raises(StoreUnavailable):
                await store.list("t", 5)
        finally:
            await store.aclose()

    asyncio.run(body())

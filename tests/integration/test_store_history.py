"""The per-step history key of :class:`~mpflow.service.store.stream_store.StreamStore` against a real Redis (as
``test_store``): written by the compare-and-set only when it writes, capped, deleted and expiring with the stream, in
the stream's hash slot. ``test_api_history`` runs these again on a Redis Cluster."""

from __future__ import annotations

import asyncio

import pytest
from mpflow.service.store.stream_store import StreamStore

from tests.integration.test_store import TTL, meta_doc, run

DATA = b"state"


def entry(step: int) -> str:
    return f'{{"step":{step}}}'


async def advance(store: StreamStore, version: int, steps: range, cap: int, ttl: int = TTL) -> bool:
    """One compare-and-set from ``version`` carrying a history entry per step of ``steps``."""
    history = [entry(m) for m in steps]
    meta = {"step": steps[-1]}
    return await store.compare_and_set("t", "s", version, meta, DATA, ttl, history=history, history_steps=cap)


def test_history_is_appended_by_each_write_and_capped(redis_url):
    async def body(store: StreamStore):
        assert await store.create("t", "s", meta_doc(), DATA, TTL)
        assert await store.history("t", "s", 10) == (0, [])  # a new stream has no history (and no history key)
        assert not await store.client.exists(store.history_key("t", "s"))
        assert await advance(store, 1, range(1, 4), cap=5)
        assert await advance(store, 2, range(4, 6), cap=5)
        step, got = await store.history("t", "s", 10)
        assert step == 5 and got == [entry(m).encode() for m in range(1, 6)]
        assert await advance(store, 3, range(6, 9), cap=5)  # over the cap: the oldest go
        assert await store.history("t", "s", 10) == (8, [entry(m).encode() for m in range(4, 9)])
        assert await store.history("t", "s", 2) == (8, [entry(7).encode(), entry(8).encode()])  # the latest 2
        assert await advance(store, 4, range(9, 21), cap=5)  # one write of more steps than the cap keeps its last
        assert (await store.history("t", "s", 10))[1] == [entry(m).encode() for m in range(16, 21)]
        assert not await advance(store, 4, range(21, 23), cap=5)  # a lost race writes no history
        assert (await store.history("t", "s", 10))[1][-1] == entry(20).encode()
        assert await store.history("t", "nope", 10) is None
        with pytest.raises(ValueError, match="history_steps"):
            await advance(store, 5, range(21, 22), cap=0)
        with pytest.raises(ValueError, match="limit"):
            await store.history("t", "s", 0)

    run(redis_url, body)


def test_a_write_of_thousands_of_steps_is_kept(redis_url):
    """The script pushes its entries in chunks (Lua's unpack takes at most ~8000 values at once)."""

    async def body(store: StreamStore):
        assert await store.create("t", "s", meta_doc(), DATA, TTL)
        assert await advance(store, 1, range(1, 20_001), cap=12_000)
        _, got = await store.history("t", "s", 12_000)
        assert len(got) == 12_000 and got[0] == entry(8_001).encode() and got[-1] == entry(20_000).encode()

    run(redis_url, body)


def test_history_is_deleted_with_the_stream_and_not_inherited(redis_url):
    async def body(store: StreamStore):
        assert await store.create("t", "s", meta_doc(), DATA, TTL)
        assert await advance(store, 1, range(1, 3), cap=10)
        assert await store.client.exists(store.history_key("t", "s"))
        assert await store.delete("t", "s")
        assert not await store.client.exists(store.history_key("t", "s"))
        assert await store.history("t", "s", 10) is None
        assert await store.create("t", "s", meta_doc(), DATA, TTL)  # the id again: a new stream, no steps
        assert await store.history("t", "s", 10) == (0, [])

    run(redis_url, body)


def test_history_carries_the_streams_ttl_and_expires_with_it(redis_url):
    async def body(store: StreamStore):
        assert await store.create("t", "s", meta_doc(), DATA, 100)
        assert await advance(store, 1, range(1, 2), cap=10, ttl=5000)
        meta_key, state_key = store.keys("t", "s")
        history_key = store.history_key("t", "s")
        assert 100 < await store.client.ttl(history_key) <= 5000
        assert await store.client.ttl(history_key) == await store.client.ttl(meta_key)
        assert await advance(store, 2, range(2, 3), cap=10, ttl=1)  # a write refreshes every key's TTL
        assert 0 < await store.client.pttl(history_key) <= 1000
        await asyncio.sleep(1.2)
        assert await store.client.exists(meta_key, state_key, history_key) == 0
        assert await store.history("t", "s", 10) is None

    run(redis_url, body)


def test_history_key_shares_the_streams_hash_slot(redis_url):
    async def body(store: StreamStore):
        meta_key, state_key = store.keys("t", "s")
        history_key = store.history_key("t", "s")
        tag = meta_key[meta_key.index("{") : meta_key.index("}") + 1]
        assert tag == "{t:s}" and tag in history_key and history_key.startswith(f"{store.prefix}:")

    run(redis_url, body)

"""The service on a real Redis Cluster (3 primaries + 3 replicas on loopback: the ``redis_cluster`` fixture).

The core of the integration suite — create, update, ``seq``, concurrency across two app replicas, listing,
delete, tenancy — runs here again with ``MPFLOW_REDIS_URL`` pointing at one node of the cluster (the same test
functions as against one Redis), and then what only a cluster has: the mode told from any node's URL, keys on
every primary, the live feed through sharded pub/sub, replica acknowledgement (``WAIT``) and readiness while a
primary fails over.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from typing import Any

import httpx
import pytest
from mpflow.service.settings import Settings
from mpflow.service.store.replication import REFRESH_S, DegradedShards
from mpflow.service.store.stream_store import StoreOutcomeUnknown, StreamStore

from tests.harness.cluster import LocalCluster, cluster_binaries
from tests.harness.server import drop_prefix, serve_in_process, serve_in_thread
from tests.integration import test_api_concurrency as concurrency
from tests.integration import test_api_streams as api
from tests.integration import test_store as store_tests

CORE = [
    store_tests.test_round_trip_create_get_delete,
    store_tests.test_create_twice_keeps_the_first,
    store_tests.test_compare_and_set_versions,
    store_tests.test_ttl_on_both_keys_and_refreshed,
    store_tests.test_concurrent_cas_from_one_read_has_one_winner,
    store_tests.test_concurrent_read_cas_retry_loses_no_update,
    store_tests.test_list_paginates_every_stream_once_per_tenant,
    store_tests.test_names_that_would_break_keys_are_rejected,
    store_tests.test_a_shared_secret_is_set_once_and_every_store_gets_it,
    api.test_seq_rules,
    api.test_failing_requests_change_nothing,
    api.test_tenants_are_isolated_and_listing_is_scoped,
    api.test_a_restarted_app_serves_the_same_streams,
    api.test_batch_endpoint_each_update_on_its_own,
    concurrency.test_50_writers_with_seq_apply_every_batch_exactly_once,
    concurrency.test_concurrent_appends_without_seq_are_all_applied,
    concurrency.test_micro_batching_across_streams_keeps_answers,
]


@pytest.mark.parametrize("core_test", CORE, ids=[f"{t.__module__.rsplit('.', 1)[1]}.{t.__name__}" for t in CORE])
def test_core_suite_on_a_cluster(core_test: Any, redis_cluster: LocalCluster) -> None:
    core_test(redis_cluster.url)


def test_cluster_mode_is_told_from_any_node_and_keys_spread_over_every_primary(redis_cluster, redis_url):
    prefix = f"mpflowtest-{uuid.uuid4().hex}"

    async def main() -> None:
        for port in redis_cluster.ports:  # every node, replicas too, tells the store it is in a cluster
            store = StreamStore.from_url(redis_cluster.url_of(port), prefix=prefix)
            assert store.cluster is True
            await store.aclose()
        single = StreamStore.from_url(redis_url, prefix=prefix)
        assert single.cluster is False
        await single.aclose()
        store = StreamStore.from_url(redis_cluster.url_of(redis_cluster.ports[-1]), prefix=prefix)
        try:
            for i in range(48):
                assert await store.create("t", f"s{i:02d}", {"step": 0}, b"state", 600)
            assert await store.count() == 48
            per_primary = redis_cluster.keys_per_primary(f"{prefix}:*")
            assert len(per_primary) == 3 and all(n > 0 for n in per_primary.values()), per_primary
            assert sum(per_primary.values()) == 2 * 48 + 1  # two keys per stream and the tenant's index
        finally:
            await store.aclose()
            await drop_prefix(redis_cluster.url, prefix)

    asyncio.run(main())


def test_an_undecided_store_decides_at_its_first_answer(redis_cluster):
    """A store made while its node did not answer (``cluster=None`` left undecided) asks at its first command."""

    async def main() -> None:
        store = StreamStore(
            StreamStore.from_url(redis_cluster.url, cluster=False).client,
            prefix=f"mpflowtest-{uuid.uuid4().hex}",
            reopen=lambda cluster: StreamStore.from_url(redis_cluster.url, cluster=cluster).client,
        )
        assert store.cluster is False
        try:
            for i in range(12):  # on several slots: a plain client would be answered MOVED for most of them
                assert await store.create("t", f"s{i}", {"step": 0}, b"x", 600)
            assert store.cluster is True
            assert len((await store.list("t"))[0]) == 12
        finally:
            await store.aclose()
            await drop_prefix(redis_cluster.url, store.prefix)

    asyncio.run(main())


def _events(url: str, stream_id: str, want: int, out: list[tuple[str, dict]], opened: threading.Event) -> None:
    """Read ``want`` events of one stream's live feed into ``out`` (in a thread: the feed blocks)."""
    with httpx.Client(base_url=url, timeout=30) as client, client.stream("GET", f"/v1/streams/{stream_id}/events") as r:
        assert r.status_code == 200
        name = ""
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                out.append((name, json.loads(line[6:])))
                opened.set()
                if len(out) == want:
                    return


def test_live_feed_through_sharded_pub_sub(redis_cluster):
    """The dashboard's feed on a cluster: the stream's document, then one event per applied update (the CAS
    script SPUBLISHes in the stream's slot, the feed SSUBSCRIBEs on that slot's primary)."""
    prefix = f"mpflowtest-{uuid.uuid4().hex}"
    settings = Settings(redis_url=redis_cluster.url, redis_prefix=prefix)
    try:
        with serve_in_thread(settings) as url, httpx.Client(base_url=url, timeout=30) as client:
            for sid in ("feed-a", "feed-b", "feed-c"):  # streams in different slots
                assert client.post("/v1/streams", json=api.new_stream("linear_gaussian", "kalman", stream_id=sid))
            events: dict[str, list] = {}
            readers = []
            for sid in ("feed-a", "feed-b", "feed-c"):
                events[sid], opened = [], threading.Event()
                reader = threading.Thread(target=_events, args=(url, sid, 3, events[sid], opened), daemon=True)
                reader.start()
                assert opened.wait(10)
                readers.append(reader)
            for sid in ("feed-a", "feed-b", "feed-c"):
                for seq in (1, 2):
                    answer = client.post(
                        f"/v1/streams/{sid}/observations", json={"seq": seq, "observations": [[0.1, 0.2]]}
                    )
                    assert answer.status_code == 200, answer.text
                dup = client.post(f"/v1/streams/{sid}/observations", json={"seq": 2, "observations": [[0.1, 0.2]]})
                assert dup.json()["duplicate"] is True  # nothing applied: no event
            for reader in readers:
                reader.join(15)
            for sid, got in events.items():
                assert [(name, doc["stream_id"], doc["step"]) for name, doc in got] == [
                    ("stream", sid, 0),
                    ("update", sid, 1),
                    ("update", sid, 2),
                ]
    finally:
        asyncio.run(drop_prefix(redis_cluster.url, prefix))


def test_replica_acknowledgement(redis_cluster):
    """``wait_replicas=1``: a write is acknowledged once the primary's replica has it; asking for more replicas
    than there are makes every write 503 ``store_outcome_unknown`` (applied on the primary, not acknowledged) and
    ``/readyz`` not ready."""
    prefix = f"mpflowtest-{uuid.uuid4().hex}"

    async def main() -> None:
        store = StreamStore.from_url(redis_cluster.url, prefix=prefix, wait_replicas=1)
        greedy = StreamStore.from_url(redis_cluster.url, prefix=prefix, wait_replicas=2, wait_timeout_ms=100)
        try:
            assert await store.writable() and not await greedy.writable()
            for i in range(6):
                assert await store.create("t", f"s{i}", {"step": 0}, b"x", 600)
                assert await store.compare_and_set("t", f"s{i}", 1, {"step": 1}, b"y", 600)
            with pytest.raises(StoreOutcomeUnknown, match=r"[01] of 2"):
                await greedy.compare_and_set("t", "s0", 2, {"step": 2}, b"z", 600)
            assert (await store.get("t", "s0"))[0]["version"] == 3  # it was applied on the primary
            assert await store.delete("t", "s1") and not await store.delete("t", "s1")
        finally:
            await store.aclose()
            await greedy.aclose()
            await drop_prefix(redis_cluster.url, prefix)
        s = Settings(redis_url=redis_cluster.url, redis_prefix=prefix, redis_wait_replicas=2, redis_wait_timeout_ms=50)
        async with serve_in_process(s) as (_, client):
            ready = await client.get("/readyz")
            assert ready.status_code == 503 and ready.json()["store"] is False

    asyncio.run(main())


async def _degraded_until(watch: DegradedShards, done: Any, timeout: float = 20.0) -> bool:
    """Look at the shards (once per ``REFRESH_S``) until ``done(degraded)``; whether it came in time."""
    deadline = time.monotonic() + timeout
    while not done(await watch.look()):
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(REFRESH_S)
    return True


@pytest.mark.skipif(cluster_binaries() is None, reason="needs redis-server >= 7 and redis-cli")
def test_failover_keeps_acknowledged_writes_and_readiness_follows(tmp_path):
    """The primary of the readiness key SIGKILLed: writes acknowledged with ``wait_replicas=1`` survive on the
    promoted replica. The store takes no acknowledged write (``/readyz`` false) while the slot has no primary,
    nor once the replica took over alone (no replica left to acknowledge); when the killed node is back (it
    rejoins as the new primary's replica) the same store — not restarted — is writable again. Meanwhile the
    promoted replica is named as a degraded shard (a primary without the replica ``WAIT`` 1 needs), and no longer
    once the killed node is back."""
    prefix = f"mpflowtest-{uuid.uuid4().hex}"
    with LocalCluster(tmp_path) as cluster:

        async def main() -> None:
            store = StreamStore.from_url(cluster.url, prefix=prefix, wait_replicas=1, wait_timeout_ms=300)
            try:
                for i in range(24):
                    assert await store.create("t", f"s{i}", {"step": 0}, b"x", 600)
                    assert await store.compare_and_set("t", f"s{i}", 1, {"step": 1}, b"y", 600)
                victim = store.client.get_node_from_key(f"{prefix}:readyz").port
                watch, before = DegradedShards(lambda: store.client, 1), set(cluster.primary_ports())
                assert await watch.look() == {}
                cluster.kill(victim)
                assert not await store.writable()
                await asyncio.to_thread(cluster.wait_promoted, victim)
                assert not await store.writable()  # a primary alone: nothing can be acknowledged
                replacement = next(p for p in cluster.primary_ports() if p not in before)
                assert await _degraded_until(watch, lambda found: f"127.0.0.1:{replacement}" in found)
                for i in range(24):  # every acknowledged write is on the primaries now
                    meta, state = await store.get("t", f"s{i}")
                    assert (meta["version"], meta["step"], state) == (2, 1, b"y")
                assert len((await store.list("t", limit=100))[0]) == 24
                await asyncio.to_thread(cluster.restart, victim)
                await asyncio.to_thread(cluster.wait_ok)
                deadline = time.monotonic() + 20
                while not await store.writable():
                    assert time.monotonic() < deadline, "the store never became writable after the failover"
                    await asyncio.sleep(0.1)
                assert await store.compare_and_set("t", "s0", 2, {"step": 2}, b"z", 600)
                assert await _degraded_until(watch, lambda found: found == {})
            finally:
                await store.aclose()

        asyncio.run(main())

"""Per-tenant stream and stored-bytes quotas (:mod:`mpflow.service.store.quotas`) across replicas: two apps over one
store (one Redis, and a Redis Cluster, where a tenant's accounting keys share a slot of their own), creating, importing,
updating and deleting concurrently. The quota is never passed, the accounted total is always the sum of the
streams' entries, and it matches what is stored.
"""

from __future__ import annotations

import asyncio
import uuid

from mpflow.service.settings import Settings
from mpflow.service.store.quotas import TenantUsage

from tests.harness.cluster import LocalCluster
from tests.harness.server import drop_prefix, serve_in_process
from tests.harness.specs import LINEAR_STREAM

STREAM = {**LINEAR_STREAM, "num_particles": 512, "seed": 3}
KEYS = "alpha:key-a,beta:key-b"


def _settings(url: str, **quotas: int) -> Settings:
    return Settings(redis_url=url, redis_prefix=f"mpflowtest-{uuid.uuid4().hex}", api_keys=KEYS, **quotas)


async def _replicas_race(url: str) -> None:
    settings = _settings(url, max_streams_per_tenant=5)
    try:
        async with (
            serve_in_process(settings, "key-a") as (app1, one),
            serve_in_process(settings, "key-a") as (_, two),
            serve_in_process(settings, "key-b") as (_, beta),
        ):
            usage: TenantUsage = app1.state.streams.usage
            creates = [
                (one if i % 2 else two).post("/v1/streams", json={**STREAM, "stream_id": f"s{i}"}) for i in range(12)
            ]
            statuses = sorted(r.status_code for r in await asyncio.gather(*creates))
            assert statuses == [201] * 5 + [429] * 7, statuses
            listed = (await one.get("/v1/streams")).json()["streams"]
            assert len(listed) == 5 and (await usage.usage("alpha"))[0] == 5
            assert (await beta.post("/v1/streams", json=STREAM)).status_code == 201  # another tenant

            # updates through both replicas, deletes and re-creates: the accounting follows
            ids = [s["stream_id"] for s in listed]
            updates = [
                (one if k % 2 else two).post(f"/v1/streams/{sid}/observations", json={"observations": [[0.1, 0.2]]})
                for k, sid in enumerate(ids * 2)
            ]
            assert {r.status_code for r in await asyncio.gather(*updates)} == {200}
            streams, total = await usage.usage("alpha")
            assert streams == 5 and total > 5 * 512 * 2 * 4, total  # at least the particles
            assert (await two.delete(f"/v1/streams/{ids[0]}")).status_code == 204
            assert (await usage.usage("alpha"))[0] == 4
            again = await asyncio.gather(*(one.post("/v1/streams", json=STREAM) for _ in range(3)))
            assert sorted(r.status_code for r in again) == [201, 429, 429]
            # a create refused as a duplicate id (409) gives nothing back and takes nothing
            assert (await two.delete(f"/v1/streams/{ids[1]}")).status_code == 204
            before = await usage.usage("alpha")
            assert (await one.post("/v1/streams", json={**STREAM, "stream_id": ids[2]})).status_code == 409
            assert await usage.usage("alpha") == before
    finally:
        await drop_prefix(url, settings.redis_prefix)


async def _bytes(url: str) -> None:
    probe = _settings(url)
    try:
        async with serve_in_process(probe, "key-a") as (app, c):
            assert (await c.post("/v1/streams", json={**STREAM, "stream_id": "p"})).status_code == 201
            one_stream = (await app.state.streams.usage.usage("alpha"))[1]
    finally:
        await drop_prefix(url, probe.redis_prefix)
    settings = _settings(url, max_stored_bytes_per_tenant=int(3.5 * one_stream))
    try:
        async with (
            serve_in_process(settings, "key-a") as (app1, one),
            serve_in_process(settings, "key-a") as (_, two),
        ):
            usage: TenantUsage = app1.state.streams.usage
            assert (await one.post("/v1/streams", json={**STREAM, "stream_id": "src"})).status_code == 201
            blob = (await one.get("/v1/streams/src/export")).content
            headers = {"Content-Type": "application/octet-stream"}
            imports = [
                (one if i % 2 else two).post("/v1/streams:import", content=blob, headers=headers) for i in range(6)
            ]
            statuses = sorted(r.status_code for r in await asyncio.gather(*imports))
            assert statuses == [201] * 2 + [429] * 4, statuses
            streams, total = await usage.usage("alpha")
            assert streams == 3 and total <= settings.max_stored_bytes_per_tenant, (streams, total)
            assert len((await one.get("/v1/streams")).json()["streams"]) == 3
    finally:
        await drop_prefix(url, settings.redis_prefix)


def test_quotas_hold_across_replicas(redis_url: str) -> None:
    asyncio.run(_replicas_race(redis_url))
    asyncio.run(_bytes(redis_url))


def test_quotas_on_a_cluster(redis_cluster: LocalCluster) -> None:
    """The tenant's accounting keys share one slot (``{<tenant>}``), the stream's keys another: both scripts run."""
    asyncio.run(_replicas_race(redis_cluster.url))
    asyncio.run(_bytes(redis_cluster.url))

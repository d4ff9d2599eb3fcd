"""Every acknowledgment honours ``MPFLOW_REDIS_WAIT_REPLICAS``, on one Redis primary with one replica (no Cluster).

A replica frozen (SIGSTOP: connected, acknowledging nothing) makes a write answer 503 ``store_outcome_unknown``
(applied on the primary only); the retry with the same ``seq`` must not then answer 200 ``duplicate`` — the write
it would acknowledge is still on the primary alone — nor may a repeated create answer 409 or a repeated delete 404
(what a retrying client reads as "done"). Once the replica is back, the same retry answers ``duplicate``. A replica
killed shows in ``/readyz`` (``degraded_shards``) and in ``mpflow_store_degraded_shards``, and the log says so
once per change. The cluster counterpart (a primary killed, its replica alone) is ``test_cluster_faults.py``.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import httpx
import pytest
import redis
from mpflow.service.settings import Settings
from mpflow.service.store.replication import REFRESH_S, DegradedShards

from tests.harness.server import RedisProcess, serve_in_thread

STREAM = {
    "model": {"family": "linear_gaussian", "params": {}},
    "prior": {"type": "gaussian", "mean": [0.0, 0.0], "cov": [[1.0, 0.0], [0.0, 1.0]]},
    "method": "kalman",
}


def _replicate(replica: RedisProcess, primary: RedisProcess, timeout: float = 30.0) -> None:
    """Make ``replica`` a replica of ``primary`` and wait until the primary lists it online."""
    with redis.Redis(port=replica.port, socket_timeout=5) as r:
        r.replicaof("127.0.0.1", primary.port)
    deadline = time.monotonic() + timeout
    with redis.Redis(port=primary.port, socket_timeout=5) as p:
        while p.info("replication").get("slave0", {}).get("state") != "online":
            assert time.monotonic() < deadline, "the replica never came online"
            time.sleep(0.05)


@pytest.fixture
def pair(tmp_path, redis_server_binary):
    with RedisProcess(tmp_path / "primary") as primary, RedisProcess(tmp_path / "replica") as replica:
        primary.start()
        replica.start()
        _replicate(replica, primary)
        yield primary, replica


def _until(predicate, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_no_acknowledgment_before_the_replica_has_the_write(pair):
    primary, replica = pair
    settings = Settings(
        redis_url=primary.url,
        redis_prefix=f"mpflowtest-{uuid.uuid4().hex}",
        redis_wait_replicas=1,
        redis_wait_timeout_ms=300,
    )
    with serve_in_thread(settings) as url, httpx.Client(base_url=url, timeout=30) as client:
        assert client.post("/v1/streams", json={**STREAM, "stream_id": "s"}).status_code == 201
        assert client.post("/v1/streams", json={**STREAM, "stream_id": "gone"}).status_code == 201
        body = {"seq": 1, "observations": [[0.1, 0.2]]}
        assert client.post("/v1/streams/s/observations", json=body).status_code == 200

        replica.freeze()
        try:
            body = {"seq": 2, "observations": [[0.3, 0.4]]}
            first = client.post("/v1/streams/s/observations", json=body)
            assert first.status_code == 503 and first.json()["error"]["code"] == "store_outcome_unknown"
            for _ in range(2):  # the retries the docs prescribe: never acknowledged while the replica lacks it
                retry = client.post("/v1/streams/s/observations", json=body)
                assert retry.status_code == 503, retry.text
                assert retry.json()["error"]["code"] == "store_outcome_unknown"
            assert client.get("/v1/streams/s").json()["step"] == 2  # it is on the primary
            deleted = client.delete("/v1/streams/gone")
            assert deleted.status_code == 503  # applied on the primary, not acknowledged
            again = client.delete("/v1/streams/gone")
            assert again.status_code == 503, again.text  # not 404 before the replica has the delete
            created = client.post("/v1/streams", json={**STREAM, "stream_id": "s"})
            assert created.status_code == 503, created.text  # not 409 before the replica has the stream
        finally:
            replica.thaw()

        retry = client.post("/v1/streams/s/observations", json=body)
        assert retry.status_code == 200 and retry.json()["duplicate"] is True and retry.json()["step"] == 2
        assert client.delete("/v1/streams/gone").status_code == 404
        assert client.post("/v1/streams", json={**STREAM, "stream_id": "s"}).status_code == 409
    with redis.Redis(port=replica.port) as r:  # what was acknowledged is on the replica
        keys = [k for k in r.keys(f"{settings.redis_prefix}:*") if k.endswith(b":meta")]
        assert [r.hget(k, "step") for k in keys] == [b"2"]


def _degraded(client: httpx.Client) -> tuple[list[str], float]:
    ready = client.get("/readyz").json()["degraded_shards"]
    gauge = next(
        float(line.split()[-1])
        for line in client.get("/metrics").text.splitlines()
        if line.startswith("mpflow_store_degraded_shards ")
    )
    return ready, gauge


def test_a_shard_without_its_replicas_is_named_in_readyz_and_metrics(pair):
    primary, replica = pair
    settings = Settings(redis_url=primary.url, redis_prefix=f"mpflowtest-{uuid.uuid4().hex}", redis_wait_replicas=1)
    name = f"127.0.0.1:{primary.port}"
    with serve_in_thread(settings) as url, httpx.Client(base_url=url, timeout=30) as client:
        assert _degraded(client) == ([], 0.0)
        replica.kill()
        _until(lambda: _degraded(client) == ([name], 1.0))
        assert client.get("/readyz").status_code == 503  # its one primary takes no acknowledged write
        replica.start()
        _replicate(replica, primary)
        _until(lambda: _degraded(client) == ([], 0.0))
        assert client.get("/readyz").status_code == 200


def test_the_log_says_so_once_per_change(tmp_path, redis_server_binary, caplog):
    """A Redis without replicas, one needed: degraded, said once however often it is looked at; with none needed
    nothing is looked at."""
    import redis.asyncio as aredis

    async def main(url: str) -> list[dict]:
        client = aredis.Redis.from_url(url)
        counts: list[int] = []
        try:
            watch = DegradedShards(lambda: client, 1, counts.append)
            looks = []
            for _ in range(3):
                looks.append(dict(await watch.look()))
                await asyncio.sleep(REFRESH_S)
            assert await DegradedShards(lambda: client, 0).look() == {}
        finally:
            await client.aclose()
        assert counts == [1, 1, 1]
        return looks

    with caplog.at_level(logging.INFO, logger="mpflow.service.store.replication"), RedisProcess(tmp_path) as alone:
        alone.start()
        looks = asyncio.run(main(alone.url))
    assert all(list(look.values()) == [0] for look in looks)
    said = [r.getMessage() for r in caplog.records if r.name == "mpflow.service.store.replication"]
    assert len(said) == 1 and "fewer than the 1 replica(s)" in said[0], said

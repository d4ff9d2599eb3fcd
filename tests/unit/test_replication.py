"""Which replicas count as in sync for ``WAIT`` (:func:`mpflow.service.store.replication.in_sync`), on ``INFO
replication`` answers as redis-py parses them (the counts on live servers: tests/reliability/
test_replica_acknowledgement.py and tests/integration/test_cluster.py)."""

from mpflow.service.store.replication import MAX_LAG_S, in_sync


def _replica(state: str = "online", lag: int = 0) -> dict:
    return {"ip": "127.0.0.1", "port": 7000, "state": state, "offset": 10, "lag": lag}


def test_online_replicas_that_acknowledged_lately_count():
    info = {"role": "master", "connected_slaves": 3, "slave0": _replica(), "slave1": _replica(lag=MAX_LAG_S)}
    info["slave2"] = _replica(lag=MAX_LAG_S + 1)  # frozen or cut off: still connected, acknowledging nothing
    assert in_sync(info) == 2


def test_a_replica_still_syncing_does_not_count():
    info = {"role": "master", "slave0": _replica("wait_bgsave"), "slave1": _replica("send_bulk"), "slave_x": "n/a"}
    assert in_sync(info) == 0
    assert in_sync({"role": "master", "connected_slaves": 0}) == 0

"""A primary of a real local Redis Cluster SIGKILLed under sequential writers (:mod:`tests.harness.cluster_faults`,
the must-show rows of ``benchmarks/cluster_faults.py``, which runs the whole matrix).

``WAIT 1`` with one replica per primary: once the replica has taken over alone, no write of that shard — first
answer or any retry, ``duplicate`` included — is acknowledged until a replica has it again (the killed node back
as its replica), and the other shards' writers carry on (``cluster-require-full-coverage no``: with Redis' default
every shard stops while a slot has no primary). With two replicas per primary the shard stays writable: nothing
acknowledged is lost or doubled, and the longest outage is the failover's, under 5 s.
"""

from __future__ import annotations

import pytest

from tests.harness.cluster import cluster_binaries
from tests.harness.cluster_faults import DOWN_S, run_case

pytestmark = pytest.mark.skipif(cluster_binaries() is None, reason="needs redis-server >= 7 and redis-cli")


def test_one_replica_wait_1_no_acknowledgment_without_the_replica(tmp_path):
    r = run_case("primary_kill", wait=1, replicas=1, full_coverage=False, base_dir=tmp_path)
    assert r["acks_without_promised_replicas"] == 0, r["short_examples"]
    assert (r["lost"], r["doubled"], r["acknowledged"]) == (0, 0, r["stored"]), r
    # the victim's writers met the replica-less shard (503s, retried) until the killed node was back
    assert r["answers_victim"].get("503", 0) > 0 and r["outage_victim_s"] > DOWN_S, r
    # the other shards: no 503, no error, no stall like the victim's
    assert set(r["answers_healthy"]) == {"200"}, r
    assert r["outage_healthy_s"] < 2.5, r


def test_two_replicas_wait_1_primary_killed_loses_nothing(tmp_path):
    r = run_case("primary_kill", wait=1, replicas=2, base_dir=tmp_path)
    assert r["acks_without_promised_replicas"] == 0, r["short_examples"]
    assert (r["lost"], r["doubled"], r["acknowledged"]) == (0, 0, r["stored"]), r
    assert r["outage_victim_s"] <= 5.0, r

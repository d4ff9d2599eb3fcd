"""A primary of a real local Redis Cluster SIGKILLed under sequential writers (:mod:`tests.harness.cluster_faults`,
the must-show rows of ``benchmarks/cluster_faults.py``, which runs the whole matrix).

``WAIT 1`` with one replica per primary: once the replica has taken over alone, no write of that shard — first
answer or any retry, ``duplicate`` included — is acknowledged until a replica has it again (the killed node back
as its replica), and the other shards' writers carry on (``cluster-require-full-coverage no``: with Redis' default
every shard stops while a slot has no primary). With two replicas per primary the shard stays writable: nothing
acknowledged is lost or doubled, and the longest outage is the failover's, under 5 s. And the check can fail: the
first case with the service's ``WAIT`` off counts the acknowledgments made on the promoted replica alone.
"""

from __future__ import annotations

import time

import pytest

from tests.harness.cluster import cluster_binaries
from tests.harness.cluster_faults import DOWN_S, FAULTS, Ack, Context, classify, primary_kill, run_case

pytestmark = pytest.mark.skipif(cluster_binaries() is None, reason="needs redis-server >= 7 and redis-cli")


def test_one_replica_wait_1_no_acknowledgment_without_the_replica(tmp_path):
    r = run_case("primary_kill", wait=1, replicas=1, full_coverage=False, base_dir=tmp_path)
    assert r["acks_without_promised_replicas"] == 0, r["short_examples"]
    assert r["acks_while_struck"] == 0, r  # nothing acknowledged while the shard had no replica
    assert (r["lost"], r["doubled"], r["acknowledged"]) == (0, 0, r["stored"]), r
    # the victim's writers met the replica-less shard (503s, retried) until the killed node was back
    assert r["answers_victim"].get("503", 0) > 0 and r["outage_victim_s"] > DOWN_S, r
    # the other shards: no 503, no error, no stall like the victim's
    assert set(r["answers_healthy"]) == {"200"}, r
    # the healthy shards' longest gap is 0.1 s in some runs and 2.7-4.2 s in the others, on the code of stop 52 as
    # on this one (3 of 6 and 8 of 13 runs on 2026-12-07; the victim's outage 5.5-6.5 s): every writer stalls
    # at once, which points at the store client's topology refresh after the kill, not at the service — an open
    # problem (the closing note of issue 54's stop). Held here: shorter than the victim's outage by a second
    assert r["outage_healthy_s"] < r["outage_victim_s"] - 1.0, r


def test_two_replicas_wait_1_primary_killed_loses_nothing(tmp_path):
    r = run_case("primary_kill", wait=1, replicas=2, base_dir=tmp_path)
    assert r["acks_without_promised_replicas"] == 0, r["short_examples"]
    assert (r["lost"], r["doubled"], r["acknowledged"]) == (0, 0, r["stored"]), r
    assert r["outage_victim_s"] <= 5.0, r


def test_the_check_catches_a_service_that_does_not_wait(tmp_path):
    # the first case with the service's WAIT off while the check still holds it to WAIT 1: once its replica has
    # taken over alone, the victim's shard acknowledges on one node until the killed node is back — counted
    r = run_case("primary_kill", wait=1, replicas=1, full_coverage=False, base_dir=tmp_path, service_wait=0)
    if r["acks_while_struck"] == 0:  # a machine so loaded that the victim's writers got no answer meanwhile
        pytest.skip(f"no acknowledgment while the victim was down, nothing to catch: {r}")
    assert r["acks_without_promised_replicas"] > 0, r
    # among them the victim's, acknowledged by its promoted replica alone; a healthy shard's may be counted too,
    # rightly: without WAIT its replica can still be behind when the check reads it (seen once, seq 35 of a
    # healthy shard, on a loaded machine)
    assert r["of_them_on_the_victim"] > 0, r["short_examples"]


def _primary_kill_then_starved(ctx: Context) -> None:
    """``primary_kill``, then the killed node — back as the only replica — stopped 2.5 s, three times, behind the
    check's back: what a redis-server starved of CPU on a loaded machine looks like to the check."""
    primary_kill(ctx)
    for _ in range(3):
        time.sleep(0.5)
        ctx.cluster.pause(ctx.victim)
        time.sleep(2.5)
        ctx.cluster.resume(ctx.victim)
    ctx.cluster.wait_ok()


def test_a_replica_starved_of_cpu_is_read_again_not_counted_as_missing(tmp_path, monkeypatch):
    # the check once counted the rejoined replica's 2 s timeout as a missing copy (it was struck before the
    # request, so not "unverifiable"): {'victim': True, 'retry': False, '<replica>': 'timeout', ...}
    monkeypatch.setitem(FAULTS, "primary_kill_then_starved", _primary_kill_then_starved)
    r = run_case("primary_kill_then_starved", wait=1, replicas=1, full_coverage=False, base_dir=tmp_path)
    assert r["acks_without_promised_replicas"] == 0, r["short_examples"]
    assert r["acks_while_struck"] == 0, r


def test_a_doubtful_node_excuses_only_the_copy_it_may_have_held():
    """With ``WAIT 1`` (two copies promised): a primary killed while the acknowledgment was read may have held one
    copy — with the replica's, unverifiable —, but a live replica that lacks the step is short whatever happened to
    the primary (the check once called that unverifiable too)."""
    ack = Ack("s", 1, duplicate=False, retry=False, sent=0.0, at=0.1)
    cases = [((2, 0), "kept"), ((1, 1), "unverifiable"), ((0, 1), "short"), ((0, 2), "unverifiable"), ((1, 0), "short")]
    for (holders, doubtful), kind in cases:
        ack.holders, ack.doubtful = holders, doubtful
        assert classify(ack, wait=1) == kind, (holders, doubtful)
    ack.holders, ack.doubtful = 0, 1
    assert classify(ack, wait=0) == "unverifiable"

"""Isolation between tenants against a real server (issue 34 item 4; :mod:`tests.harness.isolation`).

``python -m mpflow serve --workers 1`` with two tenants on the local Redis:

* tenant alpha keeps two N = 65536, d = 32 ``smc`` streams busy (requests of 2 steps, the most the cost model
  accepts there since each step's summary is priced at its time — 5 and 10 before, ≈ 2 s per batched step
  here: docs/benchmarks.md "What each method costs against its price") while tenant beta updates a ``kalman``
  d = 2 stream: beta's p50 must stay within 5× its idle p50 (or 0.25 s). With one update worker for everything
  beta waited behind alpha's steps (p50 ≈ 1 s);
* ``/readyz`` answers 503 within 10 s of a worker being on one job past ``MPFLOW_WORKER_DEADLINE_SECONDS``
  (lowered to 0.1 s, below one step of a legitimately heavy request) and 200 again after the request ends;
* ``/healthz`` answers within 1 s while ``GET .../particles`` reads an N = 65536, d = 64 cloud (84 MB of JSON;
  d = 48 or 32 where the server's limits refuse that stream). In one ``json.dumps`` on the event loop the 84 MB
  read held ``/healthz`` 4 s here, 63 MB at d = 48 1.4 s.
"""

from __future__ import annotations

import pytest

from tests.harness.isolation import (
    gaussian_stream,
    healthz_during_particles,
    light_under_heavy,
    readyz_when_stuck,
    tenant_server,
)
from tests.harness.server import redis_server_binary

pytestmark = pytest.mark.skipif(redis_server_binary() is None, reason="no Redis")

HEAVY = gaussian_stream("smc", 65536, 32)
#: the steps of one of its requests: the most the default budgets accept at that size
HEAVY_STEPS = 2


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("isolation") / "server.log"
    with tenant_server(log, {"MPFLOW_WORKER_DEADLINE_SECONDS": "0.1"}) as srv:
        yield srv


def test_a_heavy_tenant_does_not_stall_a_light_one(server):
    r = light_under_heavy(server.url, HEAVY, heavy_streams=2, heavy_steps=HEAVY_STEPS, requests=20)
    assert r["heavy_streams"] == 2 and r["light_statuses"] == [200]
    assert r["heavy_requests"] >= 1 and r["heavy_statuses"] == [200]  # the heavy tenant was really working
    assert r["loaded_p50_s"] <= max(5 * r["idle_p50_s"], 0.25), r
    assert r["healthz_max_s"] < 1.0, r


def test_readyz_is_503_while_a_worker_is_past_its_deadline_and_200_after(server):
    r = readyz_when_stuck(server.url, HEAVY, steps=HEAVY_STEPS)
    assert r["request_status"] == 200 and r["ready_before"], r
    assert r["first_503_after_s"] is not None and r["first_503_after_s"] < 10.0, r
    assert "slow worker" in r["detail"] and "MPFLOW_WORKER_DEADLINE_SECONDS" in r["detail"], r
    assert r["ready_again_after_answer_s"] is not None and r["ready_again_after_answer_s"] < 10.0, r


def test_healthz_answers_during_a_large_particles_read(server):
    for d in (64, 48, 32):  # the largest cloud this server's limits let a stream have
        r = healthz_during_particles(server.url, 65536, d)
        if not r.get("refused_at_creation"):
            break
    assert r["status"] == 200 and r["complete"], r
    assert r["bytes"] > 40_000_000  # the read was really large
    assert r["healthz_max_s"] < 1.0, r

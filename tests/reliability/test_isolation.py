"""Isolation between tenants against a real server (issue 34 item 4; :mod:`tests.harness.isolation`).

``python -m mpflow serve --workers 1`` with two tenants on the local Redis:

* tenant alpha keeps two N = 65536, d = 32 ``smc`` streams busy (requests of 2 steps, the most the cost model
  accepts there since each step's summary is priced at its time — 5 and 10 before, ≈ 2 s per batched step
  here: docs/benchmarks.md "What each method costs against its price") while tenant beta updates a ``kalman``
  d = 2 stream: beta's p50 must stay within 5× its idle p50 (or 0.25 s). With one update worker for everything
  beta waited behind alpha's steps (p50 ≈ 1 s);
* ``/readyz`` answers 503 within 10 s of a worker being on one job past ``MPFLOW_WORKER_DEADLINE_SECONDS``
  (lowered to 0.1 s, below one step of a legitimately heavy request) and 200 again after the request ends;
* issue 54: six multi-second ``lorenz96`` d = 40 steps at once (``enkf`` N = 1024 integrating 800 RK4 sub-steps,
  ``ienkf`` N = 1500 with 20 iterations), which the lanes' old proxy (N · d · f) sent to the fast lane: beta's
  Kalman updates each answer within 3 s (the benchmark's figure is against 2 s) and their p50 within 3× idle —
  before, one such update waited 16 s (ienkf) to 2 minutes (16 enkf steps);
* issue 54: eight concurrent one-step posts to the marginal ``mpf`` filter on ``stochastic_volatility`` at the
  largest N the cost model accepts (its N² pairs): the server's RSS grows by at most 1 GB — when each was priced
  alone and micro-batched together, 15 of them took it from 1.3 to 9.5 GB;
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
    rss_during_posts,
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


def lorenz96(method: str, n: int, params: dict | None = None, **options: object) -> dict:
    spec = gaussian_stream(method, n, 40, model={"family": "lorenz96", "params": params or {}})
    return {**spec, "method_options": options} if options else spec


#: six accepted multi-second steps of ``dt`` = 40 (issue 54 item 2): ``enkf`` integrating 800 RK4 sub-steps
#: (Δ = 0.05 in sub-steps of 0.0025), ``ienkf`` with 20 iterations of 40 sub-steps each
LORENZ96_HEAVY = [lorenz96("enkf", 1024, {"rk4_step": 0.0025})] * 3 + [lorenz96("ienkf", 1500, iterations=20)] * 3


def test_multi_second_lorenz96_steps_do_not_hold_a_kalman_update(server):
    r = light_under_heavy(server.url, LORENZ96_HEAVY, heavy_steps=1, heavy_dt=40.0, requests=200, warmup_seconds=3)
    assert r["heavy_streams"] == 6 and r["light_statuses"] == [200], r
    assert r["heavy_requests"] >= 1 and r["heavy_statuses"] == [200], r  # accepted, and really working
    assert r["heavy_request_p50_s"] > 1.0, r  # multi-second steps
    assert r["loaded_max_s"] <= 3.0, r
    assert r["loaded_p50_s"] <= max(3 * r["idle_p50_s"], 0.025), r


def test_concurrent_pair_filter_posts_stay_within_the_memory_bound(server):
    spec = {
        "model": {"family": "stochastic_volatility", "params": {}},
        "prior": {"type": "gaussian", "mean": [0.0], "cov": [[1.0]]},
        "method": "mpf",
    }
    for n in (6000, 5000, 4000):  # the largest N the cost model accepts (the N² pairs' bytes)
        r = rss_during_posts(server, {**spec, "num_particles": n}, 8)
        if r["streams"]:
            break
    assert r["streams"] == 8 and r["statuses"] == [200], r
    assert r["peak_growth_mb"] <= 1024, r


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

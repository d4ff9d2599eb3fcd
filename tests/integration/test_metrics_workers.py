"""``/metrics`` of ``python -m mpflow serve --workers 2`` counts every worker (prometheus_client multiprocess mode).

The server runs as a user runs it (:func:`tests.harness.server.serve_as_user`) against the real Redis, under a fresh
key prefix, with ``TMPDIR`` pointed at a test folder so its private metrics directory can be watched. Streams
are updated over many fresh connections (so both workers answer some); the test checks from the workers' own
metric files that each worker applied some but not all of the steps, so a scrape of one worker's registry
would under-count, and then that every scrape (fresh connections, either worker) reports all of them. After the
server stops, its metrics directory is gone.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from mpflow.service.api.metrics import MULTIPROC_ENV
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from tests.harness.server import UserServer, drop_prefix, serve_as_user
from tests.integration import conftest as integration

redis_url = integration.redis_url  # the real-Redis fixture

STREAMS = 4
REQUESTS_PER_ROUND = 6  # per stream and round, each on a new connection
OBSERVATIONS = [[0.5, -1.0], [0.25, -0.75]]  # two steps per request
MAX_ROUNDS = 5  # rounds until both workers have answered observations
SCRAPES = 8
OBSERVE_ROUTE = {"route": "/v1/streams/{stream_id}/observations", "method": "POST", "status": "200"}
STREAM = {
    "model": {"family": "linear_gaussian", "params": {}},
    "prior": {"type": "gaussian", "mean": [0.0, 0.5], "cov": [[1.0, 0.2], [0.2, 0.8]]},
    "method": "smc",
    "num_particles": 16,
    "seed": 7,
}

Select = Callable[[Sample], bool]


def total(samples: list[Sample], name: str, select: Select = lambda s: True) -> float:
    """Σ of the samples called ``name`` (over all label values ``select`` keeps)."""
    return sum(s.value for s in samples if s.name == name and select(s))


def is_observe(s: Sample) -> bool:
    return all(s.labels.get(k) == v for k, v in OBSERVE_ROUTE.items())


def scrape(url: str) -> list[Sample]:
    """One ``/metrics`` scrape on a new connection, parsed."""
    r = httpx.get(f"{url}/metrics", timeout=30)
    assert r.status_code == 200, r.text
    return [s for family in text_string_to_metric_families(r.text) for s in family.samples]


def per_worker(metrics_dir: Path, name: str, select: Select = lambda s: True) -> dict[str, float]:
    """pid → that worker's own value of counter ``name`` (from its ``counter_<pid>.db`` file)."""
    out = {}
    for f in sorted(metrics_dir.glob("counter_*.db")):
        samples = [s for m in MultiProcessCollector.merge([str(f)]) for s in m.samples]
        out[f.stem.removeprefix("counter_")] = total(samples, name, select)
    return out


def counted(metrics_dir: Path, requests: int, wait: float = 10.0) -> dict[str, float]:
    """Observation requests counted per worker, once all ``requests`` are (the middleware counts a request after
    its response is sent, so the client can read the files a moment before the last count lands)."""
    deadline = time.monotonic() + wait
    while sum((served := per_worker(metrics_dir, "mpflow_http_requests_total", is_observe)).values()) < requests:
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    return served


def observe_round(url: str, stream_ids: list[str]) -> int:
    """:data:`REQUESTS_PER_ROUND` observation requests per stream, each on a new connection, streams in
    parallel and each stream's requests in order (no write races, so no step is computed twice); the steps."""

    def one_stream(sid: str) -> int:
        for _ in range(REQUESTS_PER_ROUND):
            r = httpx.post(f"{url}/v1/streams/{sid}/observations", json={"observations": OBSERVATIONS}, timeout=60)
            assert r.status_code == 200, r.text
        return REQUESTS_PER_ROUND * len(OBSERVATIONS)

    with ThreadPoolExecutor(len(stream_ids)) as pool:
        return sum(pool.map(one_stream, stream_ids))


@pytest.fixture
def two_workers(redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[UserServer, Path]]:
    """``python -m mpflow serve --workers 2`` on a fresh prefix, its temporary files under ``tmp_path/tmp``:
    (server, the folder that holds its metrics directory). The prefix's keys are deleted afterwards."""
    monkeypatch.delenv(MULTIPROC_ENV, raising=False)  # the server must make its own
    prefix = f"mpflowtest-{uuid.uuid4().hex}"
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {
        "MPFLOW_REDIS_URL": redis_url,
        "MPFLOW_REDIS_PREFIX": prefix,
        "MPFLOW_LOG_LEVEL": "WARNING",
        "TMPDIR": str(tmp),
    }
    try:
        with serve_as_user(env, tmp_path / "service.log", args=["--workers", "2"], inherit_mpflow_env=False) as srv:
            yield srv, tmp
    finally:
        asyncio.run(drop_prefix(redis_url, prefix))


def zero_series_of_each_worker(metrics_dir: Path) -> dict[str, set[tuple[str, str]]]:
    """pid → the (family, method) pairs whose ``mpflow_updates_total`` series its file holds at 0."""
    out = {}
    for f in sorted(metrics_dir.glob("counter_*.db")):
        samples = [s for m in MultiProcessCollector.merge([str(f)]) for s in m.samples]
        out[f.stem.removeprefix("counter_")] = {
            (s.labels["family"], s.labels["method"])
            for s in samples
            if s.name == "mpflow_updates_total" and s.value == 0
        }
    return out


def test_metrics_sum_over_two_workers_on_every_scrape(two_workers: tuple[UserServer, Path]) -> None:
    srv, tmp = two_workers
    (metrics_dir,) = tmp.glob("mpflow-metrics-*")  # the server's own directory, one

    # before any update, every worker holds every (family, method) series at 0, and a scrape shows them (issue 38)
    runs = {
        (f["family"], m) for f in httpx.get(f"{srv.url}/v1/models", timeout=30).json()["families"] for m in f["methods"]
    }
    deadline = time.monotonic() + 60  # both workers have built their app (each writes its own file)
    while len(zeroed := zero_series_of_each_worker(metrics_dir)) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(zeroed) == 2 and all(pairs == runs for pairs in zeroed.values()), (zeroed, runs)
    first = scrape(srv.url)
    shown = {(s.labels["family"], s.labels["method"]) for s in first if s.name == "mpflow_updates_total"}
    assert shown == runs and total(first, "mpflow_updates_total") == 0
    assert {s.labels["method"] for s in first if s.name == "mpflow_update_duration_seconds_count"} == {
        m for _, m in runs
    }
    stream_ids = []
    for _ in range(STREAMS):
        r = httpx.post(f"{srv.url}/v1/streams", json=STREAM, timeout=60)
        assert r.status_code == 201, r.text
        stream_ids.append(r.json()["stream_id"])

    steps = requests = 0
    for _ in range(MAX_ROUNDS):
        steps += observe_round(srv.url, stream_ids)
        requests += STREAMS * REQUESTS_PER_ROUND
        served = counted(metrics_dir, requests)
        if len(served) == 2 and min(served.values()) > 0:
            break
    # both workers answered observations: either one's registry alone would show fewer than all of them
    assert len(served) == 2 and min(served.values()) > 0, served
    assert sum(served.values()) == requests, served
    applied = per_worker(metrics_dir, "mpflow_updates_total")
    assert sum(applied.values()) == steps and max(applied.values()) < steps, applied

    for _ in range(SCRAPES):  # new connections: both workers render
        samples = scrape(srv.url)
        assert total(samples, "mpflow_updates_total") == steps
        assert total(samples, "mpflow_http_requests_total", is_observe) == requests
        # what benchmarks/service_load.py reads: every step is in one operator call of some batch size
        assert total(samples, "mpflow_batch_size_sum") == steps
        assert total(samples, "mpflow_update_duration_seconds_count") == total(samples, "mpflow_batch_size_count")
        assert total(samples, "mpflow_update_duration_seconds_sum") > 0
        assert total(samples, "mpflow_streams") == STREAMS
    scrapes = per_worker(metrics_dir, "mpflow_http_requests_total", lambda s: s.labels.get("route") == "/metrics")
    assert sum(scrapes.values()) == SCRAPES + 1, scrapes

    srv.stop()
    assert srv.proc.returncode == 0, srv.log_path.read_text()[-3000:]
    assert not metrics_dir.exists() and not list(tmp.glob("mpflow-metrics-*"))

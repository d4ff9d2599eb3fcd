"""Isolation between tenants, measured against a real server: does heavy work stall light work, does ``/readyz``
tell the truth, does ``/healthz`` answer during a large read? Shared by ``tests/reliability/test_isolation.py``
(small, bounded runs) and ``benchmarks/abuse.py`` (the full figures).

The server is started as a user starts it (:func:`tenant_server`: ``python -m mpflow serve --workers 1`` with
``MPFLOW_API_KEYS`` of two tenants, :data:`~tests.harness.server.TENANT_KEYS`, on the local Redis under a fresh
key prefix, removed afterwards). The clients are plain ``httpx`` clients in threads — one per role (the heavy
tenant, the light tenant, a ``/healthz`` prober), each with its own connection — as separate callers would be.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from tests.harness.server import TENANT_KEYS, UserServer, drop_prefix, serve_as_user

LOCAL_REDIS = "redis://127.0.0.1:6379/0"
ALPHA = {"Authorization": "Bearer key-a"}  # the heavy tenant
BETA = {"Authorization": "Bearer key-b"}  # the light tenant


@contextmanager
def tenant_server(log_path: Path, env: Mapping[str, str] | None = None) -> Iterator[UserServer]:
    """``python -m mpflow serve --workers 1`` with tenants alpha (``key-a``) and beta (``key-b``) on the local Redis
    under a fresh prefix (deleted on exit); ``env`` adds or overrides settings."""
    prefix = f"isolation-{uuid.uuid4().hex[:10]}"
    base = {"MPFLOW_API_KEYS": TENANT_KEYS, "MPFLOW_REDIS_URL": LOCAL_REDIS, "MPFLOW_REDIS_PREFIX": prefix}
    base["MPFLOW_LOG_LEVEL"] = "WARNING"
    try:
        with serve_as_user({**base, **(env or {})}, log_path, args=["--workers", "1"]) as server:
            yield server
    finally:
        asyncio.run(drop_prefix(LOCAL_REDIS, prefix))


def gaussian_stream(method: str, n: int, d: int, **extra: Any) -> dict[str, Any]:
    """A ``linear_gaussian`` stream of dimension d with prior N(0, I) and N particles."""
    return {
        "model": {"family": "linear_gaussian", "params": {}},
        "prior": {"type": "gaussian", "mean": [0.0] * d, "cov": [[float(i == j) for j in range(d)] for i in range(d)]},
        "method": method,
        "num_particles": n,
        **extra,
    }


def create(client: httpx.Client, spec: dict[str, Any]) -> tuple[int, str | None]:
    """(status, stream id or None) of a creation."""
    r = client.post("/v1/streams", json=spec)
    return r.status_code, (r.json()["stream_id"] if r.status_code == 201 else None)


class StreamDriver:
    """Sends observation requests of ``steps`` observations each to one stream, ``seq`` after ``seq``; each step
    lasting ``dt`` (None: the stream's own step, the bare value)."""

    def __init__(self, client: httpx.Client, stream_id: str, d: int, steps: int = 1, dt: float | None = None) -> None:
        self.client, self.stream_id, self.d, self.steps, self.dt = client, stream_id, d, steps, dt
        self.seq = 1

    def send(self) -> tuple[int, float]:
        """One request: (status, seconds)."""
        values = [[0.1 * (self.seq + k)] * self.d for k in range(self.steps)]
        items = values if self.dt is None else [{"value": v, "dt": self.dt} for v in values]
        body = {"seq": self.seq, "observations": items}
        t0 = time.perf_counter()
        r = self.client.post(f"/v1/streams/{self.stream_id}/observations", json=body)
        seconds = time.perf_counter() - t0
        if r.status_code == 200:
            self.seq += self.steps
        return r.status_code, seconds


@dataclass
class Prober:
    """Polls ``url + path`` every ``every`` seconds in a thread while running: each answer's (time since start,
    status or None for no answer in ``timeout``, seconds)."""

    url: str
    path: str = "/healthz"
    every: float = 0.1
    timeout: float = 10.0
    samples: list[tuple[float, int | None, float]] = field(default_factory=list)
    first_error: str | None = None  # the body of the first answer that was not 200

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"probe{self.path}", daemon=True)
        self._t0 = time.monotonic()

    def __enter__(self) -> Prober:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(self.timeout + 5)

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=self.timeout) as client:
            while not self._stop.is_set():
                t0 = time.perf_counter()
                try:
                    r = client.get(self.path)
                    status: int | None = r.status_code
                    if status != 200 and self.first_error is None:
                        self.first_error = r.text
                except httpx.HTTPError:
                    status = None
                self.samples.append((time.monotonic() - self._t0, status, time.perf_counter() - t0))
                self._stop.wait(self.every)

    def now(self) -> float:
        """Seconds since the prober was made (the clock of :attr:`samples`)."""
        return time.monotonic() - self._t0

    def max_seconds(self) -> float:
        return max((s for *_, s in self.samples), default=float("nan"))


def p50(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def light_times(driver: StreamDriver, requests: int) -> tuple[list[float], list[int]]:
    """The latencies (seconds) of ``requests`` light updates one after the other, and their statuses."""
    times, statuses = [], []
    for _ in range(requests):
        status, seconds = driver.send()
        statuses.append(status)
        times.append(seconds)
    return times, statuses


def light_p50(driver: StreamDriver, requests: int) -> tuple[float, list[int]]:
    """The p50 latency (seconds) of ``requests`` light updates one after the other, and their statuses."""
    times, statuses = light_times(driver, requests)
    return p50(times), statuses


@contextmanager
def background(fn: Callable[[threading.Event], None], name: str) -> Iterator[None]:
    """``fn(stop)`` in a thread while the block runs; ``stop`` is set when it ends."""
    stop = threading.Event()
    thread = threading.Thread(target=fn, args=(stop,), name=name, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(600)


def light_under_heavy(
    url: str,
    heavy: dict[str, Any] | list[dict[str, Any]],
    *,
    heavy_streams: int = 2,
    heavy_steps: int = 5,
    heavy_dt: float | None = None,
    light: dict[str, Any] | None = None,
    requests: int = 30,
    warmup_seconds: float = 2.0,
) -> dict[str, Any]:
    """Tenant beta's light update p50 idle, then while tenant alpha keeps ``heavy_streams`` streams of ``heavy``
    (or one stream of each spec of a list) busy, each sending requests of ``heavy_steps`` observations of
    ``heavy_dt`` back to back; ``/healthz`` probed throughout. The heavy streams' creation is timed too (it is
    heavy work as well); ``loaded_max_s`` is beta's slowest update under the load."""
    specs = heavy if isinstance(heavy, list) else [heavy] * heavy_streams
    light = light or gaussian_stream("kalman", 256, 2)
    d_light = len(light["prior"]["mean"])
    d_heavy = len(specs[0]["prior"]["mean"])
    out: dict[str, Any] = {
        "heavy": [{k: spec.get(k) for k in ("method", "num_particles", "method_options")} for spec in specs],
        "heavy_dt": heavy_dt,
        "state_dim": d_heavy,
    }
    with (
        httpx.Client(base_url=url, headers=BETA, timeout=120) as beta,
        httpx.Client(base_url=url, headers=ALPHA, timeout=600) as alpha,
    ):
        status, light_id = create(beta, light)
        assert light_id is not None, f"the light stream was refused ({status})"
        driver = StreamDriver(beta, light_id, d_light)
        light_p50(driver, 5)  # warm-up
        out["idle_p50_s"], _ = light_p50(driver, requests)
        t0 = time.perf_counter()
        heavy_ids = []
        for spec in specs:
            status, sid = create(alpha, spec)
            out["heavy_create_status"] = status
            if sid is not None:
                heavy_ids.append(sid)
        out["heavy_create_s"] = time.perf_counter() - t0
        out["heavy_streams"] = len(heavy_ids)
        heavy_answers: list[tuple[int, float]] = []

        def drive(sid: str) -> Callable[[threading.Event], None]:
            def run(stop: threading.Event) -> None:
                with httpx.Client(base_url=url, headers=ALPHA, timeout=600) as own:
                    d = StreamDriver(own, sid, d_heavy, heavy_steps, heavy_dt)
                    while not stop.is_set():
                        heavy_answers.append(d.send())

            return run

        with contextlib.ExitStack() as stack, Prober(url) as health:
            for i, sid in enumerate(heavy_ids):
                stack.enter_context(background(drive(sid), f"heavy-{i}"))
            time.sleep(warmup_seconds)
            times, statuses = light_times(driver, requests)
            out["loaded_p50_s"], out["loaded_max_s"] = p50(times), max(times)
        out["light_statuses"] = sorted(set(statuses))
        out["heavy_requests"] = len(heavy_answers)
        out["heavy_statuses"] = sorted({s for s, _ in heavy_answers})
        out["heavy_request_p50_s"] = p50([s for _, s in heavy_answers])
        out["healthz_max_s"] = health.max_seconds()
        out["ratio"] = out["loaded_p50_s"] / out["idle_p50_s"]
        for sid in heavy_ids:
            alpha.delete(f"/v1/streams/{sid}")
    return out


def rss_during_posts(server: UserServer, spec: dict[str, Any], posts: int) -> dict[str, Any]:
    """Tenant alpha creates ``posts`` streams of ``spec`` (d = 1 observations) and warms one, then posts one
    observation to each at once: the server's RSS (its processes but Redis) before, its peak growth while the
    posts ran (sampled every 20 ms) and its growth after, and each post's (status, seconds)."""
    procs = [psutil.Process(server.pid)]
    procs += [c for c in procs[0].children(recursive=True) if "redis" not in c.name()]

    def rss() -> int:
        return sum(p.memory_info().rss for p in procs if p.is_running())

    with httpx.Client(base_url=server.url, headers=ALPHA, timeout=600) as alpha:
        ids = [sid for _, sid in (create(alpha, spec) for _ in range(posts)) if sid is not None]
        out: dict[str, Any] = {"streams": len(ids)}
        if ids:
            out["warm_status"] = alpha.post(f"/v1/streams/{ids[0]}/observations", json={"observations": [[0.1]]})
            out["warm_status"] = out["warm_status"].status_code
    time.sleep(0.5)
    base = rss()
    peak, answers = [base], []

    def watch(stop: threading.Event) -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], rss())
            stop.wait(0.02)

    def post(sid: str) -> None:
        with httpx.Client(base_url=server.url, headers=ALPHA, timeout=600) as own:
            t0 = time.perf_counter()
            r = own.post(f"/v1/streams/{sid}/observations", json={"observations": [[0.2]]})
            answers.append((r.status_code, time.perf_counter() - t0))

    with background(watch, "rss"):
        posters = [threading.Thread(target=post, args=(sid,), daemon=True) for sid in ids]
        for t in posters:
            t.start()
        for t in posters:
            t.join(600)
    return {
        **out,
        "rss_before_mb": base / 2**20,
        "peak_growth_mb": (peak[0] - base) / 2**20,
        "growth_after_mb": (rss() - base) / 2**20,
        "statuses": sorted({s for s, _ in answers}),
        "slowest_s": max((t for _, t in answers), default=float("nan")),
    }


def readyz_when_stuck(url: str, heavy: dict[str, Any], *, steps: int, settle: float = 30.0) -> dict[str, Any]:
    """Tenant alpha sends one legitimately heavy request (``steps`` observations of a ``heavy`` stream) to a
    server started with a worker deadline below one such step; ``/readyz`` is probed throughout and after: when
    it first answered 503 (seconds after the request was sent), what it said, and how long after the request's
    answer it answered 200 again (at most ``settle`` seconds are waited for that)."""
    d = len(heavy["prior"]["mean"])
    with httpx.Client(base_url=url, headers=ALPHA, timeout=600) as alpha:
        status, sid = create(alpha, heavy)
        assert sid is not None, f"the heavy stream was refused ({status})"
        with Prober(url, "/readyz", every=0.1) as ready:
            time.sleep(0.5)
            sent = ready.now()
            answer, seconds = StreamDriver(alpha, sid, d, steps).send()
            answered = ready.now()
            while ready.now() < answered + settle and not any(t > answered and s == 200 for t, s, _ in ready.samples):
                time.sleep(0.1)
        alpha.delete(f"/v1/streams/{sid}")
    first_503 = next((t for t, s, _ in ready.samples if s == 503 and t >= sent), None)
    back_200 = next((t for t, s, _ in ready.samples if s == 200 and t > answered), None)
    return {
        "request_status": answer,
        "request_s": seconds,
        "ready_before": all(s == 200 for t, s, _ in ready.samples if t < sent),
        "first_503_after_s": None if first_503 is None else first_503 - sent,
        "detail": ready.first_error,
        "ready_again_after_answer_s": None if back_200 is None else back_200 - answered,
        "probes": len(ready.samples),
    }


def healthz_during_particles(url: str, n: int, d: int) -> dict[str, Any]:
    """Tenant alpha reads ``GET .../particles`` of an N × d ``smc`` stream while ``/healthz`` is probed: the
    read's status, size and time, and the probe's worst latency (``refused_at_creation`` when the stream was
    refused)."""
    with httpx.Client(base_url=url, headers=ALPHA, timeout=600) as alpha:
        status, sid = create(alpha, gaussian_stream("smc", n, d))
        if sid is None:
            return {"status": status, "complete": False, "refused_at_creation": True}
        with Prober(url) as health:
            time.sleep(0.3)
            t0 = time.perf_counter()
            r = alpha.get(f"/v1/streams/{sid}/particles")
            seconds = time.perf_counter() - t0
            time.sleep(0.3)
        ok = r.status_code == 200 and len(r.json()["particles"]) == n
        alpha.delete(f"/v1/streams/{sid}")
    return {
        "status": r.status_code,
        "complete": ok,
        "bytes": len(r.content),
        "seconds": seconds,
        "healthz_max_s": health.max_seconds(),
        "healthz_probes": len(health.samples),
    }


__all__ = [
    "ALPHA",
    "BETA",
    "LOCAL_REDIS",
    "Prober",
    "StreamDriver",
    "create",
    "gaussian_stream",
    "healthz_during_particles",
    "light_under_heavy",
    "readyz_when_stuck",
    "tenant_server",
]

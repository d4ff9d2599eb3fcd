"""Service load benchmark: closed-loop streams against a server started as a user starts it.

``python -m benchmarks.service_load [--quick] [--client {aiohttp,httpx}]``

The server is a subprocess ``python -m service --port <free port> --workers W`` (uvicorn; ``--workers`` 1, the
default, or one per core; default settings otherwise), its store the local Redis (``--redis-url``, default
redis://127.0.0.1:6379/0) under a key prefix of its own (``MPFLOW_REDIS_PREFIX=mpflowbench-<random>``, deleted
afterwards) — or, when that Redis does not answer (or with ``--store embedded``), the embedded Redis in a
temporary ``MPFLOW_DATA_DIR``. The output says which.

Every stream: ``lds``, d = 2, x_m = A x_{m−1} + N(0, Q), o_m = x_m + N(0, R) with A = 0.95·rot(0.1 rad),
Q = 0.1 I, R = 0.5 I, prior N(0, I); the observations are simulated on the fly (numpy, seeded per stream).
One cell = (method, N particles, K streams, batching on/off): K streams are created, then each sends
single-observation updates (with ``seq``) as fast as it gets answers — K concurrent closed-loop clients, all on
one event loop, no retries (a failure is counted, never hidden; the loop then re-reads the stream's step).

The load generator's HTTP client (``--client``): ``aiohttp`` (default) — one ``aiohttp.ClientSession`` with K
keep-alive connections, sending the very bodies :class:`service.client.AsyncClient` sends (stdlib ``json``) — or
``httpx`` — :class:`service.client.AsyncClient` itself, one per stream with one keep-alive connection. Why
aiohttp: the load generator runs on the same machine as the server and shares its cores (2 here), so every
millisecond of CPU it spends per request is taken from the server being measured. Measured (same server, cells
alternated, mpf N = 256; the load generator's own process CPU time over the window ÷ completed updates):
httpx ≈ 0.8–1.1 ms CPU per request at K = 16 and 64 (1.15–1.2 ms at K = 1), aiohttp ≈ 0.2–0.35 ms
(≈ 0.37 ms at K = 1) — 3–4× less; on a quiet 2-core machine that showed as ~40 % more measured throughput
(K = 16: 486 vs 341 updates/s; K = 64: 444 vs 325), under other jobs' load the noise hides it.
(orjson would save another ~0.01 ms per request over stdlib ``json`` — ~4 %, not worth a dependency; uvloop
saved nothing measurable.) The **client CPU ms/req** column reports that figure for every cell.

After a warm-up, requests *completing* inside the measurement window count:

* **updates/s** = completed updates / window length;
* **p50 / p99**: end-to-end latency (client send → answer parsed) of those requests;
* **mean batch**: stream-steps per operator call inside the window (server's ``mpflow_batch_size``), and
  **compute ms**: mean operator time per call (``mpflow_update_duration_seconds``);
* **client CPU ms/req**: the load generator's own CPU time (``time.process_time``: user + system, all its
  threads; not the server's) over the window ÷ updates completed in it.

Grid: method ∈ {mpf, smc, gpf} × N ∈ {256, 1024} × K ∈ {1, 16, 64} with micro-batching on (the default), then
K = 64 again against a second server with ``MPFLOW_BATCHING=false``. ``--quick``: K ∈ {1, 16}, N = 256, short
windows (the batching-off server then runs at K = 16). ``mpf`` uses a trained operator when one fits
(lds, d = 2), else the untrained Daum–Huang base flow; the output names which.

Targets (one stream's p50 ≤ 5 ms; ≥ 500 updates/s at 64 streams; batching ≥ 2× unbatched throughput at 64
streams; all for mpf at N = 256) are reported as met / not met / not measured. The load generator runs on the
same machine as the server and shares its cores (its CPU per request is in the table); on a machine loaded by
other jobs (the load average is recorded) the numbers are pessimistic. One worker process runs the event loop
and the operator's worker thread under one GIL, so on this 2-core machine ``--workers 2`` (one per core) is
how a user gets the machine's throughput; both are reported.

Results: a markdown table on stdout, ``<out>.json`` and ``<out>.png`` (``--out`` defaults to
``benchmarks/results/service_load``, ``service_load-quick`` with ``--quick``, ``-workers<W>`` appended for W > 1).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import math
import os
import platform
import ssl
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import quote

import aiohttp
import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from service.client import (
    NO_RETRY,
    AsyncClient,
    AsyncStream,
    MpflowError,
    _create_body,  # the very bodies AsyncClient sends, for the aiohttp client too
    _update_body,
)
from service.testing import drop_prefix, redis_answers, serve_as_user

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parent.parent
METHODS = ("mpf", "smc", "gpf")
FULL = {"particles": (256, 1024), "streams": (1, 16, 64), "warmup_s": 2.0, "window_s": 8.0}
QUICK = {"particles": (256,), "streams": (1, 16), "warmup_s": 1.0, "window_s": 3.0}
MIN_COMPLETIONS = 20  # a window is extended (up to 4×) until this many requests completed
STATE_DIM = 2
A = (0.95 * np.array([[math.cos(0.1), -math.sin(0.1)], [math.sin(0.1), math.cos(0.1)]])).tolist()
MODEL = {
    "family": "lds",
    "params": {"A": A, "Q": [[0.1, 0.0], [0.0, 0.1]], "B": [[1.0, 0.0], [0.0, 1.0]], "R": [[0.5, 0.0], [0.0, 0.5]]},
}
PRIOR = {"type": "gaussian", "mean": [0.0, 0.0], "cov": [[1.0, 0.0], [0.0, 1.0]]}
TARGETS = {"p50_ms_k1": 5.0, "updates_per_s_k64": 500.0, "batching_speedup_k64": 2.0}
HTTP_TIMEOUT_S = 300.0
JSON_HEADERS = {"Content-Type": "application/json"}
JSON_ENCODING: dict[str, Any] = {"separators": (",", ":"), "ensure_ascii": False, "allow_nan": False}  # as httpx


# ----------------------------------------------------------------------------------------------------------
# the server


def machine_meta(load_before: Sequence[float]) -> dict[str, Any]:
    """What a benchmark's JSON records of the machine: cores, load average before and after, versions."""
    import torch  # only for its version: the load generator itself never needs it

    return {
        "machine_cores": os.cpu_count(),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
    }


@dataclass
class Store:
    """Where the servers keep their streams: ``env`` for the server process, ``label`` for the report."""

    env: dict[str, str]
    label: str
    redis_url: str | None = None
    prefix: str | None = None


@contextlib.contextmanager
def choose_store(kind: str, redis_url: str) -> Iterator[Store]:
    if kind in ("auto", "redis") and asyncio.run(redis_answers(redis_url)):
        prefix = f"mpflowbench-{uuid.uuid4().hex[:12]}"
        try:
            yield Store(
                {"MPFLOW_REDIS_URL": redis_url, "MPFLOW_REDIS_PREFIX": prefix},
                f"Redis {redis_url} (key prefix {prefix}, deleted afterwards)",
                redis_url,
                prefix,
            )
        finally:
            asyncio.run(drop_prefix(redis_url, prefix))
        return
    if kind == "redis":
        raise SystemExit(f"no Redis answers at {redis_url}")
    with tempfile.TemporaryDirectory(prefix="mpflowbench-") as data_dir:
        yield Store({"MPFLOW_DATA_DIR": data_dir, "MPFLOW_REDIS_URL": ""}, f"embedded Redis (data dir {data_dir})")


@contextlib.contextmanager
def server(store: Store, batching: bool, log_dir: Path, workers: int = 1) -> Iterator[str]:
    """``python -m service`` on a free port (:func:`service.testing.serve_as_user`); yields its base URL once
    ``/readyz`` answers 200."""
    env = {**store.env, "MPFLOW_BATCHING": "true" if batching else "false"}
    log_path = log_dir / f"server-{'batched' if batching else 'unbatched'}.log"
    with serve_as_user(env, log_path, args=["--workers", str(workers)], inherit_mpflow_env=True) as srv:
        yield srv.url


def scrape(url: str) -> dict[str, float]:
    """The counters a cell reads off ``/metrics``: batch-size and update-duration sums and counts."""
    text = httpx.get(f"{url}/metrics", timeout=10.0).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in ("mpflow_batch_size_sum", "mpflow_batch_size_count"):
                out[s.name] = s.value
            elif s.name in ("mpflow_update_duration_seconds_sum", "mpflow_update_duration_seconds_count"):
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


# ----------------------------------------------------------------------------------------------------------
# one cell


class Target:
    """The simulated system behind one stream (numpy, its own generator)."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.A = np.array(MODEL["params"]["A"])
        self.x = self.rng.standard_normal(STATE_DIM)

    def observe(self) -> list[float]:
        self.x = self.A @ self.x + math.sqrt(0.1) * self.rng.standard_normal(STATE_DIM)
        return (self.x + math.sqrt(0.5) * self.rng.standard_normal(STATE_DIM)).tolist()


@dataclass
class Tally:
    """What the closed loops of one cell record: latencies inside the window, errors by code, and every
    successful update (``done``, inside the window or not: the client-CPU sample counts it)."""

    latencies: list[float] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    done: int = 0


class BenchStream(Protocol):
    """One stream as the closed loop sees it, whichever HTTP client carries it."""

    document: dict[str, Any] | None  # the create answer

    async def update(self, observation: list[float], seq: int) -> None:
        """``POST .../observations`` with one step numbered ``seq``; raises on any failure."""

    async def step(self) -> int:
        """``GET`` the stream: its current step (to resynchronise ``seq`` after a failure)."""

    async def delete(self) -> None:
        """``DELETE`` the stream."""


#: ``create(method, N, seed)`` → a new stream (``POST /v1/streams``)
Create = Callable[[str, int, int], Awaitable[BenchStream]]


class HttpxStream:
    """:class:`service.client.AsyncStream` (httpx) as a :class:`BenchStream`."""

    def __init__(self, stream: AsyncStream):
        self.stream = stream
        self.document = stream.document

    async def update(self, observation: list[float], seq: int) -> None:
        await self.stream.update([observation], seq=seq)

    async def step(self) -> int:
        return int((await self.stream.get())["step"])

    async def delete(self) -> None:
        await self.stream.delete()


@contextlib.asynccontextmanager
async def httpx_streams(url: str, k: int) -> AsyncIterator[Create]:
    """``--client httpx``: one :class:`service.client.AsyncClient` (one keep-alive connection) per stream, no
    retries. One client per stream: httpcore's pool scans all its connections on every request (O(connections)
    per request, encode/httpcore#1035), which made one shared 64-connection client the bottleneck."""
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    tls = ssl.create_default_context()  # unused for http://, but httpx builds one per client unless given one
    async with contextlib.AsyncExitStack() as stack:

        async def create(method: str, n: int, seed: int) -> BenchStream:
            client = AsyncClient(url, timeout=HTTP_TIMEOUT_S, retry=NO_RETRY, limits=limits, verify=tls)
            await stack.enter_async_context(client)
            stream = await client.create_stream(model=MODEL, prior=PRIOR, method=method, num_particles=n, seed=seed)
            return HttpxStream(stream)

        yield create


def _mpflow_error(status: int, reason: str | None, raw: bytes) -> MpflowError:
    """The API's error body ``{"error": {"code", "message"}}`` as :class:`service.client.MpflowError` (a code
    from the status when the body has none)."""
    code, message = f"http_{status}", reason or "error"
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        err = json.loads(raw).get("error")
        if isinstance(err, dict):
            code, message = str(err.get("code", code)), str(err.get("message", message))
    return MpflowError(status, code, message)


async def _call(session: aiohttp.ClientSession, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
    """One API call on ``session``: the decoded JSON answer (None when empty); a non-2xx raises MpflowError."""
    data = None if body is None else json.dumps(body, **JSON_ENCODING).encode()
    headers = JSON_HEADERS if body is not None else None
    async with session.request(method, path, data=data, headers=headers) as response:
        raw = await response.read()
        if response.status >= 400:
            raise _mpflow_error(response.status, response.reason, raw)
    return json.loads(raw) if raw else None


class AiohttpStream:
    """One stream driven over a shared ``aiohttp.ClientSession``: the same requests as
    :class:`service.client.AsyncStream` (bodies from the client's own builders), no retries."""

    def __init__(self, session: aiohttp.ClientSession, document: dict[str, Any]):
        self.session = session
        self.document = document
        self.path = f"/v1/streams/{quote(document['stream_id'], safe='')}"
        self.observations_path = f"{self.path}/observations"

    async def update(self, observation: list[float], seq: int) -> None:
        await _call(self.session, "POST", self.observations_path, _update_body([observation], seq, 0))

    async def step(self) -> int:
        return int((await _call(self.session, "GET", self.path))["step"])

    async def delete(self) -> None:
        await _call(self.session, "DELETE", self.path)


@contextlib.asynccontextmanager
async def aiohttp_streams(url: str, k: int) -> AsyncIterator[Create]:
    """``--client aiohttp`` (default): one ``aiohttp.ClientSession`` whose connector keeps up to K keep-alive
    connections to the server (one per stream in flight), no retries."""
    connector = aiohttp.TCPConnector(limit=k, limit_per_host=k, keepalive_timeout=HTTP_TIMEOUT_S)
    timeout = aiohttp.ClientTimeout(total=HTTP_TIMEOUT_S)
    async with aiohttp.ClientSession(url, connector=connector, timeout=timeout) as session:

        async def create(method: str, n: int, seed: int) -> BenchStream:
            body = _create_body(MODEL, PRIOR, method=method, num_particles=n, seed=seed)
            return AiohttpStream(session, await _call(session, "POST", "/v1/streams", body))

        yield create


CLIENTS: dict[str, Callable[[str, int], contextlib.AbstractAsyncContextManager[Create]]] = {
    "aiohttp": aiohttp_streams,
    "httpx": httpx_streams,
}


async def drive(stream: BenchStream, target: Target, window: list[float], stop: asyncio.Event, tally: Tally) -> None:
    """Closed loop: send, await the answer, send the next. Records requests completing inside ``window``."""
    seq = 1
    while not stop.is_set():
        obs = target.observe()
        t0 = time.perf_counter()
        try:
            await stream.update(obs, seq)
            seq += 1
        except Exception as exc:  # counted, never hidden
            name = getattr(exc, "code", None) or type(exc).__name__
            tally.errors[name] = tally.errors.get(name, 0) + 1
            with contextlib.suppress(Exception):
                seq = await stream.step() + 1
            continue
        t1 = time.perf_counter()
        tally.done += 1
        if window[0] <= t1 <= window[1]:
            tally.latencies.append(t1 - t0)


@dataclass
class CpuMark:
    """This process's CPU time (user + system, all threads) and the updates completed so far, at one instant."""

    cpu_s: float
    done: int

    @classmethod
    def now(cls, tally: Tally) -> CpuMark:
        return cls(time.process_time(), tally.done)


def client_cpu_ms(start: CpuMark, end: CpuMark) -> float | None:
    """The load generator's own CPU per completed update between two marks, in ms: Δ process time ÷ Δ updates
    (the server is another process and is not counted; numpy's simulation of the observations is)."""
    n = end.done - start.done
    return (end.cpu_s - start.cpu_s) / n * 1e3 if n > 0 else None


async def run_cell(
    url: str, method: str, n: int, k: int, warmup_s: float, window_s: float, client: str = "aiohttp"
) -> dict[str, Any]:
    """One cell: K streams created, driven closed loop for ``warmup_s`` + ``window_s`` (extended until
    :data:`MIN_COMPLETIONS`), then deleted; its summary row (:func:`summarize`)."""
    async with CLIENTS[client](url, k) as create:
        streams = await asyncio.gather(*(create(method, n, i) for i in range(k)))
        operator = streams[0].document.get("operator") if streams[0].document else None
        stop, tally = asyncio.Event(), Tally()
        start = time.perf_counter()
        window = [start + warmup_s, start + warmup_s + window_s]
        tasks = [asyncio.create_task(drive(s, Target(1000 + i), window, stop, tally)) for i, s in enumerate(streams)]
        await asyncio.sleep(warmup_s)
        before = await asyncio.to_thread(scrape, url)
        cpu_start = CpuMark.now(tally)  # after the scrape: its CPU is not the load generator's per-request cost
        await asyncio.sleep(window_s)
        while len(tally.latencies) < MIN_COMPLETIONS and time.perf_counter() - window[0] < 4 * window_s:
            window[1] = time.perf_counter() + 0.5
            await asyncio.sleep(0.5)
        window[1] = time.perf_counter()
        cpu_end = CpuMark.now(tally)
        after = await asyncio.to_thread(scrape, url)
        stop.set()
        await asyncio.gather(*tasks)
        await asyncio.gather(*(s.delete() for s in streams), return_exceptions=True)
    row = summarize(method, n, k, operator, window[1] - window[0], tally, before, after)
    row["client_cpu_ms_per_request"] = client_cpu_ms(cpu_start, cpu_end)
    return row


def _delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def summarize(
    method: str,
    n: int,
    k: int,
    operator: str | None,
    seconds: float,
    tally: Tally,
    before: dict[str, float],
    after: dict[str, float],
) -> dict[str, Any]:
    lat = sorted(tally.latencies)
    calls = _delta(after, before, "mpflow_batch_size_count")
    steps = _delta(after, before, "mpflow_batch_size_sum")
    compute = _delta(after, before, "mpflow_update_duration_seconds_sum")
    return {
        "method": method,
        "operator": operator if method == "mpf" else None,
        "N": n,
        "K": k,
        "completed": len(lat),
        "window_s": round(seconds, 3),
        "updates_per_s": len(lat) / seconds if seconds > 0 else 0.0,
        "p50_ms": percentile(lat, 0.50) * 1e3 if lat else None,
        "p99_ms": percentile(lat, 0.99) * 1e3 if lat else None,
        "mean_ms": statistics.fmean(lat) * 1e3 if lat else None,
        "mean_batch": steps / calls if calls else None,
        "compute_ms_per_call": compute / calls * 1e3 if calls else None,
        "errors": tally.errors,
    }


def percentile(sorted_xs: list[float], q: float) -> float:
    """The q-quantile of sorted data, linear interpolation (numpy's default)."""
    return float(np.quantile(np.asarray(sorted_xs), q))


# ----------------------------------------------------------------------------------------------------------
# the run

CLIENT_LABELS = {
    "aiohttp": "K streams on one aiohttp.ClientSession (K keep-alive connections), one event loop, closed loop, "
    "no retries",
    "httpx": "K service.client.AsyncClient (httpx, 1 connection each) on one event loop, closed loop, no retries",
}


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    grid = QUICK if args.quick else FULL
    particles = tuple(args.particles or grid["particles"])
    ks = tuple(args.streams or grid["streams"])
    methods = tuple(args.methods or METHODS)
    warmup_s = args.warmup if args.warmup is not None else grid["warmup_s"]
    window_s = args.window if args.window is not None else grid["window_s"]
    k_off = max(ks)
    rows: list[dict[str, Any]] = []
    load_before = os.getloadavg()
    t_start = time.perf_counter()
    with choose_store(args.store, args.redis_url) as store, tempfile.TemporaryDirectory() as logs:
        print(f"store: {store.label}; client: {args.client}", file=sys.stderr)
        for batching, ks_run in ((True, ks), (False, (k_off,))):
            with server(store, batching, Path(logs), args.workers) as url:
                for method in methods:
                    for n in particles:
                        for k in ks_run:
                            row = asyncio.run(run_cell(url, method, n, k, warmup_s, window_s, args.client))
                            row["batching"] = batching
                            rows.append(row)
                            print(format_row(row), file=sys.stderr, flush=True)
    meta = metadata(args, store.label, methods, particles, ks, k_off, warmup_s, window_s, load_before)
    meta["wall_s"] = round(time.perf_counter() - t_start, 1)
    return {"meta": meta, "rows": rows, "batching_speedup": speedups(rows), "targets": targets(rows)}


def speedups(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Throughput with batching ÷ without, per (method, N) at the K both servers ran."""
    out = []
    for off in (r for r in rows if not r["batching"]):
        on = next(
            (r for r in rows if r["batching"] and (r["method"], r["N"], r["K"]) == (off["method"], off["N"], off["K"])),
            None,
        )
        if on is not None and off["updates_per_s"] > 0:
            ratio = on["updates_per_s"] / off["updates_per_s"]
            out.append({"method": off["method"], "N": off["N"], "K": off["K"], "speedup": ratio})
    return out


def metadata(args, store_label, methods, particles, ks, k_off, warmup_s, window_s, load_before) -> dict[str, Any]:
    return {
        "benchmark": "service_load",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "quick": bool(args.quick),
        "store": store_label,
        "server": f"python -m service --workers {args.workers} (uvicorn, default settings otherwise; "
        "MPFLOW_BATCHING=false for the off rows)",
        "workers": args.workers,
        "client_kind": args.client,
        "client": CLIENT_LABELS[args.client],
        "model": MODEL,
        "prior": PRIOR,
        "methods": list(methods),
        "particles": list(particles),
        "streams": list(ks),
        "unbatched_at_K": k_off,
        "warmup_s": warmup_s,
        "window_s": window_s,
        **machine_meta(load_before),
    }


def _find(rows: list[dict[str, Any]], k: int, batching: bool) -> dict[str, Any] | None:
    return next(
        (r for r in rows if r["method"] == "mpf" and r["N"] == 256 and r["K"] == k and r["batching"] == batching),
        None,
    )


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The three targets (module docstring) as measured: met / not met / not measured."""

    def verdict(value: float | None, ok: bool) -> str:
        return "not measured" if value is None else ("met" if ok else "not met")

    one, on64, off64 = _find(rows, 1, True), _find(rows, 64, True), _find(rows, 64, False)
    p50 = one["p50_ms"] if one else None
    rate = on64["updates_per_s"] if on64 else None
    speedup = on64["updates_per_s"] / off64["updates_per_s"] if on64 and off64 and off64["updates_per_s"] else None
    return [
        {
            "target": f"one stream (mpf, N=256) p50 ≤ {TARGETS['p50_ms_k1']:g} ms end to end",
            "measured": p50,
            "status": verdict(p50, p50 is not None and p50 <= TARGETS["p50_ms_k1"]),
        },
        {
            "target": f"64 streams (mpf, N=256) ≥ {TARGETS['updates_per_s_k64']:g} updates/s",
            "measured": rate,
            "status": verdict(rate, rate is not None and rate >= TARGETS["updates_per_s_k64"]),
        },
        {
            "target": f"batching ≥ {TARGETS['batching_speedup_k64']:g}× unbatched throughput, 64 streams (mpf, N=256)",
            "measured": speedup,
            "status": verdict(speedup, speedup is not None and speedup >= TARGETS["batching_speedup_k64"]),
        },
    ]


# ----------------------------------------------------------------------------------------------------------
# reporting


def _fmt(x: float | None, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def format_row(r: dict[str, Any]) -> str:
    errors = ", ".join(f"{k}×{v}" for k, v in r["errors"].items()) or "0"
    method = r["method"] + (
        f" ({r['operator']})" if r.get("operator") else (" (base flow)" if r["method"] == "mpf" else "")
    )
    return (
        f"| {method} | {r['N']} | {r['K']} | {'on' if r['batching'] else 'off'} | {r['updates_per_s']:.1f} "
        f"| {_fmt(r['p50_ms'], '.1f')} | {_fmt(r['p99_ms'], '.1f')} | {_fmt(r['mean_batch'], '.1f')} "
        f"| {_fmt(r['compute_ms_per_call'], '.1f')} | {_fmt(r.get('client_cpu_ms_per_request'), '.2f')} "
        f"| {r['completed']} | {errors} |"
    )


def format_table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| method | N | K streams | batching | updates/s | p50 ms | p99 ms | mean batch | compute ms/call "
        "| client CPU ms/req | requests | errors |"
    )
    return "\n".join([head, "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---|", *map(format_row, rows)])


def format_targets(items: list[dict[str, Any]]) -> str:
    lines = []
    for t in items:
        value = "—" if t["measured"] is None else f"{t['measured']:.2f}"
        lines.append(f"- {t['target']}: measured {value} → **{t['status']}**")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path, meta: dict[str, Any]) -> None:
    """Throughput, p50 and p99 per cell (bars), one group per (method, N)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys((r["method"], r["N"]) for r in rows))
    series = list(dict.fromkeys((r["K"], r["batching"]) for r in rows))
    width = 0.8 / max(1, len(series))
    fig, axes = plt.subplots(3, 1, figsize=(min(13.0, max(7.0, 0.45 * len(groups) * len(series) + 2)), 9), sharex=True)
    panels = (("updates_per_s", "updates / s"), ("p50_ms", "p50 latency, ms"), ("p99_ms", "p99 latency, ms"))
    for ax, (key, label) in zip(axes, panels, strict=True):
        for j, (k, batching) in enumerate(series):
            xs, ys = [], []
            for i, g in enumerate(groups):
                r = next(
                    (r for r in rows if (r["method"], r["N"]) == g and (r["K"], r["batching"]) == (k, batching)), None
                )
                if r is not None and r[key] is not None:
                    xs.append(i + (j - (len(series) - 1) / 2) * width)
                    ys.append(r[key])
            ax.bar(
                xs, ys, width, label=f"K={k}, batching {'on' if batching else 'off'}", hatch=None if batching else "//"
            )
        ax.set_ylabel(label)
        ax.set_yscale("log")
        ax.grid(axis="y", alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=min(4, len(series)), fontsize=7, bbox_to_anchor=(0.5, 0.955))
    axes[-1].set_xticks(range(len(groups)))
    axes[-1].set_xticklabels([f"{m}\nN={n}" for m, n in groups])
    fig.suptitle(
        f"service load: lds d=2, closed-loop streams, {meta['store'].split(' (')[0]}, {meta['machine_cores']} cores "
        f"(load avg before {meta['load_average_before'][0]})",
        fontsize=9,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.92))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.service_load", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="K ∈ {1, 16}, N = 256, short windows")
    p.add_argument("--store", choices=("auto", "redis", "embedded"), default="auto")
    p.add_argument("--client", choices=tuple(CLIENTS), default="aiohttp", help="the load generator's HTTP client")
    p.add_argument("--redis-url", default=os.environ.get("MPFLOW_REDIS_URL") or "redis://127.0.0.1:6379/0")
    p.add_argument("--methods", type=lambda s: [x for x in s.split(",") if x], default=None, help="e.g. mpf,smc")
    p.add_argument("--particles", type=_ints, default=None, help="e.g. 256,1024")
    p.add_argument("--streams", type=_ints, default=None, help="K values, e.g. 1,16,64")
    p.add_argument("--warmup", type=float, default=None, help="seconds per cell before measuring")
    p.add_argument("--window", type=float, default=None, help="seconds measured per cell")
    p.add_argument("--workers", type=int, default=1, help="server worker processes (mpflow serve --workers)")
    p.add_argument("--out", type=Path, default=None, help="output path without suffix")
    args = p.parse_args(argv)
    default_out = "service_load-quick" if args.quick else "service_load"
    out = args.out or RESULTS / (default_out + (f"-workers{args.workers}" if args.workers > 1 else ""))
    result = run_benchmark(args)
    meta = result["meta"]
    print(
        f"store: {meta['store']}; client: {meta['client_kind']} ({meta['client']}); "
        f"load average before {meta['load_average_before']}, after {meta['load_average_after']}"
    )
    print()
    print(format_table(result["rows"]))
    print()
    speedup = ", ".join(f"{x['method']} N={x['N']}: {x['speedup']:.2f}×" for x in result["batching_speedup"])
    print(f"batching on ÷ off, updates/s at K={meta['unbatched_at_K']}: {speedup}")
    print()
    print(format_targets(result["targets"]))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2, allow_nan=False) + "\n")
    plot(result["rows"], out.with_suffix(".png"), meta)
    print(f"\nwrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The closed-loop load generator: K streams, each sending its next update as soon as it has the answer.

One cell (:func:`run_cell`) = (method, N particles, K streams) against a running server: K ``lds`` d = 2 streams
are created (:data:`~tests.harness.specs.LDS_MODEL`, prior N(0, I), observations simulated on the fly by
:class:`Target`: numpy, seeded per stream), then each sends single-observation updates (with ``seq``) as fast as
it gets answers — K concurrent closed-loop clients, all on one event loop, no retries (a failure is counted,
never hidden; the loop then re-reads the stream's step). After a warm-up, requests *completing* inside the
measurement window count (:func:`summarize`): updates/s, p50/p99 end-to-end latency, mean batch and compute ms
per operator call (from the server's ``/metrics``), and the load generator's own CPU per request.

The HTTP client (:data:`CLIENTS`): ``aiohttp`` — one ``aiohttp.ClientSession`` with K keep-alive connections,
sending the very bodies :class:`mpflow.client.http.AsyncClient` sends (stdlib ``json``) — or ``httpx`` —
:class:`mpflow.client.http.AsyncClient` itself, one per stream with one keep-alive connection. Why aiohttp:
the load generator runs on the same machine as the server and shares its cores, so every millisecond of CPU it
spends per request is taken from the server being measured; measured, httpx costs ≈ 0.8–1.2 ms CPU per request,
aiohttp ≈ 0.2–0.37 ms (see ``benchmarks/service_load.py``).

The server: :func:`server` starts ``python -m mpflow serve`` as a user does
(:func:`~tests.harness.server.serve_as_user`; ``workers=None``: without ``--workers``, the server's default, as
``make serve`` starts it — :func:`started_workers` reads the number it started off its log) on the store
:func:`choose_store` picks: the local Redis under a fresh key prefix, else the embedded one, or (``"cluster"``) a
fresh local Redis Cluster of 3 primaries with a replica each (:class:`tests.harness.cluster.LocalCluster`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import statistics
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import quote

import aiohttp
import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from mpflow.client.http import (
    NO_RETRY,
    AsyncClient,
    AsyncStream,
    MpflowError,
    _create_body,  # the very bodies AsyncClient sends, for the aiohttp client too
)
from mpflow.client.observations import update_body
from tests.harness.cluster import LocalCluster
from tests.harness.server import drop_prefix, redis_answers, serve_as_user
from tests.harness.specs import LDS_MODEL, PRIOR, STATE_DIM
from tests.harness.traffic import percentile

MIN_COMPLETIONS = 20  # a window is extended (up to 4×) until this many requests completed
HTTP_TIMEOUT_S = 300.0
JSON_HEADERS = {"Content-Type": "application/json"}
JSON_ENCODING: dict[str, Any] = {"separators": (",", ":"), "ensure_ascii": False, "allow_nan": False}  # as httpx


# ----------------------------------------------------------------------------------------------------------
# the server


@dataclass
class Store:
    """Where the servers keep their streams: ``env`` for the server process, ``label`` for the report."""

    env: dict[str, str]
    label: str
    redis_url: str | None = None
    prefix: str | None = None


@contextlib.contextmanager
def choose_store(kind: str, redis_url: str) -> Iterator[Store]:
    """``kind``: ``redis`` (the Redis at ``redis_url``), ``embedded``, ``auto`` (the first when it answers, else
    the second) or ``cluster`` (a local Redis Cluster, 3 primaries + 3 replicas, started here and stopped after)."""
    if kind == "cluster":
        with tempfile.TemporaryDirectory(prefix="mpflowbench-cluster-") as base, LocalCluster(base) as cluster:
            prefix = f"mpflowbench-{uuid.uuid4().hex[:12]}"
            yield Store(
                {"MPFLOW_REDIS_URL": cluster.url, "MPFLOW_REDIS_PREFIX": prefix},
                f"local Redis Cluster, {cluster.primaries} primaries + {cluster.primaries * cluster.replicas} "
                f"replicas on 127.0.0.1 (MPFLOW_REDIS_URL {cluster.url}; stopped afterwards)",
                cluster.url,
                prefix,
            )
        return
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


def server_log(log_dir: Path, batching: bool) -> Path:
    """Where :func:`server` appends the server's output."""
    return log_dir / f"server-{'batched' if batching else 'unbatched'}.log"


@contextlib.contextmanager
def server(store: Store, batching: bool, log_dir: Path, workers: int | None = 1) -> Iterator[str]:
    """``python -m mpflow serve`` on a free port (:func:`tests.harness.server.serve_as_user`) with ``--workers
    workers`` (None: no ``--workers``, the server's default); yields its base URL once ``/readyz`` answers 200."""
    env = {**store.env, "MPFLOW_BATCHING": "true" if batching else "false"}
    args = [] if workers is None else ["--workers", str(workers)]
    with serve_as_user(env, server_log(log_dir, batching), args=args, inherit_mpflow_env=True) as srv:
        yield srv.url


def started_workers(log_path: Path) -> int:
    """The worker processes a server started, from its log: uvicorn logs ``Started server process [pid]`` once
    per worker (read it once they have all started, e.g. after a cell has run)."""
    return log_path.read_text(errors="replace").count("Started server process")


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
    """The simulated system behind one stream: :data:`~tests.harness.specs.LDS_MODEL` stepped in numpy, its own
    generator. (Not the family's torch ``simulate``: the loop is open-ended, one step per request, and the load
    generator's CPU per request is measured and taken from the server.)"""

    def __init__(self, seed: int):
        p = LDS_MODEL["params"]
        self.rng = np.random.default_rng(seed)
        self.A, self.B = np.array(p["A"]), np.array(p["B"])
        self.lq, self.lr = np.linalg.cholesky(p["Q"]), np.linalg.cholesky(p["R"])
        self.x = self.rng.standard_normal(STATE_DIM)

    def observe(self) -> list[float]:
        self.x = self.A @ self.x + self.lq @ self.rng.standard_normal(STATE_DIM)
        return (self.B @ self.x + self.lr @ self.rng.standard_normal(len(self.lr))).tolist()


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
    """:class:`mpflow.client.http.AsyncStream` (httpx) as a :class:`BenchStream`."""

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
    """``--client httpx``: one :class:`mpflow.client.http.AsyncClient` (one keep-alive connection) per stream, no
    retries. One client per stream: httpcore's pool scans all its connections on every request (O(connections)
    per request, encode/httpcore#1035), which made one shared 64-connection client the bottleneck."""
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    tls = ssl.create_default_context()  # unused for http://, but httpx builds one per client unless given one
    async with contextlib.AsyncExitStack() as stack:

        async def create(method: str, n: int, seed: int) -> BenchStream:
            client = AsyncClient(url, timeout=HTTP_TIMEOUT_S, retry=NO_RETRY, limits=limits, verify=tls)
            await stack.enter_async_context(client)
            stream = await client.create_stream(model=LDS_MODEL, prior=PRIOR, method=method, num_particles=n, seed=seed)
            return HttpxStream(stream)

        yield create


def _mpflow_error(status: int, reason: str | None, raw: bytes) -> MpflowError:
    """The API's error body ``{"error": {"code", "message"}}`` as :class:`mpflow.client.http.MpflowError` (a code
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
    :class:`mpflow.client.http.AsyncStream` (bodies from the client's own builders), no retries."""

    def __init__(self, session: aiohttp.ClientSession, document: dict[str, Any]):
        self.session = session
        self.document = document
        self.path = f"/v1/streams/{quote(document['stream_id'], safe='')}"
        self.observations_path = f"{self.path}/observations"

    async def update(self, observation: list[float], seq: int) -> None:
        await _call(self.session, "POST", self.observations_path, update_body([observation], seq, 0))

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
            body = _create_body(LDS_MODEL, PRIOR, method=method, num_particles=n, seed=seed)
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


CLIENT_LABELS = {
    "aiohttp": "K streams on one aiohttp.ClientSession (K keep-alive connections), one event loop, closed loop, "
    "no retries",
    "httpx": "K mpflow.client.AsyncClient (httpx, 1 connection each) on one event loop, closed loop, no retries",
}

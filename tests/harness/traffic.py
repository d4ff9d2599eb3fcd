"""Recorded traffic: streams fed through :mod:`mpflow.client.http` with every HTTP exchange on record.

One :class:`~mpflow.client.http.AsyncClient` per stream (one keep-alive connection each, all on one event loop,
:func:`clients`), each exchange recorded by a wrapping transport (:class:`RecordingTransport`: status,
``Retry-After``, error code, transport errors), so nothing the client retries away is hidden. :func:`drive` feeds
a stream with :meth:`AsyncStream.filter`, which numbers its requests with ``seq``; the client retries timeouts,
refused/reset connections and 503s (honouring ``Retry-After``), and a request that was applied but whose answer
was lost comes back as ``duplicate``. When the client gives up (or is answered 409) the driver *resumes*: it
reads the stream's ``step`` and starts a new filter at ``step + 1``.

A step is **acknowledged** when a 200 answer covering it was received (a duplicate answer acknowledges its steps
too); an acknowledged step the server later did not have (found on a resume, ``stored < acknowledged``) is
counted as **lost**. :func:`tally` counts what the recorder saw; :func:`applied_after_failure` finds requests
that failed but were applied.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import ssl
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from mpflow.client.http import AsyncClient, AsyncStream, MpflowError, Retry
from tests.harness.specs import PRIOR, STATE_DIM


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
    """Observations [steps, k] of the ``model`` spec as float32 (exactly what the server will parse), simulated
    by the model's own family (:meth:`ModelFamily.simulate`) from a true state x0 ~ N(0, I), seeded per stream."""
    from mpflow.operators.models import make_model
    from mpflow.operators.rng import generator, randn

    gens = [generator(seed)]
    family = make_model(model["family"], model.get("params"), STATE_DIM)
    _, obs = family.simulate(steps, randn(gens, [STATE_DIM]), gens)
    return obs[0].numpy()


@contextlib.asynccontextmanager
async def clients(url: str, k: int, recorder: Recorder, retry: Retry) -> Any:
    """``k`` clients, one keep-alive connection each (see :mod:`tests.harness.load` on why)."""
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
    """One stream per client (ids ``{tag}-000``, ...), each with ``steps`` simulated observations."""

    async def one(i: int, c: AsyncClient) -> tuple[AsyncStream, StreamRun]:
        sid = f"{tag}-{i:03d}"
        s = await c.create_stream(model=model, prior=PRIOR, method=method, num_particles=n, seed=i, stream_id=sid)
        return s, StreamRun(sid, simulate(model, 1000 + i, steps))

    return list(await asyncio.gather(*(one(i, c) for i, c in enumerate(cs))))


#: how long :func:`stored_step` keeps asking a server that does not answer: longer than any restart or failover
#: a fault script makes (seconds), short enough that a server that is gone fails the run instead of hanging it
STORED_STEP_PATIENCE_S = 120.0


async def stored_step(stream: AsyncStream, patience: float = STORED_STEP_PATIENCE_S) -> int:
    """The stream's step, read until an answer comes (the client retries; this outlasts its attempts), for at
    most ``patience`` seconds: then RuntimeError naming the last failure."""
    deadline = time.monotonic() + patience
    while True:
        try:
            return int((await stream.get())["step"])
        except (MpflowError, httpx.HTTPError) as exc:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"stream {stream.stream_id}: no answer to GET in {patience:.0f} s (last: {exc!r})"
                ) from exc
            await asyncio.sleep(0.5)


async def drive(
    stream: AsyncStream, run: StreamRun, batch: int, on_steps: Callable[[int], None], keep_means: bool = True
) -> None:
    """Feed ``run.obs`` through :meth:`AsyncStream.filter` until the stream holds every step; resume after a
    failure the client did not retry away (module docstring)."""
    total = len(run.obs)
    first = True
    while True:
        stored = await stored_step(stream)
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
    """Returns once ``fraction`` of all the runs' steps are acknowledged."""
    total = sum(len(r.obs) for r in runs)
    while sum(len(r.acked) for r in runs) < fraction * total:
        await asyncio.sleep(0.01)


def progress(total: int, desc: str, enabled: bool) -> Any:
    """A tqdm bar on stderr (disabled unless ``enabled``)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="step", disable=not enabled, leave=False, file=sys.stderr)


def percentile(sorted_xs: Sequence[float], q: float) -> float:
    """The q-quantile of sorted data, linear interpolation (numpy's default)."""
    return float(np.quantile(np.asarray(sorted_xs), q))


def tally(runs: Sequence[StreamRun], rec: Recorder) -> dict[str, Any]:
    """What the recorder and the drivers saw: statuses, 503s (and those without ``Retry-After``), other 5xx,
    409s, transport errors, duplicates, resumes, bad answers, the errors the clients gave up on."""
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

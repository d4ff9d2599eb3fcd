"""A Python client for the mpflow REST API (docs/API.md), on httpx: :class:`Client` (sync) and :class:`AsyncClient`.

::

    from mpflow import Client

    with Client("http://127.0.0.1:8000") as client:
        stream = client.create_stream(
            model={"family": "lds", "params": {"A": [[0.9, 0.1], [0, 0.9]], "B": [[1, 0], [0, 1]]}},
            prior={"type": "gaussian", "mean": [0, 0], "cov": [[1, 0], [0, 1]]},
            method="mpf", num_particles=256, seed=0,
        )
        for posterior in stream.filter(observations):       # any iterable of observations
            print(posterior["step"], posterior["summary"]["mean"])

The async client mirrors it: ``stream = await client.create_stream(...)``,
``async for posterior in stream.filter(observations)`` (a sync or async iterable).

Errors. Every non-2xx answer raises :class:`MpflowError` with ``status``, ``code`` and ``message`` taken from the
API's error body ``{"error": {"code", "message"}}``; a server that cannot be reached (refused, timed out, once the
retries are spent) raises its subclass :class:`MpflowConnectionError` (``status`` None, ``code``
``connection_failed`` or ``timeout``), with the transport's exception as its ``__cause__``.

numpy and pandas. Arrays and scalars of numpy (anything with ``tolist()``) may stand anywhere in a request:
observations, model parameters, the prior, ``seq``, ``n``. Observations are checked before anything is sent
(:mod:`mpflow.client.observations`): NaN or None entries go as ``null`` (missing entries), ±inf and
non-numbers raise :class:`MpflowError` naming the entry; a pandas DataFrame's rows (``columns=`` by name or
position, a ``dt`` column) or a Series' elements are the steps. ``stream.samples(n)``, ``stream.particles()`` and
``stream.forecast(k)`` answer numpy arrays, ``stream.smoothed()`` a :class:`~mpflow.client.results.Smoothed`.
Stream documents and observation answers come back as
:class:`~mpflow.client.results.Posterior` — the API's dict, with ``posterior.mean``, ``.std``, ``.cov``,
``.quantiles``, ``.samples`` as numpy arrays, ``.steps`` (the per-step summaries as a
:class:`~mpflow.client.results.StepTable`) and ``.to_pandas()`` where pandas is installed; ``stream.history()``
(the steps the server keeps, with their observations) as a :class:`~mpflow.client.results.History`.

Retries and exactly-once. Requests that are safe to repeat are retried after a timeout, a connection error
(refused, reset, closed mid-answer) or a 503 (the store was unreachable: nothing was applied, or — code
``store_outcome_unknown`` — a write the store never confirmed, which a retry with ``seq`` settles): at most
``Retry.attempts`` tries in all, waiting ``Retry-After`` when the server sends it, else an exponential backoff
``min(max_delay, base_delay · 2^k)`` with jitter (half of it random). Safe to repeat are the reads (GET), and
observation updates *that carry* ``seq``: the server applies step ``seq`` only when the stream is at ``seq − 1``,
and answers a batch that is already applied with 200 and ``"duplicate": true`` (and the current state) without
applying it again. So when a request was applied but its answer was lost (a timeout after the server wrote),
the retry comes back as a duplicate, which :meth:`Stream.update` and :meth:`Stream.filter` treat as success —
every observation is applied exactly once. :meth:`Stream.filter` always sends ``seq`` (it numbers the steps
itself, continuing from the stream's step when the filter starts); :meth:`Stream.update` retries only when
called with ``seq``. Stream creation is never retried automatically (a retry of a create whose answer was lost
would answer 409 ``stream_exists``); neither is ``delete``.

A duplicate answer has ``per_step: []`` (nothing was applied by that request); its ``summary`` is the stream's
current posterior — after the lost request, if no one else has written to the stream since.
"""

from __future__ import annotations

import asyncio
import random
import re
import time
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator, Sequence
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import Any, ClassVar
from urllib.parse import quote

import httpx
import numpy as np

from mpflow.client.errors import MpflowConnectionError, MpflowError
from mpflow.client.observations import is_table, refuse, step_json, steps_json, table_steps, update_body
from mpflow.client.results import History, Posterior, Smoothed, forecast_arrays, jsonable, particles_arrays, state_names
from mpflow.client.websocket import AsyncStreamSocket, StreamSocket, socket_url

DEFAULT_URL = "http://127.0.0.1:8000"
DEFAULT_TIMEOUT = 30.0
#: transport errors after which a safe request is retried (timeouts, refused/reset connections, ...)
RETRYABLE_ERRORS = (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError)
RETRYABLE_STATUS = frozenset({503})
#: the media type of a stream snapshot (``GET .../export``, ``POST /v1/streams:import``)
SNAPSHOT_TYPE = "application/octet-stream"


@dataclass(frozen=True)
class Retry:
    """Retry policy for safe requests: ``attempts`` tries in all; delay ``min(max_delay, base_delay·2^k)``
    (half of it random) after the k-th failure, or the server's ``Retry-After`` (capped at ``max_retry_after``)."""

    attempts: int = 5
    base_delay: float = 0.05
    max_delay: float = 2.0
    max_retry_after: float = 30.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"attempts: must be at least 1, got {self.attempts}")
        if self.base_delay < 0 or self.max_delay < 0 or self.max_retry_after < 0:
            raise ValueError("base_delay, max_delay, max_retry_after: must be non-negative")

    def delay(self, failures: int, response: httpx.Response | None, rng: random.Random) -> float:
        """Seconds to wait after the ``failures``-th failure (1-based)."""
        after = _retry_after(response) if response is not None else None
        if after is not None:
            return min(after, self.max_retry_after)
        backoff = min(self.max_delay, self.base_delay * 2 ** (failures - 1))
        return backoff / 2 + rng.uniform(0, backoff / 2)


NO_RETRY = Retry(attempts=1)


def _retry_after(response: httpx.Response) -> float | None:
    """``Retry-After`` in seconds (delta-seconds or an HTTP date), or None."""
    value = response.headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None


def _answer(response: httpx.Response) -> Any:
    if response.status_code >= 400:
        raise MpflowError.from_response(response)
    if response.headers.get("content-type", "").startswith(SNAPSHOT_TYPE):  # a snapshot (export): its bytes
        return response.content
    return None if response.status_code == 204 or not response.content else response.json()


def _stream_path(stream_id: str) -> str:
    return f"/v1/streams/{quote(stream_id, safe='')}"


def _create_body(model: dict[str, Any], prior: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {"model": model, "prior": prior, **{k: v for k, v in fields.items() if v is not None}}


def _steps(
    observations: Any, dt: float | None, u: Sequence[float] | None, columns: Sequence[Any] | None = None
) -> list[Any]:
    """The ``observations`` of a request: the items as given (a DataFrame's rows, a Series' elements:
    :func:`~mpflow.client.observations.table_steps`); ``None`` alone is one step without a measurement;
    with ``dt`` or ``u``, ``observations`` is ONE observation (or None), sent as ``{"value", "dt", "u"}``."""
    if is_table(observations):
        if dt is not None or u is not None:
            raise refuse("dt", "a DataFrame gives each step's dt in its 'dt' column; dt= and u= are for one step")
        return table_steps(observations, columns)
    if dt is None and u is None:
        return [None] if observations is None else list(observations)
    item: dict[str, Any] = {"value": observations}
    if dt is not None:
        item["dt"] = dt
    if u is not None:
        item["u"] = list(u)
    return [item]


class _Clock:
    """Timestamped observations of :meth:`Stream.filter`: a ``(t, observation)`` tuple becomes ``{"value", "dt"}``
    with dt the time since the previous timed item (``t0`` before the first); other items pass as they are."""

    def __init__(self, t0: float):
        self.last = t0

    def item(self, item: Any) -> Any:
        if not isinstance(item, tuple):
            return item
        t, value = item
        dt, self.last = t - self.last, t
        return {"value": value, "dt": dt}


def _filter_steps(observations: Iterable[Any], columns: Sequence[Any] | None, clock: _Clock) -> Iterable[Any]:
    """The steps :meth:`Stream.filter` sends, as JSON, named by their position in ``observations``: all of them
    checked before the first request when ``observations`` has a length (a list, an array, a DataFrame), else
    each one as it comes."""
    items = table_steps(observations, columns) if is_table(observations) else observations
    if hasattr(items, "__len__"):
        return steps_json(map(clock.item, items))
    return (step_json(clock.item(item), f"observations[{i}]") for i, item in enumerate(items))


async def _atimed(items: AsyncIterable[Any], clock: _Clock) -> AsyncIterator[Any]:
    i = 0
    async for item in items:
        yield step_json(clock.item(item), f"observations[{i}]")
        i += 1


#: steps per request of ``filter(DataFrame)`` by default: the service's default MPFLOW_MAX_OBSERVATIONS_PER_REQUEST
FRAME_BATCH = 1000


def _estimates(answers: Sequence[dict[str, Any]]) -> Any:
    """The per-step estimates of ``filter(DataFrame)``'s answers as one DataFrame
    (:func:`~mpflow.client.frames.steps_frame`)."""
    from mpflow.client.frames import steps_frame

    per_step = [s for a in answers for s in a.get("per_step") or []]
    dim = len(per_step[0]["mean"]) if per_step else 0
    return steps_frame(per_step, state_names(answers[-1], dim) if answers else [])


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _auth_header(http: httpx.Client | httpx.AsyncClient) -> dict[str, str]:
    """The client's ``Authorization`` header (its API key), for a WebSocket handshake."""
    key = http.headers.get("authorization")
    return {"Authorization": key} if key else {}


def _read_timeout(http: httpx.Client | httpx.AsyncClient) -> float:
    return http.timeout.read or DEFAULT_TIMEOUT


def _chunks(items: Iterable[Any], size: int) -> Iterator[list[Any]]:
    chunk: list[Any] = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


#: a 413 ``limit_exceeded`` naming ``observations`` says how many steps fit: "…; at most K here" (the cost model) or
#: "observations: at most K steps per request" (MPFLOW_MAX_OBSERVATIONS_PER_REQUEST)
_FITTING = re.compile(r"^observations: .*\bat most (\d+)( here| steps per request)")


def _steps_that_fit(exc: MpflowError, sent: int) -> int:
    """How many of the ``sent`` steps a refused request could have carried, from the server's 413 — ``exc`` itself
    raised when it is another error, or when not even one step fits (nothing was applied: the smaller request
    repeats the same ``seq`` safely)."""
    found = _FITTING.match(exc.message) if exc.status == 413 and exc.code == "limit_exceeded" else None
    fits = int(found.group(1)) if found else 0
    if not 1 <= fits < sent:
        raise exc
    return fits


class _Batches:
    """The requests of :meth:`Stream.filter`: ``size`` steps each, shrunk to what the server's 413 says fits
    (:func:`_steps_that_fit`) and kept at that for the requests after."""

    def __init__(self, size: int):
        self.size = size

    def part(self, chunk: list[Any]) -> list[Any]:
        return chunk[: self.size]

    def refused(self, exc: MpflowError, sent: int) -> None:
        self.size = _steps_that_fit(exc, sent)


async def _achunks(items: Iterable[Any] | AsyncIterable[Any], size: int) -> AsyncIterator[list[Any]]:
    if not isinstance(items, AsyncIterable):
        for chunk in _chunks(items, size):
            yield chunk
        return
    chunk: list[Any] = []
    async for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _batch_body(updates: Iterable[dict[str, Any]]) -> tuple[dict[str, Any], bool]:
    """The body of ``POST /v1/observations:batch`` — ``updates``, each ``{"stream_id", "observations", "seq",
    "return_samples"}`` (``seq`` and ``return_samples`` optional) — and whether it is safe to retry: when every
    update carries ``seq`` (an applied one answers ``duplicate``). Each update is applied or refused on its own:
    the answer is one result per update, in order, ``{"stream_id", "status", "stream"}`` (a
    :class:`~mpflow.client.results.Posterior`) or ``{"stream_id", "status", "error"}``; a refused update raises
    nothing. Observations are taken and checked as by :meth:`Stream.update` (NaN: missing entries; DataFrames), and
    what cannot be sent raises :class:`MpflowError` naming ``updates[i].observations[j]`` before anything is
    sent."""
    listed = [
        {**u, "observations": steps_json(_steps(u["observations"], None, None), f"updates[{i}].observations")}
        if "observations" in u
        else u
        for i, u in enumerate(updates)
    ]
    return {"updates": listed}, all(u.get("seq") is not None for u in listed)


def _batch_results(answer: dict[str, Any]) -> list[dict[str, Any]]:
    return [{**r, "stream": Posterior(r["stream"])} if r.get("stream") else r for r in answer["results"]]


def _check_batch(batch: int) -> None:
    if batch < 1:
        raise ValueError(f"batch: must be at least 1, got {batch}")


def _forecast_params(steps: int, dt: float | None, samples: int) -> dict[str, Any]:
    return {"steps": steps} | ({"dt": dt} if dt is not None else {}) | ({"samples": samples} if samples else {})


def _limit(limit: int | None) -> dict[str, Any]:
    return {} if limit is None else {"limit": jsonable(limit)}


def _levels(levels: Sequence[float] | None) -> dict[str, Any]:
    """``?levels=0.025,0.975`` of a read (none when None)."""
    return {} if levels is None else {"levels": ",".join(str(float(q)) for q in levels)}


def _import_request(snapshot: bytes, stream_id: str | None, foreign: bool) -> dict[str, Any]:
    """The keywords of an import request: the snapshot verbatim, its media type, the id asked for, and
    ``trust=foreign`` for a snapshot of another deployment."""
    params = {"stream_id": stream_id} if stream_id else {}
    if foreign:
        params["trust"] = "foreign"
    return {"content": snapshot, "headers": {"content-type": SNAPSHOT_TYPE}, "params": params or None}


class _ClientBase:
    """What :class:`Client` and :class:`AsyncClient` share: the httpx client (``_http_class``, with the base URL,
    the bearer key and the timeout), the retry policy and the decision after each attempt of a request."""

    _http_class: ClassVar[type[httpx.Client] | type[httpx.AsyncClient]]

    def __init__(
        self,
        base_url: str = DEFAULT_URL,
        api_key: str | None = None,
        timeout: float | httpx.Timeout = DEFAULT_TIMEOUT,
        *,
        retry: Retry | None = None,
        transport: httpx.BaseTransport | httpx.AsyncBaseTransport | None = None,
        **http_options: Any,
    ):
        self.retry = retry or Retry()
        self._rng = random.Random()
        self.http = self._http_class(
            base_url=base_url, headers=_headers(api_key), timeout=timeout, transport=transport, **http_options
        )

    def _attempts(self, safe: bool) -> int:
        return self.retry.attempts if safe else 1

    @staticmethod
    def _plain(kwargs: dict[str, Any]) -> dict[str, Any]:
        """A request's ``json`` and ``params`` with numpy arrays and scalars as plain JSON values."""
        return {k: jsonable(v) if k in ("json", "params") else v for k, v in kwargs.items()}

    def _backoff(self, failures: int, attempts: int, response: httpx.Response | None) -> float | None:
        """After attempt ``failures`` of ``attempts`` (``response`` None: it raised one of ``RETRYABLE_ERRORS``,
        which the caller re-raises on its last attempt): the seconds to wait before trying again, or None when
        the response is the answer."""
        if response is not None and (response.status_code not in RETRYABLE_STATUS or failures == attempts):
            return None
        return self.retry.delay(failures, response, self._rng)


# ---------------------------------------------------------------------------------------------- sync
class Client(_ClientBase):
    """Synchronous client. ``retry`` is the policy for safe requests (module docstring); ``transport`` (an
    ``httpx.BaseTransport``: tests use it to inject failures) and any other keyword (``verify``, ``limits``,
    ``proxy``, ...) go to ``httpx.Client``."""

    _http_class = httpx.Client
    http: httpx.Client

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the client's connections (``with Client(...) as client:`` closes them on leaving)."""
        self.http.close()

    def request(self, method: str, path: str, *, safe: bool, **kwargs: Any) -> Any:
        """One API call; ``safe`` requests are retried per :attr:`retry`. The decoded JSON answer (None for 204)."""
        attempts, kwargs = self._attempts(safe), self._plain(kwargs)
        for failures in range(1, attempts + 1):
            try:
                response = self.http.request(method, path, **kwargs)
            except RETRYABLE_ERRORS as exc:
                if failures == attempts:
                    raise MpflowError.from_transport(exc, self.http.base_url) from exc
                response = None
            wait = self._backoff(failures, attempts, response)
            if wait is None:
                return _answer(response)
            time.sleep(wait)
        raise AssertionError("unreachable")

    def create_stream(
        self,
        model: dict[str, Any],
        prior: dict[str, Any],
        method: str | None = None,
        num_particles: int | None = None,
        seed: int | None = None,
        stream_id: str | None = None,
        **fields: Any,
    ) -> Stream:
        """``POST /v1/streams``: open a stream of ``model`` (``{"family", "params"}``) with the belief ``prior``
        (e.g. ``{"type": "gaussian", "mean", "cov"}``) and return its :class:`Stream` (the answer kept as its
        ``document``). ``method`` and ``num_particles`` default to the service's choice for the model, ``seed``
        makes its draws reproducible, ``stream_id`` names it (else the server does); other fields of the request
        (``ttl_seconds``, ``operator``, ...) as keywords (docs/API.md). Not retried."""
        body = _create_body(
            model, prior, method=method, num_particles=num_particles, seed=seed, stream_id=stream_id, **fields
        )
        doc = self.request("POST", "/v1/streams", safe=False, json=body)
        return Stream(self, doc["stream_id"], doc)

    def stream(self, stream_id: str) -> Stream:
        """A handle on an existing stream (no request is made)."""
        return Stream(self, stream_id)

    def list_streams(self, limit: int = 100) -> list[dict[str, Any]]:
        """``GET /v1/streams``: every stream of the caller's tenant, one summary dict each (``stream_id``,
        ``step``, ...), read ``limit`` per request (it follows ``next_cursor`` to the end)."""
        out: list[dict[str, Any]] = []
        cursor = None
        while True:
            params = {"limit": limit} | ({"cursor": cursor} if cursor else {})
            page = self.request("GET", "/v1/streams", safe=True, params=params)
            out += page["streams"]
            cursor = page.get("next_cursor")
            if not cursor:
                return out

    def models(self) -> dict[str, Any]:
        """``GET /v1/models``: the catalogue — each model family with its parameters, their defaults, the shape
        of one observation and the methods that serve it (docs/API.md "Catalogue")."""
        return self.request("GET", "/v1/models", safe=True)

    def operators(self) -> list[dict[str, Any]]:
        """``GET /v1/operators``: the trained operators the server loaded, one dict each (``name``, ``family``,
        ``state_dim``, ``version``, held-out ``metrics``, ``auto_select``, ...)."""
        return self.request("GET", "/v1/operators", safe=True)["operators"]

    def batch(self, updates: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
        """``POST /v1/observations:batch`` (:func:`_batch_body`)."""
        body, safe = _batch_body(updates)
        return _batch_results(self.request("POST", "/v1/observations:batch", safe=safe, json=body))

    def import_stream(self, snapshot: bytes, stream_id: str | None = None, *, foreign: bool = False) -> Stream:
        """``POST /v1/streams:import``: recreate an exported stream (``Stream.export()``'s bytes) for this client's
        tenant, under ``stream_id`` or a new id. ``foreign``: the snapshot comes from another deployment (its
        signature is not this one's; it is validated all the same). Not retried (a lost answer's retry would be 409
        ``stream_exists``)."""
        request = _import_request(snapshot, stream_id, foreign)
        doc = self.request("POST", "/v1/streams:import", safe=False, **request)
        return Stream(self, doc["stream_id"], doc)


class _StreamBase:
    """What :class:`Stream` and :class:`AsyncStream` share: the id, its path and the last document seen."""

    def __init__(self, client: Any, stream_id: str, document: dict[str, Any] | None = None):
        self.client = client
        self.stream_id = stream_id
        self.document = None if document is None else Posterior(document)
        self.path = _stream_path(stream_id)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.stream_id!r})"

    def _keep(self, doc: dict[str, Any]) -> Posterior:
        self.document = Posterior(doc)
        return self.document


class Stream(_StreamBase):
    """One stream of a :class:`Client`. ``document`` is the last stream document seen (None until read)."""

    client: Client

    def update(
        self,
        observations: Any,
        seq: int | None = None,
        return_samples: int = 0,
        *,
        dt: float | None = None,
        u: Sequence[float] | None = None,
        columns: Sequence[Any] | None = None,
        per_step_params: bool = False,
        levels: Sequence[float] | None = None,
        per_step_cov: bool = False,
    ) -> Posterior:
        """``POST .../observations``: the stream document (``per_step``, ``duplicate``, ``samples``).
        ``observations`` is a list (or array) of steps (``None`` items: no measurement; NaN or None entries:
        missing entries), a pandas DataFrame (its rows; ``columns`` by name or position; a ``dt`` column gives each
        step's dt) or Series (one step per element); ``update(None)`` is one step without a measurement; with
        ``dt`` (time since the previous step) or ``u`` (inputs) it is one observation:
        ``update([0.3, None], dt=0.5, u=[1.0])``. What cannot be sent (±inf, strings, ...) raises
        :class:`MpflowError` naming the entry before anything is sent. Retried on timeouts, connection errors and
        503 only when ``seq`` is given (module docstring). ``per_step_params``: a stream that learns its parameters
        (``smc2``) gives them in every ``per_step`` entry too, not only in the summary (docs/API.md). ``levels``: the
        quantile levels of the answer's quantiles (default 0.025, 0.05, 0.5, 0.95, 0.975); ``per_step_cov``: each
        ``per_step`` entry carries the state's covariance (``.steps.cov``)."""
        body = update_body(
            _steps(observations, dt, u, columns), seq, return_samples, per_step_params, levels, per_step_cov
        )
        return self._keep(self.client.request("POST", f"{self.path}/observations", safe=seq is not None, json=body))

    def get(self, levels: Sequence[float] | None = None) -> Posterior:
        """``GET /v1/streams/{id}``: the stream document now — the posterior's summary (``mean``, ``std``,
        ``cov``, ``quantiles``, ``ess``, ``log_evidence``) at the stream's latest ``step`` — as a
        :class:`~mpflow.client.results.Posterior`, kept as :attr:`document`. Nothing is changed. ``levels``: the
        quantiles at those levels instead of the defaults (``?levels=``)."""
        return self._keep(self.client.request("GET", self.path, safe=True, params=_levels(levels)))

    def samples(self, n: int = 1000) -> np.ndarray:
        """``n`` draws of the posterior, [n, d]."""
        return np.asarray(
            self.client.request("GET", f"{self.path}/samples", safe=True, params={"n": n})["samples"], np.float64
        )

    def particles(self) -> dict[str, Any]:
        """``{"particles": array [N, d], "log_weights": array [N]}``."""
        return particles_arrays(self.client.request("GET", f"{self.path}/particles", safe=True))

    def delete(self) -> None:
        """``DELETE /v1/streams/{id}``: delete the stream and everything stored for it, its history included;
        :class:`MpflowError` 404 ``stream_not_found`` when there is no such stream. Not retried."""
        self.client.request("DELETE", self.path, safe=False)

    def forecast(self, steps: int, dt: float | None = None, samples: int = 0) -> dict[str, Any]:
        """``GET .../forecast``: the predictive of the state and the observation 1..``steps`` steps of ``dt`` ahead
        (``samples`` draws of each per step); the stream is not changed. The API's answer with each horizon's
        ``state`` and ``observation`` as numpy arrays: ``mean`` [d], ``cov`` [d, d], ``quantiles`` {"0.05": [d],
        ...}, ``samples`` [samples, d]."""
        params = _forecast_params(steps, dt, samples)
        return forecast_arrays(self.client.request("GET", f"{self.path}/forecast", safe=True, params=params))

    def history(self, limit: int | None = None) -> History:
        """``GET .../history``: the latest ``limit`` steps the server keeps (all of them when None) as a
        :class:`~mpflow.client.results.History`, its dimensions named by the stream's ``state_names`` (the stream
        document is read first when this handle has none)."""
        names = (self.document or self.get()).names
        return History(self.client.request("GET", f"{self.path}/history", safe=True, params=_limit(limit)), names)

    def smoothed(self) -> Smoothed:
        """``GET .../smoothed``: p(x_s | o_1..t) for the last ``smoothing_lag`` steps of a stream created with
        ``smoothing_lag=L`` — a :class:`~mpflow.client.results.Smoothed` (``steps, means, covs =
        stream.smoothed()``; ``.to_pandas()``); :class:`MpflowError` 409 ``smoothing_disabled`` without a lag."""
        names = (self.document or self.get()).names
        return Smoothed(self.client.request("GET", f"{self.path}/smoothed", safe=True), names)

    def export(self) -> bytes:
        """``GET .../export``: the stream's snapshot, for :meth:`Client.import_stream`."""
        return self.client.request("GET", f"{self.path}/export", safe=True)

    def socket(self) -> StreamSocket:
        """Updates over the stream's WebSocket, one connection for many: ``with stream.socket() as ws:
        ws.update([[0.3, -1.2]], seq=1)`` (:mod:`mpflow.client.websocket`)."""

        http = self.client.http
        return StreamSocket(socket_url(http.base_url, self.path), _auth_header(http), _read_timeout(http))

    def filter(
        self,
        observations: Iterable[Any],
        batch: int | None = None,
        return_samples: int = 0,
        t0: float = 0.0,
        *,
        columns: Sequence[Any] | None = None,
        per_step_params: bool = False,
    ) -> Any:
        """Send the observations ``batch`` steps per request, each with its ``seq`` (the first one is the stream's
        step + 1, read when the iteration starts), and yield the stream document after each request. ``None`` is a
        step without a measurement; a ``(t, observation)`` tuple is timestamped: its ``dt`` is the time since the
        previous timestamp (``t0``, the time of the stream's current state, before the first). Every step of a
        list or an array is checked before the first request (:class:`MpflowError` naming ``observations[i]``); of
        an iterator, each as it comes. Retries are safe: an applied request whose answer was lost comes back as
        ``duplicate`` (module docstring). ``batch``: 1 by default. A request the server refuses as too large (413
        ``limit_exceeded`` naming ``observations`` and how many steps fit: the cost model's budget,
        MPFLOW_MAX_OBSERVATIONS_PER_REQUEST) is sent again as that many steps, and the rest follow in requests of
        that size; one step that does not fit alone raises the 413.

        A pandas DataFrame (or Series) in, a DataFrame out: its rows are sent as by :meth:`update` (``columns`` by
        name or position, a ``dt`` column, NaN for a missing entry), :data:`FRAME_BATCH` steps per request by
        default (``batch``: at most the server's MPFLOW_MAX_OBSERVATIONS_PER_REQUEST), and the answer is the
        per-step estimates, one row per step (:func:`~mpflow.client.frames.steps_frame`: ``mean_<name>``,
        ``std_<name>``, ``q0.05_<name>`` …, ``log_evidence_increment``, ``ess`` and any other field of the
        ``per_step`` entries: a learned parameter's ``params_<name>_mean`` … with ``per_step_params``, as by
        :meth:`update`)."""
        asked = {"per_step_params": per_step_params}
        if is_table(observations):
            steps = self._filter(observations, batch or FRAME_BATCH, return_samples, t0, columns, **asked)
            return _estimates(list(steps))
        return self._filter(observations, batch or 1, return_samples, t0, columns, **asked)

    def _filter(
        self,
        observations: Any,
        batch: int,
        return_samples: int,
        t0: float,
        columns: Sequence[Any] | None,
        per_step_params: bool = False,
    ) -> Iterator[dict[str, Any]]:
        _check_batch(batch)
        steps = _filter_steps(observations, columns, _Clock(t0))
        seq = int(self.get()["step"]) + 1
        batches = _Batches(batch)
        for chunk in _chunks(steps, batch):
            while chunk:
                part = batches.part(chunk)
                try:
                    answer = self.update(part, seq=seq, return_samples=return_samples, per_step_params=per_step_params)
                except MpflowError as exc:
                    batches.refused(exc, len(part))
                    continue
                yield answer
                seq, chunk = seq + len(part), chunk[len(part) :]


# ---------------------------------------------------------------------------------------------- async
class AsyncClient(_ClientBase):
    """Asynchronous client; the same methods as :class:`Client`, awaited. ``transport`` is an
    ``httpx.AsyncBaseTransport`` (e.g. ``httpx.ASGITransport(app=app)`` to call an app in process); other
    keywords go to ``httpx.AsyncClient``. Many concurrent streams: httpx's pool (``limits``, 100 connections by
    default) scans its connections on every request, so past a few dozen concurrent requests several clients
    (e.g. one per stream, ``limits=httpx.Limits(max_connections=1)``) cost less CPU than one big pool."""

    _http_class = httpx.AsyncClient
    http: httpx.AsyncClient

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the client's connections (``async with AsyncClient(...) as client:`` closes them on leaving)."""
        await self.http.aclose()

    async def request(self, method: str, path: str, *, safe: bool, **kwargs: Any) -> Any:
        """As :meth:`Client.request`."""
        attempts, kwargs = self._attempts(safe), self._plain(kwargs)
        for failures in range(1, attempts + 1):
            try:
                response = await self.http.request(method, path, **kwargs)
            except RETRYABLE_ERRORS as exc:
                if failures == attempts:
                    raise MpflowError.from_transport(exc, self.http.base_url) from exc
                response = None
            wait = self._backoff(failures, attempts, response)
            if wait is None:
                return _answer(response)
            await asyncio.sleep(wait)
        raise AssertionError("unreachable")

    async def create_stream(
        self,
        model: dict[str, Any],
        prior: dict[str, Any],
        method: str | None = None,
        num_particles: int | None = None,
        seed: int | None = None,
        stream_id: str | None = None,
        **fields: Any,
    ) -> AsyncStream:
        """As :meth:`Client.create_stream`."""
        body = _create_body(
            model, prior, method=method, num_particles=num_particles, seed=seed, stream_id=stream_id, **fields
        )
        doc = await self.request("POST", "/v1/streams", safe=False, json=body)
        return AsyncStream(self, doc["stream_id"], doc)

    def stream(self, stream_id: str) -> AsyncStream:
        """A handle on an existing stream (no request is made; not awaited)."""
        return AsyncStream(self, stream_id)

    async def list_streams(self, limit: int = 100) -> list[dict[str, Any]]:
        """As :meth:`Client.list_streams`."""
        out: list[dict[str, Any]] = []
        cursor = None
        while True:
            params = {"limit": limit} | ({"cursor": cursor} if cursor else {})
            page = await self.request("GET", "/v1/streams", safe=True, params=params)
            out += page["streams"]
            cursor = page.get("next_cursor")
            if not cursor:
                return out

    async def models(self) -> dict[str, Any]:
        """As :meth:`Client.models`."""
        return await self.request("GET", "/v1/models", safe=True)

    async def operators(self) -> list[dict[str, Any]]:
        """As :meth:`Client.operators`."""
        return (await self.request("GET", "/v1/operators", safe=True))["operators"]

    async def batch(self, updates: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
        """``POST /v1/observations:batch`` (:func:`_batch_body`)."""
        body, safe = _batch_body(updates)
        return _batch_results(await self.request("POST", "/v1/observations:batch", safe=safe, json=body))

    async def import_stream(
        self, snapshot: bytes, stream_id: str | None = None, *, foreign: bool = False
    ) -> AsyncStream:
        """As :meth:`Client.import_stream`."""
        request = _import_request(snapshot, stream_id, foreign)
        doc = await self.request("POST", "/v1/streams:import", safe=False, **request)
        return AsyncStream(self, doc["stream_id"], doc)


class AsyncStream(_StreamBase):
    """One stream of an :class:`AsyncClient` (see :class:`Stream`)."""

    client: AsyncClient

    async def update(
        self,
        observations: Any,
        seq: int | None = None,
        return_samples: int = 0,
        *,
        dt: float | None = None,
        u: Sequence[float] | None = None,
        columns: Sequence[Any] | None = None,
        per_step_params: bool = False,
        levels: Sequence[float] | None = None,
        per_step_cov: bool = False,
    ) -> Posterior:
        """As :meth:`Stream.update`."""
        body = update_body(
            _steps(observations, dt, u, columns), seq, return_samples, per_step_params, levels, per_step_cov
        )
        doc = await self.client.request("POST", f"{self.path}/observations", safe=seq is not None, json=body)
        return self._keep(doc)

    async def get(self, levels: Sequence[float] | None = None) -> Posterior:
        """As :meth:`Stream.get`."""
        return self._keep(await self.client.request("GET", self.path, safe=True, params=_levels(levels)))

    async def samples(self, n: int = 1000) -> np.ndarray:
        """As :meth:`Stream.samples`."""
        answer = await self.client.request("GET", f"{self.path}/samples", safe=True, params={"n": n})
        return np.asarray(answer["samples"], np.float64)

    async def particles(self) -> dict[str, Any]:
        """As :meth:`Stream.particles`."""
        return particles_arrays(await self.client.request("GET", f"{self.path}/particles", safe=True))

    async def delete(self) -> None:
        """As :meth:`Stream.delete`."""
        await self.client.request("DELETE", self.path, safe=False)

    async def forecast(self, steps: int, dt: float | None = None, samples: int = 0) -> dict[str, Any]:
        """As :meth:`Stream.forecast`."""
        params = _forecast_params(steps, dt, samples)
        return forecast_arrays(await self.client.request("GET", f"{self.path}/forecast", safe=True, params=params))

    async def history(self, limit: int | None = None) -> History:
        """As :meth:`Stream.history`."""
        names = (self.document or await self.get()).names
        answer = await self.client.request("GET", f"{self.path}/history", safe=True, params=_limit(limit))
        return History(answer, names)

    async def smoothed(self) -> Smoothed:
        """As :meth:`Stream.smoothed`."""
        names = (self.document or await self.get()).names
        return Smoothed(await self.client.request("GET", f"{self.path}/smoothed", safe=True), names)

    async def export(self) -> bytes:
        """As :meth:`Stream.export`."""
        return await self.client.request("GET", f"{self.path}/export", safe=True)

    def socket(self) -> AsyncStreamSocket:
        """``async with stream.socket() as ws: await ws.update(...)`` (:mod:`mpflow.client.websocket`)."""

        http = self.client.http
        return AsyncStreamSocket(socket_url(http.base_url, self.path), _auth_header(http), _read_timeout(http))

    def filter(
        self,
        observations: Iterable[Any] | AsyncIterable[Any],
        batch: int | None = None,
        return_samples: int = 0,
        t0: float = 0.0,
        *,
        columns: Sequence[Any] | None = None,
        per_step_params: bool = False,
    ) -> Any:
        """As :meth:`Stream.filter`; ``observations`` may be a sync or an async iterable (``async for answer in
        stream.filter(...)``); a DataFrame's estimates are awaited: ``frame = await stream.filter(df)``."""
        asked = {"per_step_params": per_step_params}
        if is_table(observations):
            return self._estimates(observations, batch or FRAME_BATCH, t0, columns, **asked)
        return self._filter(observations, batch or 1, return_samples, t0, columns, **asked)

    async def _estimates(
        self, frame: Any, batch: int, t0: float, columns: Sequence[Any] | None, per_step_params: bool = False
    ) -> Any:
        steps = self._filter(frame, batch, 0, t0, columns, per_step_params=per_step_params)
        return _estimates([answer async for answer in steps])

    async def _filter(
        self,
        observations: Iterable[Any] | AsyncIterable[Any],
        batch: int,
        return_samples: int,
        t0: float,
        columns: Sequence[Any] | None,
        per_step_params: bool = False,
    ) -> AsyncIterator[dict[str, Any]]:
        _check_batch(batch)
        clock = _Clock(t0)
        if isinstance(observations, AsyncIterable):
            items: Iterable[Any] | AsyncIterable[Any] = _atimed(observations, clock)
        else:
            items = _filter_steps(observations, columns, clock)
        seq = int((await self.get())["step"]) + 1
        batches = _Batches(batch)
        async for chunk in _achunks(items, batch):
            while chunk:
                part = batches.part(chunk)
                try:
                    answer = await self.update(
                        part, seq=seq, return_samples=return_samples, per_step_params=per_step_params
                    )
                except MpflowError as exc:
                    batches.refused(exc, len(part))
                    continue
                yield answer
                seq, chunk = seq + len(part), chunk[len(part) :]


__all__ = [
    "FRAME_BATCH",
    "NO_RETRY",
    "AsyncClient",
    "AsyncStream",
    "Client",
    "MpflowConnectionError",
    "MpflowError",
    "Posterior",
    "Retry",
    "Stream",
]

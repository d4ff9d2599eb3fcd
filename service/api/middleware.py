"""ASGI middleware, outermost first: per-request metrics plus one JSON log line, the auth gate, the body limit.

:class:`AuthGate` refuses a request that needs an API key and carries no valid one (:func:`needs_key`: every
``/v1`` path, and ``/metrics`` when it is not public) from its headers alone, before a byte of its body is read:
the 401 of every route (``{"error": {"code": "unauthorized", ...}}``, ``WWW-Authenticate: Bearer``), sent with
``Connection: close`` when the request announces a body, so that the server drops the connection instead of
reading and discarding that body. Why: a body is buffered before the route runs (below), so before the gate 300
keyless connections each announcing 8 MiB took one worker from 355 MB to 1.3 GB RSS (issue 34, item 2). The
tenant it found goes into ``scope["mpflow.tenant"]``, which the routes' ``Tenant`` dependency reads instead of
comparing the key again.

:class:`BodyLimit` answers 413 before the app runs when ``Content-Length`` exceeds ``max_body_bytes``, and
otherwise reads the body (chunked uploads included) counting bytes, answering 413 as soon as the count
passes the limit, and 408 ``body_timeout`` when the whole body has not arrived within ``read_timeout_s`` of the
first read (a slow-loris holds a worker's memory and a connection for no longer). Both refusals close the
connection. The body is read into one buffer, grown as it arrives (a large one is one mapping that goes back to
the system when it is freed, instead of hundreds of 64 KiB chunks scattered over the heap), and replayed to the
app as one message; after a request with a large body, :class:`~mpflow.service.api.reclaim.Reclaimer` hands its
memory back to the system (what kept 1 GB after the connections closed). A body is held only while its request
runs, and one holds at most ``max_body_bytes``: with *valid* keys, N concurrent uploads may hold up to
N × ``max_body_bytes`` for at most ``read_timeout_s`` (measured in docs/operations.md).

:class:`Observe` times every HTTP request, records ``mpflow_http_requests_total`` /
``mpflow_http_request_duration_seconds`` under the route *template* (``/v1/streams/{stream_id}``, not the raw
path, so label cardinality stays bounded; ``unmatched`` for a request refused before routing — the gate's 401s,
the body limit's 413/408 — or that matched no route) and logs one JSON line on the ``mpflow.access`` logger:
``{"route", "method", "status", "ms", "stream", "step", "tenant"}`` — handlers add ``stream``/``step``/``tenant``
to ``scope["mpflow.log"]``. A request whose client went away before any answer was sent (an aborted upload) is
recorded as 499 (nginx's "client closed request"), not as a 500: the server did nothing wrong. Query strings and
headers (API keys) are never logged.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from mpflow.service.api.auth import Authenticator
from mpflow.service.api.metrics import Metrics
from mpflow.service.api.reclaim import RECLAIM_BODY_BYTES, Reclaimer
from mpflow.service.errors import ApiError, too_large
from mpflow.service.store.quotas import TenantSlots
from starlette.types import ASGIApp, Message, Receive, Scope, Send

access_log = logging.getLogger("mpflow.access")

LOG_KEY = "mpflow.log"
#: the tenant :class:`AuthGate` authenticated, for the routes' ``Tenant`` dependency
TENANT_KEY = "mpflow.tenant"
#: nginx's status for a request whose client closed the connection before it was answered
CLIENT_CLOSED = 499


async def _send_error(send: Send, err: ApiError, close: bool = False) -> None:
    """``err`` as the API's JSON error body; ``close``: ask the server to drop the connection after it."""
    payload = json.dumps(err.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in err.headers.items()]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key == name:
            return value.decode("latin-1")
    return None


def _has_body(scope: Scope) -> bool:
    """Whether the request announces a body (a ``Content-Length`` above 0, or a chunked one)."""
    length = _header(scope, b"content-length")
    return _header(scope, b"transfer-encoding") is not None or (length is not None and length.strip() not in ("", "0"))


def needs_key(path: str, metrics_public: bool) -> bool:
    """Whether a request to ``path`` needs an API key when auth is on: all of ``/v1`` (a path there that names no
    route too: which routes exist is not told without a key), and ``/metrics`` unless it is public. The rest —
    ``/healthz``, ``/readyz``, the OpenAPI documents, the dashboard's pages and files — needs none."""
    return path == "/v1" or path.startswith("/v1/") or (path == "/metrics" and not metrics_public)


class AuthGate:
    """Refuse an HTTP request that needs a key and has no valid one, from its headers (module docstring)."""

    def __init__(self, app: ASGIApp, auth: Authenticator, metrics_public: bool = True):
        self.app = app
        self.auth = auth
        self.metrics_public = metrics_public

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.auth.open or not needs_key(scope["path"], self.metrics_public):
            await self.app(scope, receive, send)
            return
        try:
            tenant = self.auth.tenant(_header(scope, b"authorization"))
        except ApiError as err:
            await _send_error(send, err, close=_has_body(scope))  # a body left unread: drop the connection
            return
        scope[TENANT_KEY] = tenant
        info = scope.get(LOG_KEY)
        if info is not None:
            info["tenant"] = tenant
        await self.app(scope, receive, send)


class BodyLimit:
    """The body limit, the read deadline and the body bytes in flight (module docstring)."""

    def __init__(
        self, app: ASGIApp, max_body_bytes: int, read_timeout_s: float = 20.0, max_in_flight: int = 256 * 1024 * 1024
    ):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.read_timeout_s = read_timeout_s
        self.in_flight = TenantSlots(
            "request body bytes in flight",
            max(1, max_in_flight // 2),
            max_in_flight,
            "MPFLOW_MAX_BODY_BYTES_IN_FLIGHT / 2",
        )
        self._busy = ApiError(
            503,
            "server_busy",
            f"body: this server already holds {max_in_flight} bytes of request bodies "
            "(MPFLOW_MAX_BODY_BYTES_IN_FLIGHT); retry later (or use another replica)",
            {"Retry-After": "1"},
        )
        self.reclaimer = Reclaimer()

    def _too_large(self) -> ApiError:
        return too_large(f"body: larger than the limit of {self.max_body_bytes} bytes (MPFLOW_MAX_BODY_BYTES)")

    def _too_slow(self) -> ApiError:
        return ApiError(
            408,
            "body_timeout",
            f"body: not received within {self.read_timeout_s:g} s (MPFLOW_BODY_READ_TIMEOUT_S); send it faster",
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        try:
            length = int(declared) if declared is not None else None
        except ValueError:
            length = None
        if length is not None and length > self.max_body_bytes:
            await _send_error(send, self._too_large(), close=True)
            return
        body = bytearray()
        tenant = scope.get(TENANT_KEY)
        try:
            await self._answer(scope, receive, send, body, tenant)
        finally:
            if body:
                self.in_flight.give(tenant, len(body))
            if len(body) >= RECLAIM_BODY_BYTES:
                self.reclaimer.soon()

    async def _answer(self, scope: Scope, receive: Receive, send: Send, body: bytearray, tenant: str | None) -> None:
        """Read the body into ``body`` within the deadline, then run the app on it (or refuse it)."""
        try:
            async with asyncio.timeout(self.read_timeout_s):
                outcome = await self._read(receive, body, tenant)
        except TimeoutError:
            await _send_error(send, self._too_slow(), close=True)
            return
        if outcome is not None:
            if isinstance(outcome, ApiError):
                await _send_error(send, outcome, close=True)
            return  # else the client went away mid-body: nothing to answer
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _read(self, receive: Receive, body: bytearray, tenant: str | None) -> ApiError | str | None:
        """Append the whole body to ``body``, each piece counted in :attr:`in_flight` (given back by the caller):
        ``None`` once it is all there, ``"gone"`` when the client disconnected, an :class:`ApiError` when it
        passes the limit or the bytes in flight."""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return "gone"
            piece = message.get("body", b"")
            if len(body) + len(piece) > self.max_body_bytes:
                return self._too_large()
            if piece:
                try:
                    self.in_flight.take(tenant, self._busy, len(piece))
                except ApiError as err:
                    return err
                body += piece
            if not message.get("more_body", False):
                return None


class Observe:
    def __init__(self, app: ASGIApp, metrics: Metrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = 500 if scope["type"] == "http" else 101
        answered = client_gone = False
        info: dict[str, Any] = {}
        scope[LOG_KEY] = info

        async def receive_wrapper() -> Message:
            nonlocal client_gone
            message = await receive()
            if message["type"] == "http.disconnect":
                client_gone = True
            return message

        async def send_wrapper(message: Message) -> None:
            nonlocal status, answered
            if message["type"] == "http.response.start":
                status, answered = message["status"], True
            elif message["type"] == "websocket.close" and status == 101:
                status = 1000 if message.get("code") is None else message["code"]
            await send(message)

        try:
            await self.app(scope, receive_wrapper if scope["type"] == "http" else receive, send_wrapper)
        finally:
            if client_gone and not answered:
                status = CLIENT_CLOSED
            seconds = time.perf_counter() - t0
            route_obj = scope.get("route")
            route = getattr(route_obj, "path", None) or "unmatched"
            method = scope.get("method", "WS")
            if scope["type"] == "http":
                self.metrics.observe_request(route, method, status, seconds)
            line = {"route": route, "method": method, "status": status, "ms": round(seconds * 1000, 2)}
            line.update({k: v for k, v in info.items() if v is not None})
            access_log.info(json.dumps(line, separators=(",", ":")))


__all__ = ["CLIENT_CLOSED", "LOG_KEY", "TENANT_KEY", "AuthGate", "BodyLimit", "Observe", "needs_key"]

"""What a connection may hold of a server process before it has sent a request: a deadline and a size for each
request head, a cap on open connections, and the API's JSON error body for what uvicorn answers itself (issue 54).

uvicorn's HTTP protocol (httptools) keeps a connection for as long as its client sends a byte now and then: its one
timer, ``timeout_keep_alive``, runs only between requests and the next request's first byte cancels it, and a new
connection has none at all. Measured against ``python -m mpflow serve --workers 1``: 800 keyless connections, each
sending a header line every 2 s, were all still open after 30 s (10 silent ones after 15 s too), each an open file
and a parser of the worker; nor did anything bound a head's size (a 200 KB header was read and answered 200).
:class:`GuardedHttpToolsProtocol` is the ``http=`` protocol ``mpflow serve`` gives uvicorn:

* **head deadline**: a connection that has not delivered a complete request head (request line and headers)
  within ``MPFLOW_HEADER_TIMEOUT_S`` of connecting, or of its previous response on keep-alive, is answered 408
  ``header_timeout`` and closed (closed without an answer when nothing of a head came: an idle connection). The
  timer runs only while a head is awaited: a request being processed, its body (``MPFLOW_BODY_READ_TIMEOUT_S``, the
  body limit's) and a WebSocket are not bound by it.
* **head size**: a head of more than :data:`MAX_HEAD_BYTES` is answered 431 ``header_too_large`` and closed.
* **connection cap**: a connection that finds ``MPFLOW_MAX_CONNECTIONS`` open on its process (HTTP and WebSocket
  together) is answered 503 ``too_many_connections`` (``Retry-After: 1``) at once, before any of its bytes is
  parsed, and closed: its sending side at once, the socket once the client closes or :data:`LINGER_S` has passed
  (its request, read and dropped meanwhile, would otherwise make the kernel reset the connection and lose the
  answer). The cap is lowered to fit the process's open-file limit, which :func:`connection_cap` raises first.
* **JSON errors**: the parser's own 400 for a malformed or over-long request line or header (uvicorn's
  ``text/plain`` "Invalid HTTP request received.") is the API's error body, 400 ``bad_request``.

The limits are read from the environment (:class:`~mpflow.service.settings.Settings`) once per process: uvicorn
builds one protocol per connection from its class alone, and pickles that class by name for its worker processes.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from http import HTTPStatus

from mpflow.service.errors import error_body
from mpflow.service.settings import Settings
from mpflow.service.throttled_log import ThrottledLog
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

try:
    import resource
except ImportError:  # not on POSIX
    resource = None  # type: ignore[assignment]

log = logging.getLogger("mpflow.connections")
_warn = ThrottledLog(log, 10.0)

#: the largest request head (request line and headers) read, in bytes: far above any real client's (nginx's
#: default is 32 KiB), so that a head cannot grow a connection's memory for as long as its deadline lets it
MAX_HEAD_BYTES = 64 * 1024
#: seconds a refused connection is kept half-closed after its 503, reading and dropping its request
LINGER_S = 1.0
#: open files kept for everything else a process has open: Redis connections, the listening socket, logs, libraries
RESERVED_FDS = 256


@dataclass(frozen=True)
class Limits:
    header_timeout_s: float
    max_connections: int


@functools.cache
def limits() -> Limits:
    """This process's limits, from the environment (read once)."""
    settings = Settings()
    return Limits(settings.header_timeout_s, connection_cap(settings.max_connections))


def connection_cap(configured: int) -> int:
    """``configured``, or fewer where the process's open-file limit would not hold them besides
    :data:`RESERVED_FDS` (its soft limit is raised to its hard limit first, as far as needed; a cap lowered is
    logged): past the limit ``accept`` fails and the connection waits unanswered in the backlog instead of
    getting its 503."""
    if resource is None:
        return configured
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = configured + RESERVED_FDS
    if soft != resource.RLIM_INFINITY and soft < wanted:
        raised = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return configured
    cap = max(1, soft - RESERVED_FDS)
    log.warning("MPFLOW_MAX_CONNECTIONS=%d lowered to %d: the open-file limit is %d", configured, cap, soft)
    return cap


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the head deadline, the head size, the connection cap and JSON errors of
    the module's docstring."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.limits = limits()
        self._refused = False
        self._head_timer: asyncio.TimerHandle | None = None
        self._in_head = False  # the parser has begun a request head and not finished it
        self._head_bytes = 0

    # -- the connection cap
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.limits.max_connections:
            self._refuse(transport)
            return
        super().connection_made(transport)
        self._await_head()

    def _refuse(self, transport: asyncio.Transport) -> None:
        self._refused, self.transport = True, transport
        cap = self.limits.max_connections
        _warn.warning("cap", "connection refused: %d connections open on this process (MPFLOW_MAX_CONNECTIONS)", cap)
        message = f"connections: this process holds its maximum of {cap} open connections; retry later"
        self._answer(503, "too_many_connections", message, [(b"retry-after", b"1")])
        if transport.can_write_eof():
            transport.write_eof()
        self._head_timer = self.loop.call_later(LINGER_S, transport.close)

    # -- the head deadline and size
    def _await_head(self) -> None:
        self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_late)

    def _head_arrived(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_late(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        if self._in_head:
            timeout = self.limits.header_timeout_s
            message = (
                f"request head: not received within {timeout:g} s (MPFLOW_HEADER_TIMEOUT_S); send the request line "
                "and headers at once"
            )
            self._answer(408, "header_timeout", message)
        self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # read and dropped until the linger ends
        super().data_received(data)
        if self._in_head and not self.transport.is_closing():
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                message = f"request head: at most {MAX_HEAD_BYTES} bytes of request line and headers"
                self._answer(431, "header_too_large", message)
                self.transport.close()

    def on_message_begin(self) -> None:
        self._in_head, self._head_bytes = True, 0
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head_arrived()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        pipelined = bool(self.pipeline)  # a queued request's head has arrived already
        super().on_response_complete()
        if not pipelined and not self.transport.is_closing():
            self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_arrived()
        if not self._refused:
            super().connection_lost(exc)

    # -- the API's error body for what the parser refuses
    def send_400_response(self, msg: str) -> None:
        message = "request: not valid HTTP/1.1 (a malformed or too long request line or header)"
        self._answer(400, "bad_request", message)
        self.transport.close()

    def _answer(self, status: int, code: str, message: str, headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
        """Write ``status`` with the API's JSON error body and ``Connection: close`` (the caller closes)."""
        body = json.dumps(error_body(code, message)).encode()
        lines = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}".encode()]
        lines += [name + b": " + value for name, value in (*self.server_state.default_headers, *headers)]
        lines += [b"content-type: application/json", b"content-length: %d" % len(body), b"connection: close"]
        self.transport.write(b"\r\n".join(lines) + b"\r\n\r\n" + body)


__all__ = ["LINGER_S", "MAX_HEAD_BYTES", "GuardedHttpToolsProtocol", "Limits", "connection_cap", "limits"]

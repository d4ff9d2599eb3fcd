"""Observations over the stream WebSocket ``WS /v1/streams/{id}/ws`` (docs/API.md), for the Python client:
:class:`StreamSocket` (``with stream.socket() as ws: ws.update(...)``) and :class:`AsyncStreamSocket`
(``async with stream.socket() as ws: await ws.update(...)``), on the ``websockets`` package.

One connection carries many updates: each frame ``{"seq", "observations", "return_samples"}`` is answered, in
order, with the document of ``POST .../observations`` (returned as a
:class:`~mpflow.client.results.Posterior`) or an error frame ``{"error": {...}, "status": s}`` (raised as
:class:`~mpflow.client.errors.MpflowError` with that status). A refused handshake (401) raises it too, and a
server that cannot be reached :class:`~mpflow.client.errors.MpflowConnectionError`. Nothing is retried: a
socket that failed is closed; open a new one and resend with the same ``seq`` (a duplicate answers as such).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Sequence
from typing import Any

import httpx
from websockets.asyncio.client import ClientConnection as AsyncConnection
from websockets.asyncio.client import connect as aconnect
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import ClientConnection, connect

from mpflow.client.errors import MpflowConnectionError, MpflowError
from mpflow.client.observations import update_body
from mpflow.client.results import Posterior, jsonable


def socket_url(base_url: httpx.URL, path: str) -> str:
    """The WebSocket URL of a stream path on the client's base URL (http → ws, https → wss)."""
    scheme = "wss" if base_url.scheme == "https" else "ws"
    return str(base_url.copy_with(scheme=scheme, path=base_url.path.rstrip("/") + path + "/ws"))


def _refused(exc: InvalidStatus) -> MpflowError:
    """A handshake the server answered with an HTTP error (e.g. 401): its status and error body."""
    r = exc.response
    return MpflowError.from_response(httpx.Response(r.status_code, content=r.body or b"", headers=dict(r.headers)))


def _frame(observations: Sequence[Any], seq: int | None, return_samples: int) -> str:
    return json.dumps(jsonable(update_body(observations, seq, return_samples)))


def _read(raw: str | bytes) -> Posterior:
    answer = json.loads(raw)
    err = answer.get("error")
    if isinstance(err, dict):
        raise MpflowError(answer.get("status"), str(err.get("code")), str(err.get("message")))
    return Posterior(answer)


class StreamSocket:
    """A WebSocket to one stream (module docstring); a context manager that closes it."""

    def __init__(self, url: str, headers: dict[str, str], timeout: float):
        self.url, self.timeout = url, timeout
        try:
            self.connection: ClientConnection = connect(url, additional_headers=headers, open_timeout=timeout)
            self.connection.__enter__()  # this object is the context manager; close() exits the connection's
        except InvalidStatus as exc:
            raise _refused(exc) from exc
        except (OSError, TimeoutError) as exc:
            raise MpflowConnectionError(None, "connection_failed", f"no WebSocket at {url}: {exc}") from exc

    def update(self, observations: Sequence[Any], seq: int | None = None, return_samples: int = 0) -> Posterior:
        """Send one frame and wait for its answer (the document of ``POST .../observations``)."""
        with contextlib.suppress(ConnectionClosed):  # closed after an error frame (unknown stream): read it below
            self.connection.send(_frame(observations, seq, return_samples))
        try:
            return _read(self.connection.recv(timeout=self.timeout))
        except (ConnectionClosed, TimeoutError) as exc:
            raise MpflowConnectionError(None, "connection_failed", f"the WebSocket {self.url} ended: {exc}") from exc

    def close(self) -> None:
        """Close the WebSocket (``with stream.socket() as ws:`` closes it on leaving)."""
        self.connection.__exit__(None, None, None)

    def __enter__(self) -> StreamSocket:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncStreamSocket:
    """The asynchronous twin of :class:`StreamSocket`: ``async with stream.socket() as ws``."""

    def __init__(self, url: str, headers: dict[str, str], timeout: float):
        self.url, self.timeout = url, timeout
        self._connect = aconnect(url, additional_headers=headers, open_timeout=timeout)
        self.connection: AsyncConnection | None = None

    async def __aenter__(self) -> AsyncStreamSocket:
        try:
            self.connection = await self._connect.__aenter__()
        except InvalidStatus as exc:
            raise _refused(exc) from exc
        except (OSError, TimeoutError) as exc:
            raise MpflowConnectionError(None, "connection_failed", f"no WebSocket at {self.url}: {exc}") from exc
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.connection is not None:
            await self._connect.__aexit__(None, None, None)

    async def update(self, observations: Sequence[Any], seq: int | None = None, return_samples: int = 0) -> Posterior:
        """As :meth:`StreamSocket.update`."""
        assert self.connection is not None, "use `async with stream.socket() as ws`"
        with contextlib.suppress(ConnectionClosed):  # closed after an error frame: read it below
            await self.connection.send(_frame(observations, seq, return_samples))
        try:
            return _read(await asyncio.wait_for(self.connection.recv(), self.timeout))
        except (ConnectionClosed, TimeoutError) as exc:
            raise MpflowConnectionError(None, "connection_failed", f"the WebSocket {self.url} ended: {exc}") from exc


__all__ = ["AsyncStreamSocket", "StreamSocket", "socket_url"]

"""ASGI middleware: the request body limit, and per-request metrics plus one JSON log line.

:class:`BodyLimit` answers 413 before the app runs when ``Content-Length`` exceeds ``max_body_bytes``, and
otherwise reads the body (chunked uploads included) counting bytes, answering 413 as soon as the count
passes the limit; a body within the limit is replayed to the app unchanged.

:class:`Observe` times every HTTP request, records ``mpflow_http_requests_total`` /
``mpflow_http_request_duration_seconds`` under the route *template* (``/v1/streams/{stream_id}``, not the raw
path, so label cardinality stays bounded) and logs one JSON line on the ``mpflow.access`` logger:
``{"route", "method", "status", "ms", "stream", "step", "tenant"}`` — handlers add ``stream``/``step``/``tenant``
to ``scope["mpflow.log"]``. Query strings and headers (API keys) are never logged.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from mpflow.service.errors import too_large
from mpflow.service.metrics import Metrics
from starlette.types import ASGIApp, Message, Receive, Scope, Send

access_log = logging.getLogger("mpflow.access")

LOG_KEY = "mpflow.log"


async def _send_error(send: Send, status: int, body: dict[str, Any]) -> None:
    payload = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": payload})


class BodyLimit:
    def __init__(self, app: ASGIApp, max_body_bytes: int):
        self.app = app
        self.max_body_bytes = max_body_bytes

    def _too_large(self) -> tuple[int, dict[str, Any]]:
        err = too_large(f"body: larger than the limit of {self.max_body_bytes} bytes (MPFLOW_MAX_BODY_BYTES)")
        return err.status, err.body()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = -1
                if declared > self.max_body_bytes:
                    await _send_error(send, *self._too_large())
                    return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_body_bytes:
                await _send_error(send, *self._too_large())
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


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
        info: dict[str, Any] = {}
        scope[LOG_KEY] = info

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "websocket.close" and status == 101:
                status = 1000 if message.get("code") is None else message["code"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            seconds = time.perf_counter() - t0
            route_obj = scope.get("route")
            route = getattr(route_obj, "path", None) or "unmatched"
            method = scope.get("method", "WS")
            if scope["type"] == "http":
                self.metrics.observe_request(route, method, status, seconds)
            line = {"route": route, "method": method, "status": status, "ms": round(seconds * 1000, 2)}
            line.update({k: v for k, v in info.items() if v is not None})
            access_log.info(json.dumps(line, separators=(",", ":")))


__all__ = ["LOG_KEY", "BodyLimit", "Observe"]

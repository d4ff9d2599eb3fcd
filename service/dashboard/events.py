"""``GET /v1/streams/{stream_id}/events``: a Server-Sent-Events feed of one stream's updates.

The feed authenticates like every ``/v1`` route (``Authorization: Bearer <key>``; the dashboard sends it with
``fetch``, so the key never appears in a URL or a log) and answers 404 for an unknown stream or one of another
tenant. It subscribes to the stream's channel (:mod:`mpflow.service.streams.publish`) *before* it reads the stream,
so no update falls in between, and then sends::

    event: stream        the stream document (as GET /v1/streams/{id}) at the moment of subscribing
    event: update        {"stream_id", "step", "updated_at", "method", "summary", "per_step"} per applied update
    event: error         {"error": {...}} when the store stops answering (the feed then ends)
    : keep-alive         a comment every KEEPALIVE_SECONDS without updates

Each feed holds one Redis connection for its subscription (on a Redis Cluster an ``SSUBSCRIBE`` on the primary of
the stream's slot, moved by redis-py when the slot moves: :class:`mpflow.service.store.redis_conn.Subscription`), from a
pool of its own (:class:`Feeds`, opened by the
app's lifespan) so that viewers can never take the connections the API's reads and writes need; at most
``MAX_FEEDS`` feeds per process, beyond which a feed is refused with 503 ``too_many_feeds`` and ``Retry-After``,
and at most ``MPFLOW_MAX_FEEDS_PER_TENANT`` of them for one tenant, beyond which that tenant's feeds are refused
with 429 ``quota_exceeded`` and ``Retry-After`` (so one tenant holding its feeds blocks no one else's).
A feed ends after ``MAX_FEED_SECONDS`` and the client reconnects: uvicorn waits for open responses before it
shuts down, so an endless feed would hold a stopping server (``mpflow serve`` stops within that time). Updates
applied while no feed is open are not replayed; the first event of the next feed is the current document, so a
client sees at most a gap. A client that gets an ``update`` whose ``step`` it already has (an older event,
delivered late) ignores it.

``/openapi.json`` documents the route (``text/event-stream``, each event's data in ``x-sse-events``, checked against
real frames by tests/integration/test_api_contract.py); the schema fuzzers leave it out
(:data:`NOT_FUZZED`): they read each answer to its end, and a live feed has none for ``MAX_FEED_SECONDS``.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any

import anyio
from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse
from mpflow.service.api.deps import Log, Streams, Tenant
from mpflow.service.api.responses import error_responses
from mpflow.service.errors import ApiError, unavailable
from mpflow.service.store.quotas import TenantSlots
from mpflow.service.store.redis_conn import Subscription
from mpflow.service.store.stream_store import StoreUnavailable, StreamStore
from mpflow.service.streams.publish import channel
from redis import exceptions as rexc
from starlette.requests import HTTPConnection

KEEPALIVE_SECONDS = 15.0
MAX_FEEDS = 64  # live feeds per process, each with its own subscription connection
MAX_FEED_SECONDS = 20.0  # a stopping server waits at most this long (Kubernetes' default grace is 30 s)
_POLL_SECONDS = 1.0  # how often a quiet feed checks for a disconnected client and the keep-alive
_STORE_DOWN = (rexc.ConnectionError, rexc.TimeoutError, OSError, StoreUnavailable)

router = APIRouter()


class Feeds:
    """The live feeds of one process: a Redis connection pool of their own (``MAX_FEEDS`` connections) and the
    open feeds, per tenant (:class:`~mpflow.service.store.quotas.TenantSlots`: at most ``per_tenant`` each, so that one
    tenant cannot hold every feed of the process). ``cluster``: the store's mode when known (``None``: asked, as
    :meth:`StreamStore.from_url`)."""

    def __init__(self, url: str, max_feeds: int = MAX_FEEDS, cluster: bool | None = None, per_tenant: int = 16):
        self.store = StreamStore.from_url(url, max_connections=max_feeds, cluster=cluster)
        self.slots = TenantSlots("live feeds", per_tenant, max_feeds, "MPFLOW_MAX_FEEDS_PER_TENANT")

    @property
    def max_feeds(self) -> int:
        return self.slots.per_process

    @max_feeds.setter
    def max_feeds(self, value: int) -> None:
        self.slots.per_process = value

    @property
    def open(self) -> int:
        return self.slots.total

    def take(self, tenant: str) -> None:
        """Count one more feed of ``tenant``: 429 at its quota, 503 ``too_many_feeds`` when the process is full."""
        full = ApiError(
            503,
            "too_many_feeds",
            f"this server already streams {self.max_feeds} live feeds; retry later (or use another replica)",
            {"Retry-After": "5"},
        )
        self.slots.take(tenant, full)

    async def aclose(self) -> None:
        await self.store.aclose()


async def _close(subscription: Subscription | None, feeds: Feeds, tenant: str) -> None:
    """Unsubscribe and return the connection to the pool, even when the feed's task is being cancelled (a
    client that went away): a cancelled close would lose the pool's slot for good."""
    if subscription is not None:
        with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
            await subscription.aclose()
    feeds.slots.give(tenant)


def _sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


#: the path pattern of this route, for schema fuzzers to skip (a feed answers for MAX_FEED_SECONDS)
NOT_FUZZED = r"/events$"
_EVENTS_DOC = (
    "`text/event-stream`: `event: stream` (the stream document now), then `event: update` per applied update "
    '(`{"stream_id", "step", "updated_at", "method", "summary", "per_step"}`), `event: error` if the store stops '
    f"answering, `: keep-alive` comments; the feed ends after {MAX_FEED_SECONDS:.0f} s — reconnect."
)

_COMPONENT = "#/components/schemas/"
#: the media type of a feed: the body is text (``event: <name>`` and ``data: <JSON>`` lines, a blank line after each
#: event); ``x-sse-events`` gives each event's name and the schema of its ``data`` (OpenAPI 3.1 has no keyword for
#: the items of a stream of events; 3.2's ``itemSchema`` is the same idea)
_EVENTS_MEDIA = {
    "schema": {
        "type": "string",
        "description": "Server-Sent Events: per event an `event: <name>` line, a `data: <JSON>` line and a blank line; "
        "`: keep-alive` comment lines between them. The data of each event name: `x-sse-events`",
    },
    "x-sse-events": {
        "stream": {"$ref": _COMPONENT + "StreamDocument"},
        "update": {
            "type": "object",
            "properties": {
                "stream_id": {"type": "string"},
                "step": {"type": "integer"},
                "updated_at": {"type": "string"},
                "method": {"type": "string"},
                "summary": {  # the stream document's summary (Summary) but its d × d cov (events stay small)
                    "type": "object",
                    "properties": {
                        "mean": {"type": "array", "items": {"type": "number"}},
                        "std": {"type": "array", "items": {"type": "number"}},
                        "quantiles": {"$ref": _COMPONENT + "Quantiles"},
                        "ess": {"type": ["number", "null"]},
                        "log_evidence": {"type": "number"},
                    },
                    "required": ["mean", "std", "quantiles", "ess", "log_evidence"],
                    "not": {"required": ["cov"]},
                },
                "per_step": {"type": "array", "items": {"$ref": _COMPONENT + "StepSummary"}},
            },
            "required": ["stream_id", "step", "updated_at", "method", "summary", "per_step"],
        },
        "error": {"$ref": _COMPONENT + "ErrorResponse"},
    },
}


async def live_feeds(conn: HTTPConnection) -> Feeds:
    """The app's :class:`Feeds` (built by the lifespan), as a dependency."""
    return conn.app.state.feeds


LiveFeeds = Annotated[Feeds, Depends(live_feeds)]


@router.get(
    "/v1/streams/{stream_id}/events",
    summary="Live updates of a stream (Server-Sent Events)",
    response_class=StreamingResponse,
    responses={
        200: {"description": _EVENTS_DOC, "content": {"text/event-stream": _EVENTS_MEDIA}},
        **error_responses(401, 404, 422, 429, 503),
    },
)
async def stream_events(
    request: Request, stream_id: str, tenant: Tenant, service: Streams, feeds: LiveFeeds, log: Log
) -> StreamingResponse:
    """Follow a stream live: the stream document now, then one event per applied update (the dashboard's
    feed). The feed ends after a while; reconnect to go on."""
    log.add(stream=stream_id)
    feeds.take(tenant)  # 429 at the tenant's quota, 503 when the process streams MAX_FEEDS
    subscription: Subscription | None = None
    try:
        subscription = await feeds.store.subscription(channel(service.store.prefix, tenant, stream_id))
        first = await service.get(tenant, stream_id)  # 404 for an unknown stream or one of another tenant
    except _STORE_DOWN as exc:
        await _close(subscription, feeds, tenant)
        raise StoreUnavailable(f"live feed: {exc}") from exc  # 503 with Retry-After, counted as a store error
    except BaseException:
        await _close(subscription, feeds, tenant)
        raise

    async def feed() -> AsyncIterator[bytes]:
        try:
            yield _sse("stream", first)
            started = last_sent = time.monotonic()
            while time.monotonic() - started < MAX_FEED_SECONDS:
                message = await subscription.next_message(timeout=_POLL_SECONDS)
                if message is not None:
                    last_sent = time.monotonic()
                    yield b"event: update\ndata: " + message + b"\n\n"
                elif time.monotonic() - last_sent >= KEEPALIVE_SECONDS:
                    last_sent = time.monotonic()
                    yield b": keep-alive\n\n"
                if await request.is_disconnected():
                    return
        except _STORE_DOWN:
            yield _sse("error", unavailable().body())
        finally:
            await _close(subscription, feeds, tenant)

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(feed(), media_type="text/event-stream", headers=headers)


__all__ = ["KEEPALIVE_SECONDS", "MAX_FEEDS", "MAX_FEED_SECONDS", "Feeds", "router"]

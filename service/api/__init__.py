"""The HTTP surface of docs/API.md, one router per resource:

* :mod:`.streams` — create, list, read and delete streams;
* :mod:`.observations` — observations for one stream (exactly once by ``seq``) or many (``:batch``);
* :mod:`.websocket` — the same observations over a WebSocket;
* :mod:`.reads` — samples, particles, forecasts, smoothed estimates and history: reads that never change a stream;
* :mod:`.snapshots` — export and import;
* :mod:`.catalogue` — the model families, methods and operators this server runs;
* :mod:`.health` — liveness, readiness and the Prometheus metrics;
* :mod:`.docs` — the ReDoc page (Swagger UI is FastAPI's own).

:mod:`.deps` gives the handlers what they need (``Annotated`` dependencies: the stream service, the store, the
settings, the tenant); :mod:`.responses` the error answers they declare. Around them: :mod:`.middleware` (access
log and metrics, the auth gate of :mod:`.auth`, the body limit and :mod:`.reclaim`), :mod:`.json_stream` (large
answers encoded in chunks) and :mod:`.metrics`. Handlers call
:class:`~mpflow.service.streams.service.StreamService` and nothing below it; the dashboard's routes live in
:mod:`mpflow.service.dashboard`.
"""

from __future__ import annotations

from fastapi import APIRouter
from mpflow.service.api import catalogue, health, observations, reads, snapshots, streams, websocket

#: the routers ``create_app`` includes, in this order (the order of ``/openapi.json``'s paths)
ROUTERS: tuple[APIRouter, ...] = (
    streams.router,
    observations.router,
    reads.router,
    snapshots.router,
    catalogue.router,
    websocket.router,
    health.router,
)

__all__ = ["ROUTERS"]

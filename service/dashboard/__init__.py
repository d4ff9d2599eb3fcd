"""The dashboard: live posteriors in the browser, served by the service itself.

* :mod:`.pages` — the page (``GET /``, ``GET /streams/{id}``) and its script and style (``static/``; plain
  canvas, no build step, no CDN);
* :mod:`.events` — ``GET /v1/streams/{id}/events``, a Server-Sent-Events feed of a stream's updates; the other end
  of that feed, updates published through Redis as they are stored, is the stream service's
  (:mod:`mpflow.service.streams.publish`).

:data:`router` holds both; ``create_app`` includes it. Nothing below the HTTP layer imports the dashboard, and the
API's routers do not either (the layering contract of pyproject.toml).
"""

from __future__ import annotations

from fastapi import APIRouter
from mpflow.service.dashboard import events, pages

router = APIRouter()
router.include_router(pages.router)
router.include_router(events.router)

__all__ = ["router"]

"""The routes take what they need as injected dependencies (``service/api/deps.py``), never from ``app.state``:
no route handler's code reads ``app.state``, and a dependency swapped with ``app.dependency_overrides`` is what the
handler sees (real app, real Redis)."""

from __future__ import annotations

import asyncio
import inspect
import os
import uuid

from fastapi.routing import APIRoute, APIWebSocketRoute
from mpflow.service.api import deps
from mpflow.service.app import create_app
from mpflow.service.settings import Settings

from tests.harness.server import drop_prefix, serve_in_process

REDIS = os.environ.get("MPFLOW_REDIS_URL") or "redis://127.0.0.1:6379/0"


def endpoints(routes: list) -> list:
    """The handlers of ``routes``, through included routers (FastAPI keeps an included router whole, as
    ``original_router``)."""
    found = []
    for r in routes:
        if isinstance(r, APIRoute | APIWebSocketRoute):
            found.append(r.endpoint)
        elif hasattr(r, "original_router"):
            found += endpoints(r.original_router.routes)
        elif hasattr(r, "routes") and not hasattr(r, "app"):
            found += endpoints(r.routes)
    return found


def test_no_route_handler_reads_app_state() -> None:
    app = create_app(Settings())
    handlers = [h for h in endpoints(app.routes) if h.__module__.startswith("mpflow.")]
    assert len(handlers) >= 20  # every route of docs/API.md, the WebSocket and the dashboard's
    readers = [f"{h.__module__}.{h.__name__}" for h in handlers if "app.state" in inspect.getsource(h)]
    assert readers == [], readers


def test_a_swapped_dependency_is_what_the_handler_sees() -> None:
    """``GET /v1/models`` reads the settings' ``max_state_dim`` through :data:`deps.AppSettings`: overriding the
    provider changes the answer, while the app's own settings stay as they were."""
    prefix = f"mpflowtest-{uuid.uuid4().hex}"

    async def run() -> tuple[dict, dict, int]:
        settings = Settings(redis_url=REDIS, redis_prefix=prefix)
        try:
            async with serve_in_process(settings) as (app, client):
                plain = (await client.get("/v1/models")).json()
                small = Settings(redis_url=REDIS, redis_prefix=prefix, max_state_dim=3)

                async def small_settings() -> Settings:
                    return small

                app.dependency_overrides[deps.settings] = small_settings
                swapped = (await client.get("/v1/models")).json()
                return plain, swapped, app.state.settings.max_state_dim
        finally:
            await drop_prefix(REDIS, prefix)

    plain, swapped, kept = asyncio.run(run())
    assert plain["families"] != swapped["families"]
    assert plain["capabilities"] == swapped["capabilities"]  # what does not read the settings is unchanged
    assert kept == Settings().max_state_dim

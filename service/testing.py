"""The app for tests and benchmarks, without starting a process.

``async with serve_in_process(settings) as (app, client)`` runs the app's lifespan (store, engine, operators)
and yields an ``httpx.AsyncClient`` bound to it through ASGI (no network). ``with serve_in_thread(settings) as
url`` serves the app with uvicorn on a free local port in a background thread (real HTTP and WebSockets).
:func:`drop_prefix` deletes every key under a store prefix (tests use a fresh prefix each and clean up).
"""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager

import httpx
from fastapi import FastAPI

from service.app import create_app
from service.settings import Settings
from service.store import StreamStore


@asynccontextmanager
async def serve_in_process(
    settings: Settings, api_key: str | None = None
) -> AsyncIterator[tuple[FastAPI, httpx.AsyncClient]]:
    app = create_app(settings)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://mpflow", headers=headers, timeout=60
        ) as client,
    ):
        yield app, client


@contextmanager
def serve_in_thread(settings: Settings, start_timeout: float = 30.0) -> Iterator[str]:
    """Serve a new app with uvicorn on 127.0.0.1:<free port> in a daemon thread; yields the base URL."""
    import uvicorn

    app = create_app(settings)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, name="mpflow-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


async def drop_prefix(url: str, prefix: str) -> int:
    """Delete every key under ``prefix`` in the Redis at ``url``; the number deleted."""
    store = StreamStore.from_url(url, prefix=prefix)
    try:
        keys = [k async for k in store.client.scan_iter(match=f"{prefix}:*", count=1000)]
        if keys:
            await store.client.delete(*keys)
        return len(keys)
    finally:
        await store.aclose()


async def redis_answers(url: str) -> bool:
    store = StreamStore.from_url(url, timeout=2.0)
    try:
        return await store.ping()
    finally:
        await store.aclose()


__all__ = ["drop_prefix", "redis_answers", "serve_in_process", "serve_in_thread"]

"""The FastAPI application: ``create_app(settings) -> FastAPI`` (uvicorn: ``mpflow.service.app:create_app --factory``).

The lifespan opens what a replica needs and closes it on shutdown:

1. the state store — ``MPFLOW_REDIS_URL`` (one Redis or any node of a Redis Cluster, told apart by asking it), or the
   embedded Redis of :mod:`mpflow.service.store.embedded` under ``data_dir``; an unreachable store does not stop the
   start (``/readyz`` answers 503, requests 503 until it is back);
2. the trained-operator catalogue (listed once), and the snapshot key (:mod:`mpflow.service.streams.snapshot_signing`);
3. the update engine (micro-batching dispatchers and their worker threads: a fast and a slow lane);
4. the watchdog (:mod:`mpflow.service.engine.watchdog`): a thread that tells ``/readyz`` when the event loop lags or a
   compute worker is stuck.

Middleware, outermost first: metrics and the JSON access log (:class:`~mpflow.service.api.middleware.Observe`), the auth
gate (:class:`~mpflow.service.api.middleware.AuthGate`: no body is read without a valid key), then the body limit and
read deadline (:class:`~mpflow.service.api.middleware.BodyLimit`). Every error has the body of
:mod:`mpflow.service.errors`.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI
from fastapi_offline import FastAPIOffline
from mpflow.operators.models import FAMILIES, FAMILY_ERRORS
from mpflow.operators.models.plugins import CATALOGUE_ORDER
from mpflow.operators.updaters import UPDATERS
from mpflow.service import errors
from mpflow.service.api import ROUTERS, contract
from mpflow.service.api import docs as redoc_page
from mpflow.service.api import websocket as ws
from mpflow.service.api.auth import Authenticator, redact_secrets_in_logs
from mpflow.service.api.metrics import Metrics
from mpflow.service.api.middleware import AuthGate, BodyLimit, Observe
from mpflow.service.api.query import known_query_only
from mpflow.service.dashboard import router as dashboard
from mpflow.service.dashboard.events import Feeds
from mpflow.service.engine.catalogue import OperatorCatalogue, methods_for
from mpflow.service.engine.lanes import LaneLimits
from mpflow.service.engine.methods import check_method_options
from mpflow.service.engine.stepping import row_views
from mpflow.service.engine.update_engine import UpdateEngine
from mpflow.service.engine.watchdog import Watchdog
from mpflow.service.settings import Settings
from mpflow.service.store.embedded import EmbeddedRedis
from mpflow.service.store.replication import DegradedShards
from mpflow.service.store.stream_store import StoreUnavailable, StreamStore
from mpflow.service.streams.service import StreamService

log = logging.getLogger("mpflow.app")

#: where the Swagger UI and ReDoc files of /docs and /redoc are served (from the installed fastapi-offline package)
DOCS_ASSETS = "/docs-assets"

METHOD_NAMES = ", ".join(f"`{m}`" for m in UPDATERS)
DESCRIPTION = f"""Online sequential Bayesian inference. Open a *stream* (a model, a prior, a method), POST observations
as they arrive, read posterior summaries, samples and log-evidence after each. Methods: {METHOD_NAMES} (`mpf`: a
learned Meta Particle Flow operator; `smc2`: for a model whose parameters are given as priors, learned online with
the state); `GET /v1/models` says what each can do. Errors: `{{"error": {{"code", "message"}}}}`."""


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    settings: Settings = app.state.settings
    embedded: EmbeddedRedis | None = None
    url = settings.redis_url
    if url is None:
        embedded = EmbeddedRedis(settings.data_dir)
        url = await asyncio.to_thread(embedded.start)
    store = await asyncio.to_thread(
        StreamStore.from_url,
        url,
        prefix=settings.redis_prefix,
        wait_replicas=settings.redis_wait_replicas,
        wait_timeout_ms=settings.redis_wait_timeout_ms,
    )
    engine = UpdateEngine(
        max_batch_size=settings.batch_max_size,
        max_wait_ms=settings.batch_max_wait_ms,
        batching=settings.batching,
        observer=app.state.metrics.observe_batch,
        summarise=row_views,
        health_observer=app.state.metrics.observe_health,
        limits=LaneLimits(settings.max_request_flops, settings.max_request_bytes),
    )
    await engine.start()
    watchdog = Watchdog(
        asyncio.get_running_loop(),
        engine.busy,
        loop_lag_limit=settings.loop_lag_limit_seconds,
        worker_deadline=settings.worker_deadline_seconds,
        on_tick=app.state.metrics.observe_watchdog,
    )
    watchdog.start()
    app.state.watchdog = watchdog
    await asyncio.to_thread(app.state.operators.load)
    app.state.store = store
    app.state.degraded = DegradedShards(
        lambda: store.client, settings.redis_wait_replicas, app.state.metrics.degraded_shards.set
    )
    reachable = await store.ping()
    # the dashboard's live feeds: a connection pool of their own (in the store's mode, once that is known)
    app.state.feeds = Feeds(url, cluster=store.cluster if reachable else None, per_tenant=settings.max_feeds_per_tenant)
    app.state.engine = engine
    app.state.streams = StreamService(
        settings,
        store,
        engine,
        app.state.operators,
        on_store_error=app.state.metrics.store_errors.inc,
        on_fallback=app.state.metrics.observe_fallback,
        on_outside_domain=app.state.metrics.observe_outside_domain,
    )
    app.state.auth.warn_if_open()
    plugins = [f"{n} ({c.__module__}:{c.__qualname__})" for n, c in FAMILIES.items() if n not in CATALOGUE_ORDER]
    log.info("model family plugins loaded: %s", ", ".join(plugins) or "none")
    for problem in FAMILY_ERRORS.values():  # a plugin left out: named, and the rest is served
        log.error("%s; the family is not served", problem)
    if reachable:  # the snapshot key, read (or generated) once; an unreachable store: at the first export/import
        with contextlib.suppress(StoreUnavailable):
            await app.state.streams.snapshots.key.get()
    else:
        log.warning("the state store does not answer yet; /readyz reports 503 until it does")
    log.info("mpflow ready (batching %s, max batch %d)", "on" if engine.batching else "off", engine.max_batch_size)
    _freeze_startup_objects()
    try:
        yield
    finally:
        watchdog.stop()
        await engine.stop()
        await app.state.feeds.aclose()
        await store.aclose()
        if embedded is not None:
            await asyncio.to_thread(embedded.stop)


def _freeze_startup_objects() -> None:
    """Once per process: start-up objects (torch, operators) leave the cyclic GC's full scans, which a request
    body of many small arrays triggers over and over while it is parsed (measured: 1.2 s → 0.3 s for 1.8 MB of
    nested arrays)."""
    global _FROZEN
    if not _FROZEN:
        _FROZEN = True
        gc.collect()
        gc.freeze()


_FROZEN = False


def create_app(settings: Settings | None = None) -> FastAPI:
    """A new app (own metrics registry, own store connection and engine, opened by the lifespan)."""
    settings = settings or Settings()
    check_method_options(settings.method_options)
    logging.getLogger("mpflow").setLevel(settings.log_level)
    # /docs (Swagger UI) and /redoc from the JavaScript and CSS that the fastapi-offline package installs, served
    # under DOCS_ASSETS: FastAPI's own pages load them from a CDN, a blank page offline
    app = FastAPIOffline(
        title="mpflow",
        version="0.1.0",
        description=DESCRIPTION,
        lifespan=_lifespan,
        static_url=DOCS_ASSETS,
        redoc_url=None,  # redoc_page's: its bundle without the one image it loads from a CDN
    )
    redoc_page.install(app, DOCS_ASSETS)
    app.state.settings = settings
    app.state.metrics = Metrics()
    app.state.metrics.zero_series({name: methods_for(cls) for name, cls in FAMILIES.items()})
    app.state.auth = Authenticator(settings.api_key_tenants)
    redact_secrets_in_logs()  # uvicorn logs WebSocket paths with their query string (?api_key=...)
    ws.quiet_denial_noise()
    app.state.sockets = ws.open_sockets(settings)  # WebSockets open, per tenant (MPFLOW_MAX_WEBSOCKETS*)
    app.state.operators = OperatorCatalogue(settings.operator_dir_list)
    errors.install(app, on_store_error=app.state.metrics.store_errors.inc)
    only_known = [Depends(known_query_only)]  # a /v1 route refuses query parameters it does not take (422)
    for router in ROUTERS:  # one per resource (mpflow.service.api)
        app.include_router(router, dependencies=only_known)
    app.include_router(dashboard, dependencies=only_known)  # the page at / and the live feed /v1/streams/{id}/events
    # added last = outermost: Observe sees every request, including the gate's 401s and BodyLimit's 413s and 408s;
    # the gate runs before BodyLimit, so no body is read for a request without a valid key
    app.add_middleware(
        BodyLimit,
        max_body_bytes=settings.max_body_bytes,
        read_timeout_s=settings.body_read_timeout_s,
        max_in_flight=settings.max_body_bytes_in_flight,
    )
    app.add_middleware(AuthGate, auth=app.state.auth, metrics_public=settings.metrics_public)
    app.add_middleware(Observe, metrics=app.state.metrics)
    contract.install(app, settings)  # the limits of `settings` in /openapi.json (docs/API.md "Limits")
    if app.state.auth.open:
        _document_open_mode(app)
    return app


def _document_open_mode(app: FastAPI) -> None:
    """Without API keys no request needs ``Authorization``: drop the bearer requirement from the OpenAPI."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = build()
            for item in schema.get("paths", {}).values():
                for op in item.values():
                    if isinstance(op, dict):
                        op.pop("security", None)
                        op.get("responses", {}).pop("401", None)
            schema.get("components", {}).pop("securitySchemes", None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


__all__ = ["create_app"]

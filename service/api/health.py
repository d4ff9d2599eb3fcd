"""Operations: ``GET /healthz`` (liveness), ``GET /readyz`` (readiness: the store takes writes, the operators are
loaded, nothing is stuck) and ``GET /metrics`` (Prometheus text)."""

from __future__ import annotations

import asyncio
import contextlib

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from mpflow.service.api.deps import AppMetrics, AppSettings, Auth, Degraded, Log, Operators, Store, Stuck
from mpflow.service.api.metrics import CONTENT_TYPE
from mpflow.service.api.middleware import TENANT_KEY
from mpflow.service.errors import error_body
from mpflow.service.schemas import ErrorResponse, Health, Readiness

router = APIRouter(tags=["operations"])


@router.get("/healthz", response_model=Health)
async def healthz() -> Response:
    """Liveness: 200 while the process answers requests (readiness is `/readyz`)."""
    return JSONResponse({"status": "ok"})


@router.get("/readyz", response_model=Readiness, responses={503: {"model": ErrorResponse, "description": "not ready"}})
async def readyz(store: Store, operators: Operators, watchdog: Stuck, degraded: Degraded) -> Response:
    """Ready when the state store takes a write now (a small one, acknowledged as updates are), the operators are
    loaded, and nothing is stuck: the event loop answers in time and no compute worker is past its deadline (the
    watchdog, MPFLOW_LOOP_LAG_LIMIT_SECONDS and MPFLOW_WORKER_DEADLINE_SECONDS). `degraded_shards`: the store's
    primaries with fewer replicas in sync than MPFLOW_REDIS_WAIT_REPLICAS needs (their streams' writes answer 503
    until replicas are back); only with MPFLOW_REDIS_WAIT_REPLICAS > 0."""
    store_ok = await store.writable()
    ops_ok = bool(operators.loaded)
    stuck = watchdog.problems()
    # the shards whose writes answer 503 for want of replicas: named, without taking the replica out (the others serve)
    shards = {"degraded_shards": sorted(await degraded.look())} if degraded.needed else {}
    if store_ok and ops_ok and not stuck:
        return JSONResponse({"status": "ready", "store": True, "operators": True, **shards})
    missing = [
        what
        for what, ok in (("the state store does not take writes", store_ok), ("operators are not loaded", ops_ok))
        if not ok
    ] + stuck
    body = error_body("not_ready", "; ".join(missing))
    return JSONResponse(
        {**body, "store": store_ok, "operators": ops_ok, "stuck": bool(stuck), **shards}, status_code=503
    )


@router.get(
    "/metrics",
    response_class=Response,
    responses={
        200: {"content": {CONTENT_TYPE: {}}},
        401: {"model": ErrorResponse, "description": "no valid API key (only with MPFLOW_METRICS_PUBLIC=false)"},
    },
    description="Prometheus text. Needs an API key when auth is on and MPFLOW_METRICS_PUBLIC=false.",
)
async def metrics(
    request: Request,
    settings: AppSettings,
    auth: Auth,
    store: Store,
    degraded: Degraded,
    registry: AppMetrics,
    log: Log,
) -> Response:
    if not settings.metrics_public:
        tenant = request.scope.get(TENANT_KEY) or auth.tenant(request.headers.get("authorization"))  # or 401
        log.add(tenant=tenant)
    # a scrape never fails because the store is down: the gauge keeps its last value
    with contextlib.suppress(Exception):
        registry.streams.set(await asyncio.wait_for(store.count(), 2.0))
    await degraded.look()  # sets mpflow_store_degraded_shards; never raises
    return Response(registry.render(), media_type=CONTENT_TYPE)


__all__ = ["router"]

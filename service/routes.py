"""The HTTP endpoints of docs/API.md (streams, batch, catalogue, operations). Handlers stay thin: they authenticate,
call :class:`~mpflow.service.streams.StreamService` and add the stream id / step to the request's log line.

Answers are built as plain dicts and sent with ``JSONResponse`` (large sample arrays skip a second pydantic
pass); each route still declares its response model so ``/openapi.json`` describes it.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Security
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from mpflow.operators.updaters import UPDATERS
from mpflow.service import catalogue
from mpflow.service.errors import error_body
from mpflow.service.metrics import CONTENT_TYPE
from mpflow.service.middleware import LOG_KEY
from mpflow.service.schemas import (
    BatchRequest,
    BatchResponse,
    CreateStreamRequest,
    ErrorResponse,
    Health,
    ModelsResponse,
    ObservationResult,
    ObservationsRequest,
    OperatorsResponse,
    ParticlesResponse,
    Readiness,
    SamplesResponse,
    StreamDocument,
    StreamList,
)
from mpflow.service.streams import StreamService

bearer = HTTPBearer(auto_error=False, description="an API key of MPFLOW_API_KEYS (when auth is on)")


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    text = {
        400: "malformed JSON",
        401: "missing or invalid API key",
        404: "unknown stream (or one of another tenant)",
        409: "seq conflict / stream exists",
        413: "over a configured limit",
        422: "invalid request",
        503: "state store unreachable (Retry-After): `store_unavailable`, nothing applied; or "
        "`store_outcome_unknown`, a write it never confirmed (retry with the same seq to learn whether it applied)",
    }
    return {s: {"model": ErrorResponse, "description": text[s]} for s in statuses}


def _log(request: Request, **fields: Any) -> None:
    info = request.scope.get(LOG_KEY)
    if info is not None:
        info.update(fields)


async def tenant_of(
    request: Request, cred: Annotated[HTTPAuthorizationCredentials | None, Security(bearer)] = None
) -> str:
    header = f"Bearer {cred.credentials}" if cred is not None else None
    tenant = request.app.state.auth.tenant(header)
    _log(request, tenant=tenant)
    return tenant


Tenant = Annotated[str, Security(tenant_of)]


def _service(request: Request) -> StreamService:
    return request.app.state.streams


api = APIRouter(prefix="/v1", tags=["streams"])
ops = APIRouter(tags=["operations"])


@api.post(
    "/streams",
    status_code=201,
    response_model=StreamDocument,
    responses=error_responses(400, 401, 409, 413, 422, 503),
    summary="Create a stream",
)
async def create_stream(request: Request, body: CreateStreamRequest, tenant: Tenant) -> Response:
    doc = await _service(request).create(tenant, body)
    _log(request, stream=doc["stream_id"], step=0)
    return JSONResponse(doc, status_code=201)


@api.post(
    "/streams/{stream_id}/observations",
    response_model=ObservationResult,
    responses=error_responses(400, 401, 404, 409, 413, 422, 503),
    summary="Apply observations (seq: exactly once)",
)
async def observe(request: Request, stream_id: str, body: ObservationsRequest, tenant: Tenant) -> Response:
    _log(request, stream=stream_id)
    doc = await _service(request).observe(tenant, stream_id, body)
    _log(request, step=doc["step"])
    return JSONResponse(doc)


@api.get(
    "/streams/{stream_id}",
    response_model=StreamDocument,
    responses=error_responses(401, 404, 503),
    summary="The stream document",
)
async def get_stream(request: Request, stream_id: str, tenant: Tenant) -> Response:
    _log(request, stream=stream_id)
    doc = await _service(request).get(tenant, stream_id)
    _log(request, step=doc["step"])
    return JSONResponse(doc)


@api.get(
    "/streams/{stream_id}/samples",
    response_model=SamplesResponse,
    responses=error_responses(401, 404, 413, 422, 503),
    summary="Draws from the current posterior",
)
async def get_samples(
    request: Request,
    stream_id: str,
    tenant: Tenant,
    n: Annotated[int, Query(ge=1, description="number of draws (may exceed the particle count)")] = 1000,
) -> Response:
    _log(request, stream=stream_id)
    return JSONResponse({"samples": await _service(request).samples(tenant, stream_id, n)})


@api.get(
    "/streams/{stream_id}/particles",
    response_model=ParticlesResponse,
    responses=error_responses(401, 404, 503),
    summary="The particles and their log-weights",
)
async def get_particles(request: Request, stream_id: str, tenant: Tenant) -> Response:
    _log(request, stream=stream_id)
    return JSONResponse(await _service(request).particles(tenant, stream_id))


@api.delete(
    "/streams/{stream_id}",
    status_code=204,
    response_class=Response,
    responses=error_responses(401, 404, 503),
    summary="Delete a stream",
)
async def delete_stream(request: Request, stream_id: str, tenant: Tenant) -> Response:
    _log(request, stream=stream_id)
    await _service(request).delete(tenant, stream_id)
    return Response(status_code=204)


@api.get(
    "/streams", response_model=StreamList, responses=error_responses(401, 422, 503), summary="The tenant's streams"
)
async def list_streams(
    request: Request,
    tenant: Tenant,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    cursor: Annotated[str | None, Query(description="next_cursor of the previous page")] = None,
) -> Response:
    return JSONResponse(await _service(request).list(tenant, limit, cursor))


@api.post(
    "/observations:batch",
    response_model=BatchResponse,
    responses=error_responses(400, 401, 413, 422),
    summary="Observations for many streams (each update on its own)",
)
async def observe_batch(request: Request, body: BatchRequest, tenant: Tenant) -> Response:
    return JSONResponse({"results": await _service(request).batch(tenant, body)})


@api.get("/models", response_model=ModelsResponse, responses=error_responses(401), tags=["catalogue"])
async def list_models(request: Request, tenant: Tenant) -> Response:
    families = catalogue.models(request.app.state.settings.max_state_dim)
    return JSONResponse({"families": families, "methods": sorted(UPDATERS)})


@api.get("/operators", response_model=OperatorsResponse, responses=error_responses(401), tags=["catalogue"])
async def list_operators(request: Request, tenant: Tenant) -> Response:
    return JSONResponse({"operators": request.app.state.operators.to_json()})


@ops.get("/healthz", response_model=Health)
async def healthz() -> Response:
    return JSONResponse({"status": "ok"})


@ops.get("/readyz", response_model=Readiness, responses={503: {"model": ErrorResponse, "description": "not ready"}})
async def readyz(request: Request) -> Response:
    store_ok = await request.app.state.store.ping()
    ops_ok = bool(request.app.state.operators.loaded)
    if store_ok and ops_ok:
        return JSONResponse({"status": "ready", "store": True, "operators": True})
    missing = [
        what
        for what, ok in (("the state store does not answer", store_ok), ("operators are not loaded", ops_ok))
        if not ok
    ]
    body = error_body("not_ready", "; ".join(missing))
    return JSONResponse({**body, "store": store_ok, "operators": ops_ok}, status_code=503)


@ops.get(
    "/metrics",
    response_class=Response,
    responses={
        200: {"content": {CONTENT_TYPE: {}}},
        401: {"model": ErrorResponse, "description": "no valid API key (only with MPFLOW_METRICS_PUBLIC=false)"},
    },
    description="Prometheus text. Needs an API key when auth is on and MPFLOW_METRICS_PUBLIC=false.",
)
async def metrics(request: Request) -> Response:
    state = request.app.state
    if not state.settings.metrics_public:
        tenant = state.auth.tenant(request.headers.get("authorization"))  # 401 without a valid key
        _log(request, tenant=tenant)
    # a scrape never fails because the store is down: the gauge keeps its last value
    with contextlib.suppress(Exception):
        state.metrics.streams.set(await asyncio.wait_for(state.store.count(), 2.0))
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)


__all__ = ["api", "ops", "tenant_of"]

"""The HTTP endpoints of docs/API.md (streams, batch, catalogue, operations). Handlers stay thin: they authenticate,
call :class:`~mpflow.service.streams.service.StreamService` and add the stream id / step to the request's log line.

Answers are built as plain dicts and sent with ``JSONResponse`` (large sample arrays skip a second pydantic
pass); each route still declares its response model so ``/openapi.json`` describes it. The particles and the
samples, which can be hundreds of megabytes of JSON, are streamed in chunks encoded off the event loop
(:mod:`mpflow.service.api.json_stream`).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Security
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from mpflow.service.api.json_stream import json_answer
from mpflow.service.api.metrics import CONTENT_TYPE
from mpflow.service.api.middleware import LOG_KEY, TENANT_KEY
from mpflow.service.engine import catalogue
from mpflow.service.errors import ApiError, error_body
from mpflow.service.schemas import (
    FLOAT32_MAX,
    STREAM_ID_PATTERN,
    BatchRequest,
    BatchResponse,
    CreateStreamRequest,
    ErrorResponse,
    ForecastResponse,
    Health,
    HistoryResponse,
    ModelsResponse,
    ObservationResult,
    ObservationsRequest,
    OperatorsResponse,
    ParticlesResponse,
    Readiness,
    SamplesResponse,
    SmoothedResponse,
    StreamDocument,
    StreamList,
)
from mpflow.service.streams import snapshots
from mpflow.service.streams.service import StreamService

bearer = HTTPBearer(auto_error=False, description="an API key of MPFLOW_API_KEYS (when auth is on)")


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    text = {
        400: "malformed JSON",
        401: "missing or invalid API key",
        404: "unknown stream (or one of another tenant)",
        409: "seq conflict / stream exists / smoothing_disabled (a stream without smoothing_lag)",
        413: "over a configured limit",
        415: "the body is not of the media type the route takes",
        422: "`invalid_request`: a field that cannot be used; the message names it and what to send instead",
        429: '`quota_exceeded`: over one of the tenant\'s quotas (docs/API.md "Limits"), nothing applied; '
        "`Retry-After` says when to try again",
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
    tenant = request.scope.get(TENANT_KEY)  # authenticated by the gate (middleware.AuthGate) from the headers
    if tenant is None:
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
    responses=error_responses(400, 401, 409, 413, 422, 429, 503),
    summary="Create a stream",
)
async def create_stream(request: Request, body: CreateStreamRequest, tenant: Tenant) -> Response:
    """Open a stream: a model family with its parameters, a prior over the state, and the method that updates the
    posterior (with no `method`, the one measured most accurate for this family and dimension; `method_reason`
    says which). Answers the stream document at step 0."""
    doc = await _service(request).create(tenant, body)
    _log(request, stream=doc["stream_id"], step=0)
    return JSONResponse(doc, status_code=201)


@api.post(
    "/streams/{stream_id}/observations",
    response_model=ObservationResult,
    responses=error_responses(400, 401, 404, 409, 413, 422, 429, 503),
    summary="Apply observations (seq: exactly once)",
)
async def observe(request: Request, stream_id: str, body: ObservationsRequest, tenant: Tenant) -> Response:
    """Apply one or more time steps' observations, in order, and answer the posterior after the last one with a
    summary per step (`per_step`). `seq` (the step number of the first observation) makes a retry safe: the same
    `seq` and observations again answer `duplicate: true` and apply nothing."""
    _log(request, stream=stream_id)
    doc = await _service(request).observe(tenant, stream_id, body)
    _log(request, step=doc["step"])
    return JSONResponse(doc)


@api.get(
    "/streams/{stream_id}",
    response_model=StreamDocument,
    responses=error_responses(401, 404, 422, 503),
    summary="The stream document",
)
async def get_stream(request: Request, stream_id: str, tenant: Tenant) -> Response:
    """The stream's model, method and current posterior summary (mean, covariance, quantiles, effective sample
    size, log-evidence so far)."""
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
    """`n` draws from the current posterior: the exact Gaussian for an exact method (`capabilities.exact`), the
    particles by weight for a weighted cloud (`capabilities.weighted`), else the Gaussian or the smoothed cloud the
    particles stand for (docs/API.md)."""
    _log(request, stream=stream_id)
    service = _service(request)
    return json_answer({"samples": await service.samples(tenant, stream_id, n)}, service.work.off_loop)


@api.get(
    "/streams/{stream_id}/forecast",
    response_model=ForecastResponse,
    responses=error_responses(401, 404, 413, 422, 503),
    summary="Predictive distributions 1..k steps ahead",
)
async def get_forecast(
    request: Request,
    stream_id: str,
    tenant: Tenant,
    steps: Annotated[int, Query(ge=1, description="k: horizons 1..k (at most MPFLOW_MAX_FORECAST_STEPS)")],
    dt: Annotated[
        float, Query(gt=0, le=FLOAT32_MAX, allow_inf_nan=False, description="each step's duration (default 1)")
    ] = 1.0,
    samples: Annotated[int, Query(ge=0, description="draws of the state and observation per horizon")] = 0,
) -> Response:
    """The predictive distributions of the state and of the observation 1..k steps of `dt` ahead, without
    measurements and with zero inputs: exact for `kalman`, by propagating the particles for the other methods. It
    reads the stream and never changes it."""
    _log(request, stream=stream_id)
    return JSONResponse(await _service(request).forecast(tenant, stream_id, steps, dt, samples))


@api.get(
    "/streams/{stream_id}/smoothed",
    response_model=SmoothedResponse,
    responses=error_responses(401, 404, 409, 413, 422, 503),
    summary="Fixed-lag smoothed estimates of the last L steps",
)
async def get_smoothed(request: Request, stream_id: str, tenant: Tenant) -> Response:
    """p(x_s | o_1..o_t) — each earlier state given the observations after it too — for the last min(L, t) steps
    s = t−L+1 … t of a stream created with `smoothing_lag` L (the newest is the filtered estimate): exact RTS for
    `kalman`, the particle genealogy for `smc`, the ensemble RTS smoother for the others. A stream created
    without `smoothing_lag` is answered 409 `smoothing_disabled`. It reads the stream and never changes it."""
    _log(request, stream=stream_id)
    return JSONResponse(await _service(request).smoothed(tenant, stream_id))


_SNAPSHOT_BODY = {snapshots.MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}}


@api.get(
    "/streams/{stream_id}/export",
    response_class=Response,
    responses={200: {"content": _SNAPSHOT_BODY, "description": "the snapshot"}, **error_responses(401, 404, 422, 503)},
    summary="A snapshot of the stream, to import elsewhere",
)
async def export_stream(request: Request, stream_id: str, tenant: Tenant) -> Response:
    """A versioned, self-describing snapshot of the stream (safetensors: its state tensors, and in the header its
    model, prior, method, operator and the operator's content hash, step, log-evidence, a SHA-256 checksum and an
    HMAC-SHA256 signature under the deployment's snapshot key). `POST /v1/streams:import` takes it verbatim."""
    _log(request, stream=stream_id)
    blob = await _service(request).export(tenant, stream_id)
    return Response(blob, media_type=snapshots.MEDIA_TYPE)


@api.post(
    "/streams:import",
    status_code=201,
    response_model=StreamDocument,
    responses=error_responses(400, 401, 409, 413, 415, 422, 429, 503),
    openapi_extra={"requestBody": {"required": True, "content": _SNAPSHOT_BODY}},
    summary="Recreate a stream from its snapshot",
)
async def import_stream(
    request: Request,
    tenant: Tenant,
    stream_id: Annotated[
        str | None, Query(pattern=STREAM_ID_PATTERN, description="the new stream's id; generated when absent")
    ] = None,
    trust: Annotated[
        snapshots.Trust,
        Query(
            description="signed (default): only a snapshot this deployment signed; foreign: also another "
            "deployment's (or an unsigned one), on your word — validated all the same"
        ),
    ] = "signed",
) -> Response:
    """Recreate an exported stream for the caller's tenant (the body: `GET .../export`'s, verbatim, with its
    Content-Type). A snapshot this deployment did not sign is refused (422 `untrusted_snapshot`) unless
    `trust=foreign`; a truncated, altered or oversized snapshot, another format version, a field or tensor that a
    new stream could not have, or an operator this server lacks is refused with a 4xx saying why, and nothing is
    created."""
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media != snapshots.MEDIA_TYPE:
        raise ApiError(415, "unsupported_media_type", f"content-type: send the snapshot as {snapshots.MEDIA_TYPE}")
    doc = await _service(request).import_stream(tenant, await request.body(), stream_id, trust)
    _log(request, stream=doc["stream_id"], step=doc["step"])
    return JSONResponse(doc, status_code=201)


@api.get(
    "/streams/{stream_id}/particles",
    response_model=ParticlesResponse,
    responses=error_responses(401, 404, 422, 503),
    summary="The particles and their log-weights",
)
async def get_particles(request: Request, stream_id: str, tenant: Tenant) -> Response:
    """The particle cloud that represents the posterior, with normalised log-weights."""
    _log(request, stream=stream_id)
    service = _service(request)
    return json_answer(await service.particles(tenant, stream_id), service.work.off_loop)


@api.get(
    "/streams/{stream_id}/history",
    response_model=HistoryResponse,
    responses=error_responses(401, 404, 422, 503),
    summary="The stream's recent steps and their observations",
)
async def get_history(
    request: Request,
    stream_id: str,
    tenant: Tenant,
    limit: Annotated[
        int | None,
        Query(ge=1, description="the latest `limit` steps (at most MPFLOW_HISTORY_STEPS); all that are kept if absent"),
    ] = None,
) -> Response:
    """The stream's latest steps, oldest first: each step's posterior mean and standard deviation, log-evidence
    increment and ESS (as in `per_step`), with the observation that was applied and its `dt`. The stream keeps its
    last MPFLOW_HISTORY_STEPS steps; a request answered `duplicate` adds none."""
    _log(request, stream=stream_id)
    return Response(await _service(request).history(tenant, stream_id, limit), media_type="application/json")


@api.delete(
    "/streams/{stream_id}",
    status_code=204,
    response_class=Response,
    responses=error_responses(401, 404, 422, 503),
    summary="Delete a stream",
)
async def delete_stream(request: Request, stream_id: str, tenant: Tenant) -> Response:
    """Delete the stream and everything stored for it."""
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
    """The caller's streams, a page of at most `limit` at a time (follow `next_cursor`)."""
    return JSONResponse(await _service(request).list(tenant, limit, cursor))


@api.post(
    "/observations:batch",
    response_model=BatchResponse,
    responses=error_responses(400, 401, 413, 422),
    summary="Observations for many streams (each update on its own)",
)
async def observe_batch(request: Request, body: BatchRequest, tenant: Tenant) -> Response:
    """Observations for many streams in one request. Each update is applied on its own, as its POST would be:
    each result carries its own HTTP `status` and the stream's answer or the error."""
    return JSONResponse({"results": await _service(request).batch(tenant, body)})


@api.get("/models", response_model=ModelsResponse, responses=error_responses(401), tags=["catalogue"])
async def list_models(request: Request, tenant: Tenant) -> Response:
    """The model families this server runs — parameters, state dimensions, the shape of one observation, the
    methods that can run each — and every method with what it can do (`capabilities`: a weighted cloud, exact,
    forecasts, controls, smoothing, unknown parameters)."""
    families = catalogue.models(request.app.state.settings.max_state_dim)
    methods = catalogue.method_entries()
    return JSONResponse({"families": families, "methods": list(methods), "capabilities": methods})


@api.get("/operators", response_model=OperatorsResponse, responses=error_responses(401), tags=["catalogue"])
async def list_operators(request: Request, tenant: Tenant) -> Response:
    """The trained `mpf` operators installed on this server, with the family and dimension each was trained for
    and its measured accuracy."""
    return JSONResponse({"operators": request.app.state.operators.to_json()})


@ops.get("/healthz", response_model=Health)
async def healthz() -> Response:
    """Liveness: 200 while the process answers requests (readiness is `/readyz`)."""
    return JSONResponse({"status": "ok"})


@ops.get("/readyz", response_model=Readiness, responses={503: {"model": ErrorResponse, "description": "not ready"}})
async def readyz(request: Request) -> Response:
    """Ready when the state store takes a write now (a small one, acknowledged as updates are), the operators are
    loaded, and nothing is stuck: the event loop answers in time and no compute worker is past its deadline (the
    watchdog, MPFLOW_LOOP_LAG_LIMIT_SECONDS and MPFLOW_WORKER_DEADLINE_SECONDS). `degraded_shards`: the store's
    primaries with fewer replicas in sync than MPFLOW_REDIS_WAIT_REPLICAS needs (their streams' writes answer 503
    until replicas are back); only with MPFLOW_REDIS_WAIT_REPLICAS > 0."""
    store_ok = await request.app.state.store.writable()
    ops_ok = bool(request.app.state.operators.loaded)
    stuck = request.app.state.watchdog.problems()
    # the shards whose writes answer 503 for want of replicas: named, without taking the replica out (the others serve)
    watch = request.app.state.degraded
    degraded = {"degraded_shards": sorted(await watch.look())} if watch.needed else {}
    if store_ok and ops_ok and not stuck:
        return JSONResponse({"status": "ready", "store": True, "operators": True, **degraded})
    missing = [
        what
        for what, ok in (("the state store does not take writes", store_ok), ("operators are not loaded", ops_ok))
        if not ok
    ] + stuck
    body = error_body("not_ready", "; ".join(missing))
    return JSONResponse(
        {**body, "store": store_ok, "operators": ops_ok, "stuck": bool(stuck), **degraded}, status_code=503
    )


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
        tenant = request.scope.get(TENANT_KEY) or state.auth.tenant(request.headers.get("authorization"))  # or 401
        _log(request, tenant=tenant)
    # a scrape never fails because the store is down: the gauge keeps its last value
    with contextlib.suppress(Exception):
        state.metrics.streams.set(await asyncio.wait_for(state.store.count(), 2.0))
    await state.degraded.look()  # sets mpflow_store_degraded_shards; never raises
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)


__all__ = ["api", "ops", "tenant_of"]

"""Observations: ``POST /v1/streams/{id}/observations`` (one stream, exactly once by ``seq``) and
``POST /v1/observations:batch`` (many streams, each update on its own). The WebSocket of :mod:`.websocket` takes
the same frames."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from mpflow.service.api.deps import Log, Streams, Tenant
from mpflow.service.api.responses import error_responses
from mpflow.service.schemas import BatchRequest, BatchResponse, ObservationResult, ObservationsRequest

router = APIRouter(prefix="/v1", tags=["streams"])


@router.post(
    "/streams/{stream_id}/observations",
    response_model=ObservationResult,
    responses=error_responses(400, 401, 404, 409, 413, 415, 422, 429, 503),
    summary="Apply observations (seq: exactly once)",
)
async def observe(stream_id: str, body: ObservationsRequest, tenant: Tenant, streams: Streams, log: Log) -> Response:
    """Apply one or more time steps' observations, in order, and answer the posterior after the last one with a
    summary per step (`per_step`). `seq` (the step number of the first observation) makes a retry safe: the same
    `seq` and observations again answer `duplicate: true` and apply nothing."""
    log.add(stream=stream_id)
    doc = await streams.observe(tenant, stream_id, body)
    log.add(step=doc["step"])
    return JSONResponse(doc)


@router.post(
    "/observations:batch",
    response_model=BatchResponse,
    responses=error_responses(400, 401, 413, 415, 422),
    summary="Observations for many streams (each update on its own)",
)
async def observe_batch(body: BatchRequest, tenant: Tenant, streams: Streams) -> Response:
    """Observations for many streams in one request. Each update is applied on its own, as its POST would be:
    each result carries its own HTTP `status` and the stream's answer or the error."""
    return JSONResponse({"results": await streams.batch(tenant, body)})


__all__ = ["router"]

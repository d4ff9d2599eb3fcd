"""Reads of a stream's posterior that never change it: draws (``/samples``), the particles, the predictive
distributions ahead (``/forecast``), the fixed-lag smoothed estimates (``/smoothed``) and the recent steps
(``/history``). The particles and the samples, which can be hundreds of megabytes of JSON, are streamed in chunks
encoded off the event loop (:mod:`.json_stream`)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse, Response
from mpflow.service.api.deps import Log, Streams, Tenant
from mpflow.service.api.json_stream import json_answer
from mpflow.service.api.responses import error_responses
from mpflow.service.schemas import (
    FLOAT32_MAX,
    ForecastResponse,
    HistoryResponse,
    ParticlesResponse,
    SamplesResponse,
    SmoothedResponse,
)

router = APIRouter(prefix="/v1", tags=["streams"])


@router.get(
    "/streams/{stream_id}/samples",
    response_model=SamplesResponse,
    responses=error_responses(401, 404, 413, 422, 503),
    summary="Draws from the current posterior",
)
async def get_samples(
    stream_id: str,
    tenant: Tenant,
    streams: Streams,
    log: Log,
    n: Annotated[int, Query(ge=1, description="number of draws (may exceed the particle count)")] = 1000,
) -> Response:
    """`n` draws from the current posterior: the exact Gaussian for an exact method (`capabilities.exact`), the
    particles by weight for a weighted cloud (`capabilities.weighted`), else the Gaussian or the smoothed cloud the
    particles stand for (docs/API.md)."""
    log.add(stream=stream_id)
    return json_answer({"samples": await streams.samples(tenant, stream_id, n)}, streams.work.off_loop)


@router.get(
    "/streams/{stream_id}/forecast",
    response_model=ForecastResponse,
    responses=error_responses(401, 404, 413, 422, 503),
    summary="Predictive distributions 1..k steps ahead",
)
async def get_forecast(
    stream_id: str,
    tenant: Tenant,
    streams: Streams,
    log: Log,
    steps: Annotated[int, Query(ge=1, description="k: horizons 1..k (at most MPFLOW_MAX_FORECAST_STEPS)")],
    dt: Annotated[
        float, Query(gt=0, le=FLOAT32_MAX, allow_inf_nan=False, description="each step's duration (default 1)")
    ] = 1.0,
    samples: Annotated[int, Query(ge=0, description="draws of the state and observation per horizon")] = 0,
) -> Response:
    """The predictive distributions of the state and of the observation 1..k steps of `dt` ahead, without
    measurements and with zero inputs: exact for `kalman`, by propagating the particles for the other methods. It
    reads the stream and never changes it."""
    log.add(stream=stream_id)
    return JSONResponse(await streams.forecast(tenant, stream_id, steps, dt, samples))


@router.get(
    "/streams/{stream_id}/smoothed",
    response_model=SmoothedResponse,
    responses=error_responses(401, 404, 409, 413, 422, 503),
    summary="Fixed-lag smoothed estimates of the last L steps",
)
async def get_smoothed(stream_id: str, tenant: Tenant, streams: Streams, log: Log) -> Response:
    """p(x_s | o_1..o_t) — each earlier state given the observations after it too — for the last min(L, t) steps
    s = t−L+1 … t of a stream created with `smoothing_lag` L (the newest is the filtered estimate): exact RTS for
    `kalman`, FFBSm (N ≤ 512) or backward simulation for `smc`, the ensemble RTS smoother for the others. A stream
    created without `smoothing_lag` is answered 409 `smoothing_disabled`. It reads the stream and never changes it."""
    log.add(stream=stream_id)
    return JSONResponse(await streams.smoothed(tenant, stream_id))


@router.get(
    "/streams/{stream_id}/particles",
    response_model=ParticlesResponse,
    responses=error_responses(401, 404, 422, 503),
    summary="The particles and their log-weights",
)
async def get_particles(stream_id: str, tenant: Tenant, streams: Streams, log: Log) -> Response:
    """The particle cloud that represents the posterior, with normalised log-weights."""
    log.add(stream=stream_id)
    return json_answer(await streams.particles(tenant, stream_id), streams.work.off_loop)


@router.get(
    "/streams/{stream_id}/history",
    response_model=HistoryResponse,
    responses=error_responses(401, 404, 422, 503),
    summary="The stream's recent steps and their observations",
)
async def get_history(
    stream_id: str,
    tenant: Tenant,
    streams: Streams,
    log: Log,
    limit: Annotated[
        int | None,
        Query(ge=1, description="the latest `limit` steps (at most MPFLOW_HISTORY_STEPS); all that are kept if absent"),
    ] = None,
) -> Response:
    """The stream's latest steps, oldest first: each step's posterior mean and standard deviation, log-evidence
    increment and ESS (as in `per_step`), with the observation that was applied and its `dt`. The stream keeps its
    last MPFLOW_HISTORY_STEPS steps; a request answered `duplicate` adds none."""
    log.add(stream=stream_id)
    return Response(await streams.history(tenant, stream_id, limit), media_type="application/json")


__all__ = ["router"]

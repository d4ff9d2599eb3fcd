"""The stream resource: ``POST /v1/streams`` (create), ``GET /v1/streams`` (the tenant's, a page at a time),
``GET`` and ``DELETE /v1/streams/{id}``.

Handlers stay thin (as in every router of this package): they take what :mod:`.deps` injects, call
:class:`~mpflow.service.streams.service.StreamService` and add the stream id / step to the request's log line.
Answers are built as plain dicts and sent with ``JSONResponse`` (large arrays skip a second pydantic pass); each
route still declares its response model so ``/openapi.json`` describes it.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse, Response
from mpflow.service.api.deps import Log, Streams, Tenant
from mpflow.service.api.responses import error_responses
from mpflow.service.engine.summary import MAX_LEVELS, QUANTILES, check_levels
from mpflow.service.errors import invalid
from mpflow.service.schemas import CreateStreamRequest, StreamDocument, StreamList

router = APIRouter(prefix="/v1", tags=["streams"])


@router.post(
    "/streams",
    status_code=201,
    response_model=StreamDocument,
    responses=error_responses(400, 401, 409, 413, 415, 422, 429, 503),
    summary="Create a stream",
)
async def create_stream(body: CreateStreamRequest, tenant: Tenant, streams: Streams, log: Log) -> Response:
    """Open a stream: a model family with its parameters, a prior over the state, and the method that updates the
    posterior (with no `method`, the one measured most accurate for this family and dimension; `method_reason`
    says which). Answers the stream document at step 0."""
    doc = await streams.create(tenant, body)
    log.add(stream=doc["stream_id"], step=0)
    return JSONResponse(doc, status_code=201)


@router.get(
    "/streams/{stream_id}",
    response_model=StreamDocument,
    responses=error_responses(401, 404, 422, 503),
    summary="The stream document",
)
async def get_stream(
    stream_id: str,
    tenant: Tenant,
    streams: Streams,
    log: Log,
    levels: Annotated[
        str | None,
        Query(
            description=f"the summary's quantile levels, comma-separated, each in (0, 1), at most {MAX_LEVELS}: "
            f"?levels=0.025,0.5,0.975 (default {','.join(map(str, QUANTILES))})",
            max_length=200,
        ),
    ] = None,
) -> Response:
    """The stream's model, method and current posterior summary (mean, covariance, quantiles, effective sample
    size, log-evidence so far)."""
    log.add(stream=stream_id)
    doc = await streams.get(tenant, stream_id, query_levels(levels))
    log.add(step=doc["step"])
    return JSONResponse(doc)


def query_levels(text: str | None) -> tuple[float, ...] | None:
    """``?levels=0.025,0.5,0.975`` as checked levels (None: none asked); 422 naming ``levels``."""
    if text is None:
        return None
    try:
        return check_levels([float(t) for t in text.split(",")])
    except ValueError as exc:
        message = str(exc) if str(exc).startswith("levels") else "levels: comma-separated numbers, e.g. 0.025,0.975"
        raise invalid(message) from None


@router.delete(
    "/streams/{stream_id}",
    status_code=204,
    response_class=Response,
    responses=error_responses(401, 404, 422, 503),
    summary="Delete a stream",
)
async def delete_stream(stream_id: str, tenant: Tenant, streams: Streams, log: Log) -> Response:
    """Delete the stream and everything stored for it."""
    log.add(stream=stream_id)
    await streams.delete(tenant, stream_id)
    return Response(status_code=204)


@router.get(
    "/streams", response_model=StreamList, responses=error_responses(401, 422, 503), summary="The tenant's streams"
)
async def list_streams(
    tenant: Tenant,
    streams: Streams,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    cursor: Annotated[str | None, Query(description="next_cursor of the previous page")] = None,
) -> Response:
    """The caller's streams, a page of at most `limit` at a time (follow `next_cursor`)."""
    return JSONResponse(await streams.list(tenant, limit, cursor))


__all__ = ["router"]

"""Snapshots: ``GET /v1/streams/{id}/export`` (a signed, self-describing safetensors file of the stream) and
``POST /v1/streams:import`` (a stream recreated from one, checked first: :mod:`mpflow.service.streams.snapshots`)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response
from mpflow.service.api.deps import Log, Streams, Tenant
from mpflow.service.api.responses import error_responses
from mpflow.service.errors import ApiError
from mpflow.service.schemas import STREAM_ID_PATTERN, StreamDocument
from mpflow.service.streams import snapshots

router = APIRouter(prefix="/v1", tags=["streams"])

_SNAPSHOT_BODY = {snapshots.MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}}


@router.get(
    "/streams/{stream_id}/export",
    response_class=Response,
    responses={200: {"content": _SNAPSHOT_BODY, "description": "the snapshot"}, **error_responses(401, 404, 422, 503)},
    summary="A snapshot of the stream, to import elsewhere",
)
async def export_stream(stream_id: str, tenant: Tenant, streams: Streams, log: Log) -> Response:
    """A versioned, self-describing snapshot of the stream (safetensors: its state tensors, and in the header its
    model, prior, method, operator and the operator's content hash, step, log-evidence, a SHA-256 checksum and an
    HMAC-SHA256 signature under the deployment's snapshot key). `POST /v1/streams:import` takes it verbatim."""
    log.add(stream=stream_id)
    blob = await streams.export(tenant, stream_id)
    return Response(blob, media_type=snapshots.MEDIA_TYPE)


@router.post(
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
    streams: Streams,
    log: Log,
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
    doc = await streams.import_stream(tenant, await request.body(), stream_id, trust)
    log.add(stream=doc["stream_id"], step=doc["step"])
    return JSONResponse(doc, status_code=201)


__all__ = ["router"]

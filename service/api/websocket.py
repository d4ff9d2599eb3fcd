"""``WS /v1/streams/{stream_id}/ws``: observations over a WebSocket (docs/API.md).

The client sends frames ``{"seq": n, "observations": [...], "return_samples": 0}``; the server answers each, in
order, with the same document as ``POST /v1/streams/{id}/observations`` or with ``{"error": {...}, "status": s}``
(``s`` the HTTP status the POST would have had). The sequencing rules are the POST's: frames go through
:meth:`~mpflow.service.streams.service.StreamService.observe`.

Auth: ``Authorization: Bearer <key>`` on the handshake, or ``?api_key=<key>`` for clients that cannot set
headers (browsers). A missing or invalid key refuses the handshake with the HTTP 401 of every other route (the
ASGI ``websocket.http.response`` extension; servers without it close the handshake, code 1008); an unknown
stream (or one of another tenant) is answered with a 404 error frame and the socket closed (1008).

Caps (:class:`~mpflow.service.store.quotas.TenantSlots`, :data:`~mpflow.service.api.deps.Sockets`): a tenant with
``MPFLOW_MAX_WEBSOCKETS_PER_TENANT`` sockets open on this process is refused the handshake with 429
``quota_exceeded`` and ``Retry-After``; when the process holds ``MPFLOW_MAX_WEBSOCKETS`` in all, with 503
``too_many_websockets`` (before the caps, 3000 sockets of one client were all accepted: issue 34, item 10).
"""

from __future__ import annotations

import json
import logging

from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from fastapi.responses import JSONResponse
from mpflow.service.api.deps import AppSettings, Auth, Log, Sockets, Streams
from mpflow.service.errors import ApiError, from_validation_errors, too_large, unavailable
from mpflow.service.schemas import ObservationsRequest
from mpflow.service.settings import Settings
from mpflow.service.store.quotas import TenantSlots
from mpflow.service.store.stream_store import StoreUnavailable
from mpflow.service.stream_errors import MalformedJsonError
from mpflow.service.streams.service import StreamService
from pydantic import ValidationError

router = APIRouter()

POLICY_VIOLATION = 1008
INTERNAL_ERROR = 1011  # WebSocket close code "internal error": used when the state store cannot be reached
#: what uvicorn's ``websockets-sansio`` protocol logs at ERROR after every denial response it sent correctly (it
#: never marks such a handshake complete; uvicorn PR #3138, open): the one route here always accepts, denies or
#: closes, so the line is noise that would page on every refused key
_DENIAL_NOISE = "ASGI callable returned without completing handshake."


class DropDenialNoise(logging.Filter):
    """Drop uvicorn's spurious ERROR line after a WebSocket denial response (:data:`_DENIAL_NOISE`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != _DENIAL_NOISE


def quiet_denial_noise() -> None:
    """Put one :class:`DropDenialNoise` on ``uvicorn.error`` (idempotent)."""
    logger = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, DropDenialNoise) for f in logger.filters):
        logger.addFilter(DropDenialNoise())


def _frame(err: ApiError) -> dict:
    return {**err.body(), "status": err.status}


@router.websocket("/v1/streams/{stream_id}/ws")
async def stream_socket(
    websocket: WebSocket,
    stream_id: str,
    streams: Streams,
    settings: AppSettings,
    auth: Auth,
    sockets: Sockets,
    log: Log,
) -> None:
    log.add(stream=stream_id)
    try:
        tenant = auth.tenant(websocket.headers.get("authorization"), websocket.query_params.get("api_key"))
        sockets.take(tenant, _full(sockets))
    except ApiError as err:
        await _deny(websocket, err)
        return
    try:
        await _serve(websocket, streams, tenant, stream_id, settings.max_body_bytes)
    finally:
        sockets.give(tenant)


async def _deny(websocket: WebSocket, err: ApiError) -> None:
    """Refuse the handshake with ``err`` as an HTTP answer (or close 1008 on servers without denial responses)."""
    if "websocket.http.response" in websocket.scope.get("extensions", {}):
        await websocket.send_denial_response(JSONResponse(err.body(), err.status, err.headers))
    else:
        await websocket.close(code=POLICY_VIOLATION, reason=err.code)


def _full(sockets: TenantSlots) -> ApiError:
    return ApiError(
        503,
        "too_many_websockets",
        f"this server already holds {sockets.per_process} WebSockets (MPFLOW_MAX_WEBSOCKETS); retry later "
        "(or use another replica)",
        {"Retry-After": str(sockets.retry_after_s)},
    )


def open_sockets(settings: Settings) -> TenantSlots:
    """The count of open WebSockets of a process (``app.state.sockets``), capped per tenant and in total."""
    return TenantSlots(
        "WebSockets", settings.max_websockets_per_tenant, settings.max_websockets, "MPFLOW_MAX_WEBSOCKETS_PER_TENANT"
    )


async def _serve(websocket: WebSocket, service: StreamService, tenant: str, stream_id: str, max_bytes: int) -> None:
    """Accept the handshake and answer the client's frames until it goes away."""
    await websocket.accept()
    try:
        await service.get(tenant, stream_id)
    except ApiError as err:
        await websocket.send_json(_frame(err))
        await websocket.close(code=POLICY_VIOLATION)
        return
    except StoreUnavailable as exc:
        await websocket.send_json(_frame(unavailable(exc)))
        await websocket.close(code=INTERNAL_ERROR)
        return
    while True:
        try:
            message = await websocket.receive()
        except WebSocketDisconnect:
            return
        if message["type"] == "websocket.disconnect":
            return
        raw = message.get("text")
        if raw is None:
            raw = (message.get("bytes") or b"").decode("utf-8", errors="replace")
        await websocket.send_json(await _answer(service, tenant, stream_id, raw, max_bytes))


async def _answer(service: StreamService, tenant: str, stream_id: str, raw: str, max_bytes: int) -> dict:
    if len(raw.encode("utf-8")) > max_bytes:
        return _frame(too_large(f"frame: larger than the limit of {max_bytes} bytes (MPFLOW_MAX_BODY_BYTES)"))
    try:
        payload = json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: arrays nested thousands deep
        return _frame(MalformedJsonError("frame: not valid JSON (or nested too deeply)"))
    try:
        req = ObservationsRequest.model_validate(payload)
    except ValidationError as exc:
        return _frame(from_validation_errors(exc.errors()))
    try:
        return await service.observe(tenant, stream_id, req)
    except ApiError as err:
        return _frame(err)
    except StoreUnavailable as exc:
        if service.on_store_error is not None:
            service.on_store_error()
        return _frame(unavailable(exc))


__all__ = ["router"]

"""Every 4xx/5xx answer as ``{"error": {"code": "<snake_case>", "message": "<what and how to fix>"}}`` (docs/API.md).

:class:`ApiError` is what the service code raises; the handlers registered by :func:`install` turn it, FastAPI's
request validation errors, Starlette's HTTP errors, :class:`~mpflow.service.store.stream_store.StoreUnavailable` and
anything unexpected into that body. Malformed (or unparseable: nested thousands deep) JSON is 400 ``malformed_json``;
every other fault of the request — a field of the wrong type, a value the model family refuses, an unknown
operator — is 422 ``invalid_request`` with a message that names the field (``observations[0]: ...``): one code
for one kind of fault, whether pydantic or the operators found it; a JSON body sent with another ``Content-Type``
(or none) is 415 ``unsupported_media_type`` naming the header; an unreachable store is 503 with ``Retry-After``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi import routing as fastapi_routing
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from mpflow.service.store.stream_store import StoreOutcomeUnknown, StoreUnavailable
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

log = logging.getLogger("mpflow.errors")

RETRY_AFTER_S = 1

# FastAPI's 400 for a body its JSON parser gave up on other than by a syntax error (a RecursionError from
# arrays nested thousands deep, an integer literal of more than 4300 digits)
_FASTAPI_BODY_ERROR = "There was an error parsing the body"
_UNPARSABLE = "body: not parseable JSON (nested too deeply or a number literal too long); send a JSON object"

# default code per status, used for errors raised without one (Starlette's 404/405, ...)
_CODES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "payload_too_large",
    415: "unsupported_media_type",
    422: "invalid_request",
    500: "internal_error",
    503: "store_unavailable",
}


class ApiError(Exception):
    """An answer other than 2xx: ``status``, a snake_case ``code`` and a message saying what to fix."""

    def __init__(self, status: int, code: str, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.code, self.message)


def error_body(code: str, message: str) -> dict[str, Any]:
    return {"error": {"code": code, "message": message}}


def not_found(stream_id: str) -> ApiError:
    return ApiError(404, "stream_not_found", f"stream_id: no stream {stream_id!r}")


def invalid(message: str) -> ApiError:
    """The 422 ``invalid_request`` of a request field that cannot be used; ``message`` starts with the field
    (e.g. a ``ValueError("field: ...")`` of the operators package, kept as it is)."""
    return ApiError(422, "invalid_request", message)


def too_large(message: str) -> ApiError:
    return ApiError(413, "limit_exceeded", message)


def unavailable(exc: BaseException | None = None) -> ApiError:
    """503 with ``Retry-After``. A write that was sent but never answered
    (:class:`~mpflow.service.store.stream_store.StoreOutcomeUnknown`)
    may still have been applied by the store: that answer says so (``store_outcome_unknown``) and how to find out —
    the same request with the same ``seq`` answers ``duplicate`` if it was."""
    headers = {"Retry-After": str(RETRY_AFTER_S)}
    if isinstance(exc, StoreOutcomeUnknown):
        msg = (
            "the state store did not confirm the write, so it may or may not have been applied; retry the same "
            "request with the same seq (a duplicate answer confirms it was applied)"
        )
        return ApiError(503, "store_outcome_unknown", msg, headers)
    msg = "the state store is unreachable; nothing was applied, retry later"
    return ApiError(503, "store_unavailable", msg, headers)


def _loc(loc: Sequence[Any]) -> str:
    """A pydantic error location as a field path: ``("body", "observations", 0)`` → ``observations[0]``."""
    parts = list(loc)
    if parts and parts[0] in ("body", "query", "path", "header"):
        parts = parts[1:]
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        elif p in ("function-after", "function-before") or str(p).startswith(("function-", "tagged-union")):
            continue
        else:
            out += ("." if out else "") + str(p)
    return out or "body"


def validation_message(errors: Sequence[dict[str, Any]]) -> str:
    """One line per error, each starting with the field it is about — down to the entry where the validator named
    one (a ``ValueError`` with a ``subfield``, e.g. ``[1]`` of ``observations[3]``: ``observations[3][1]: ...``)."""
    lines = []
    for e in errors[:10]:
        msg = str(e.get("msg", "invalid value")).removeprefix("Value error, ")
        loc = _loc(e.get("loc", ()))
        sub = getattr((e.get("ctx") or {}).get("error"), "subfield", None)
        if isinstance(sub, str) and msg.startswith(f"{sub}: "):
            loc, msg = f"{loc}{sub}", msg.removeprefix(f"{sub}: ")
        lines.append(msg if msg.startswith(f"{loc}:") else f"{loc}: {msg}")
    if len(errors) > 10:
        lines.append(f"... and {len(errors) - 10} more")
    return "; ".join(lines)


def from_validation_errors(errors: Sequence[dict[str, Any]]) -> ApiError:
    """400 for a body that is not JSON, else the 422 of :func:`invalid` naming the fields."""
    if any(e.get("type") == "json_invalid" for e in errors):
        return ApiError(400, "malformed_json", "body: not valid JSON; send a JSON object")
    return invalid(validation_message(errors))


def is_json(content_type: str | None) -> bool:
    """Whether a ``Content-Type`` is JSON as FastAPI reads a body: ``application/json`` or ``application/*+json``."""
    media = (content_type or "").split(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def wrong_media_type(request: Request, errors: Sequence[dict[str, Any]]) -> ApiError | None:
    """415 ``unsupported_media_type`` for a route that takes a JSON body when the request's ``Content-Type`` is not
    JSON (curl's default ``application/x-www-form-urlencoded``), or is missing while a body came: FastAPI then left
    the body unparsed, so that it failed validation as "Input should be a valid dictionary" (issue 58, item 3)."""
    route = request.scope.get("route")
    if getattr(route, "body_field", None) is None or getattr(route, "dependant", None) is None:
        return None
    given = request.headers.get("content-type")
    if is_json(given):
        return None
    if given is None and not any(e.get("loc") == ("body",) and isinstance(e.get("input"), bytes) for e in errors):
        return None  # no header and no body: the missing body's own 422
    what = f"is {given.split(';')[0].strip()[:80]!r}" if given else "is missing"
    return ApiError(
        415,
        "unsupported_media_type",
        f"content-type: the Content-Type header {what}; this route takes a JSON body: send it with "
        "'Content-Type: application/json' (curl: -H 'Content-Type: application/json', or --json)",
    )


def _routes(app: Any) -> list[Any]:
    """The app's routes, flat: FastAPI ≥ 0.120 keeps an included router as one entry (``_IncludedRouter``, no
    ``methods``), which :func:`fastapi.routing.iter_route_contexts` expands."""
    expand = getattr(fastapi_routing, "iter_route_contexts", None)
    return list(expand(app.router.routes)) if expand is not None else list(app.router.routes)


def _allowed_methods(request: Request) -> list[str]:
    """Every method of every route on this path (Starlette's own ``Allow`` names only the first route's)."""
    allowed: set[str] = set()
    for route in _routes(request.app):
        methods = getattr(route, "methods", None)
        if methods and route.matches(request.scope)[0] != Match.NONE:
            allowed |= set(methods)
    return sorted(allowed)


def respond(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def install(app: FastAPI, on_store_error: Callable[[], None] | None = None) -> None:
    """Register the handlers that give every error the API's body."""

    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return respond(exc)

    async def request_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return respond(wrong_media_type(request, exc.errors()) or from_validation_errors(exc.errors()))

    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = _CODES.get(exc.status_code, HTTPStatus(exc.status_code).phrase.lower().replace(" ", "_"))
        detail = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
        headers = dict(exc.headers or {})
        if exc.status_code == 404 and detail == "Not Found":
            detail = f"path: no route {request.url.path}"
        if exc.status_code == 400 and detail == _FASTAPI_BODY_ERROR:  # e.g. nested past the parser's depth
            code, detail = "malformed_json", _UNPARSABLE
        if exc.status_code == 405:
            allowed = _allowed_methods(request)
            headers["Allow"] = ", ".join(allowed)
            detail = f"method: {request.method} is not allowed here; use {', '.join(allowed)}"
        return respond(ApiError(exc.status_code, code, detail, headers))

    async def store_error(request: Request, exc: StoreUnavailable) -> JSONResponse:
        if on_store_error is not None:
            on_store_error()
        log.warning("state store unavailable: %s", exc)
        return respond(unavailable(exc))

    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return respond(ApiError(500, "internal_error", "internal error; the request may be retried"))

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(RequestValidationError, request_validation)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(StoreUnavailable, store_error)
    app.add_exception_handler(Exception, unexpected)


__all__ = ["ApiError", "error_body", "from_validation_errors", "install", "invalid", "not_found", "too_large"]

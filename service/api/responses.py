"""The error answers a route declares in ``/openapi.json`` (``responses=error_responses(404, 422)``): each status
with the error body of docs/API.md and what it means on this API."""

from __future__ import annotations

from typing import Any

from mpflow.service.schemas import ErrorResponse

MEANINGS = {
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


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {s: {"model": ErrorResponse, "description": MEANINGS[s]} for s in statuses}


__all__ = ["MEANINGS", "error_responses"]

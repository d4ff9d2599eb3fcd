"""The stream service's refusals, one type per answer: each fixes its HTTP status and ``code``, so the code that
raises one names what went wrong, never a status. They are :class:`~mpflow.service.errors.ApiError` s, answered
with the error body of docs/API.md by the handlers of :mod:`mpflow.service.errors` (whose factories ``invalid``,
``too_large``, ``not_found`` and ``unavailable`` cover the generic 422, 413, 404 and 503)."""

from __future__ import annotations

from typing import ClassVar

from mpflow.service.errors import ApiError


class StreamError(ApiError):
    """An :class:`ApiError` whose status and code are the class's."""

    STATUS: ClassVar[int]
    CODE: ClassVar[str]

    def __init__(self, message: str) -> None:
        super().__init__(self.STATUS, self.CODE, message)


class MalformedJsonError(StreamError):
    """A body or WebSocket frame that is not JSON."""

    STATUS, CODE = 400, "malformed_json"


class StreamExistsError(StreamError):
    """``POST /v1/streams`` with the id of an existing stream."""

    STATUS, CODE = 409, "stream_exists"


class SeqConflictError(StreamError):
    """A ``seq`` that leaves a gap or partly overlaps the applied steps (:mod:`mpflow.service.engine.sequencing`)."""

    STATUS, CODE = 409, "seq_conflict"


class ConcurrentUpdateError(StreamError):
    """Every compare-and-set of an observation request lost to another writer."""

    STATUS, CODE = 409, "concurrent_update"


class OperatorUnavailableError(StreamError):
    """A stream whose trained operator is not installed on this server."""

    STATUS, CODE = 422, "operator_unavailable"


class StoredModelInvalidError(StreamError):
    """A stored stream whose model does not validate on this server."""

    STATUS, CODE = 422, "stored_model_invalid"


class NonFiniteUpdateError(StreamError):
    """An update whose result would not be finite (nothing applied)."""

    STATUS, CODE = 422, "non_finite_update"


__all__ = [
    "ConcurrentUpdateError",
    "MalformedJsonError",
    "NonFiniteUpdateError",
    "OperatorUnavailableError",
    "SeqConflictError",
    "StoredModelInvalidError",
    "StreamError",
    "StreamExistsError",
]

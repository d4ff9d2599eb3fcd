"""The Python client's errors: :class:`MpflowError` (an API error answer, or a request the client refuses to send)
and :class:`MpflowConnectionError` (no answer at all). Apart from :mod:`mpflow.client.http` so that the modules it
uses (:mod:`mpflow.client.observations`) raise them too; the client re-exports both."""

from __future__ import annotations

from typing import Any

import httpx


class MpflowError(Exception):
    """A non-2xx answer: HTTP ``status``, the error ``code`` (snake_case) and ``message`` of its body; or a request
    the client refuses before sending anything (``status`` None, code ``invalid_request``, the message naming the
    field, e.g. an infinite observation entry)."""

    def __init__(self, status: int | None, code: str, message: str, headers: dict[str, str] | None = None):
        super().__init__(f"{status} {code}: {message}" if status is not None else f"{code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers or {}

    @classmethod
    def from_transport(cls, exc: Exception, url: Any) -> MpflowConnectionError:
        """The error of a request that got no answer at all (``exc``, an httpx transport error) from ``url``."""
        code = "timeout" if isinstance(exc, httpx.TimeoutException) else "connection_failed"
        return MpflowConnectionError(None, code, f"no answer from {url}: {exc or type(exc).__name__}")

    @classmethod
    def from_response(cls, response: httpx.Response) -> MpflowError:
        """Read ``{"error": {"code", "message"}}``; a body without it gives a code from the status."""
        code, message = f"http_{response.status_code}", response.reason_phrase or "error"
        try:
            err = response.json().get("error")
            if isinstance(err, dict):
                code, message = str(err.get("code", code)), str(err.get("message", message))
        except (ValueError, AttributeError):
            if response.text:
                message = response.text[:500]
        return cls(response.status_code, code, message, dict(response.headers))


class MpflowConnectionError(MpflowError):
    """The server could not be reached, or did not answer in time (``status`` None): retrying later may help."""

"""What the routes are given, as FastAPI dependencies (``Annotated[T, Depends(...)]``): a handler names what it
needs in its signature — the stream service, the store, the settings, the caller's tenant, its log line — and never
reaches into ``app.state``. ``create_app``'s lifespan builds each once per app (:mod:`mpflow.service.app`); here is
the one place that reads them back, so a test can swap one with ``app.dependency_overrides``.

Every provider is ``async``: FastAPI runs a plain ``def`` dependency on its thread pool, a thread hop per request.
They take an :class:`~starlette.requests.HTTPConnection`, so the WebSocket route gets them too. None adds a
parameter to ``/openapi.json`` except :data:`Tenant` (the bearer scheme, as before).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from fastapi import Depends, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from mpflow.service.api.auth import Authenticator
from mpflow.service.api.metrics import Metrics
from mpflow.service.api.middleware import LOG_KEY, TENANT_KEY
from mpflow.service.engine.catalogue import OperatorCatalogue
from mpflow.service.engine.watchdog import Watchdog
from mpflow.service.settings import Settings
from mpflow.service.store.quotas import TenantSlots
from mpflow.service.store.replication import DegradedShards
from mpflow.service.store.stream_store import StreamStore
from mpflow.service.streams.service import StreamService
from starlette.requests import HTTPConnection

bearer = HTTPBearer(auto_error=False, description="an API key of MPFLOW_API_KEYS (when auth is on)")


class LogLine:
    """The fields of the request's JSON access-log line (:class:`~mpflow.service.api.middleware.Observe` writes it
    when the request is over): ``add(stream=..., step=...)``; nothing when the middleware does not log."""

    def __init__(self, fields: dict[str, Any] | None) -> None:
        self.fields = fields

    def add(self, **fields: Any) -> None:
        if self.fields is not None:
            self.fields.update(fields)


async def log_line(conn: HTTPConnection) -> LogLine:
    return LogLine(conn.scope.get(LOG_KEY))


async def tenant_of(
    conn: HTTPConnection, cred: Annotated[HTTPAuthorizationCredentials | None, Security(bearer)] = None
) -> str:
    """The caller's tenant: authenticated by the gate (:class:`~mpflow.service.api.middleware.AuthGate`) from the
    headers, else here from the bearer key (401 without a valid one)."""
    tenant = conn.scope.get(TENANT_KEY)
    if tenant is None:
        header = f"Bearer {cred.credentials}" if cred is not None else None
        tenant = conn.app.state.auth.tenant(header)
    LogLine(conn.scope.get(LOG_KEY)).add(tenant=tenant)
    return tenant


def from_state(name: str) -> Callable[[HTTPConnection], Awaitable[Any]]:
    """A provider of ``app.state.<name>`` (what the lifespan or ``create_app`` put there)."""

    async def provide(conn: HTTPConnection) -> Any:
        return getattr(conn.app.state, name)

    provide.__name__ = provide.__qualname__ = f"app_state_{name}"
    return provide


#: the providers, by name, for ``app.dependency_overrides[deps.stream_service] = ...``
stream_service = from_state("streams")
stream_store = from_state("store")
settings = from_state("settings")
operators = from_state("operators")
metrics = from_state("metrics")
authenticator = from_state("auth")
degraded_shards = from_state("degraded")
watchdog = from_state("watchdog")
websocket_slots = from_state("sockets")

Tenant = Annotated[str, Security(tenant_of)]
Log = Annotated[LogLine, Depends(log_line)]
Streams = Annotated[StreamService, Depends(stream_service)]
Store = Annotated[StreamStore, Depends(stream_store)]
AppSettings = Annotated[Settings, Depends(settings)]
Operators = Annotated[OperatorCatalogue, Depends(operators)]
AppMetrics = Annotated[Metrics, Depends(metrics)]
Auth = Annotated[Authenticator, Depends(authenticator)]
Degraded = Annotated[DegradedShards, Depends(degraded_shards)]
Sockets = Annotated[TenantSlots, Depends(websocket_slots)]
Stuck = Annotated[Watchdog, Depends(watchdog)]

__all__ = [
    "AppMetrics",
    "AppSettings",
    "Auth",
    "Degraded",
    "Log",
    "LogLine",
    "Operators",
    "Sockets",
    "Store",
    "Streams",
    "Stuck",
    "Tenant",
    "bearer",
    "tenant_of",
]

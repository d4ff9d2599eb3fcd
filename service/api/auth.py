"""Bearer API keys → tenant (docs/DESIGN.md "Auth").

``MPFLOW_API_KEYS="tenantA:key1,tenantB:key2"`` turns auth on: every ``/v1`` request needs
``Authorization: Bearer <key>`` (WebSockets may send the header or ``?api_key=<key>``), and the key's tenant
scopes every stream key. The presented key is compared with *every* configured key by
:func:`hmac.compare_digest` over SHA-256 digests (equal length), without stopping at a match, so the time
taken does not depend on which key matched or how much of a key was right. With no keys configured the
service is open and every request belongs to the tenant ``default`` (a WARNING says so at start).

Keys are never logged. mpflow's own logs never carry headers or query strings; uvicorn's do — its WebSocket
lines print the path *with* the query string (``"WebSocket /v1/streams/x/ws?api_key=..." [accepted]``), at
INFO — so :func:`redact_secrets_in_logs` (called by ``create_app``) adds :class:`RedactSecrets` to the server's
loggers: ``api_key=<value>`` and ``Bearer <value>``, in any case (``API_KEY=``, ``bearer``), are replaced by
``<redacted>`` in every record they emit.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re

from mpflow.service.errors import ApiError
from mpflow.service.log_redaction import RedactSecrets, redact, redact_secrets_in_logs

log = logging.getLogger("mpflow.auth")

OPEN_TENANT = "default"
_TENANT = re.compile(r"^[A-Za-z0-9._~-]{1,128}$")  # tenants are part of store keys


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


class Authenticator:
    def __init__(self, key_tenants: dict[str, str]):
        for tenant in key_tenants.values():
            if not _TENANT.match(tenant):
                raise ValueError(f"api_keys: tenant {tenant!r} must be 1-128 characters from A-Z a-z 0-9 . _ ~ -")
        self._keys = [(_digest(k), t) for k, t in key_tenants.items()]

    @property
    def open(self) -> bool:
        return not self._keys

    def warn_if_open(self) -> None:
        if self.open:
            log.warning(
                "no API keys configured (MPFLOW_API_KEYS): the API is open, every request is tenant %r", OPEN_TENANT
            )
        else:
            log.info("bearer auth on: %d API key(s)", len(self._keys))

    def tenant_for_key(self, key: str | None) -> str | None:
        """The tenant of ``key`` (constant time over all keys), or None."""
        if self.open:
            return OPEN_TENANT
        if not key:
            return None
        given = _digest(key)
        found = None
        for digest, tenant in self._keys:
            if hmac.compare_digest(given, digest) and found is None:
                found = tenant
        return found

    def tenant(self, authorization: str | None, query_key: str | None = None) -> str:
        """The tenant of a request, from its ``Authorization`` header (or a WebSocket's ``api_key``); raises
        401 when auth is on and no valid key was presented."""
        if self.open:
            return OPEN_TENANT
        key = query_key
        if authorization:
            scheme, _, value = authorization.partition(" ")
            key = value.strip() if scheme.lower() == "bearer" else None
        tenant = self.tenant_for_key(key)
        if tenant is None:
            raise ApiError(
                401,
                "unauthorized",
                "authorization: send a valid API key as 'Authorization: Bearer <key>'",
                {"WWW-Authenticate": "Bearer"},
            )
        return tenant


__all__ = ["OPEN_TENANT", "Authenticator", "RedactSecrets", "redact", "redact_secrets_in_logs"]

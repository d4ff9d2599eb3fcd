"""Signed snapshots: which deployment wrote a stream snapshot (docs/API.md "export / import").

A snapshot's ``sha256`` (:func:`mpflow.service.streams.snapshots.checksum`) is unkeyed: anyone can recompute it after
changing the snapshot, so it only tells a truncated or damaged file. Its ``hmac`` is keyed by the deployment's
secret K::

    hmac = HMAC-SHA256(K, FORMAT ‖ 0x00 ‖ stream ‖ 0x00 ‖ state bytes)          (hex)
    key_id = SHA-256("mpflow-snapshot-key-id" ‖ 0x00 ‖ K)[:16]                   (hex)

so a snapshot whose ``hmac`` verifies (compared in constant time, :func:`hmac.compare_digest`) was written by a
server holding K, byte for byte. ``key_id`` names the key without revealing it (a one-way hash of a ≥ 256-bit
secret): it lets import tell "signed by another deployment" from "altered" in its answer.

K is ``MPFLOW_SNAPSHOT_KEY`` when set (its UTF-8 bytes); otherwise 32 random bytes generated once and kept in the
store under ``<prefix>:secret:snapshot-key`` (``SET NX``: :meth:`StreamStore.shared_secret`), so every replica
sharing the store — one Redis or a cluster — signs and verifies with the same key. It is read when the app
starts; when the store does not answer then, at the first export or import (503 until it does).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets

from mpflow.service.settings import Settings
from mpflow.service.store.stream_store import StreamStore

#: the store's name of the generated key (``<prefix>:secret:<name>``)
STORE_NAME = "snapshot-key"
#: bytes of a generated key
GENERATED_BYTES = 32
_KEY_ID_LABEL = b"mpflow-snapshot-key-id\0"


def signature(key: bytes, signed: bytes) -> str:
    """HMAC-SHA256 of ``signed`` under ``key`` (hex)."""
    return hmac.new(key, signed, hashlib.sha256).hexdigest()


def key_id(key: bytes) -> str:
    """A name of ``key`` that does not reveal it (module docstring)."""
    return hashlib.sha256(_KEY_ID_LABEL + key).hexdigest()[:16]


def verifies(key: bytes, signed: bytes, claimed: object) -> bool:
    """Whether ``claimed`` is the signature of ``signed`` under ``key`` (constant-time compare)."""
    return isinstance(claimed, str) and hmac.compare_digest(signature(key, signed), claimed)


class SnapshotKey:
    """The deployment's snapshot key K (module docstring), fetched once and kept."""

    def __init__(self, settings: Settings, store: StreamStore) -> None:
        configured = settings.snapshot_key
        self._key: bytes | None = configured.get_secret_value().encode() if configured is not None else None
        self._store = store
        self._lock = asyncio.Lock()

    async def get(self) -> bytes:
        """K; the first call without ``MPFLOW_SNAPSHOT_KEY`` reads (or generates) it in the store, and raises
        :class:`~mpflow.service.store.stream_store.StoreUnavailable` when the store does not answer."""
        if self._key is None:
            async with self._lock:
                if self._key is None:
                    self._key = await self._store.shared_secret(STORE_NAME, secrets.token_bytes(GENERATED_BYTES))
        return self._key


__all__ = ["GENERATED_BYTES", "STORE_NAME", "SnapshotKey", "key_id", "signature", "verifies"]

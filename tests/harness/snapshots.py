"""Forged stream snapshots, as an attacker makes them from a genuine export (issue 34 item 9).

:func:`forge` changes a snapshot's stream description and state tensors and recomputes its unkeyed ``sha256`` (what
anyone can do). Its ``hmac`` is recomputed only under a ``key`` the forger holds — this deployment's (an insider,
or the validation of every field under test) or another deployment's; without one the original, now stale,
signature stays.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from mpflow.operators.state import ParticleState, read_metadata
from mpflow.service.streams.snapshots import checksum, header
from safetensors.torch import save


def forge(
    snapshot: bytes,
    *,
    key: bytes | None = None,
    stream: dict[str, Any] | None = None,
    tensors: dict[str, torch.Tensor] | None = None,
) -> bytes:
    """``snapshot`` with the description's fields ``stream`` and the state's ``tensors`` (by serialised name,
    ``extras.<name>`` for a method's) replaced or added, its ``sha256`` recomputed, and its ``hmac`` recomputed
    under ``key`` when given (module docstring)."""
    meta = read_metadata(snapshot)
    description = json.dumps({**json.loads(meta["stream"]), **(stream or {})}, sort_keys=True, separators=(",", ":"))
    fields = {**ParticleState.from_bytes(snapshot).fields(), **(tensors or {})}
    state = ParticleState.from_bytes(save({k: t.contiguous() for k, t in fields.items()}))
    data = state.to_bytes()
    if key is not None:
        return state.to_bytes(header(description, data, key))
    return state.to_bytes({**meta, "stream": description, "sha256": checksum(description, data)})


def unsigned(snapshot: bytes) -> bytes:
    """``snapshot`` without its signature (``hmac``, ``key_id``), as a server before signed snapshots wrote it."""
    meta = {k: v for k, v in read_metadata(snapshot).items() if k not in ("hmac", "key_id")}
    return ParticleState.from_bytes(snapshot).to_bytes(meta)


def flip_byte(snapshot: bytes, at: float = 0.9) -> bytes:
    """``snapshot`` with one byte of its state data (a fraction ``at`` into the file) inverted."""
    data = bytearray(snapshot)
    data[int(at * len(data))] ^= 0xFF
    return bytes(data)


__all__ = ["flip_byte", "forge", "unsigned"]

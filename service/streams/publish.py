"""Publishing stream updates to live viewers (Redis publish/subscribe; read by :mod:`mpflow.service.dashboard.events`).

An applied update is told to viewers as a compact event on the channel ``<prefix>:events:{<tenant>:<stream_id>}``,
published only once the update is stored. The channel carries the stream keys' hash tag: on a Redis Cluster it is a
sharded channel (SPUBLISH/SSUBSCRIBE) of the stream's own slot, so the CAS script stays single-slot.
:func:`update_event` builds that event as ``(channel, payload)`` for
:meth:`~mpflow.service.store.stream_store.StreamStore.compare_and_set` (``event=``), whose script PUBLISHes it right
after its write and only if the write happened — atomically with it and without a second round trip
(:meth:`~mpflow.service.streams.service.StreamService.observe` passes it). Because the channel lives in the store, a
viewer connected to one replica sees updates applied by any replica.

Event size is bounded: ``summary`` and the ``per_step`` entries leave out ``cov`` (d² numbers) and ``per_step`` keeps
the last entries only, up to ``MAX_EVENT_NUMBERS`` numbers (means, stds, quantiles) in all (a 1000-step batch of a
2-D stream is sent whole).

This module imports nothing of the request path (:mod:`mpflow.service.streams.service` imports it).
"""

from __future__ import annotations

import json
from typing import Any

MAX_EVENT_NUMBERS = 20000


def channel(prefix: str, tenant: str, stream_id: str) -> str:
    """The pub/sub channel of one stream's updates (hash-tagged like the stream's keys)."""
    return f"{prefix}:events:{{{tenant}:{stream_id}}}"


def event_of(doc: dict[str, Any]) -> dict[str, Any]:
    """The ``update`` event of an observation answer: stream_id, step, updated_at, method, summary (no cov) and
    the last ``per_step`` entries (module docstring)."""
    summary = {k: v for k, v in doc.get("summary", {}).items() if k != "cov"}
    per_step = doc.get("per_step") or []
    dim = max(1, len(summary.get("mean") or [0]))
    vectors = 2 + len(per_step[-1].get("quantiles") or {}) if per_step else 2  # mean, std and each quantile
    keep = max(1, MAX_EVENT_NUMBERS // (vectors * dim))
    return {
        "stream_id": doc["stream_id"],
        "step": doc["step"],
        "updated_at": doc["updated_at"],
        "method": doc["method"],
        "summary": summary,
        "per_step": [{k: v for k, v in e.items() if k != "cov"} for e in per_step[-keep:]],  # per_step_cov's d²
    }


def update_event(prefix: str, tenant: str, stream_id: str, doc: dict[str, Any]) -> tuple[str, str] | None:
    """``(channel, payload)`` telling the stream's viewers of the applied update ``doc`` (an observation answer):
    the stream's :func:`channel` and :func:`event_of` as compact JSON. ``None`` when there is nothing to tell: a
    duplicate (nothing applied) or an answer without ``per_step``."""
    if doc.get("duplicate") or not doc.get("per_step"):
        return None
    return channel(prefix, tenant, stream_id), json.dumps(event_of(doc), separators=(",", ":"))


__all__ = ["MAX_EVENT_NUMBERS", "channel", "event_of", "update_event"]

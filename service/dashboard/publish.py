"""Publishing stream updates to live viewers (Redis publish/subscribe; read by :mod:`service.dashboard.events`).

:func:`announce` is called by :meth:`~service.streams.StreamService.observe` right after an update's
compare-and-set succeeded — the update is durable before anyone hears of it. It publishes a compact event on
the channel ``<prefix>:events:<tenant>:<stream_id>`` from a background task, so the answer to the writer never
waits for it, and a failed publish never fails the (already stored) update: viewers are told, best effort.
Because the channel lives in the store, a viewer connected to one replica sees updates applied by any replica.

Event size is bounded: ``summary`` leaves out ``cov`` (d² numbers) and ``per_step`` keeps the last entries only,
up to ``MAX_EVENT_NUMBERS`` means and stds in all (a 1000-step batch of a 2-D stream is sent whole).

This module imports nothing of the request path (:mod:`service.streams` imports it).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from service.store import StreamStore

log = logging.getLogger("mpflow.events")

MAX_EVENT_NUMBERS = 20000
_pending: set[asyncio.Task] = set()  # background publishes (a reference keeps each task alive until done)


def channel(prefix: str, tenant: str, stream_id: str) -> str:
    """The pub/sub channel of one stream's updates."""
    return f"{prefix}:events:{tenant}:{stream_id}"


def event_of(doc: dict[str, Any]) -> dict[str, Any]:
    """The ``update`` event of an observation answer: stream_id, step, updated_at, method, summary (no cov) and
    the last ``per_step`` entries (module docstring)."""
    summary = {k: v for k, v in doc.get("summary", {}).items() if k != "cov"}
    per_step = doc.get("per_step") or []
    dim = max(1, len(summary.get("mean") or [0]))
    keep = max(1, MAX_EVENT_NUMBERS // (2 * dim))
    return {
        "stream_id": doc["stream_id"],
        "step": doc["step"],
        "updated_at": doc["updated_at"],
        "method": doc["method"],
        "summary": summary,
        "per_step": per_step[-keep:],
    }


async def _publish(store: StreamStore, name: str, payload: str) -> None:
    try:
        await store.client.publish(name, payload)
    except Exception as exc:  # best effort: the update is stored, only live viewers miss it (store down, closing)
        log.debug("could not publish a stream event: %s", exc)


def announce(store: StreamStore, tenant: str, stream_id: str, doc: dict[str, Any]) -> None:
    """Publish the applied update ``doc`` (an observation answer) to the stream's viewers, in the background.
    Duplicates (nothing applied) are not announced."""
    if doc.get("duplicate") or not doc.get("per_step"):
        return
    payload = json.dumps(event_of(doc), separators=(",", ":"))
    task = asyncio.get_running_loop().create_task(_publish(store, channel(store.prefix, tenant, stream_id), payload))
    _pending.add(task)
    task.add_done_callback(_pending.discard)


__all__ = ["MAX_EVENT_NUMBERS", "announce", "channel", "event_of"]

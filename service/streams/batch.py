"""``POST /v1/observations:batch``: many observation requests in one, each answered on its own.

Updates of one stream run in request order, updates of different streams concurrently (so the update engine can
micro-batch them). Each result carries the status its own ``POST .../observations`` would have had, and the
stream document or the error body; one update's refusal does not affect the others.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from mpflow.service.errors import ApiError, too_large, unavailable
from mpflow.service.schemas import BatchRequest, ObservationsRequest
from mpflow.service.store.stream_store import StoreUnavailable

Observe = Callable[[str, str, ObservationsRequest], Awaitable[dict[str, Any]]]


async def run_batch(
    observe: Observe,
    tenant: str,
    req: BatchRequest,
    max_observations: int,
    on_store_error: Callable[[], None] | None = None,
) -> list[dict[str, Any]]:
    """The results of the batch's updates, in request order; 413 when they hold more than ``max_observations``
    observation steps in all. ``observe(tenant, stream_id, request)`` answers one update; ``on_store_error`` is
    called for each that met an unreachable store."""
    total = sum(len(u.observations) for u in req.updates)
    if total > max_observations:
        raise too_large(f"updates: at most {max_observations} observation steps per request in all, got {total}")
    results: list[dict[str, Any] | None] = [None] * len(req.updates)
    chains: dict[str, list[int]] = {}
    for i, u in enumerate(req.updates):
        chains.setdefault(u.stream_id, []).append(i)

    async def one(i: int) -> dict[str, Any]:
        u = req.updates[i]
        body = ObservationsRequest(seq=u.seq, observations=u.observations, return_samples=u.return_samples)
        try:
            doc = await observe(tenant, u.stream_id, body)
            return {"stream_id": u.stream_id, "status": 200, "stream": doc}
        except ApiError as err:
            return {"stream_id": u.stream_id, "status": err.status, "error": err.body()["error"]}
        except StoreUnavailable as exc:
            if on_store_error is not None:
                on_store_error()
            err = unavailable(exc)
            return {"stream_id": u.stream_id, "status": err.status, "error": err.body()["error"]}

    async def chain(indices: list[int]) -> None:
        for i in indices:
            results[i] = await one(i)

    await asyncio.gather(*(chain(ix) for ix in chains.values()))
    return [r for r in results if r is not None]


__all__ = ["run_batch"]

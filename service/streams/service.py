"""The stream service the HTTP and WebSocket routes call: create, observe (one request or a batch), read, sample,
list and delete streams (docs/API.md). It only wires the modules that do the work, one concern each:

* :mod:`mpflow.service.streams.deps` — what the parts below share, handed to each whole;
* :mod:`mpflow.service.streams.creation` — validating a new stream and drawing its step-0 state;
* :mod:`mpflow.service.streams.observations` — an observation request (or a batch of them) end to end, exactly
  once, under the ``seq`` rules and compare-and-set of :mod:`mpflow.service.engine.sequencing`, its steps run by
  the engine (:mod:`mpflow.service.engine`: stepping, fall-backs, micro-batching);
* :mod:`mpflow.service.streams.forecasts` — ``GET .../forecast``, the predictive distributions k steps ahead;
* :mod:`mpflow.service.streams.smoothed` — ``GET .../smoothed``, the fixed-lag smoothed marginals;
* :mod:`mpflow.service.streams.snapshots` — ``GET .../export`` and ``POST /v1/streams:import``;
* :mod:`mpflow.service.engine.views` and :mod:`mpflow.service.streams.documents` — what reads show, and the JSON
  documents;
* :mod:`mpflow.service.streams.state_reads` — what a read of a stored state costs and where it runs (the stream
  document reads the summary kept in the meta, not the state);
* :mod:`mpflow.service.streams.history` — the per-step history a stream keeps (``GET .../history``);
* :mod:`mpflow.service.store.quotas` — each tenant's streams and stored bytes, reserved before every write that
  grows them.

Refusals are :class:`~mpflow.service.errors.ApiError` s whose type fixes the HTTP status
(:mod:`mpflow.service.errors`, :mod:`mpflow.service.stream_errors`); an unreachable store raises
:class:`~mpflow.service.store.stream_store.StoreUnavailable` (503).
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Callable
from typing import Any

import torch
from mpflow.service.engine import views
from mpflow.service.engine.catalogue import OperatorCatalogue
from mpflow.service.engine.fallback import Fallbacks
from mpflow.service.engine.methods import Methods
from mpflow.service.engine.stepping import Stepper
from mpflow.service.engine.summary import QUANTILES, level_key
from mpflow.service.engine.tensor_work import TensorWork
from mpflow.service.engine.update_engine import UpdateEngine
from mpflow.service.errors import invalid, not_found
from mpflow.service.schemas import BatchRequest, CreateStreamRequest, ObservationsRequest
from mpflow.service.settings import Settings
from mpflow.service.store.quotas import TenantUsage
from mpflow.service.store.stream_store import StreamStore
from mpflow.service.streams import costs, creation, history
from mpflow.service.streams.deps import StreamDeps
from mpflow.service.streams.documents import LIST_FIELDS, document, list_entry
from mpflow.service.streams.forecasts import Forecasts
from mpflow.service.streams.observations import Observations, check_samples, run_batch
from mpflow.service.streams.smoothed import Smoothing
from mpflow.service.streams.snapshots import Snapshots
from mpflow.service.streams.state_reads import SUMMARY, StateReads, reading


class StreamService:
    """The operations of docs/API.md on streams (module docstring). ``on_store_error`` is called for each batch
    update that met an unreachable store; ``on_fallback(family, method, fall-back or "none")`` for each step that
    fell back; ``on_outside_domain(family, operator)`` for each stream created outside its operator's training
    domain."""

    def __init__(
        self,
        settings: Settings,
        store: StreamStore,
        engine: UpdateEngine,
        operators: OperatorCatalogue,
        on_store_error: Callable[[], None] | None = None,
        on_fallback: Callable[[str, str, str], None] | None = None,
        on_outside_domain: Callable[[str, str], None] | None = None,
    ):
        self.settings = settings
        self.store = store
        self.engine = engine
        self.operators = operators
        self.on_store_error = on_store_error
        self.on_outside_domain = on_outside_domain
        self.methods = Methods(settings, operators)
        self.work = TensorWork(engine)
        self.fallbacks = Fallbacks(self.methods, engine, self.work, on_fallback)
        self.stepper = Stepper(engine, self.work, self.fallbacks)
        self.usage = TenantUsage(store, settings.max_streams_per_tenant, settings.max_stored_bytes_per_tenant)
        self.reads = StateReads(settings, store, self.work)
        deps = StreamDeps(settings, store, engine, self.methods, self.work, self.stepper, self.usage, self.reads)
        self.observations = Observations(deps)
        self.forecasts = Forecasts(deps)
        self.snapshots = Snapshots(deps)
        self.smoothing = Smoothing(deps)

    async def create(self, tenant: str, req: CreateStreamRequest) -> dict[str, Any]:
        meta, state, summary = await self.work.off_loop(creation.prepare, self.settings, self.methods, req)
        stream_id = req.stream_id or uuid.uuid4().hex
        blob = await self.work.run(meta, state.to_bytes)
        # the summary is kept beside the state: GET /v1/streams/{id} reads it, not the state (.state_reads)
        await self.usage.create(tenant, stream_id, {**meta, SUMMARY: summary}, blob)  # 429 over a quota, 409 taken id
        domain = meta["operator_domain"]
        if domain is not None and not domain["inside"] and self.on_outside_domain is not None:
            self.on_outside_domain(meta["model"]["family"], meta["operator"])
        return document(stream_id, meta, summary)

    async def observe(self, tenant: str, stream_id: str, req: ObservationsRequest) -> dict[str, Any]:
        return await self.observations.observe(tenant, stream_id, req)

    async def batch(self, tenant: str, req: BatchRequest) -> list[dict[str, Any]]:
        limit = self.settings.max_observations_per_request
        observe = functools.partial(self.observations.observe, budget=costs.Budget(self.settings))
        return await run_batch(observe, tenant, req, limit, self.on_store_error)

    async def get(self, tenant: str, stream_id: str, levels: tuple[float, ...] | None = None) -> dict[str, Any]:
        """The stream document from the meta hash alone, its kept summary included; a stream stored without one
        (or with one of fewer quantile levels than the defaults: kept before they grew) is summarised from its state
        once (:mod:`mpflow.service.streams.state_reads`). ``levels``: the summary's quantiles at those levels
        instead (``?levels=``), computed from the state — priced as a read of it — unless the kept summary has
        them all."""
        peeked = await self.reads.peek(tenant, stream_id, inline_bytes=-1)
        meta, summary = peeked.meta, peeked.meta.get(SUMMARY)
        if summary is None or not _has_levels(summary, QUANTILES):
            meta, summary = await self.reads.summary(peeked, _summary)
        if levels is not None and not _has_levels(summary, levels):
            n, d = int(meta["num_particles"]), int(meta["state_dim"])
            price = reading(peeked.size, costs.summary_cost(n, d, len(levels)))

            def at_levels(m: dict[str, Any], data: bytes) -> tuple[dict[str, Any], dict[str, Any]]:
                return m, views.summary_and_draws(m, data, 0, levels)[0]

            meta, summary = await self.reads.run(peeked, price, at_levels)
        elif levels is not None:
            summary = {**summary, "quantiles": {k: summary["quantiles"][k] for k in map(level_key, levels)}}
        return document(stream_id, meta, summary)

    async def samples(self, tenant: str, stream_id: str, n: int) -> torch.Tensor:
        """``n`` draws [n, d] (encoded by the route, in chunks when large: :mod:`mpflow.service.api.json_stream`)."""
        check_samples(self.settings, n)
        peeked = await self.reads.peek(tenant, stream_id)
        cost = costs.check_draws(self.settings, "n", n, peeked.meta)
        price = reading(peeked.size, cost)
        return await self.reads.run(peeked, price, lambda meta, data: views.samples(meta, data, n), draws=n)

    async def forecast(self, tenant: str, stream_id: str, steps: int, dt: float, samples: int) -> dict[str, Any]:
        return await self.forecasts.forecast(tenant, stream_id, steps, dt, samples)

    async def smoothed(self, tenant: str, stream_id: str) -> dict[str, Any]:
        return await self.smoothing.smoothed(tenant, stream_id)

    async def export(self, tenant: str, stream_id: str) -> bytes:
        return await self.snapshots.export(tenant, stream_id)

    async def import_stream(
        self, tenant: str, body: bytes, stream_id: str | None, trust: str = "signed"
    ) -> dict[str, Any]:
        return await self.snapshots.import_(tenant, body, stream_id, trust)

    async def history(self, tenant: str, stream_id: str, limit: int | None) -> bytes:
        return await history.read(self.store, tenant, stream_id, limit, self.settings.history_steps)

    async def particles(self, tenant: str, stream_id: str) -> dict[str, torch.Tensor]:
        peeked = await self.reads.peek(tenant, stream_id)
        n, d = int(peeked.meta["num_particles"]), int(peeked.meta["state_dim"])
        cost = costs.check(
            self.settings,
            "stream_id",
            n,
            lambda m: costs.particles_cost(m, d),
            f"sending this stream's {n} particles of d = {d} as JSON",
            "; read draws with GET .../samples?n=, or the whole state with GET .../export",
        )
        return await self.reads.run(peeked, reading(peeked.size, cost), lambda _, data: views.particles(data))

    async def delete(self, tenant: str, stream_id: str) -> None:
        views.check_id(stream_id)
        if not await self.store.delete(tenant, stream_id):
            raise not_found(stream_id)
        await self.usage.release(tenant, stream_id)

    async def list(self, tenant: str, limit: int, cursor: str | None) -> dict[str, Any]:
        try:  # the listed fields only: a page carries no summaries (nor states)
            fields = [f for f in LIST_FIELDS if f != "stream_id"]
            items, next_cursor = await self.store.list(tenant, limit, cursor, fields)
        except ValueError as exc:
            raise invalid(str(exc)) from None
        return {"streams": [list_entry(it) for it in items], "next_cursor": next_cursor}


def _has_levels(summary: dict[str, Any], levels: tuple[float, ...]) -> bool:
    """Whether a kept summary has the quantiles at every one of ``levels``."""
    kept = summary.get("quantiles") or {}
    return all(level_key(q) in kept for q in levels)


def _summary(meta: dict[str, Any], data: bytes) -> dict[str, Any]:
    """The summary of a stored state (blocking)."""
    return views.summary_and_draws(meta, data, 0)[0]


__all__ = ["StreamService"]

"""An observation request end to end: its limits, the stream's lock, the ``seq`` rules and the compare-and-set
(:mod:`mpflow.service.engine.sequencing`), the steps (:mod:`mpflow.service.engine.stepping`), and the live viewers'
event.

The event for the dashboard's live feeds (:func:`mpflow.service.streams.publish.update_event`) and the steps'
history entries (:mod:`mpflow.service.streams.history`) travel with the compare-and-set, so viewers hear of an update,
and the history records it, exactly when it is stored and never for one that lost its race.

``POST /v1/observations:batch`` (:func:`run_batch`) is many such requests in one, each answered on its own: updates
of one stream run in request order, updates of different streams concurrently (so the update engine can micro-batch
them). Each result carries the status its own ``POST .../observations`` would have had, and the stream document or
the error body; one update's refusal does not affect the others.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from mpflow.operators.models.base import ModelFamily
from mpflow.operators.updaters import Updater
from mpflow.service.engine import anomaly, views
from mpflow.service.engine.sequencing import KeyedLocks, Seq, check_seq, until_written
from mpflow.service.engine.stepping import Applied, parse
from mpflow.service.engine.summary import QUANTILES, StepView
from mpflow.service.errors import ApiError, too_large, unavailable
from mpflow.service.schemas import BatchRequest, ObservationsRequest
from mpflow.service.settings import Settings
from mpflow.service.store.quotas import stored_size
from mpflow.service.store.stream_store import StoreUnavailable
from mpflow.service.streams import costs, history, pit
from mpflow.service.streams.deps import StreamDeps, StreamPart
from mpflow.service.streams.documents import now, observation_document
from mpflow.service.streams.publish import update_event
from mpflow.service.streams.state_reads import SUMMARY


def check_samples(settings: Settings, n: int) -> None:
    """413 for more draws than ``max_samples_per_request``."""
    if n > settings.max_samples_per_request:
        raise too_large(f"n: at most {settings.max_samples_per_request} samples per request, got {n}")


def check_work(
    settings: Settings,
    meta: dict[str, Any],
    model: ModelFamily,
    updater: Updater,
    req: ObservationsRequest,
    budget: costs.Budget | None = None,
) -> tuple[costs.Cost, costs.Cost]:
    """The request's estimated cost and the price of its dearest step (:func:`costs.step_price`, what the update
    engine's lanes read); 413 before any tensor work for a step that integrates in too many sub-steps
    (its ``dt``) or a request over the cost model's budget (:mod:`mpflow.service.streams.costs`), naming
    ``observations`` and how many fit; with a ``budget`` shared by a batch's updates, also when the batch's updates
    together are over it."""
    steps = costs.requested_steps(req.observations)
    for i, (dt, _) in enumerate(steps):
        costs.check_substeps(settings, model, dt, f"observations[{i}]")
    n, d = int(meta["num_particles"]), model.state_dim
    lag = int(meta.get("smoothing_lag") or 0)
    what = f"applying {len(steps)} steps to this {meta['method']} stream (N = {n}, d = {d})"

    levels, cov = step_view(req).levels, req.per_step_cov
    count = None if levels is None else len(levels)

    def cost(m: int) -> costs.Cost:
        return costs.observations_cost(model, updater, n, steps[:m], req.return_samples, lag, count, cov)

    spent = costs.check(settings, "observations", len(steps), cost, what)
    if budget is not None:
        budget.spend(req, spent)
    if len(steps) == 1 and req.return_samples == 0:  # the request is its one step: priced already
        return spent, spent
    return spent, costs.step_price(model, updater, n, steps, lag, count, cov)


def step_view(req: ObservationsRequest) -> StepView:
    """What the request's ``per_step`` entries show beyond the defaults: its quantile ``levels`` (None when it
    asked for none, or for the defaults) and ``per_step_cov``."""
    levels = None if req.levels is None or tuple(req.levels) == QUANTILES else tuple(req.levels)
    return StepView(levels, req.per_step_cov)


def quantiles_of(applied: Applied) -> dict[str, Any]:
    """The ``quantiles`` of the request's last step at the request's levels: the answer's summary's."""
    return {"quantiles": applied.per_step[-1]["quantiles"]}


class Observations(StreamPart):
    """Applies observation requests exactly once (module docstring)."""

    def __init__(self, deps: StreamDeps) -> None:
        super().__init__(deps)
        self._locks = KeyedLocks()

    async def observe(
        self, tenant: str, stream_id: str, req: ObservationsRequest, budget: costs.Budget | None = None
    ) -> dict[str, Any]:
        """The answer to ``POST /v1/streams/{stream_id}/observations`` (docs/API.md); ``budget``: the cost model's
        budget shared with the other updates of a batch."""
        n = len(req.observations)
        limit = self.settings.max_observations_per_request
        if n > limit:
            raise too_large(
                f"observations: at most {limit} steps per request (MPFLOW_MAX_OBSERVATIONS_PER_REQUEST), got {n}"
            )
        check_samples(self.settings, req.return_samples)
        with self.work.observation():
            async with self._locks.hold((tenant, stream_id)):
                return await until_written(lambda: self._attempt(tenant, stream_id, req, n, budget))

    async def _attempt(
        self, tenant: str, stream_id: str, req: ObservationsRequest, n: int, budget: costs.Budget | None
    ) -> dict[str, Any] | None:
        """One read → check seq → apply → compare-and-set: the answer, or None when another writer won."""
        # announce the n updates about to come, so the engine waits for them (and only for them)
        with self.engine.expect(n) as announced:
            meta, data = await views.read(self.store, tenant, stream_id)
            costs.check_draws(self.settings, "return_samples", req.return_samples, meta)
            step = int(meta["step"])
            if check_seq(req.seq, n, step) is Seq.DUPLICATE:
                # a duplicate acknowledges the write it found: only once that is on the replicas WAIT asks for
                if not await self.store.confirm(tenant, stream_id, int(meta["version"])):
                    return None  # the stream changed since the read: read again
                levels = step_view(req).levels
                summary, samples = await self.work.run(
                    meta, views.summary_and_draws, meta, data, req.return_samples, levels, draws=req.return_samples
                )
                return observation_document(stream_id, meta, summary, [], samples, duplicate=True)
            if self.methods.loaded(meta):
                model, updater = self.methods.resolve(meta)
            else:  # the first use of an operator loads it from disk
                model, updater = await self.work.off_loop(self.methods.resolve, meta)
            _, price = check_work(self.settings, meta, model, updater, req, budget)
            parsed = parse(model, req.observations)
            state = await self.work.decode(meta, data)
            view = step_view(req)
            applied = await self.stepper.apply(meta, updater, state, parsed, req.return_samples, announced, price, view)
        scored = anomaly.scored(meta, applied.per_step)  # each step's anomaly_score, and the sketch they leave
        new_meta = {
            "step": step + n,
            "log_evidence": float(applied.last.state.log_evidence[0]),
            "updated_at": now(),
            **pit.latest(applied.per_step),
            **scored,
            SUMMARY: applied.summary,  # kept beside the state: GET /v1/streams/{id} reads it (.state_reads)
        }
        # the stored summary keeps the default levels; the answer's has the request's (its last step's quantiles)
        shown = applied.summary if not view.custom_levels else {**applied.summary, **quantiles_of(applied)}
        doc = observation_document(
            stream_id,
            {**meta, **new_meta},
            shown,
            applied.per_step,
            applied.samples,
            duplicate=False,
            per_step_params=req.per_step_params,
        )
        event = update_event(self.store.prefix, tenant, stream_id, doc)
        entries = history.entries(applied.per_step, req.observations)
        ttl = int(meta["ttl_seconds"])
        size = stored_size(len(applied.blob), {**meta, **new_meta}, step + n, entries, self.settings.history_steps)
        await self.usage.update(tenant, stream_id, size, ttl)  # 429 when it grows the tenant past its quota
        stored = await self.store.compare_and_set(
            tenant,
            stream_id,
            int(meta["version"]),
            new_meta,
            applied.blob,
            ttl,
            event=event,
            history=entries,
            history_steps=self.settings.history_steps,
        )
        return doc if stored else None


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
        body = ObservationsRequest(
            seq=u.seq,
            observations=u.observations,
            return_samples=u.return_samples,
            per_step_params=u.per_step_params,
            levels=u.levels,
            per_step_cov=u.per_step_cov,
        )
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


__all__ = ["Observations", "check_samples", "check_work", "run_batch"]

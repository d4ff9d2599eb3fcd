"""Stream logic: create, observe (with API.md's ``seq`` rules), read, sample, list, delete.

Exactly-once observations. An observation request is handled as

    read (meta, state, version) → check seq → apply every step in memory → compare-and-set(version)

and answered only after the compare-and-set returned: nothing is half-applied (a multi-step request is one
write) and nothing is acknowledged before the store has it. With ``seq`` given and the stream at ``step``:

* ``seq == step + 1``                 → applied;
* ``seq + len(observations) - 1 <= step`` → already applied: 200, ``duplicate: true``, the current state;
* otherwise (a gap or a partial overlap) → 409, nothing applied.

If the compare-and-set loses (another writer — another request, replica or worker — wrote first), the stream is
re-read and the same rules decide again: with ``seq`` that answers ``duplicate`` or 409 (the concurrent writer
won); without ``seq`` the steps are re-applied on the fresh state (appended in arrival order). Inside one process
requests on one stream also queue on a per-stream lock, so they do not waste compute on lost races; the
compare-and-set is what makes it correct across processes.

Where the tensor work runs. An observation step runs on the engine's worker (micro-batched with other streams'),
and so does what follows it for that stream — the finiteness check, the summary, encoding the new state and any
draws — as the job's ``after`` hook: one hop to a thread per step, not one per stage (the summary and the check
are computed for the whole micro-batch at once by the engine's ``summarise`` hook, :func:`row_views`). A small
stored state (N·d ≤ ``INLINE_MAX_ELEMENTS``) is decoded on the event loop (a copy of kilobytes costs less than a
hop), a large one on the auxiliary threads, which also initialise streams and load operators. Other reads
(summaries, draws) stay on the loop for a small state while no observation request is in flight, else go to the
auxiliary threads (measured: ``benchmarks/service_profile.py``).

Validation (shapes against the family, positive-definite covariances, method/model compatibility) happens before
anything is written; the operators package raises ``ValueError("field: ...")``, answered as 422 with that message.

Numerical failures (:mod:`service.numerics`). A step whose method fails numerically — non-finite particles, weights,
evidence or state, a covariance no longer positive definite — is computed again by a safe fall-back (gpf, then
kalman for linear-Gaussian families, then smc); its ``per_step`` entry and the answer say ``"fallback"`` and
``mpflow_update_fallbacks_total`` counts it; the log gets a WARNING, at most one a minute per kind
(:class:`service.throttled_log.ThrottledLog`). If every fall-back fails the request is 422 ``non_finite_update`` and
nothing is applied. Whatever happened, a state (or summary) with a NaN or an infinity is never written.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import re
import secrets
import sys
import uuid
from collections.abc import AsyncIterator, Callable, Hashable
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any

import torch

from operators.models import FAMILIES, make_model
from operators.models.base import ModelFamily
from operators.models.priors import prior_from_spec
from operators.state import ParticleState
from operators.updaters import UPDATERS, NonFiniteError, Updater, get_updater
from service import summary as summaries
from service.catalogue import OperatorCatalogue
from service.dashboard.publish import update_event
from service.engine import Announcement, StepResult, UpdateEngine
from service.errors import ApiError, invalid, not_found, too_large, unavailable
from service.numerics import (
    ALWAYS_RESAMPLE,
    FALLBACK_ERRORS,
    as_method_state,
    fallback_input,
    fallback_methods,
    finite_json,
    finite_rows,
    finite_state,
)
from service.schemas import STREAM_ID_PATTERN, BatchRequest, CreateStreamRequest, ObservationsRequest
from service.settings import Settings
from service.store import StoreUnavailable, StreamStore
from service.throttled_log import ThrottledLog

log = logging.getLogger("mpflow.streams")

DEFAULT_PARTICLES = 256
MAX_WRITE_ATTEMPTS = 50
_MODEL_CACHE_SIZE = 4096
#: the log-weight ``GET .../particles`` shows for a particle of zero weight (−inf: not JSON) — the most negative double
ZERO_WEIGHT_LOG = -sys.float_info.max
#: particles × state dimension (and draws × state dimension) up to which tensor work stays on the event loop
INLINE_MAX_ELEMENTS = 16384
FALLBACK_LOG_INTERVAL_S = 60.0  # at most one fall-back WARNING per (method, fall-back, error) a minute
_STREAM_ID = re.compile(STREAM_ID_PATTERN)


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class KeyedLocks:
    """One asyncio.Lock per key, dropped when no one holds or waits for it."""

    def __init__(self) -> None:
        self._locks: dict[Hashable, tuple[asyncio.Lock, int]] = {}

    @asynccontextmanager
    async def hold(self, key: Hashable) -> AsyncIterator[None]:
        lock, users = self._locks.get(key, (None, 0))
        lock = lock or asyncio.Lock()
        self._locks[key] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[key]
            if users == 1:
                del self._locks[key]
            else:
                self._locks[key] = (lock, users - 1)


def row_views(state: ParticleState) -> list[tuple[dict[str, Any], bool]]:
    """(summary, finite) of every stream of a batched new state: the update engine's ``summarise`` hook, so a
    micro-batch is summarised and checked in one pass (:func:`service.summary.summaries`, :func:`finite_rows`)."""
    return list(zip(summaries.summaries(state), finite_rows(state), strict=True))


def document(stream_id: str, meta: dict[str, Any], summary: dict[str, Any]) -> dict[str, Any]:
    """The stream document of API.md."""
    return {
        "stream_id": stream_id,
        "model": meta["model"],
        "method": meta["method"],
        "operator": meta.get("operator"),
        "num_particles": meta["num_particles"],
        "state_dim": meta["state_dim"],
        "seed": meta["seed"],
        "ttl_seconds": meta["ttl_seconds"],
        "step": meta["step"],
        "summary": summary,
        "created_at": meta["created_at"],
        "updated_at": meta["updated_at"],
    }


def _prior_dim_and_count(spec: dict[str, Any]) -> tuple[int, int | None]:
    """(state dimension, particle count of a particles prior) read off the prior's JSON, for the limits."""
    if spec["type"] == "sampler":  # its dimension is known once it is resolved (prior_from_spec checks it)
        return 0, None
    rows = {"gaussian": "mean", "particles": "particles", "mixture": "means"}[spec["type"]]
    value = spec[rows]
    if spec["type"] == "gaussian":
        return len(value), None
    d = len(value[0]) if value and isinstance(value[0], list) else 0
    return d, (len(value) if spec["type"] == "particles" else None)


def check_method_options(options: dict[str, dict[str, Any]]) -> None:
    """Fail at start, naming the field, on unknown methods or options in ``Settings.method_options``."""
    for method, opts in options.items():
        try:
            get_updater(method, **opts)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"method_options.{method}: {exc}") from None


class StreamService:
    def __init__(
        self,
        settings: Settings,
        store: StreamStore,
        engine: UpdateEngine,
        operators: OperatorCatalogue,
        on_store_error: Callable[[], None] | None = None,
        on_fallback: Callable[[str, str, str], None] | None = None,
    ):
        self.settings = settings
        self.on_store_error = on_store_error
        self.on_fallback = on_fallback  # (family, method, fall-back or "none") per step that fell back
        self._fallback_log = ThrottledLog(log, FALLBACK_LOG_INTERVAL_S)  # the metric counts every one
        self.store = store
        self.engine = engine
        self.operators = operators
        self._updaters: dict[tuple[str, str | None], Updater] = {}
        self._models: dict[str, ModelFamily] = {}
        self._locks = KeyedLocks()
        self._observing = 0  # observation requests in flight

    # ------------------------------------------------------------------ building blocks
    async def _tensor_work(
        self, meta: dict[str, Any], fn: Callable[..., Any], *args: Any, draws: int = 0, slow: bool = False
    ) -> Any:
        """``fn(*args)``: inline for a small state when no other observation request is in flight (module
        docstring), else — or when ``slow`` (e.g. it may load an operator) — on the engine's auxiliary threads."""
        if self._small(meta, draws) and not slow and self._observing <= 1:
            return fn(*args)
        return await self.engine.run(fn, *args)

    @staticmethod
    def _small(meta: dict[str, Any], draws: int = 0) -> bool:
        return max(int(meta["num_particles"]), draws) * int(meta["state_dim"]) <= INLINE_MAX_ELEMENTS

    def updater(self, method: str, operator: str | None) -> Updater:
        """A cached updater per (method, operator name); mpf loads the operator from its folder."""
        key = (method, operator)
        if key not in self._updaters:
            options = self.settings.method_options.get(method, {})
            if operator is None:
                self._updaters[key] = get_updater(method, **options)
            else:
                record = self.operators.by_name(operator)
                if record is None:
                    raise ApiError(
                        422,
                        "operator_unavailable",
                        f"operator: {operator!r} is not installed on this server; GET /v1/operators lists them",
                    )
                self._updaters[key] = get_updater(method, operator=str(record.path), **options)
        return self._updaters[key]

    def model(self, spec: dict[str, Any], state_dim: int) -> ModelFamily:
        """The validated one-stream model (cached by its JSON: models are never mutated)."""
        key = json.dumps([spec["family"], spec.get("params") or {}, state_dim], sort_keys=True)
        model = self._models.get(key)
        if model is None:
            model = make_model(spec["family"], spec.get("params") or {}, state_dim)
            if len(self._models) >= _MODEL_CACHE_SIZE:
                self._models.clear()
            self._models[key] = model
        return model

    def _limits(self, n_particles: int, state_dim: int) -> None:
        s = self.settings
        if n_particles > s.max_particles:
            raise too_large(f"num_particles: at most {s.max_particles} (MPFLOW_MAX_PARTICLES), got {n_particles}")
        if state_dim > s.max_state_dim:
            raise too_large(f"prior: state dimension at most {s.max_state_dim} (MPFLOW_MAX_STATE_DIM), got {state_dim}")

    def _choose_method(self, req: CreateStreamRequest, model: ModelFamily) -> tuple[str, str | None]:
        """(method, operator name) per API.md: default mpf when a trained operator fits, else gpf."""
        method = req.method
        if req.operator is not None:
            if method not in (None, "mpf"):
                raise invalid(f"operator: only used by method mpf, not {method}")
            if self.operators.by_name(req.operator) is None:
                raise invalid(f"operator: unknown operator {req.operator!r}; GET /v1/operators lists them")
            return "mpf", req.operator
        if method is None:
            record = self.operators.find(model.name, model.state_dim) if "mpf" in UPDATERS else None
            return ("mpf", record.name) if record is not None else ("gpf", None)
        if method == "mpf":  # a trained operator when one fits; else the untrained (Daum–Huang) base flow
            record = self.operators.find(model.name, model.state_dim)
            return "mpf", record.name if record is not None else None
        return method, None

    # ------------------------------------------------------------------ create
    def _prepare(self, req: CreateStreamRequest) -> tuple[dict[str, Any], ParticleState, dict[str, Any]]:
        """Validate and initialise a stream (blocking tensor work): (meta, state at step 0, summary)."""
        spec = req.prior.model_dump()
        d, given = _prior_dim_and_count(spec)
        n = req.num_particles or given or DEFAULT_PARTICLES
        self._limits(n, d)
        try:
            prior = prior_from_spec(spec)
            model_spec = req.model.model_dump()
            model = self.model(model_spec, prior.dim)
            method, operator = self._choose_method(req, model)
            updater = self.updater(method, operator)
            updater.check_compatible(model, prior)
            seed = req.seed if req.seed is not None else secrets.randbits(63)
            state = updater.init(prior, model, n, seed)
        except ValueError as exc:
            raise invalid(str(exc)) from None
        summary = summaries.summary(state)
        if not (finite_state(state) and finite_json(summary)):  # e.g. a prior at the edge of float32's range
            raise invalid(
                "prior: the initial particles or their summary are not finite in float32 (|x| up to about 3.4e38, "
                "squares included); rescale the prior"
            )
        now = _now()
        meta = {
            "model": model_spec,
            "method": method,
            "operator": operator,
            "num_particles": n,
            "state_dim": prior.dim,
            "seed": seed,
            "ttl_seconds": req.ttl_seconds or self.settings.default_ttl_seconds,
            "step": 0,
            "log_evidence": 0.0,
            "created_at": now,
            "updated_at": now,
        }
        return meta, state, summary

    async def create(self, tenant: str, req: CreateStreamRequest) -> dict[str, Any]:
        meta, state, summary = await self.engine.run(self._prepare, req)
        stream_id = req.stream_id or uuid.uuid4().hex
        blob = await self._tensor_work(meta, state.to_bytes)
        if not await self.store.create(tenant, stream_id, meta, blob, meta["ttl_seconds"]):
            raise ApiError(409, "stream_exists", f"stream_id: a stream {stream_id!r} already exists; choose another id")
        return document(stream_id, meta, summary)

    # ------------------------------------------------------------------ read
    async def _read(self, tenant: str, stream_id: str) -> tuple[dict[str, Any], bytes]:
        if not _STREAM_ID.match(stream_id):
            raise not_found(stream_id)
        got = await self.store.get(tenant, stream_id)
        if got is None:
            raise not_found(stream_id)
        return got

    def _view(self, meta: dict[str, Any], data: bytes, n_samples: int) -> tuple[dict[str, Any], list | None]:
        """(summary, samples) of a stored state (blocking)."""
        state = ParticleState.from_bytes(data)
        return summaries.summary(state), self._draw(meta, state, n_samples)

    def _draw(self, meta: dict[str, Any], state: ParticleState, n: int) -> list | None:
        if n <= 0:
            return None
        weighted = UPDATERS[meta["method"]].weighted if meta["method"] in UPDATERS else True
        family = FAMILIES.get(meta["model"]["family"])  # None: a stored family this server no longer knows
        gaussian_posterior = family.linear_gaussian if family is not None else True
        seed = summaries.sample_seed(meta["seed"], int(state.step[0]))
        return summaries.draw(state, n, weighted=weighted, seed=seed, gaussian_posterior=gaussian_posterior).tolist()

    async def get(self, tenant: str, stream_id: str) -> dict[str, Any]:
        meta, data = await self._read(tenant, stream_id)
        summary, _ = await self._tensor_work(meta, self._view, meta, data, 0)
        return document(stream_id, meta, summary)

    def _check_samples(self, n: int) -> None:
        if n > self.settings.max_samples_per_request:
            raise too_large(f"n: at most {self.settings.max_samples_per_request} samples per request, got {n}")

    async def samples(self, tenant: str, stream_id: str, n: int) -> list:
        self._check_samples(n)
        meta, data = await self._read(tenant, stream_id)
        _, draws = await self._tensor_work(meta, self._view, meta, data, n, draws=n)
        return draws or []

    async def particles(self, tenant: str, stream_id: str) -> dict[str, Any]:
        meta, data = await self._read(tenant, stream_id)

        def view() -> dict[str, Any]:
            state = ParticleState.from_bytes(data)
            lw = torch.log_softmax(state.log_weights[0].to(torch.float64), -1)
            # a particle of zero weight (smc) has log-weight −inf, which JSON cannot carry: the most negative double
            lw = torch.nan_to_num(lw, neginf=ZERO_WEIGHT_LOG)
            return {"particles": state.particles[0].tolist(), "log_weights": lw.tolist()}

        return await self._tensor_work(meta, view)

    async def delete(self, tenant: str, stream_id: str) -> None:
        if not _STREAM_ID.match(stream_id) or not await self.store.delete(tenant, stream_id):
            raise not_found(stream_id)

    async def list(self, tenant: str, limit: int, cursor: str | None) -> dict[str, Any]:
        try:
            items, next_cursor = await self.store.list(tenant, limit, cursor)
        except ValueError as exc:
            raise invalid(str(exc)) from None
        keys = ("stream_id", "model", "method", "operator", "step", "created_at", "updated_at")
        return {"streams": [{k: it.get(k) for k in keys} for it in items], "next_cursor": next_cursor}

    # ------------------------------------------------------------------ observe
    def _parse(self, model: ModelFamily, observations: list[Any]) -> list[torch.Tensor]:
        try:
            return [model.parse_observation(o, f"observations[{i}]") for i, o in enumerate(observations)]
        except ValueError as exc:
            raise invalid(str(exc)) from None

    def _resolve(self, meta: dict[str, Any]) -> tuple[ModelFamily, Updater]:
        """(model, updater) of a stored stream (blocking when it loads an operator: see ``_observe``)."""
        try:
            model = self.model(meta["model"], meta["state_dim"])
        except ValueError as exc:  # a stored model that no longer validates (a stricter server version)
            raise invalid(str(exc), "stored_model_invalid") from None
        return model, self.updater(meta["method"], meta.get("operator"))

    async def _decode(self, meta: dict[str, Any], data: bytes) -> ParticleState:
        """The stored state: decoded on the event loop when it is small (a copy of a few kilobytes costs less
        than a thread hop, however busy the loop), else on the auxiliary threads."""
        if self._small(meta):
            return ParticleState.from_bytes(data)
        return await self.engine.run(ParticleState.from_bytes, data)

    @staticmethod
    def _checked_summary(method: str, res: StepResult) -> dict[str, Any]:
        """The step's new state summarised — the engine's batched :func:`row_views` row when it has one — after
        checking it is finite (``NonFiniteError``, so the step falls back, if not)."""
        summary, finite = res.summary if res.summary is not None else (None, finite_state(res.state))
        if not finite:  # e.g. kalman's extras; the updater itself checks particles and weights
            raise NonFiniteError(f"{method} left non-finite values in the state")
        return summary if summary is not None else summaries.summary(res.state)

    def _after_step(self, method: str, res: StepResult) -> dict[str, Any]:
        """(on the engine's worker, right after the step) a step that is not the request's last: its state
        checked, its ``per_step`` entry."""
        return summaries.step_summary(res.state, res.info, state_summary=self._checked_summary(method, res))

    def _after_last(
        self, meta: dict[str, Any], n_samples: int, res: StepResult
    ) -> tuple[bytes, dict[str, Any], dict[str, Any], list | None]:
        """(on the engine's worker, right after the step) the request's last step: its state checked, then
        :meth:`_finish` — so an observation costs the event loop one hop to a thread, not four."""
        return self._finish(meta, res, n_samples, self._checked_summary(meta["method"], res))

    def _finish(
        self, meta: dict[str, Any], last: StepResult, n_samples: int, summary: dict[str, Any] | None = None
    ) -> tuple[bytes, dict[str, Any], dict[str, Any], list | None]:
        """(state bytes, summary, the last step's ``per_step`` entry, samples) after the last step (``summary``:
        the new state's, when already computed); 422 and nothing written if the summary is not finite (the last
        guard before the store: every step's state has been checked with :func:`finite_rows`)."""
        summary = summary if summary is not None else summaries.summary(last.state)
        if not finite_json(summary):
            raise invalid(
                "observations: the updated state has non-finite values; nothing was applied. Check the "
                "observations' scale against the model's",
                "non_finite_update",
            )
        step = summaries.step_summary(last.state, last.info, state_summary=summary)
        return last.state.to_bytes(), summary, step, self._draw(meta, last.state, n_samples)

    async def observe(self, tenant: str, stream_id: str, req: ObservationsRequest) -> dict[str, Any]:
        n = len(req.observations)
        limit = self.settings.max_observations_per_request
        if n > limit:
            raise too_large(
                f"observations: at most {limit} steps per request (MPFLOW_MAX_OBSERVATIONS_PER_REQUEST), got {n}"
            )
        self._check_samples(req.return_samples)
        self._observing += 1
        try:
            return await self._observe(tenant, stream_id, req, n)
        finally:
            self._observing -= 1

    async def _observe(self, tenant: str, stream_id: str, req: ObservationsRequest, n: int) -> dict[str, Any]:
        async with self._locks.hold((tenant, stream_id)):
            for _ in range(MAX_WRITE_ATTEMPTS):
                # announce the n updates about to come, so the engine waits for them (and only for them)
                with self.engine.expect(n) as announced:
                    meta, data = await self._read(tenant, stream_id)
                    step = int(meta["step"])
                    if req.seq is not None:
                        if req.seq + n - 1 <= step:
                            summary, samples = await self._tensor_work(
                                meta, self._view, meta, data, req.return_samples, draws=req.return_samples
                            )
                            return self._answer(stream_id, meta, summary, [], samples, duplicate=True)
                        if req.seq != step + 1:
                            raise ApiError(
                                409,
                                "seq_conflict",
                                f"seq: the stream is at step {step}, so the next seq is {step + 1}; got seq "
                                f"{req.seq} with {n} observation(s) (a gap or a partial overlap); nothing was applied",
                            )
                    if (meta["method"], meta.get("operator")) in self._updaters:
                        model, updater = self._resolve(meta)
                    else:  # the first use of an operator loads it from disk
                        model, updater = await self.engine.run(self._resolve, meta)
                    parsed = self._parse(model, req.observations)
                    state = await self._decode(meta, data)
                    last, per_step, fallbacks = await self._apply(
                        meta, model, updater, state, parsed, req.return_samples, announced
                    )
                blob, summary, last_step, samples = last.after
                per_step.append(last_step)
                for i, name in fallbacks.items():
                    per_step[i]["fallback"] = name
                new_meta = {
                    "step": step + n,
                    "log_evidence": float(last.state.log_evidence[0]),
                    "updated_at": _now(),
                }
                doc = self._answer(stream_id, {**meta, **new_meta}, summary, per_step, samples, duplicate=False)
                # live viewers (dashboard/events) hear of it from the compare-and-set itself, once it is stored
                event = update_event(self.store.prefix, tenant, stream_id, doc)
                if await self.store.compare_and_set(
                    tenant, stream_id, int(meta["version"]), new_meta, blob, int(meta["ttl_seconds"]), event=event
                ):
                    return doc
                # another writer won: re-read and decide again
        raise ApiError(
            409, "concurrent_update", "stream: too many concurrent writers on this stream; retry the request"
        )

    async def _apply(
        self,
        meta: dict[str, Any],
        model: ModelFamily,
        updater: Updater,
        state: ParticleState,
        parsed: list[torch.Tensor],
        n_samples: int,
        announced: Announcement | None = None,
    ) -> tuple[StepResult, list[dict[str, Any]], dict[int, str]]:
        """Apply the steps in order: (the last step's result, whose ``after`` is :meth:`_finish`'s (state bytes,
        summary, ``per_step`` entry, samples); the ``per_step`` entries of all steps but the last; {step index:
        fall-back method} of the steps that fell back). Each step's check and summary run on the engine's worker
        right after it (:meth:`_after_step`, :meth:`_after_last`)."""
        method, operator = meta["method"], meta.get("operator")
        per_step: list[dict[str, Any]] = []
        fallbacks: dict[int, str] = {}
        res: StepResult | None = None
        for i, obs in enumerate(parsed):
            if i == len(parsed) - 1:
                after: Callable[[StepResult], Any] = functools.partial(self._after_last, meta, n_samples)
            else:
                after = functools.partial(self._after_step, method)
            try:
                res = await self.engine.update(
                    updater, (method, operator), method, model, state, obs, announced, after=after
                )
            except FALLBACK_ERRORS as exc:  # NaN/inf particles, a collapsed covariance: a safe method instead
                res, fallbacks[i] = await self._fall_back(meta, model, state, obs, i, exc)
                res.after = await self._tensor_work(meta, after, res)
            except ValueError as exc:  # not numerical: the step cannot run as asked (nothing applied)
                raise invalid(f"observations[{i}]: {exc}") from None
            if i < len(parsed) - 1:
                per_step.append(res.after)
            state = res.state
        assert res is not None  # observations has at least one item (schema)
        return res, per_step, fallbacks

    def _fallback_updater(self, name: str, method: str) -> tuple[Updater, tuple[str, str | None]]:
        """(updater, engine key) of fall-back ``name`` for a stream of ``method``; smc resamples at every step
        for an unweighted stream (:mod:`service.numerics`)."""
        weighted = UPDATERS[method].weighted if method in UPDATERS else True
        if name != "smc" or weighted:
            return self.updater(name, None), (name, None)
        key = ("smc", "always-resample")
        if key not in self._updaters:
            options = {**self.settings.method_options.get("smc", {}), **ALWAYS_RESAMPLE}
            self._updaters[key] = get_updater("smc", **options)
        return self._updaters[key], key

    async def _fall_back(
        self,
        meta: dict[str, Any],
        model: ModelFamily,
        state: ParticleState,
        obs: torch.Tensor,
        i: int,
        error: BaseException,
    ) -> tuple[StepResult, str]:
        """Step ``i`` again from ``state`` with the first safe method that succeeds (:mod:`service.numerics`):
        (its result in the form of the stream's method, the fall-back's name); 422 if none does."""
        method = meta["method"]
        tried: list[str] = []
        for name in fallback_methods(method, model):
            updater, key = self._fallback_updater(name, method)
            try:
                start = await self._tensor_work(meta, fallback_input, state, name)
                res = await self.engine.update(updater, key, name, model, start, obs)
                new = await self._tensor_work(meta, as_method_state, res.state, state, method, name)
                if not await self._tensor_work(meta, finite_state, new):
                    raise NonFiniteError(f"{name} left non-finite values in the state")
            except FALLBACK_ERRORS as exc:
                tried.append(f"{name}: {exc}")
                continue
            self._fallback_log.warning(
                (method, name, type(error).__name__),
                "%s step failed (%s: %s); computed by %s instead",
                method,
                type(error).__name__,
                error,
                name,
            )
            self._count_fallback(model.name, method, name)
            return StepResult(new, res.info), name
        self._count_fallback(model.name, method, "none")
        raise invalid(
            f"observations[{i}]: the update failed numerically with {method} ({error}) and with every safe "
            f"fall-back ({'; '.join(tried) or 'none applies'}); nothing was applied. Check the observation's scale "
            "against the model's",
            "non_finite_update",
        )

    def _count_fallback(self, family: str, method: str, fallback: str) -> None:
        if self.on_fallback is not None:
            self.on_fallback(family, method, fallback)

    @staticmethod
    def _answer(
        stream_id: str,
        meta: dict[str, Any],
        summary: dict[str, Any],
        per_step: list[dict[str, Any]],
        samples: list | None,
        *,
        duplicate: bool,
    ) -> dict[str, Any]:
        doc = document(stream_id, meta, summary)
        doc["duplicate"] = duplicate
        doc["per_step"] = per_step
        if samples is not None:
            doc["samples"] = samples
        fell_back = [step["fallback"] for step in per_step if "fallback" in step]
        if fell_back:  # some step was computed by a safe method instead (per_step says which)
            doc["fallback"] = fell_back[-1]
        return doc

    # ------------------------------------------------------------------ batch
    async def batch(self, tenant: str, req: BatchRequest) -> list[dict[str, Any]]:
        """Each update on its own; updates of one stream in request order, different streams concurrently
        (so the engine can micro-batch them)."""
        total = sum(len(u.observations) for u in req.updates)
        limit = self.settings.max_observations_per_request
        if total > limit:
            raise too_large(f"updates: at most {limit} observation steps per request in all, got {total}")
        results: list[dict[str, Any] | None] = [None] * len(req.updates)
        chains: dict[str, list[int]] = {}
        for i, u in enumerate(req.updates):
            chains.setdefault(u.stream_id, []).append(i)

        async def one(i: int) -> dict[str, Any]:
            u = req.updates[i]
            body = ObservationsRequest(seq=u.seq, observations=u.observations, return_samples=u.return_samples)
            try:
                doc = await self.observe(tenant, u.stream_id, body)
                return {"stream_id": u.stream_id, "status": 200, "stream": doc}
            except ApiError as err:
                return {"stream_id": u.stream_id, "status": err.status, "error": err.body()["error"]}
            except StoreUnavailable as exc:
                if self.on_store_error is not None:
                    self.on_store_error()
                err = unavailable(exc)
                return {"stream_id": u.stream_id, "status": err.status, "error": err.body()["error"]}

        async def chain(indices: list[int]) -> None:
            for i in indices:
                results[i] = await one(i)

        await asyncio.gather(*(chain(ix) for ix in chains.values()))
        return [r for r in results if r is not None]


__all__ = ["KeyedLocks", "StreamService", "check_method_options", "document", "row_views"]

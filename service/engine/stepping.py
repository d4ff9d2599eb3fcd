"""Applying a request's observations to a stream's state, in memory, one step after the other on the update engine.

A request of one step runs as one job of the engine's micro-batches (with other streams' steps); a request of
several runs as *run* jobs (:meth:`~mpflow.service.engine.update_engine.UpdateEngine.update_run`): the worker applies
its steps one after the other, as many as fit in a run's slice, with one hop to the worker per slice instead of one per
step (a 1000-observation request costs close to the same steps in-process: docs/benchmarks.md "Long requests"). What
follows each step — the finiteness check, the summary, its ``per_step`` entry, and for the request's last step
encoding the new state and any draws — runs on the worker too, as the job's ``after`` hook (:func:`_after_run`),
the summaries and checks of all the run's states in one vectorised pass (the engine's ``summarise`` hook,
:func:`row_views`). Every step's state is still checked: a run stops at the first step that fails or is not
finite, the steps before it stand, that step goes to the fall-back chain, and the next run starts after it.

A step whose method fails numerically, or leaves a non-finite value anywhere in the state, is computed again by
the fall-back chain (:mod:`mpflow.service.engine.fallback`); its ``per_step`` entry says ``"fallback"``. Any other
``ValueError`` of a step means it cannot run as asked: 422 naming the step. Nothing is written here: the caller
stores the result (:mod:`mpflow.service.streams.observations`), and a state (or summary) with a NaN or an infinity never
gets that far.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from mpflow.operators.models.base import ModelFamily
from mpflow.operators.state import ParticleState
from mpflow.operators.updaters import NonFiniteError, Updater
from mpflow.service.engine import summary as summaries
from mpflow.service.engine.fallback import Fallbacks
from mpflow.service.engine.lanes import Priced
from mpflow.service.engine.methods import updater_key
from mpflow.service.engine.numerics import FALLBACK_ERRORS, finite_json, finite_rows, finite_state
from mpflow.service.engine.tensor_work import TensorWork
from mpflow.service.engine.update_engine import Announcement, RunResult, StepResult, UpdateEngine
from mpflow.service.engine.views import draw
from mpflow.service.errors import invalid
from mpflow.service.stream_errors import NonFiniteUpdateError


def row_views(state: ParticleState) -> list[tuple[dict[str, Any], bool]]:
    """(summary, finite) of every stream of a batched new state: the update engine's ``summarise`` hook, so a
    micro-batch is summarised and checked in one pass (:func:`mpflow.service.engine.summary.summaries`,
    :func:`~mpflow.service.engine.numerics.finite_rows`)."""
    return list(zip(summaries.summaries(state), finite_rows(state), strict=True))


#: one step to apply: its observation (NaN where nothing was observed) and the model of that step (its duration and
#: inputs: :meth:`~mpflow.operators.models.base.ModelFamily.at_step`)
Step = tuple[torch.Tensor, ModelFamily]


#: what to do for steps of another duration with a stream that learns parameters (issue 58, item 2)
_AS_VALUES = (
    "create a stream with those parameters given as values (numbers or matrices, not priors) for steps of any dt"
)


def unit_steps_only(model: ModelFamily) -> str:
    """Why a stream with unknown parameters takes steps of duration 1 only: its θ-particles (``smc2``) are a batch of
    models moved by one transition each, which no step of another duration re-discretises."""
    names = ", ".join(f"model.params.{n}" for n in sorted(model.unknown))
    return f"a stream with unknown parameters ({names} given as priors) takes steps of duration 1 only"


def check_learning_time(model: ModelFamily) -> None:
    """At creation: refuse a model with unknown parameters whose parameters say its steps are of irregular duration —
    an ``lds`` in continuous time (``F``, ``Qc``), whose only use over the discrete ``A``, ``Q`` is steps of other
    durations than 1, which such a stream can never take (a ValueError naming ``model.params.F``). Nothing else in a
    creation request says what ``dt`` the observations will bring: other streams are refused per step
    (:func:`parse_step`)."""
    if model.unknown and model.dynamic and getattr(model, "continuous", False):
        raise ValueError(
            f"model.params.F: an lds in continuous time (F, Qc) is for steps of any dt, but {unit_steps_only(model)}; "
            "give the discrete transition A and Q (the continuous model over one unit of time) to learn the "
            f"parameters, or {_AS_VALUES}"
        )


def parse_step(model: ModelFamily, item: Any, field: str) -> Step:
    """One item of ``observations`` (docs/API.md): a value, or ``{"value", "dt", "u"}``; ValueError naming the
    field."""
    if isinstance(item, dict) and "value" in item:
        obs = model.read_observation(item["value"], f"{field}.value", torch.float64)
        if model.unknown and model.dynamic and item.get("dt", 1.0) != 1.0:
            raise ValueError(f"{field}.dt: {unit_steps_only(model)}; send dt = 1 (or no dt), or {_AS_VALUES}")
        u = item.get("u")
        inputs = None if u is None else torch.tensor(u, dtype=torch.float64)
        return obs, model.at_step(item.get("dt", 1.0), inputs, field)
    return model.read_observation(item, field, torch.float64), model


def parse(model: ModelFamily, observations: list[Any]) -> list[Step]:
    """The request's steps: observations as float64 tensors of the family's observation shape (each updater reads
    them in its own ``model_dtype``), with the model of each step; 422 naming the first bad one."""
    try:
        return [parse_step(model, o, f"observations[{i}]") for i, o in enumerate(observations)]
    except ValueError as exc:
        raise invalid(str(exc)) from None


def observed(obs: torch.Tensor) -> bool:
    """Whether a step's observation has any entry observed (not NaN): a step with nothing observed only predicts."""
    return bool((~torch.isnan(obs)).any()) if obs.numel() else False


def unscored(entry: dict[str, Any]) -> None:
    """A ``per_step`` entry of a step with nothing observed, made to say so: it has no score — a null
    ``log_evidence_increment`` (the updaters' 0, log 1, would read as the least surprising reading there is), no
    ``log_evidence_sd``, and null p-values, log tails and surprise (docs/API.md "Missing observations")."""
    entry["log_evidence_increment"] = None
    entry.pop("log_evidence_sd", None)
    for key in ("pit", "pit_two_sided", "log_tail_lower", "log_tail_upper"):
        if key in entry:
            entry[key] = [None] * len(entry[key])
    if "surprise" in entry:
        entry["surprise"] = None


def checked_summary(method: str, res: StepResult) -> dict[str, Any]:
    """The step's new state summarised — the engine's batched :func:`row_views` row when it has one — after
    checking it is finite (``NonFiniteError``, so the step falls back, if not)."""
    summary, finite = res.summary if res.summary is not None else (None, finite_state(res.state))
    if not finite:  # e.g. kalman's extras; the updater itself checks particles and weights
        raise NonFiniteError(f"{method} left non-finite values in the state")
    return summary if summary is not None else summaries.summary(res.state)


def finish(
    meta: dict[str, Any],
    last: StepResult,
    n_samples: int,
    summary: dict[str, Any] | None = None,
    view: summaries.StepView | None = None,
) -> tuple[bytes, dict[str, Any], dict[str, Any], list | None]:
    """(state bytes, summary, the last step's ``per_step`` entry, samples) after the request's last step
    (``summary``: the new state's, when already computed); 422 and nothing written if the summary is not finite
    (the last guard before the store: every step's state has been checked with :func:`finite_rows`)."""
    summary = summary if summary is not None else summaries.summary(last.state)
    if not finite_json(summary):
        raise NonFiniteUpdateError(
            "observations: the updated state has non-finite values; nothing was applied. Check the observations' "
            "scale against the model's"
        )
    step = summaries.step_summary(last.state, last.info, state_summary=summary, view=view)
    return last.state.to_bytes(), summary, step, draw(meta, last.state, n_samples)


def _after_step(method: str, view: summaries.StepView | None, res: StepResult) -> dict[str, Any]:
    """(on the engine's worker, right after the step) a step that is not the request's last: its state checked,
    its ``per_step`` entry."""
    return summaries.step_summary(res.state, res.info, state_summary=checked_summary(method, res), view=view)


def _after_last(
    meta: dict[str, Any], n_samples: int, view: summaries.StepView | None, res: StepResult
) -> tuple[bytes, dict[str, Any], dict[str, Any], list | None]:
    """(on the engine's worker, right after the step) the request's last step: its state checked, then
    :func:`finish`."""
    return finish(meta, res, n_samples, checked_summary(meta["method"], res), view)


#: a run's ``after`` result: the ``per_step`` entries of the steps it kept, and :func:`finish`'s tuple when the run
#: applied the request's last step (else None)
RunOutcome = tuple[list[dict[str, Any]], tuple[bytes, dict[str, Any], dict[str, Any], list | None] | None]


def _after_run(
    meta: dict[str, Any], n_samples: int, last: int, view: summaries.StepView | None, run: RunResult
) -> RunOutcome:
    """(on the engine's worker, right after a run) each step's state checked, in order, and its ``per_step`` entry;
    a step whose state is not finite ends the run there (it becomes the run's error, the steps after it are
    dropped: they started from it). When the run kept the request's last step (``last``: its index in the run),
    :func:`finish` too."""
    entries: list[dict[str, Any]] = []
    for k, res in enumerate(run.steps):
        try:
            summary = checked_summary(meta["method"], res)
        except NonFiniteError as exc:
            del run.steps[k:]
            run.error = exc
            return entries, None
        entries.append(summaries.step_summary(res.state, res.info, state_summary=summary, view=view))
    if run.error is not None or len(run.steps) != last + 1:
        return entries, None
    return entries, finish(meta, run.steps[-1], n_samples, summary, view)


@dataclass
class Applied:
    """The outcome of a request's steps: the new state encoded, its summary, every step's ``per_step`` entry
    (``"fallback"`` on those computed by a safe method) and the draws asked for."""

    last: StepResult
    blob: bytes
    summary: dict[str, Any]
    per_step: list[dict[str, Any]]
    samples: list | None


class Stepper:
    """Applies observations to a stream's state on the update engine (module docstring)."""

    def __init__(self, engine: UpdateEngine, work: TensorWork, fallbacks: Fallbacks) -> None:
        self.engine = engine
        self.work = work
        self.fallbacks = fallbacks

    async def apply(
        self,
        meta: dict[str, Any],
        updater: Updater,
        state: ParticleState,
        parsed: list[Step],
        n_samples: int,
        announced: Announcement | None = None,
        price: Priced | None = None,
        view: summaries.StepView | None = None,
    ) -> Applied:
        """Apply the steps (:func:`parse`) in order from ``state``, as runs on the engine (module docstring); each
        step's check and summary run on the worker right after it, and the last one's also encode the new state and
        draw ``n_samples``; ``price``: the cost model's price of the dearest step, which places the steps on the
        engine's lanes (:mod:`mpflow.service.engine.lanes`); ``view``: what the ``per_step`` entries show beyond
        the defaults (the request's quantile levels, each step's covariance)."""
        method, last = meta["method"], len(parsed) - 1
        per_step: list[dict[str, Any]] = []
        fallbacks: dict[int, str] = {}
        i, final, res = 0, None, None
        while final is None:
            if i == last:  # one step: a job of the engine's micro-batches, with other streams' steps
                run = await self._last_step(meta, updater, state, parsed[i], n_samples, announced, price, view)
            else:
                steps = [(model, obs) for obs, model in parsed[i:]]
                after = functools.partial(_after_run, meta, n_samples, last - i, view)
                run = await self.engine.update_run(updater, method, state, steps, announced, after=after, price=price)
            entries, final = run.after or ([], None)
            per_step += entries
            i += len(run.steps)
            if run.steps:
                res = run.steps[-1]
                state = res.state
            if run.error is None:
                continue
            obs, model = parsed[i]
            if not isinstance(run.error, FALLBACK_ERRORS):
                if isinstance(run.error, ValueError):  # not numerical: the step cannot run as asked (nothing applied)
                    raise invalid(f"observations[{i}]: {run.error}") from None
                raise run.error
            # NaN/inf particles, a collapsed covariance: a safe method instead, for this step
            res, fallbacks[i] = await self.fallbacks.step(meta, model, updater, state, obs, i, run.error, price)
            if i == last:
                final = await self.work.run(meta, _after_last, meta, n_samples, view, res)
                per_step.append(final[2])
            else:
                per_step.append(await self.work.run(meta, _after_step, method, view, res))
            state = res.state
            i += 1
        assert res is not None  # observations has at least one item (schema)
        blob, summary, _, samples = final
        for i, name in fallbacks.items():
            per_step[i]["fallback"] = name
        for (obs, _), entry in zip(parsed, per_step, strict=True):
            if not observed(obs):
                unscored(entry)
        return Applied(res, blob, summary, per_step, samples)

    async def _last_step(
        self,
        meta: dict[str, Any],
        updater: Updater,
        state: ParticleState,
        step: Step,
        n_samples: int,
        announced: Announcement | None,
        price: Priced | None,
        view: summaries.StepView | None = None,
    ) -> RunResult:
        """The request's last step alone, micro-batched with other streams' steps, as a run of one (its error, if
        it raised)."""
        obs, model = step
        after = functools.partial(_after_last, meta, n_samples, view)
        try:
            res = await self.engine.update(
                updater, updater_key(meta), meta["method"], model, state, obs, announced, after, price
            )
        except Exception as exc:
            return RunResult([], exc)
        return RunResult([res], None, ([res.after[2]], res.after))


__all__ = [
    "Applied",
    "Stepper",
    "check_learning_time",
    "checked_summary",
    "finish",
    "observed",
    "parse",
    "row_views",
    "unit_steps_only",
    "unscored",
]

"""Applying a request's observations to a stream's state, in memory, one step after the other on the update engine.

Each step runs on the engine's worker (micro-batched with other streams'), and so does what follows it for that
stream — the finiteness check, the summary, and for the request's last step encoding the new state and any draws —
as the job's ``after`` hook: one hop to a thread per step, not one per stage. The summary and the check are
computed for the whole micro-batch at once by the engine's ``summarise`` hook (:func:`row_views`).

A step whose method fails numerically, or leaves a non-finite value anywhere in the state, is computed again by
the fall-back chain (:mod:`mpflow.service.fallback`); its ``per_step`` entry says ``"fallback"``. Any other
``ValueError`` of a step means it cannot run as asked: 422 naming the step. Nothing is written here: the caller
stores the result (:mod:`mpflow.service.observations`), and a state (or summary) with a NaN or an infinity never
gets that far.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from mpflow.operators.models.base import ModelFamily
from mpflow.operators.state import ParticleState
from mpflow.operators.updaters import NonFiniteError, Updater
from mpflow.service import summary as summaries
from mpflow.service.engine import Announcement, StepResult, UpdateEngine
from mpflow.service.errors import invalid
from mpflow.service.fallback import Fallbacks
from mpflow.service.methods import updater_key
from mpflow.service.numerics import FALLBACK_ERRORS, finite_json, finite_rows, finite_state
from mpflow.service.stream_errors import NonFiniteUpdateError
from mpflow.service.tensor_work import TensorWork
from mpflow.service.views import draw


def row_views(state: ParticleState) -> list[tuple[dict[str, Any], bool]]:
    """(summary, finite) of every stream of a batched new state: the update engine's ``summarise`` hook, so a
    micro-batch is summarised and checked in one pass (:func:`mpflow.service.summary.summaries`,
    :func:`~mpflow.service.numerics.finite_rows`)."""
    return list(zip(summaries.summaries(state), finite_rows(state), strict=True))


#: one step to apply: its observation (NaN where nothing was observed) and the model of that step (its duration and
#: inputs: :meth:`~mpflow.operators.models.base.ModelFamily.at_step`)
Step = tuple[torch.Tensor, ModelFamily]


def parse_step(model: ModelFamily, item: Any, field: str) -> Step:
    """One item of ``observations`` (docs/API.md): a value, or ``{"value", "dt", "u"}``; ValueError naming the
    field."""
    if isinstance(item, dict) and "value" in item:
        obs = model.read_observation(item["value"], f"{field}.value")
        if model.unknown and model.dynamic and item.get("dt", 1.0) != 1.0:
            raise ValueError(
                f"{field}.dt: a stream with unknown parameters ({', '.join(sorted(model.unknown))}) takes steps of "
                "duration 1; send dt = 1 or give the parameters as values"
            )
        u = item.get("u")
        inputs = None if u is None else torch.tensor(u, dtype=torch.float64)
        return obs, model.at_step(item.get("dt", 1.0), inputs, field)
    return model.read_observation(item, field), model


def parse(model: ModelFamily, observations: list[Any]) -> list[Step]:
    """The request's steps: observations as tensors of the family's observation shape, with the model of each step;
    422 naming the first bad one."""
    try:
        return [parse_step(model, o, f"observations[{i}]") for i, o in enumerate(observations)]
    except ValueError as exc:
        raise invalid(str(exc)) from None


def checked_summary(method: str, res: StepResult) -> dict[str, Any]:
    """The step's new state summarised — the engine's batched :func:`row_views` row when it has one — after
    checking it is finite (``NonFiniteError``, so the step falls back, if not)."""
    summary, finite = res.summary if res.summary is not None else (None, finite_state(res.state))
    if not finite:  # e.g. kalman's extras; the updater itself checks particles and weights
        raise NonFiniteError(f"{method} left non-finite values in the state")
    return summary if summary is not None else summaries.summary(res.state)


def finish(
    meta: dict[str, Any], last: StepResult, n_samples: int, summary: dict[str, Any] | None = None
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
    step = summaries.step_summary(last.state, last.info, state_summary=summary)
    return last.state.to_bytes(), summary, step, draw(meta, last.state, n_samples)


def _after_step(method: str, res: StepResult) -> dict[str, Any]:
    """(on the engine's worker, right after the step) a step that is not the request's last: its state checked,
    its ``per_step`` entry."""
    return summaries.step_summary(res.state, res.info, state_summary=checked_summary(method, res))


def _after_last(
    meta: dict[str, Any], n_samples: int, res: StepResult
) -> tuple[bytes, dict[str, Any], dict[str, Any], list | None]:
    """(on the engine's worker, right after the step) the request's last step: its state checked, then
    :func:`finish`."""
    return finish(meta, res, n_samples, checked_summary(meta["method"], res))


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
    ) -> Applied:
        """Apply the steps (:func:`parse`) in order from ``state``; each step's check and summary run on the engine's
        worker right after it, and the last one's also encode the new state and draw ``n_samples``."""
        method, key = meta["method"], updater_key(meta)
        per_step: list[dict[str, Any]] = []
        fallbacks: dict[int, str] = {}
        res: StepResult | None = None
        for i, (obs, model) in enumerate(parsed):
            if i == len(parsed) - 1:
                after: Callable[[StepResult], Any] = functools.partial(_after_last, meta, n_samples)
            else:
                after = functools.partial(_after_step, method)
            try:
                res = await self.engine.update(updater, key, method, model, state, obs, announced, after=after)
            except FALLBACK_ERRORS as exc:  # NaN/inf particles, a collapsed covariance: a safe method instead
                res, fallbacks[i] = await self.fallbacks.step(meta, model, updater, state, obs, i, exc)
                res.after = await self.work.run(meta, after, res)
            except ValueError as exc:  # not numerical: the step cannot run as asked (nothing applied)
                raise invalid(f"observations[{i}]: {exc}") from None
            if i < len(parsed) - 1:
                per_step.append(res.after)
            state = res.state
        assert res is not None  # observations has at least one item (schema)
        blob, summary, last_step, samples = res.after
        per_step.append(last_step)
        for i, name in fallbacks.items():
            per_step[i]["fallback"] = name
        return Applied(res, blob, summary, per_step, samples)


__all__ = ["Applied", "Stepper", "checked_summary", "finish", "parse", "row_views"]

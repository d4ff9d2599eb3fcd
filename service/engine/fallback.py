"""The fall-back chain of one step: when the stream's method fails numerically (:mod:`mpflow.service.engine.numerics`),
the step is computed again from the same state by the first safe method that succeeds, and its result taken back in
the form of the stream's method.

The service reads no method's state: each updater converts its own (``to_particles``, ``density``,
``from_particles`` of :class:`~mpflow.operators.updaters.Updater`). Into a fall-back goes the stream's state in the
shared form with what the stream's method knows beyond its particles (:func:`hand_over`: kalman's exact Gaussian,
a flow method's step-0 prior); out of it come its particles alone (:func:`take_back`), so the state after a
fall-back step has the form a step of the stream's own method leaves (with what that method records of the
observations carried over: ``mpf``'s posterior-move sites). A stream whose particles are read
unweighted is never handed weighted particles: a weighted fall-back runs with its ``uniform_weight_options``.

Every step that fell back is counted (``on_fallback``: family, method, fall-back or ``"none"``) and logged as a
WARNING, at most one a minute per (method, fall-back, error) (:class:`~mpflow.service.throttled_log.ThrottledLog`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from typing import Any

import torch
from mpflow.operators import smoothing
from mpflow.operators.models.base import ModelFamily
from mpflow.operators.state import ParticleState
from mpflow.operators.updaters import NonFiniteError, Updater
from mpflow.service.engine.lanes import Priced
from mpflow.service.engine.methods import Methods, weighted
from mpflow.service.engine.numerics import FALLBACK_ERRORS, fallback_methods, finite_state
from mpflow.service.engine.tensor_work import TensorWork
from mpflow.service.engine.update_engine import StepResult, UpdateEngine
from mpflow.service.stream_errors import NonFiniteUpdateError
from mpflow.service.throttled_log import ThrottledLog

log = logging.getLogger("mpflow.streams")

#: at most one fall-back WARNING per (method, fall-back, error) in this many seconds (the metric counts every one)
FALLBACK_LOG_INTERVAL_S = 60.0


def hand_over(state: ParticleState, stream: Updater, fallback: Updater) -> ParticleState:
    """The state of a ``stream`` method's stream as the ``fallback`` method reads it (module docstring)."""
    return fallback.from_particles(stream.to_particles(state), stream.density(state))


def take_back(
    new: ParticleState,
    stream: Updater,
    fallback: Updater,
    before: ParticleState,
    obs: torch.Tensor,
    model: ModelFamily,
) -> ParticleState:
    """The ``fallback`` method's result in the form of the ``stream`` method, from the stream's state ``before`` the
    step of observation ``obs`` (module docstring), with the stream's smoothing window moved on by the step as the
    stream's method records it (:meth:`~mpflow.operators.updaters.Updater.smoothed_step`)."""
    window, before = smoothing.split(before)
    resumed = stream.resume(fallback.to_particles(new), before, obs, model)
    return stream.smoothed_step(window, before, resumed, None, model)


class Fallbacks:
    """Runs the fall-back chain of a failed step on the update engine (module docstring)."""

    def __init__(
        self,
        methods: Methods,
        engine: UpdateEngine,
        work: TensorWork,
        on_fallback: Callable[[str, str, str], None] | None = None,
    ) -> None:
        self.methods = methods
        self.engine = engine
        self.work = work
        self.on_fallback = on_fallback
        self._log = ThrottledLog(log, FALLBACK_LOG_INTERVAL_S)

    def updater(self, name: str, meta: dict[str, Any]) -> tuple[Updater, Hashable]:
        """(updater, engine key) of fall-back ``name`` for the stream of ``meta`` (module docstring): weighted when
        the stream's cloud is, under its own options."""
        if weighted(meta):
            return self.methods.updater(name, None), (name, None)
        return self.methods.uniform_weight_updater(name)

    async def step(
        self,
        meta: dict[str, Any],
        model: ModelFamily,
        stream: Updater,
        state: ParticleState,
        obs: torch.Tensor,
        i: int,
        error: BaseException,
        price: Priced | None = None,
    ) -> tuple[StepResult, str]:
        """Step ``i`` (observation ``obs``) again from ``state`` with the first safe method that succeeds, after the
        stream's updater ``stream`` failed with ``error``: (its result in the form of the stream's method, the
        fall-back's name); :class:`~mpflow.service.stream_errors.NonFiniteUpdateError` if none does.
        ``price``: the failed step's, which places the fall-back's step on the engine's lanes (a safe method costs
        no more than the stream's own)."""
        method = meta["method"]
        tried: list[str] = []
        for name in fallback_methods(method, model):
            fallback, key = self.updater(name, meta)
            try:
                start = await self.work.run(meta, hand_over, state, stream, fallback)
                res = await self.engine.update(fallback, key, name, fallback.own_model(model), start, obs, price=price)
                new = await self.work.run(meta, take_back, res.state, stream, fallback, state, obs[None], model)
                if not await self.work.run(meta, finite_state, new):
                    raise NonFiniteError(f"{name} left non-finite values in the state")
            except FALLBACK_ERRORS as exc:
                tried.append(f"{name}: {exc}")
                continue
            self._log.warning(
                (method, name, type(error).__name__),
                "%s step failed (%s: %s); computed by %s instead",
                method,
                type(error).__name__,
                error,
                name,
            )
            self._count(model.name, method, name)
            return StepResult(new, res.info), name
        self._count(model.name, method, "none")
        raise NonFiniteUpdateError(
            f"observations[{i}]: the update failed numerically with {method} ({error}) and with every safe "
            f"fall-back ({'; '.join(tried) or 'none applies'}); nothing was applied. Check the observation's scale "
            "against the model's"
        )

    def _count(self, family: str, method: str, fallback: str) -> None:
        if self.on_fallback is not None:
            self.on_fallback(family, method, fallback)


__all__ = ["FALLBACK_LOG_INTERVAL_S", "Fallbacks", "hand_over", "take_back"]

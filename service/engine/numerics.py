"""Numerical safety of stream updates: which failures a fall-back may cure, which methods are the fall-backs, and
the finiteness guard every state passes before it is written.

Fall-back. When a stream's method fails on a step — :class:`~mpflow.operators.updaters.NonFiniteError` (its particles,
weights or evidence came out NaN/inf: a learned operator or a step-size-driven flow pushed far out of its range,
e.g. by an observation ~1e30), :class:`torch.linalg.LinAlgError`, or
:class:`mpflow.operators.gaussian.NotPositiveDefinite` (a covariance that stays indefinite with every jitter, when a
cloud collapses or overflows, the commonest failure under explosive dynamics) — that one step is computed again
from the same state by the first method of :data:`FALLBACK_ORDER` that succeeds and runs the family:

1. ``gpf`` — Gaussian particle flow in float64 with step sizes that are halved whenever a step raises the free
   energy (GPF Algorithm 2): it cannot diverge, and for a Gaussian target it converges to the exact posterior
   moments (GPF Theorem 1);
2. ``kalman`` — linear-Gaussian families only: the closed-form conjugate update in float64 (exact);
3. ``smc`` — bootstrap reweighting in the log domain: no optimisation and no linear algebra on the update path,
   it keeps the previous weights when every particle is impossible, so it stays finite wherever the particles
   and the likelihood are.

Any other ``ValueError`` of a step is not numerical (the step cannot run as asked): 422 naming the step, no
fall-back. If every fall-back fails too, the step — and so the whole request — is refused
(422 ``non_finite_update``) and nothing is applied. The method the stream was created with does not change: each
updater converts its own state to and from the form every method reads (``to_particles``, ``density``,
``from_particles`` of :class:`~mpflow.operators.updaters.Updater`), so the next step runs the stream's own method
again; :mod:`mpflow.service.engine.fallback` runs the chain.

Guard. :func:`finite_state` / :func:`finite_json` say whether a state (every float tensor: particles,
log-weights — where −inf is a legitimate zero weight, NaN and +inf are not —, log-density, evidence, extras) and
a JSON summary are finite; the stream service never writes a state that is not. :func:`within_float32` is the bound
a new or imported stream's summary must meet: every number of it (mean, covariance, quantiles, ...) within
±:data:`FLOAT32_MAX`, the range of every number the API accepts — a cloud spread over ±3e38 has a covariance of
~1e77, which no request could have given.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from mpflow.operators import gaussian
from mpflow.operators.models.base import ModelFamily
from mpflow.operators.state import ParticleState
from mpflow.operators.updaters import UPDATERS, NonFiniteError

#: the largest float32 (the same number as :data:`mpflow.service.schemas.FLOAT32_MAX`)
FLOAT32_MAX = float(torch.finfo(torch.float32).max)
#: errors of a step that a fall-back may cure (module docstring; the inputs were validated before the step)
FALLBACK_ERRORS: tuple[type[BaseException], ...] = (
    NonFiniteError,
    torch.linalg.LinAlgError,
    gaussian.NotPositiveDefinite,
)
#: the safe methods, tried in this order (module docstring)
FALLBACK_ORDER = ("gpf", "kalman", "smc")


def fallback_methods(method: str, model: ModelFamily) -> list[str]:
    """The fall-backs for a stream of ``method`` on ``model``, in order (never the method itself); none for a method
    that learns the model's unknown parameters (no other method can take its step)."""
    if method in UPDATERS and UPDATERS[method].unknown_params:
        return []
    return [m for m in FALLBACK_ORDER if m != method and m in UPDATERS and UPDATERS[m].refusal(type(model)) is None]


def finite_rows(state: ParticleState) -> list[bool]:
    """Per stream of a batch: every float tensor of its state finite (log-weights: no NaN or +inf, and not all
    −inf)."""
    lw = state.log_weights
    ok = ~torch.isnan(lw).any(-1) & ~(lw == math.inf).any(-1) & (lw > -math.inf).any(-1)
    tensors = [state.particles, state.log_evidence, *state.extras.values()]
    if state.log_density is not None:
        tensors.append(state.log_density)
    for t in tensors:
        if t.is_floating_point():
            ok &= torch.isfinite(t).reshape(t.shape[0], -1).all(-1)
    return ok.tolist()


def finite_state(state: ParticleState) -> bool:
    """Every float tensor of the state finite, for every stream (:func:`finite_rows`)."""
    return all(finite_rows(state))


def finite_json(value: Any) -> bool:
    """No NaN or infinite number anywhere in a JSON-like value (dicts, lists, numbers)."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(finite_json(v) for v in value.values())
    if isinstance(value, list | tuple):
        return all(finite_json(v) for v in value)
    return True


def within_float32(value: Any) -> bool:
    """:func:`finite_json`, and every number within ±:data:`FLOAT32_MAX` (module docstring)."""
    if isinstance(value, float | int) and not isinstance(value, bool):
        return math.isfinite(value) and abs(value) <= FLOAT32_MAX
    if isinstance(value, dict):
        return all(within_float32(v) for v in value.values())
    if isinstance(value, list | tuple):
        return all(within_float32(v) for v in value)
    return True


__all__ = [
    "FALLBACK_ERRORS",
    "FALLBACK_ORDER",
    "FLOAT32_MAX",
    "fallback_methods",
    "finite_json",
    "finite_rows",
    "finite_state",
    "within_float32",
]

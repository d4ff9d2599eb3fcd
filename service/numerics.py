"""Numerical safety of stream updates: fall-back methods for a step whose method failed, and the finiteness
guard every state passes before it is written.

Fall-back. When a stream's method fails on a step — :class:`~operators.updaters.NonFiniteError` (its particles,
weights or evidence came out NaN/inf: a learned operator or a step-size-driven flow pushed far out of its range,
e.g. by an observation ~1e30), :class:`torch.linalg.LinAlgError`, or
:class:`operators.gaussian.NotPositiveDefinite` (a covariance that stays indefinite with every jitter, when a
cloud collapses or overflows: measured as the commonest failure of explosive dynamics) — that one step is
computed again from the same state by the first method of
:data:`FALLBACK_ORDER` that succeeds and runs the family:

1. ``gpf`` — Gaussian particle flow in float64 with step sizes that are halved whenever a step raises the free
   energy (GPF Algorithm 2): it cannot diverge, and for a Gaussian target it converges to the exact posterior
   moments (GPF Theorem 1);
2. ``kalman`` — linear-Gaussian families only: the closed-form conjugate update in float64 (exact);
3. ``smc`` — bootstrap reweighting in the log domain: no optimisation and no linear algebra on the update path,
   it keeps the previous weights when every particle is impossible, so it stays finite wherever the particles
   and the likelihood are.

Any other ``ValueError`` of a step is not numerical (the step cannot run as asked): 422 naming the step, no
fall-back. If every fall-back fails too, the step — and so the whole request — is refused
(422 ``non_finite_update``) and nothing is applied. The method the stream was created with does not change:
the fall-back's result is converted back to the form the stream's method reads (:func:`as_method_state`), so
the next step runs the stream's own method again.

State forms (``operators/updaters``): every method keeps particles [1, N, d] and normalised log-weights [1, N];
only ``smc`` is weighted (the others are read with uniform weights). ``kalman`` keeps the exact Gaussian in
``extras["mean"]``/``extras["cov"]`` (float64); the flow methods (gpf, svgd, nvgd) keep the step-0 prior in
``extras["prior_*"]`` until their first step; ``mpf`` keeps no extras and, with ``track_density``, the
particles' log-density. Hence (:func:`fallback_input`, :func:`as_method_state`):

* into a fall-back: a kalman stream's exact Gaussian becomes the flow's prior (``prior_*`` extras) so gpf
  starts from N(m, P) itself; into ``kalman`` the state's Gaussian (its step-0 prior where it still has one,
  else the weighted moments m = Σ w_i x_i, C = Σ w_i (x_i − m)(x_i − m)ᵀ) becomes ``mean``/``cov``;
* out of a fall-back: ``prior_*`` extras are dropped (a step was applied); a kalman stream gets ``mean``/``cov``
  back as the moments of the new particles, every other stream loses them; an unweighted stream is never
  handed weighted particles (its smc fall-back resamples at every step: ``ess_threshold`` above 1); a tracked
  log-density becomes the log-density of the Gaussian fitted to the new particles.

Guard. :func:`finite_state` / :func:`finite_json` say whether a state (every float tensor: particles,
log-weights — where −inf is a legitimate zero weight, NaN and +inf are not —, log-density, evidence, extras) and
a JSON summary are finite; the stream service never writes a state that is not.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from operators import gaussian
from operators.models.base import ModelFamily
from operators.models.priors import GaussianMixture
from operators.state import ParticleState
from operators.updaters import UPDATERS, NonFiniteError
from operators.updaters.base import prior_extras, prior_from_extras

#: errors of a step that a fall-back may cure (module docstring; the inputs were validated before the step)
FALLBACK_ERRORS: tuple[type[BaseException], ...] = (
    NonFiniteError,
    torch.linalg.LinAlgError,
    gaussian.NotPositiveDefinite,
)
#: the safe methods, tried in this order (module docstring)
FALLBACK_ORDER = ("gpf", "kalman", "smc")
#: smc options for a fall-back that must hand back uniformly weighted particles (ESS ≤ N < 2N: resample always)
ALWAYS_RESAMPLE = {"ess_threshold": 2.0}


def fallback_methods(method: str, model: ModelFamily) -> list[str]:
    """The fall-backs for a stream of ``method`` on ``model``, in order (never the method itself)."""
    return [
        m
        for m in FALLBACK_ORDER
        if m != method and m in UPDATERS and (model.linear_gaussian or not UPDATERS[m].needs_linear_gaussian)
    ]


def _gaussian_of(state: ParticleState) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean [1, d], cov [1, d, d]) in float64: kalman's exact Gaussian, the step-0 prior's moments, or the
    weighted moments of the particles."""
    if "mean" in state.extras and "cov" in state.extras:
        return state.extras["mean"].to(torch.float64), state.extras["cov"].to(torch.float64)
    prior = prior_from_extras(state.extras)
    if prior is not None:
        mean, cov = prior.to(torch.float64).moments()
        return mean, cov
    return gaussian.moments(state.particles.to(torch.float64), state.log_weights)


def fallback_input(state: ParticleState, fallback: str) -> ParticleState:
    """The stream's state as the ``fallback`` method reads it (module docstring)."""
    extras = dict(state.extras)
    if fallback == "kalman":
        mean, cov = _gaussian_of(state)
        return state.replace(extras={"mean": mean, "cov": cov})
    if "mean" in extras and "cov" in extras:  # a kalman stream: its exact Gaussian is the flow's prior
        mean, cov = extras.pop("mean").to(torch.float64), extras.pop("cov").to(torch.float64)
        extras.update(prior_extras(GaussianMixture.gaussian(mean, cov).to(state.particles.dtype)))
    return state.replace(extras=extras)


def as_method_state(new: ParticleState, old: ParticleState, method: str, fallback: str) -> ParticleState:
    """The fall-back's result ``new`` in the form the stream's ``method`` reads (module docstring); ``old`` is
    the state before the step."""
    extras = {k: v for k, v in new.extras.items() if not k.startswith("prior_") and k not in ("mean", "cov")}
    if method == "kalman":
        if fallback == "kalman":
            extras.update(mean=new.extras["mean"], cov=new.extras["cov"])
        else:
            mean, cov = gaussian.moments(new.particles.to(torch.float64), new.log_weights)
            extras.update(mean=mean, cov=cov)
    log_density = None
    if old.log_density is not None:
        x = new.particles.to(torch.float64)
        mean, cov = gaussian.moments(x, new.log_weights)
        log_density = gaussian.log_prob(x, mean, gaussian.cholesky(cov)).to(old.log_density.dtype)
    return new.replace(extras=extras, log_density=log_density)


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


__all__ = [
    "ALWAYS_RESAMPLE",
    "FALLBACK_ERRORS",
    "FALLBACK_ORDER",
    "as_method_state",
    "fallback_input",
    "fallback_methods",
    "finite_json",
    "finite_rows",
    "finite_state",
]

"""The updater interface: one Bayes step for a batch of streams.

``Updater.init(prior, model, num_particles, seed)`` draws the step-0 particle cloud;
``Updater.update(state, obs, model)`` moves it from p(x | o_<m) to p(x | o_≤m) and returns the new state
and a :class:`~mpflow.operators.state.StepInfo` (log p(o_m | o_<m) estimate, ESS, iterations).

Shapes: state.particles [B, N, d], obs [B, *obs_shape], a model with batch size B (or 1, broadcast).
Subclasses implement ``_update``; the base class restores each stream's generator, checks shapes and
finiteness, advances ``step``, accumulates ``log_evidence`` and saves the generators back, so every
method is reproducible per stream whatever the batch it ran in.

Hand-over between methods. A step one method cannot compute (it fails numerically) may be computed by another
from the same state and the result taken back (the service's fall-back). Each method converts its own state, so
the caller never reads another method's extras:

* :meth:`Updater.to_particles` — the state in the *shared form*: particles, log-weights, step, evidence,
  generators and log-density as they are, no extras;
* :meth:`Updater.density` — what the method knows beyond its particles: the exact density of the belief, where
  it keeps one (kalman's Gaussian, a flow method's step-0 prior), else None;
* :meth:`Updater.from_particles` — a shared-form state (and, where known, that density) in this method's form.

A new method overrides the three only where it keeps extras or a log-density; :attr:`Updater.weighted` methods
name in :attr:`Updater.uniform_weight_options` how they hand back uniformly weighted particles.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from mpflow.operators.models.base import ModelFamily
from mpflow.operators.models.priors import GaussianMixture, ParticlePrior, Prior
from mpflow.operators.rng import Generators, generator, generators_from_state, generators_state
from mpflow.operators.state import ParticleState, StepInfo


class NonFiniteError(FloatingPointError):
    """An update produced NaN or infinite particles; the caller keeps the old state."""


class Updater:
    name: ClassVar[str]
    #: particles carry importance weights (SMC); others keep them uniform
    weighted: ClassVar[bool] = False
    #: only for linear-Gaussian families (Kalman)
    needs_linear_gaussian: ClassVar[bool] = False
    #: default options; ``__init__`` accepts only these keys
    defaults: ClassVar[dict[str, Any]] = {}
    #: the options a client may set for its own stream (``method_options`` of the REST API): cheap to honour and
    #: bounded in cost; the others are the server's (``MPFLOW_METHOD_OPTIONS``)
    stream_options: ClassVar[frozenset[str]] = frozenset()
    #: options under which a weighted method returns uniformly weighted particles, so that a method that reads
    #: its particles unweighted can take its result back (empty: the method's particles are always uniform)
    uniform_weight_options: ClassVar[dict[str, Any]] = {}

    def __init__(self, **options: Any):
        unknown = sorted(set(options) - set(self.defaults))
        if unknown:
            raise ValueError(f"options: unknown option(s) {unknown} for {self.name}; allowed: {sorted(self.defaults)}")
        self.options = {**self.defaults, **options}

    # ------------------------------------------------------------------ compatibility
    def check_compatible(self, model: ModelFamily, prior: Prior | None = None) -> None:
        """Raise ValueError (→ 422) if this method cannot run this model/prior."""
        if self.needs_linear_gaussian and not model.linear_gaussian:
            raise ValueError(
                f"method: {self.name} is exact only for linear-Gaussian families "
                f"(linear_gaussian, lds), not {model.name}; use smc, gpf or svgd"
            )

    # ------------------------------------------------------------------ init
    def init(
        self, prior: Prior, model: ModelFamily, num_particles: int, seed: int | Sequence[int] = 0
    ) -> ParticleState:
        """Step-0 state: N particles from the prior (or the given particles), uniform weights."""
        self.check_compatible(model, prior)
        B = prior.batch_size
        seeds = [seed] * B if isinstance(seed, int) else list(seed)
        if len(seeds) != B:
            raise ValueError(f"seed: expected {B} seeds, got {len(seeds)}")
        gens = [generator(s) for s in seeds]
        if prior.dim != model.state_dim:
            raise ValueError(
                f"prior: dimension {prior.dim} does not match the model's state dimension {model.state_dim}"
            )
        if isinstance(prior, ParticlePrior):
            if prior.particles.shape[1] != num_particles:
                raise ValueError(
                    f"num_particles: the particles prior has {prior.particles.shape[1]} particles but "
                    f"num_particles is {num_particles}; omit num_particles or make them agree"
                )
            particles = prior.particles.to(torch.float32)
        else:
            particles = prior.sample(num_particles, gens).to(torch.float32)
        state = ParticleState(
            particles=particles,
            log_weights=torch.full((B, num_particles), -math.log(num_particles)),
            step=torch.zeros(B, dtype=torch.int64),
            log_evidence=torch.zeros(B, dtype=torch.float64),
            rng=generators_state(gens),
        )
        return self._init(state, prior, model, gens)

    def _init(self, state: ParticleState, prior: Prior, model: ModelFamily, gens: Generators) -> ParticleState:
        """Method-specific initialisation (extras); the default keeps the sampled cloud."""
        return state

    # ------------------------------------------------------------------ update
    def autograd_free(self) -> bool:
        """True when this method's step records no gradient (the default: False). Its :meth:`update` then runs
        under ``torch.inference_mode`` — no autograd bookkeeping on any op, ~15 % of a small MPF step — and
        returns inference tensors: use them as values (functional ops, serialisation), not in autograd."""
        return False

    def update(self, state: ParticleState, obs: torch.Tensor, model: ModelFamily) -> tuple[ParticleState, StepInfo]:
        with torch.inference_mode(self.autograd_free()):
            return self._checked_update(state, obs, model)

    def _checked_update(
        self, state: ParticleState, obs: torch.Tensor, model: ModelFamily
    ) -> tuple[ParticleState, StepInfo]:
        B = state.batch_size
        if obs.shape[0] != B:
            raise ValueError(f"observations: expected a batch of {B}, got {obs.shape[0]}")
        if model.batch_size not in (1, B):
            raise ValueError(f"model: batch of {model.batch_size} does not match {B} streams")
        if not bool(torch.isfinite(obs).all()):
            raise ValueError("observations: contain NaN or infinite values")
        gens = generators_from_state(state.rng)
        new, info = self._update(state, obs.to(state.particles.dtype), model, gens)
        finite = (
            torch.isfinite(new.particles).all()
            & torch.isfinite(info.log_evidence_increment).all()
            & ~torch.isnan(new.log_weights).any()  # −inf is a legitimate zero weight; NaN never is
            & (torch.logsumexp(new.log_weights, -1) > -torch.inf).all()
        )
        if not bool(finite):
            raise NonFiniteError(f"{self.name} produced non-finite particles, weights or evidence")
        new = new.replace(
            step=state.step + 1,
            log_evidence=state.log_evidence + info.log_evidence_increment.to(torch.float64),
            rng=generators_state(gens),
        )
        return new, info

    def _update(
        self, state: ParticleState, obs: torch.Tensor, model: ModelFamily, gens: Generators
    ) -> tuple[ParticleState, StepInfo]:
        raise NotImplementedError

    # ------------------------------------------------------------------ hand-over between methods
    def to_particles(self, state: ParticleState) -> ParticleState:
        """``state`` in the shared form every method reads (module docstring): without this method's extras —
        what they say about the belief is :meth:`density`'s."""
        return state.replace(extras={})

    def density(self, state: ParticleState) -> GaussianMixture | None:
        """The exact density of the belief ``state`` represents, where this method keeps one; None (the
        default) where the particles are all there is."""
        return None

    def from_particles(self, state: ParticleState, density: GaussianMixture | None = None) -> ParticleState:
        """A shared-form ``state`` (another method's, or the result of its step) in this method's form;
        ``density``: the belief's exact density where the other method knows it (:meth:`density`). The default
        is the state as it is, for a method that keeps nothing besides its particles and weights."""
        return state


def prior_extras(prior: Prior) -> dict[str, torch.Tensor]:
    """The step-0 prior density as state extras (a Gaussian mixture), so flow methods use the exact
    prior at step 0; empty for a particles prior."""
    if isinstance(prior, GaussianMixture):
        return {"prior_weights": prior.weights, "prior_means": prior.means, "prior_covs": prior.covs}
    return {}


def prior_from_extras(extras: dict[str, torch.Tensor]) -> GaussianMixture | None:
    if "prior_weights" not in extras:
        return None
    return GaussianMixture(extras["prior_weights"], extras["prior_means"], extras["prior_covs"])


def without_prior(extras: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in extras.items() if not k.startswith("prior_")}

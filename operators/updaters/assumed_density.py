"""Flow methods used as assumed-density filters (GPF, SVGD, NVGD).

At step m the target is

    π_m(x) ∝ p̂_{m-1}(x) · p(o_m | x),

where p̂_{m-1} is the exact prior at step 0 (a Gaussian or mixture, pushed through the transition for
dynamic families) and afterwards the Gaussian N(m, C) fitted to the current particles (pushed through the
linear-Gaussian transition x' = F x + c + N(0, Q) of ``lds`` / ``stochastic_volatility``: F m + c,
F C Fᵀ + Q). The particles — moved through the transition for dynamic families — are then transported to
π_m by the method's ``solve`` (a particle flow run to convergence). Old observations are never kept.

Evidence (option ``evidence``): ``predictive`` (log mean_i p(o | x_i) over the predicted particles),
``importance`` (IS from the Gaussian fitted to the updated particles) or ``kl`` (KL integration, Zaki et
al. eq. 6, from the integral the flow accumulated; GPF and SVGD only).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from mpflow.operators import evidence, gaussian
from mpflow.operators.models.base import ModelFamily
from mpflow.operators.models.priors import GaussianMixture, Prior
from mpflow.operators.rng import Generators
from mpflow.operators.state import ParticleState, StepInfo
from mpflow.operators.updaters.base import (
    Prediction,
    StepWork,
    Updater,
    prior_extras,
    prior_from_extras,
    without_prior,
)

EVIDENCE_ESTIMATORS = ("predictive", "importance", "kl")


@dataclass
class PosteriorTarget:
    """π(x) = p̂(x) p(o | x) for a batch: ``log_prob`` [B, N] and ``score`` ∇x log π [B, N, d]."""

    prior: GaussianMixture
    model: ModelFamily
    obs: torch.Tensor

    def log_prob(self, x: torch.Tensor) -> torch.Tensor:
        return self.prior.log_prob(x) + self.model.log_likelihood(self.obs, x)

    def score(self, x: torch.Tensor) -> torch.Tensor:
        return self.prior.score(x) + self.model.score(self.obs, x)


@dataclass
class FlowResult:
    particles: torch.Tensor  # [B, N, d]
    iterations: torch.Tensor  # [B] int64
    kl_decrease: torch.Tensor | None = None  # [B] float64: ∫ dKL/dt dt along the flow (≤ 0)
    extras: dict[str, torch.Tensor] = field(default_factory=dict)


def target_scale(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Cholesky factor of the target covariance estimated by Stein's identity, Σ̂ = C (−E[s (x−m)ᵀ])⁻¹
    symmetrised; the particle covariance C where that is not positive definite."""
    B, N, d = x.shape
    mean, C = gaussian.moments(x.to(torch.float64))
    xc = x.to(torch.float64) - mean[:, None]
    M = -torch.einsum("bni,bnj->bij", s.to(torch.float64), xc) / N  # ≈ Λ C
    # Λ ≈ M C⁻¹ (C is PSD; the jittered Cholesky keeps a collapsed cloud from raising)
    prec = torch.cholesky_solve(M.transpose(-1, -2), gaussian.cholesky(C)).transpose(-1, -2)
    prec = 0.5 * (prec + prec.transpose(-1, -2))
    Lp, info = torch.linalg.cholesky_ex(prec)
    ok = (info == 0) & torch.isfinite(Lp).all((-1, -2))
    eye = torch.eye(d, dtype=torch.float64).expand(B, d, d)
    Lp = torch.where(ok[:, None, None], Lp, eye)
    # Σ̂ = Λ⁻¹ = (Lp Lpᵀ)⁻¹ → its lower Cholesky factor via the inverse
    sigma = torch.cholesky_inverse(Lp)
    sigma = torch.where(ok[:, None, None], sigma, C)
    return gaussian.cholesky(0.5 * (sigma + sigma.transpose(-1, -2))).to(x.dtype)


@dataclass
class Whitening:
    """The affine map x = m + L z of the flow methods' whitened coordinates (identity when disabled):
    ``to_z``, ``to_x`` and the score's pull-back ∇z log π = Lᵀ ∇x log π (row vectors: s @ L)."""

    mean: torch.Tensor  # [B, d]
    chol: torch.Tensor  # [B, d, d]

    @classmethod
    def fit(cls, x: torch.Tensor, score: Callable[[torch.Tensor], torch.Tensor], enabled: bool = True) -> Whitening:
        """From the particles' mean and the target scale :func:`target_scale` (or the identity)."""
        B, _, d = x.shape
        if not enabled:
            return cls(torch.zeros(B, d, dtype=x.dtype), torch.eye(d, dtype=x.dtype).expand(B, d, d))
        return cls(x.mean(1), target_scale(x, score(x)))

    def to_z(self, x: torch.Tensor) -> torch.Tensor:
        diff = (x - self.mean[:, None]).transpose(-1, -2)
        return torch.linalg.solve_triangular(self.chol, diff, upper=False).transpose(-1, -2)

    def to_x(self, z: torch.Tensor) -> torch.Tensor:
        return self.mean[:, None] + z @ self.chol.transpose(-1, -2)

    def score_z(self, score_x: torch.Tensor) -> torch.Tensor:
        return score_x @ self.chol


class AssumedDensityUpdater(Updater):
    """Base class: builds π_m, runs ``solve`` and estimates the evidence."""

    defaults = {"evidence": "predictive"}
    supports_kl = False
    shares_prediction = True

    def __init__(self, **options):
        super().__init__(**options)
        est = self.options["evidence"]
        if est not in EVIDENCE_ESTIMATORS or (est == "kl" and not self.supports_kl):
            allowed = [e for e in EVIDENCE_ESTIMATORS if e != "kl" or self.supports_kl]
            raise ValueError(f"options.evidence: {est!r} is not available for {self.name}; use one of {allowed}")

    def _init(self, state: ParticleState, prior: Prior, model: ModelFamily, gens: Generators) -> ParticleState:
        return state.replace(extras=prior_extras(prior))

    def step_work(self, model: ModelFamily, n: int, dt: float = 1.0, k: int | None = None) -> StepWork:
        """The predict and fit of a particle method (:meth:`Updater.step_work`), then up to ``max_iters``
        iterations of the solver, each its arithmetic (:meth:`iteration_work`), every particle's score and its
        fixed cost whatever n (:meth:`iteration_flops`):

            flops = base + max_iters · (iteration_work(n) + n · likelihood_flops(k) + iteration_flops)

        — an upper bound: the solver stops earlier when it converges, but the data may keep it from converging."""
        base = super().step_work(model, n, dt, k)
        per = self.iteration_work(model, n)
        iters = float(self.options.get("max_iters", 1))
        score = n * model.likelihood_flops(k)
        return StepWork(base.flops + iters * (per.flops + score + self.iteration_flops()), max(base.bytes, per.bytes))

    def iteration_flops(self) -> float:
        """One solver iteration's fixed cost, whatever n, in floating-point operations' worth: its Python and its
        tensor operations' launches, which are the whole of an iteration's time at small n (measured, each
        method's constant: ``benchmarks/price_audit.py``'s rows at N = 16)."""
        raise NotImplementedError

    def iteration_work(self, model: ModelFamily, n: int) -> StepWork:
        """One iteration of the solver beyond the particles' scores: a linear flow's (``gpf``: the cloud's
        covariance and a d × d map, about 6 n d²; a few float64 copies of the cloud)."""
        d = model.state_dim
        return StepWork(6.0 * n * d * d + 10.0 * d**3, 8.0 * 10 * n * d)

    def density(self, state: ParticleState) -> GaussianMixture | None:
        """The exact step-0 prior until the first step (afterwards the particles are the belief)."""
        return prior_from_extras(state.extras)

    def from_particles(self, state: ParticleState, density: GaussianMixture | None = None) -> ParticleState:
        """With a ``density``, it is the prior of the next step (as at step 0), kept in the particles' dtype;
        without one the next step fits a Gaussian to the particles."""
        if density is None:
            return state
        return state.replace(extras={**state.extras, **prior_extras(density.to(state.particles.dtype))})

    @staticmethod
    def predicted_prior(state: ParticleState, model: ModelFamily) -> GaussianMixture:
        """p̂_{m-1} pushed through the transition: the exact prior at step 0, else the fitted Gaussian."""
        prior = prior_from_extras(state.extras)
        if prior is None:
            mean, cov = gaussian.moments(state.particles.to(torch.float64), state.log_weights)
            prior = GaussianMixture.gaussian(mean, cov)
        prior = prior.to(torch.float64)
        if model.dynamic:
            prior = prior.push(*(t.to(torch.float64) for t in model.transition_affine()))
        return prior.to(state.particles.dtype)

    def _predict(
        self, state: ParticleState, model: ModelFamily, gens: Generators, prediction: Prediction | None = None
    ) -> tuple[ParticleState, StepInfo]:
        """No measurement: the particles move as :meth:`Updater._predict` moves them, and an exact step-0 prior
        still held (a step without a measurement came first) is pushed through the transition exactly, so the next
        step's target starts from it."""
        new, info = super()._predict(state, model, gens, prediction)
        prior = prior_from_extras(state.extras)
        if prior is not None and model.dynamic:
            pushed = prior.to(torch.float64).push(*(t.to(torch.float64) for t in model.transition_affine()))
            new = new.replace(extras={**state.extras, **prior_extras(pushed.to(state.particles.dtype))})
        return new, info

    def solver_options(self) -> dict:
        """The options that are the solver's keyword arguments (all but ``evidence``)."""
        return {k: v for k, v in self.options.items() if k != "evidence"}

    def start(self, x: torch.Tensor, prior: GaussianMixture) -> torch.Tensor:
        """Hook: adjust the predicted particles before the flow (GPF matches their moments)."""
        return x

    def solve(self, x: torch.Tensor, target: PosteriorTarget, gens: Generators, want_kl: bool) -> FlowResult:
        raise NotImplementedError

    def _update(
        self,
        state: ParticleState,
        obs: torch.Tensor,
        model: ModelFamily,
        gens: Generators,
        prediction: Prediction | None = None,
    ):
        B, N, _ = state.particles.shape
        prior = self.predicted_prior(state, model)
        moved = model.transition(state.particles, gens) if prediction is None else prediction.particles
        x0 = self.start(moved, prior)
        target = PosteriorTarget(prior, model, obs)
        ll0 = model.log_likelihood(obs, x0)
        est = self.options["evidence"]
        result = self.solve(x0, target, gens, want_kl=est == "kl")
        if est == "predictive":
            inc = evidence.predictive(ll0)
        elif est == "kl":
            h0, v0 = evidence.flow_start_terms(x0, prior.log_prob(x0) + ll0)
            inc = evidence.kl_integration(h0, v0, result.kl_decrease)
        else:
            mean, cov = gaussian.moments(result.particles.to(torch.float64))
            log_target = lambda xs: target.log_prob(xs.to(x0.dtype))  # noqa: E731
            inc = evidence.importance(log_target, mean, cov, gens, N)
        new = state.replace(
            particles=result.particles,
            log_weights=torch.full((B, N), -math.log(N), dtype=state.log_weights.dtype),
            extras=without_prior(state.extras),
        )
        n_eff = torch.full((B,), float(N), dtype=torch.float64)
        return new, StepInfo(inc, n_eff, iterations=result.iterations, extras=result.extras)

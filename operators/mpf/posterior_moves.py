"""Posterior moves for static families: after the flow, a few Metropolis-adjusted Langevin (MALA) steps against the
posterior itself, with the likelihoods of all but the last ``window`` observations replaced by Gaussian sites.

A static family's posterior after m observations is p(x | o_≤m) ∝ π(x) Π_{s≤m} p(o_s | x). The flow moves the
particles onto a Gaussian-likelihood update of the previous cloud (:mod:`mpflow.operators.mpf.daum_huang`), so
its error is that of a Gaussian belief, and it accumulates: on ``logistic`` d = 30 the flow reaches 0.17 posterior
sd. A Markov kernel that leaves the posterior invariant removes that error, but it needs the posterior's density,
i.e. every past observation. The stream keeps instead

    π̃_m(x) = N_c(x; h_m, P_m) · Π_{s = m−W+1}^{m} p(o_s | x),

the exact likelihoods of the last W observations (``window``) and, for each older one, a Gaussian site
exp(−½ xᵀ Λ_s x + η_sᵀ x) folded into the canonical Gaussian (P_m, h_m) = (P₀ + Σ Λ_s, P₀ m₀ + Σ η_s), which
starts as the prior's. A site is fitted when its observation leaves the window, by Stein's identity at the flow's
cloud of that step (:func:`~mpflow.operators.mpf.daum_huang.statistical_linearisation`): the cloud then already
holds W later observations, so the fit reads the likelihood where the posterior is (the sites of expectation
propagation, fitted once; Minka 2001, "Expectation propagation for approximate Bayesian inference", UAI, §3). On
``logistic`` d = 30 (``benchmarks.equal_compute``: 64 held-out sequences, N = 256, 5 moves, HMC reference) the mean
error is 0.171 without moves, 0.137 / 0.111 / 0.097 with W = 1 / 2 / 3; with W = 0 (each site fitted at the end
of its own step) 0.18 on 16 of them. The exact expected Hessian in place of Stein's fit is worse (0.158 against
0.137 at W = 1, 16 sequences): Stein's fit is the statistical linearisation over the cloud, not the curvature at
its points.

Each move is preconditioned MALA (Roberts & Tweedie 1996, "Exponential convergence of Langevin distributions and
their discrete approximations", Bernoulli 2(4); Girolami & Calderhead 2011, eq. 8 with a constant metric): with
A = L Lᵀ the flow cloud's covariance and g = ∇ log π̃(x),

    y = x + ½ ε² A g(x) + ε L ξ,   ξ ~ N(0, I),
    accept with probability min(1, π̃(y) q(x | y) / (π̃(x) q(y | x))),  q(y | x) = N(y; x + ½ ε² A g(x), ε² A),

ε = ``STEP_SCALE`` · d^(−1/6) (the optimal scaling of MALA, ε² ∝ d^(−1/3); Roberts & Rosenthal 1998, "Optimal
scaling of discrete approximations to Langevin diffusions", JRSS B 60(1)); acceptance 0.55–0.6 at d = 10 and 30.
A kernel that leaves π̃ invariant cannot make a cloud that already follows π̃ worse, but it does replace the flow's
moment-matched cloud (whose mean carries no Monte Carlo error) by a correlated sample whose mean does: about
1/√N posterior sd, the floor of the step's error at small m.

The moves need π̃'s density, so they run on a Gaussian prior (or a particle prior, entering as its fitted
Gaussian), and on a likelihood that Langevin moves explore well: a log-concave one (``ModelFamily.posterior_moves``:
``logistic``). On ``gmm``'s bimodal likelihood single-particle moves cannot cross between the modes (W = 2:
0.137 against the flow's 0.065).

The stream carries (extras): ``sites.precision`` [B, d, d] and ``sites.information`` [B, d] (float64) and the
window ``window.0`` (the newest) … ``window.{W−1}`` [B, *obs_shape] (gaps stored as 0 with a mask
``window.{i}.gaps``: every float of a stored state stays finite); an entry that is all NaN (a step without a
measurement, or the window before W steps) contributes nothing, one with some NaN entries its observed entries
(:meth:`~mpflow.operators.models.base.ModelFamily.observed_part`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from mpflow.operators import gaussian
from mpflow.operators.models.base import ModelFamily
from mpflow.operators.mpf.daum_huang import statistical_linearisation
from mpflow.operators.rng import Generators, rand, randn
from mpflow.operators.state import ParticleState

#: observations kept exactly (W), and moves per step (K): logistic d = 30, 16 sequences: (W, K) = (1, 5) 0.137,
#: (2, 3) 0.11, (2, 5) 0.106, (3, 5) 0.098, (3, 10) 0.084; at (2, 5) a step costs 3.1× the flow's batched, 1.6–2×
#: one stream (the service's default table picks W = 3 for logistic: benchmarks/results/equal_compute.json)
WINDOW = 2
MOVES = 5
#: ε = STEP_SCALE · d^(−1/6)
STEP_SCALE = 1.6
PRECISION, INFORMATION = "sites.precision", "sites.information"
F64 = torch.float64


def window_key(i: int) -> str:
    return f"window.{i}"


def gaps_key(i: int) -> str:
    return f"window.{i}.gaps"


@dataclass
class Sites:
    """The stream's π̃ without its newest observation: the canonical Gaussian (``precision`` [B, d, d],
    ``information`` [B, d], float64) and the window of past observations, newest first."""

    precision: torch.Tensor
    information: torch.Tensor
    window: list[torch.Tensor]

    @classmethod
    def start(cls, mean: torch.Tensor, cov: torch.Tensor, placeholder: torch.Tensor, size: int) -> Sites:
        """The prior N(mean, cov) ([B, d], [B, d, d]) and a window of ``size`` empty entries (NaN ``placeholder``
        [B, *obs_shape])."""
        precision = torch.cholesky_inverse(gaussian.cholesky(cov.to(F64)))
        information = (precision @ mean.to(F64)[..., None])[..., 0]
        return cls(precision, information, [placeholder] * size)

    @classmethod
    def read(cls, state: ParticleState) -> Sites | None:
        """The sites a state carries, or None (a state of another method, or of a stream without moves)."""
        extras = state.extras
        if PRECISION not in extras:
            return None
        size = sum(1 for k in extras if k.startswith("window.") and not k.endswith(".gaps"))
        window = [extras[window_key(i)].masked_fill(extras[gaps_key(i)], math.nan) for i in range(size)]
        return cls(extras[PRECISION], extras[INFORMATION], window)

    def write(self, state: ParticleState) -> ParticleState:
        """``state`` carrying these sites; a window entry is stored with its gaps (NaN) as 0 and a mask
        ``window.{i}.gaps``, so that every float of the state stays finite."""
        extras = {k: v for k, v in state.extras.items() if not k.startswith(("sites.", "window."))}
        extras |= {PRECISION: self.precision, INFORMATION: self.information}
        for i, o in enumerate(self.window):
            gaps = torch.isnan(o)
            extras |= {window_key(i): o.masked_fill(gaps, 0.0), gaps_key(i): gaps}
        return state.replace(extras=extras)

    def retire(self, model: ModelFamily, x: torch.Tensor) -> Sites:
        """The oldest window entry folded into the Gaussian as a site fitted at the cloud x [B, N, d] (module
        docstring; a window entry without a measurement adds nothing)."""
        if not self.window:
            return self
        *kept, oldest = self.window
        return self._folded(model, oldest, x)._with(kept)

    def push(self, obs: torch.Tensor) -> Sites:
        """The window with the newest observation ``obs`` [B, *obs_shape] (all NaN: none) in front."""
        return self._with([obs, *self.window])

    def advance(self, model: ModelFamily, obs: torch.Tensor, x: torch.Tensor) -> Sites:
        """The sites after a step of observation ``obs`` (all NaN: none) that left the cloud x without moves (a step
        without a measurement, or another method's step): the window takes ``obs`` in and its oldest entry retires
        at x."""
        return self.retire(model, x).push(obs) if self.window else self.push(obs).retire(model, x)

    def _with(self, window: list[torch.Tensor]) -> Sites:
        return Sites(self.precision, self.information, window)

    def _folded(self, model: ModelFamily, obs: torch.Tensor, x: torch.Tensor) -> Sites:
        seen = _seen(obs)
        if not bool(seen.any()):
            return self
        part, part_obs = _observed(model, obs, seen)
        fit = statistical_linearisation(x, part.score(part_obs, x))
        keep = seen.to(F64)
        return Sites(
            self.precision + keep[:, None, None] * fit.precision,
            self.information + keep[:, None] * fit.information,
            self.window,
        )

    def step(
        self, model: ModelFamily, obs: torch.Tensor, x: torch.Tensor, moves: int, gens: Generators
    ) -> tuple[torch.Tensor, Sites, torch.Tensor]:
        """One step's moves from the flow's cloud x [B, N, d] after observation ``obs`` → (moved cloud, the sites
        with ``obs`` in the window, acceptance rate [B]). The oldest entry retires at x first (its site read where
        the posterior now is); with an empty window the new observation's own site is fitted at the moved cloud."""
        size = len(self.window)
        sites = self.retire(model, x) if size else self
        x, acceptance = mala(sites, model, obs, x, moves, gens)
        sites = sites.push(obs)
        return x, (sites.retire(model, x) if not size else sites), acceptance

    def target(self, model: ModelFamily, obs: torch.Tensor) -> Target:
        """π̃ with the newest observation ``obs``."""
        terms = []
        for o in (obs, *self.window):
            seen = _seen(o)
            if bool(seen.any()):
                part, part_obs = _observed(model, o.to(obs.dtype), seen)
                terms.append((part, part_obs, None if bool(seen.all()) else seen.to(F64)))
        return Target(self.precision, self.information, terms, obs.dtype)


@dataclass
class Target:
    """log π̃(x) up to a constant: a canonical Gaussian (``precision``, ``information``, float64) times likelihood
    terms (model, obs, the rows that hold a measurement or None for all), evaluated in ``dtype`` (the model's: the
    transcendental functions of a likelihood cost several times more in float64, and the Metropolis ratio only
    needs their differences to well within 1)."""

    precision: torch.Tensor
    information: torch.Tensor
    terms: list[tuple[ModelFamily, torch.Tensor, torch.Tensor | None]]
    dtype: torch.dtype

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(log π̃(x) [B, N], ∇ log π̃(x) [B, N, d]) at x [B, N, d] (float64)."""
        grad = self.information[:, None] - x @ self.precision  # P symmetric
        log_p = (x * (self.information[:, None] + grad)).sum(-1) * 0.5  # hᵀx − ½ xᵀPx
        xm = x.to(self.dtype)
        for model, obs, keep in self.terms:
            ll = torch.nan_to_num(model.log_likelihood(obs, xm).to(F64), nan=-math.inf)
            score = model.score(obs, xm).to(F64)
            if keep is not None:
                ll, score = keep[:, None] * ll, keep[:, None, None] * score
            log_p, grad = log_p + ll, grad + score
        return log_p, grad


def _seen(obs: torch.Tensor) -> torch.Tensor:
    """[B]: the rows of ``obs`` that hold at least one measurement."""
    return ~torch.isnan(obs).flatten(1).all(1)


def _observed(model: ModelFamily, obs: torch.Tensor, seen: torch.Tensor) -> tuple[ModelFamily, torch.Tensor]:
    """(model, obs) conditioned on the observed entries; rows without any (``seen`` False) get a finite stand-in
    (their terms are then multiplied by 0)."""
    obs = torch.where(seen.reshape(-1, *[1] * (obs.dim() - 1)), obs, torch.zeros_like(obs))
    if bool(torch.isnan(obs).any()):
        return model.observed_part(obs)
    return model, obs


def mala(
    sites: Sites, model: ModelFamily, obs: torch.Tensor, x: torch.Tensor, moves: int, gens: Generators
) -> tuple[torch.Tensor, torch.Tensor]:
    """``moves`` preconditioned MALA steps against π̃ (module docstring) from the cloud x [B, N, d] →
    (moved cloud, mean acceptance rate per stream [B])."""
    B, N, d = x.shape
    dtype, x = x.dtype, x.to(F64)  # the chain in float64: the Metropolis ratio differences large log-densities
    chol = gaussian.cholesky(gaussian.moments(x)[1])  # A = L Lᵀ
    cholT = chol.transpose(-1, -2)
    eps = STEP_SCALE * d ** (-1 / 6)

    def drift(g: torch.Tensor) -> torch.Tensor:  # ½ ε² A g, row form: g L Lᵀ
        return 0.5 * eps**2 * (g @ chol) @ cholT

    def log_q(to: torch.Tensor, frm: torch.Tensor, drift_frm: torch.Tensor) -> torch.Tensor:
        r = (to - frm - drift_frm).transpose(-1, -2)
        return -0.5 * torch.linalg.solve_triangular(chol, r, upper=False).square().sum(-2) / eps**2

    target = sites.target(model, obs)
    log_p, grad = target(x)
    accepted = torch.zeros(B, dtype=F64)
    # every move's draws at once: one pass over the streams' generators per step, not two per move
    noise, uniform = randn(gens, [moves, N, d]).to(F64), rand(gens, [moves, N], F64)
    for k in range(moves):
        step = drift(grad)
        y = x + step + eps * noise[:, k] @ cholT
        log_p_y, grad_y = target(y)
        log_a = log_p_y - log_p + log_q(x, y, drift(grad_y)) - log_q(y, x, step)
        ok = torch.log(uniform[:, k]) < torch.nan_to_num(log_a, nan=-math.inf)
        x = torch.where(ok[..., None], y, x)
        log_p, grad = torch.where(ok, log_p_y, log_p), torch.where(ok[..., None], grad_y, grad)
        accepted += ok.to(F64).mean(-1)
    return x.to(dtype), accepted / max(moves, 1)

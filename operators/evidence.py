"""Log-evidence estimates: log p(o_m | o_<m) per step, summed by the state into log p(o_1..m).

* ``predictive`` — the particle estimate used by SMC: with predicted particles x_i ~ p(x_m | o_<m) and
  normalised weights w_i,   log p(o_m | o_<m) ≈ log Σ_i w_i p(o_m | x_i).
* ``importance`` — importance sampling from a Gaussian q = N(m, C) fitted to the updated particles:
  log Z ≈ log (1/M) Σ_j π(x_j) / q(x_j),  x_j ~ q, π the unnormalised target (prior × likelihood).
* ``kl_integration`` — Zaki, Galy-Fajou & Opper, eq. (6):
  log Z = H[q0] − E_q0[V] − ∫_0^∞ dKL(q_t ‖ p)/dt dt,   V = −log π,
  with the integral approximated by Σ_t ε_t dKL/dt along the flow that solved the update
  (§2.4; the flows accumulate it: GPF in closed form, SVGD with the RKHS-norm estimator eq. 10).
* ``gaussian_log_evidence`` — exact: log N(o; H m, H P Hᵀ + R) (the Kalman predictive).
* ``gaussian_fit`` — the evidence of a Gaussian predictive N(m, C) (a flow's, whose predict step maps its cloud
  onto those moments), without Monte Carlo noise: log N(o; H m, H C Hᵀ + R) for a linear observation, and for a
  family whose likelihood factorises per dimension Σ_j log Σ_q ω_q p(o_j | m_j + √C_jj z_q) (Gauss–Hermite nodes
  z_q, weights ω_q, :data:`HERMITE_NODES` of them). The particle average log mean_i p(o | x_i) of N = 256 draws
  is biased low by about Var/2N·mean² — largest exactly at an outlier, where p(o | x) lives in the cloud's tail.

Predictive p-values (PIT): for each observed entry j, u_j = P(o_j ≤ observed | o_<m) from the method's predictive:
``particle_pit`` — Σ_i w_i F_j(o_j | x_i) over the predicted cloud (F the family's conditional CDF,
:meth:`~mpflow.operators.models.base.ModelFamily.observation_cdf`); ``gaussian_pit`` — Φ((o_j − ŷ_j)/√S_jj) for the
Gaussian predictive N(ŷ, S) (Kalman). Under the model u_j ~ U(0, 1) (Rosenblatt 1952; Dawid 1984), so
|u − ½| > ½ − α/2 flags a reading at the two-sided level α.

Their logarithms without saturation (u_j is exactly 1.0 in float64 beyond about 8.3 sd): the log tails
log P(O_j ≤ o_j | o_<m) and log P(O_j ≥ o_j | o_<m) — ``gaussian_log_tails``, log Φ(z_j) and log Φ(−z_j) by
``torch.special.log_ndtr``; ``particle_log_tails``, log Σ_i w_i F_j(o_j | x_i) as a logsumexp over the particles of
log w_i + log F_j(o_j | x_i) (and the same of the upper tails,
:meth:`~mpflow.operators.models.base.ModelFamily.observation_log_tails`).
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch
from mpflow.operators import gaussian
from mpflow.operators.references.conjugate import conjugate_update
from mpflow.operators.rng import Generators, randn


def log_mean_exp(a: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return torch.logsumexp(a, dim=dim) - math.log(a.shape[dim])


def predictive(log_likelihood: torch.Tensor, log_weights: torch.Tensor | None = None) -> torch.Tensor:
    """log Σ_i w_i p(o | x_i) for log_likelihood [B, N] and normalised log weights [B, N] → [B] (float64)."""
    ll = log_likelihood.to(torch.float64)
    if log_weights is None:
        return log_mean_exp(ll)
    lw = torch.log_softmax(log_weights.to(torch.float64), dim=-1)
    return torch.logsumexp(lw + ll, dim=-1)


def kl_integration(entropy_q0: torch.Tensor, mean_v_q0: torch.Tensor, kl_decrease: torch.Tensor) -> torch.Tensor:
    """log Z = H[q0] − E_q0[V] − ∫ dKL/dt dt (eq. 6); ``kl_decrease`` is Σ_t ε_t dKL/dt (≤ 0)."""
    return (entropy_q0 - mean_v_q0 - kl_decrease).to(torch.float64)


def flow_start_terms(x0: torch.Tensor, log_target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """H[q0] and E_q0[V] for the initial cloud x0 [B, N, d]: the entropy of its fitted Gaussian and the
    particle average of V = −log π (``log_target`` = log π(x0) [B, N])."""
    _, cov = gaussian.moments(x0.to(torch.float64))
    return gaussian.entropy(gaussian.cholesky(cov)), -log_target.to(torch.float64).mean(-1)


#: Gauss–Hermite nodes of :func:`gaussian_fit` (exact for a polynomial likelihood of degree < 2·64)
HERMITE_NODES = 64


@functools.lru_cache(maxsize=1)
def _hermite() -> tuple[torch.Tensor, torch.Tensor]:
    """Nodes z_q and log weights log ω_q (Σ ω_q = 1) of the probabilists' Gauss–Hermite rule."""
    z, w = np.polynomial.hermite_e.hermegauss(HERMITE_NODES)
    return torch.from_numpy(z), torch.from_numpy(np.log(w / w.sum()))


def gaussian_fit(model, obs: torch.Tensor, mean: torch.Tensor, cov: torch.Tensor) -> torch.Tensor | None:
    """log ∫ N(x; mean, cov) p(o | x) dx [B] for the predictive fit N(mean [B, d], cov [B, d, d]) (module
    docstring): closed form for a linear observation, Gauss–Hermite per dimension for a factorised likelihood
    (``model.per_dimension``), None for any other family (the caller keeps its particle estimate)."""
    mean, cov = mean.to(torch.float64), cov.to(torch.float64)
    if model.linear_observation():
        H, R = model.observation_affine()
        _, _, log_pred = conjugate_update(mean, cov, H, R, obs)
        return log_pred + model.observation_log_offset().to(torch.float64)
    B, d = mean.shape
    split = model.per_dimension(B)
    if split is None:
        return None
    z, log_w = _hermite()
    sd = cov.diagonal(dim1=-2, dim2=-1).clamp_min(0).sqrt()
    nodes = (mean.reshape(-1, 1) + sd.reshape(-1, 1) * z)[..., None]  # [B·d, Q, 1]
    ll = split.to(torch.float64).log_likelihood(obs.reshape(B * d, 1).to(torch.float64), nodes)
    return torch.logsumexp(ll + log_w, -1).reshape(B, d).sum(-1)


def particle_pit(cdf: torch.Tensor, log_weights: torch.Tensor | None = None) -> torch.Tensor:
    """Σ_i w_i F_j(o_j | x_i) for conditional CDFs ``cdf`` [B, N, k] and log weights [B, N] (None: uniform) → [B, k]."""
    cdf = cdf.to(torch.float64)
    if log_weights is None:
        return cdf.mean(1)
    w = torch.softmax(log_weights.to(torch.float64), -1)
    return torch.einsum("bn,bnk->bk", w, cdf)


def standardised(obs: torch.Tensor, mean: torch.Tensor, cov: torch.Tensor) -> torch.Tensor:
    """z_j = (o_j − ŷ_j)/√S_jj [B, k] (float64) for obs [B, k] under the Gaussian predictive N(ŷ [B, k], S [B, k, k])
    (its entries one at a time)."""
    sd = cov.to(torch.float64).diagonal(dim1=-2, dim2=-1).clamp_min(1e-300).sqrt()
    return (obs.to(torch.float64) - mean.to(torch.float64)) / sd


def gaussian_pit(obs: torch.Tensor, mean: torch.Tensor, cov: torch.Tensor) -> torch.Tensor:
    """Φ(z_j) [B, k], z the :func:`standardised` reading under the Gaussian predictive N(ŷ, S)."""
    return torch.special.ndtr(standardised(obs, mean, cov))


def particle_log_tails(
    lower: torch.Tensor, upper: torch.Tensor, log_weights: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log Σ_i w_i e^{lower_i}, log Σ_i w_i e^{upper_i}) [B, k] for per-particle log tails [B, N, k] and log weights
    [B, N] (None: uniform): the log of :func:`particle_pit` and of its complement, as a logsumexp (no saturation)."""
    lower, upper = lower.to(torch.float64), upper.to(torch.float64)
    if log_weights is None:
        lw = torch.full(lower.shape[:2], -math.log(lower.shape[1]), dtype=torch.float64)
    else:
        lw = torch.log_softmax(log_weights.to(torch.float64), -1)
    return torch.logsumexp(lw[..., None] + lower, 1), torch.logsumexp(lw[..., None] + upper, 1)


def gaussian_log_tails(obs: torch.Tensor, mean: torch.Tensor, cov: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log Φ(z_j), log Φ(−z_j)) [B, k], z_j = (o_j − ŷ_j)/√S_jj, under the Gaussian predictive N(ŷ, S): the log tails
    of :func:`gaussian_pit`, without its saturation."""
    z = standardised(obs, mean, cov)
    return torch.special.log_ndtr(z), torch.special.log_ndtr(-z)


def importance(log_target, mean: torch.Tensor, cov: torch.Tensor, gens: Generators, n: int) -> torch.Tensor:
    """log (1/n) Σ_j π(x_j)/q(x_j), x_j ~ N(mean, cov) drawn with each stream's generator → [B]."""
    L = gaussian.cholesky(cov)
    xs = mean[:, None] + randn(gens, [n, mean.shape[-1]], mean.dtype) @ L.transpose(-1, -2)
    log_w = log_target(xs).to(torch.float64) - gaussian.log_prob(xs, mean, L).to(torch.float64)
    return log_mean_exp(log_w)

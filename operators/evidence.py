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
"""

from __future__ import annotations

import math

import torch
from mpflow.operators import gaussian
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


def importance(log_target, mean: torch.Tensor, cov: torch.Tensor, gens: Generators, n: int) -> torch.Tensor:
    """log (1/n) Σ_j π(x_j)/q(x_j), x_j ~ N(mean, cov) drawn with each stream's generator → [B]."""
    L = gaussian.cholesky(cov)
    xs = mean[:, None] + randn(gens, [n, mean.shape[-1]], mean.dtype) @ L.transpose(-1, -2)
    log_w = log_target(xs).to(torch.float64) - gaussian.log_prob(xs, mean, L).to(torch.float64)
    return log_mean_exp(log_w)

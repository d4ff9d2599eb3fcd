"""Grid references for non-Gaussian posteriors, in float64, with their own discretisation error.

Filters, each exact up to the grid:

* :func:`static_grid_posterior` — a static family of dimension d ≤ 2: p(x | o_1..t) ∝ p₀(x) Π_{k≤t} p(o_k | x)
  on a tensor grid. The box adapts at every step: a coarse pass over the prior's ±``width`` sd box finds where
  the log posterior is within ``LOG_SUPPORT`` nats of its maximum, and a fine pass of ``points`` per axis
  covers that region padded by two coarse cells (so a posterior far narrower than the prior is still resolved).
* :func:`diagonal_grid_filter` — a dynamic family whose dimensions are independent (diagonal transition and a
  likelihood that factorises per dimension, e.g. ``stochastic_volatility``): a 1-D grid filter per dimension,
      predict  p(x_t | o_<t)(x_i) = Σ_j N(x_i; c + F x_j, Q) p(x_{t−1} | o_<t)(x_j) Δ,
      update   p(x_t | o_≤t)(x_i) ∝ p(o_t | x_i) p(x_t | o_<t)(x_i),
  on a fixed grid spanning the prior and the stationary law of the transition (±``width`` sd).

Both return the posterior's mean and covariance per step ([B, T, d], [B, T, d, d]); run with two grid sizes,
:func:`grid_error` gives the reference's own error in posterior-sd units (the figure to report beside it).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from mpflow.operators.models.base import ModelFamily

F64 = torch.float64
#: the fine pass covers every coarse cell whose log posterior is within this many nats of the maximum
LOG_SUPPORT = 25.0


def _grid_moments(points: torch.Tensor, log_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean [d] and covariance [d, d] of the normalised density exp(log_p) on ``points`` [G, d]."""
    w = torch.softmax(log_p, -1)
    mean = w @ points
    diff = points - mean
    return mean, (diff * w[:, None]).T @ diff


def _tensor_grid(lo: torch.Tensor, hi: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Points [n^d, d] of the regular grid on the box [lo, hi] and the cell size per axis."""
    axes = [torch.linspace(float(a), float(b), n, dtype=F64) for a, b in zip(lo, hi, strict=True)]
    mesh = torch.meshgrid(*axes, indexing="ij")
    return torch.stack([m.reshape(-1) for m in mesh], -1), (hi - lo) / (n - 1)


def static_grid_posterior(
    model: ModelFamily,
    prior_mean: torch.Tensor,
    prior_cov: torch.Tensor,
    observations: torch.Tensor,
    points: int = 256,
    width: float = 8.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Posterior moments of a static family with d ≤ 2 for every step (module docstring).

    ``model`` has batch size 1 (shared by the sequences); ``prior_mean`` [d], ``prior_cov`` [d, d];
    ``observations`` [B, T, *obs_shape]. Returns means [B, T, d] and covariances [B, T, d, d] (float64)."""
    if model.dynamic or model.state_dim > 2:
        raise ValueError("static_grid_posterior: a static family with d ≤ 2")
    model = model.to(F64)
    m0, C0 = prior_mean.to(F64), prior_cov.to(F64)
    L0 = torch.linalg.cholesky(C0)
    sd0 = C0.diagonal().sqrt()
    obs = observations.to(F64)
    B, T = obs.shape[:2]
    coarse_n = max(64, points // 2)

    def log_post(x: torch.Tensor, b: int, t: int) -> torch.Tensor:
        z = torch.linalg.solve_triangular(L0, (x - m0).T, upper=False)
        # Π_{k ≤ t} p(o_k | x): the t + 1 observations as a batch over one (expanded, not copied) grid
        seen = obs[b, : t + 1]
        return -0.5 * (z * z).sum(0) + model.log_likelihood(seen, x[None].expand(t + 1, -1, -1)).sum(0)

    means = torch.empty(B, T, model.state_dim, dtype=F64)
    covs = torch.empty(B, T, model.state_dim, model.state_dim, dtype=F64)
    for b in range(B):
        for t in range(T):
            grid, cell = _tensor_grid(m0 - width * sd0, m0 + width * sd0, coarse_n)
            lp = log_post(grid, b, t)
            keep = grid[lp > lp.max() - LOG_SUPPORT]
            lo, hi = keep.min(0).values - 2 * cell, keep.max(0).values + 2 * cell
            fine, _ = _tensor_grid(lo, hi, points)
            means[b, t], covs[b, t] = _grid_moments(fine, log_post(fine, b, t))
    return means, covs


def static_grid_evidence(
    model: ModelFamily,
    prior_mean: torch.Tensor,
    prior_cov: torch.Tensor,
    observations: torch.Tensor,
    points: int = 400,
    width: float = 8.0,
) -> torch.Tensor:
    """log p(o_t | o_<t) [B, T] of a static family with d ≤ 2 on one fixed tensor grid over the prior's ±``width`` sd
    box: log Z_t = log Σ_i p₀(x_i) Π_{k≤t} p(o_k | x_i) (the cell size cancels in the increments
    log Z_t − log Z_{t−1}). Exact up to the grid while the posterior spans several cells (check with
    two sizes)."""
    if model.dynamic or model.state_dim > 2:
        raise ValueError("static_grid_evidence: a static family with d ≤ 2")
    model = model.to(F64)
    m0, C0 = prior_mean.to(F64), prior_cov.to(F64)
    sd0 = C0.diagonal().sqrt()
    grid, _ = _tensor_grid(m0 - width * sd0, m0 + width * sd0, points)
    z = torch.linalg.solve_triangular(torch.linalg.cholesky(C0), (grid - m0).T, upper=False)
    obs = observations.to(F64)
    B, T = obs.shape[:2]
    log_p = (-0.5 * (z * z).sum(0)).expand(B, -1)
    log_z = torch.empty(B, T, dtype=F64)
    previous = torch.logsumexp(log_p, -1)
    for t in range(T):
        log_p = log_p + model.log_likelihood(obs[:, t], grid[None].expand(B, -1, -1))
        current = torch.logsumexp(log_p, -1)
        log_z[:, t], previous = current - previous, current
    return log_z


def diagonal_grid_filter(
    model: ModelFamily,
    prior_mean: torch.Tensor,
    prior_var: torch.Tensor,
    observations: torch.Tensor,
    points: int = 800,
    width: float = 8.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Filtering moments of a dynamic family with independent dimensions: :func:`diagonal_grid_evidence`'s means
    [B, T, d] and diagonal covariances."""
    means, covs, _ = diagonal_grid_evidence(model, prior_mean, prior_var, observations, points, width)
    return means, covs


def diagonal_grid_evidence(
    model: ModelFamily,
    prior_mean: torch.Tensor,
    prior_var: torch.Tensor,
    observations: torch.Tensor,
    points: int = 800,
    width: float = 8.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Filtering moments of a dynamic family with independent dimensions (module docstring), and log p(o_t | o_<t)
    [B, T]: with the likelihood evaluated on points x⁽ᵏ⁾ that vary in coordinate k only (the others at the base
    point b), log p(o_t | x⁽ᵏ⁾) = log p_k(o_tk | x_k) + L − log p_k(o_tk | b_k), L = log p(o_t | b), so
    log p(o_t | o_<t) = Σ_k log Σ_i p(x_i | o_<t) p(o_t | x⁽ᵏ⁾_i) − (d − 1) L.

    ``model``: batch size 1, diagonal ``transition_affine`` (F, c, Q) and a likelihood that factorises per
    dimension (evaluated one dimension at a time through ``model.log_likelihood`` on points that vary in one
    coordinate only: the other factors are then constant and cancel in the normalisation). ``prior_mean`` [d],
    ``prior_var`` [d] of x₀; ``observations`` [B, T, d]. Returns means [B, T, d] and diagonal covariances."""
    F, c, Q = (t.to(F64)[0] for t in model.transition_affine())
    if not (torch.equal(F, torch.diag(F.diagonal())) and torch.equal(Q, torch.diag(Q.diagonal()))):
        raise ValueError("diagonal_grid_filter: the transition must be diagonal")
    model = model.to(F64)
    phi, shift, q = F.diagonal(), c, Q.diagonal()
    obs = observations.to(F64)
    B, T, d = obs.shape
    m0, v0 = prior_mean.to(F64), prior_var.to(F64)
    stationary_mean = torch.where(phi.abs() < 1, shift / (1 - phi).clamp_min(1e-12), m0)
    stationary_var = torch.where(phi.abs() < 1, q / (1 - phi * phi).clamp_min(1e-12), v0 + T * q)
    lo = torch.minimum(m0 - width * v0.sqrt(), stationary_mean - width * stationary_var.sqrt())
    hi = torch.maximum(m0 + width * v0.sqrt(), stationary_mean + width * stationary_var.sqrt())
    grids = torch.stack([torch.linspace(float(a), float(b), points, dtype=F64) for a, b in zip(lo, hi, strict=True)])
    # log N(x_i; c + φ x_j, q) per dimension: [d, G_i, G_j]
    pred_mean = shift[:, None, None] + phi[:, None, None] * grids[:, None, :]
    log_kernel = -0.5 * (
        (grids[:, :, None] - pred_mean) ** 2 / q[:, None, None] + torch.log(2 * math.pi * q)[:, None, None]
    )
    log_p = (-0.5 * (grids - m0[:, None]) ** 2 / v0[:, None]).expand(B, d, points).clone()  # [B, d, G]
    means = torch.empty(B, T, d, dtype=F64)
    variances = torch.empty(B, T, d, dtype=F64)
    log_z = torch.empty(B, T, dtype=F64)
    base = m0.expand(points, d)
    for t in range(T):
        log_p = torch.log_softmax(
            torch.logsumexp(log_kernel[None] + torch.log_softmax(log_p, -1)[:, :, None, :], -1), -1
        )
        for k in range(d):
            x = base.clone()
            x[:, k] = grids[k]
            log_p[:, k] = log_p[:, k] + model.log_likelihood(obs[:, t], x[None].expand(B, points, d))
        at_base = model.log_likelihood(obs[:, t], m0.expand(B, 1, d))[:, 0]
        log_z[:, t] = torch.logsumexp(log_p, -1).sum(-1) - (d - 1) * at_base
        w = torch.softmax(log_p, -1)
        means[:, t] = (w * grids).sum(-1)
        variances[:, t] = (w * (grids - means[:, t, :, None]) ** 2).sum(-1)
    return means, torch.diag_embed(variances), log_z


def grid_error(
    reference: Callable[[int], tuple[torch.Tensor, torch.Tensor]], points: int
) -> tuple[tuple[torch.Tensor, torch.Tensor], float]:
    """Run ``reference(points)`` and ``reference(points // 2)``: (the fine result, the largest difference of the
    two means in units of the fine posterior sd, over sequences, steps and dimensions) — an upper estimate of
    the fine grid's own error, which shrinks faster than the coarse one's."""
    fine = reference(points)
    coarse = reference(points // 2)
    sd = fine[1].diagonal(dim1=-2, dim2=-1).sqrt()
    return fine, float(((fine[0] - coarse[0]).abs() / sd).max())

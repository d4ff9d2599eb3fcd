"""Random priors of meta-training tasks (Chen, Dai & Song, §3.1), shared by every family's task distribution
(``sample_task_models`` of :mod:`mpflow.training.task_distribution`).

Each function draws a batch of B priors, one per generator in ``gens``, so prior b depends only on generator b
(the batch around it does not matter). Priors are diverse (§3.1):

* ``prior="gaussian"`` (default): N(μ, Σ) with μ ~ N(0, I) and Σ = Q diag(s) Qᵀ, log s_i ~ U[log s_lo, log s_hi]
  (``scale_range``, default [0.5, 2]) and Q a Haar-random rotation;
* ``prior="dpgmm"``: a mixture drawn from a truncated Dirichlet-process Gaussian mixture (§3.1 "generative model
  approach"): stick-breaking weights with concentration α (``dp_alpha``), ``dp_components`` components, means from
  the base measure N(0, I), covariances from the Gaussian recipe above shrunk by ``dp_shrink``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from mpflow.operators.models.base import DEFAULT_SCALE_RANGE
from mpflow.operators.models.priors import GaussianMixture
from mpflow.operators.rng import Generators, haar_orthogonal, rand, randn

#: task options every family reads (the prior and the true state); families add their own
#: (``task_options`` of their task distribution)
SHARED_TASK_OPTIONS = ("scale_range", "prior", "true_x", "dp_alpha", "dp_components", "dp_shrink")


def uniform(gens: Generators, shape, lo: float, hi: float, dtype) -> torch.Tensor:
    """U[lo, hi] draws [B, *shape], one row per generator."""
    return lo + (hi - lo) * rand(gens, shape, dtype)


def random_covariance(gens: Generators, d: int, dtype, scale_range: tuple[float, float]) -> torch.Tensor:
    """Σ = Q diag(s) Qᵀ, log s_i ~ U[log lo, log hi], Q Haar-random → [B, d, d]."""
    lo, hi = scale_range
    if not 0 < lo <= hi:
        raise ValueError(f"scale_range: must satisfy 0 < lo <= hi, got {scale_range!r}")
    s = torch.exp(uniform(gens, [d], math.log(lo), math.log(hi), dtype))
    Q = haar_orthogonal(gens, d, dtype)
    cov = Q @ torch.diag_embed(s) @ Q.transpose(-1, -2)
    return 0.5 * (cov + cov.transpose(-1, -2))


def dp_mixture_prior(
    gens: Generators, d: int, dtype, *, alpha: float, components: int, shrink: float, scale_range
) -> GaussianMixture:
    """A truncated Dirichlet-process Gaussian mixture (stick-breaking, MPF §3.1): weights
    β_k ~ Beta(1, α) sticks (via the inverse CDF 1 − U^{1/α}), π_k = β_k Π_{j<k} (1 − β_j) with the last stick
    taking the rest, means ~ N(0, I), covariances ``shrink``·Σ_k."""
    if not alpha > 0 or components < 1 or not 0 < shrink <= 1:
        raise ValueError("dp: alpha > 0, components >= 1 and 0 < shrink <= 1 are required")
    beta = 1 - rand(gens, [components], torch.float64) ** (1.0 / alpha)
    beta[:, -1] = 1.0
    rest = torch.cumprod(torch.cat([torch.ones_like(beta[:, :1]), 1 - beta[:, :-1]], 1), 1)
    weights = (beta * rest).clamp_min(1e-6)
    weights = (weights / weights.sum(1, keepdim=True)).to(dtype)
    means = randn(gens, [components, d], dtype)
    covs = torch.stack([random_covariance(gens, d, dtype, scale_range) for _ in range(components)], 1) * shrink
    return GaussianMixture(weights, means, covs)


def gaussian_prior(
    gens: Generators,
    d: int,
    dtype,
    scale_range: tuple[float, float],
    centre: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
) -> GaussianMixture:
    """N(μ, c·Σ): μ = ``centre`` [B, d] (drawn from N(0, I) when None), Σ from :func:`random_covariance`, c the
    per-task ``scale`` [B] (1 when None)."""
    mean = randn(gens, [d], dtype) if centre is None else centre
    cov = random_covariance(gens, d, dtype, scale_range)
    if scale is not None:
        cov = cov * scale[:, None, None]
    return GaussianMixture.gaussian(mean, cov)


def task_prior(gens: Generators, d: int, dtype, options: dict[str, Any]) -> GaussianMixture:
    """The prior the task options ask for (module docstring): ``prior`` "gaussian" or "dpgmm"."""
    kind = options.get("prior", "gaussian")
    scale_range = options.get("scale_range", DEFAULT_SCALE_RANGE)
    if kind == "gaussian":
        return gaussian_prior(gens, d, dtype, scale_range)
    if kind == "dpgmm":
        return dp_mixture_prior(
            gens,
            d,
            dtype,
            alpha=options.get("dp_alpha", 1.0),
            components=options.get("dp_components", 4),
            shrink=options.get("dp_shrink", 0.3),
            scale_range=scale_range,
        )
    raise ValueError(f"prior: expected 'gaussian' or 'dpgmm', got {kind!r}")


__all__ = [
    "SHARED_TASK_OPTIONS",
    "dp_mixture_prior",
    "gaussian_prior",
    "random_covariance",
    "task_prior",
    "uniform",
]

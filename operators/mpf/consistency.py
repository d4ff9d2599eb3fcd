"""The predictive's consistency with the observation, and the inflation that restores it: how the automatic corrected
flow (``flow_fraction: "auto"``, :mod:`~mpflow.operators.mpf.kalman_particle`) recovers a cloud that has lost the
truth.

Why. Under a perfect model (``lorenz96`` at Bocquet 2010's settings) a particle filter's cloud can collapse onto a
wrong trajectory: its spread stays small (0.2 on Bocquet's twin) while its error grows to the attractor's scale
(about 5), and no reweighting or Liu–West move of a cloud that far from the observations brings it back. On 64 twin
experiments × 1000 steps every tuning of ``smc`` at N = 800 loses 1 to 6 of them this way (docs/benchmarks.md).

Test. With a linear observation o = H x + N(0, R) and the predictive's weighted moments (m, C), the innovation
ν = o − H m is N(0, S), S = H C Hᵀ + R, under the filter's own belief, so its normalised square νᵀ S⁻¹ ν is
χ²_k with k the observed entries (Bar-Shalom, Li & Kirubarajan 2001, §5.4, the NIS test). A value beyond the
χ²_k quantile of 1 − :data:`DIVERGENCE_P` says the belief is wrong, not the observation unlucky.

Remedy. Inflate the cloud's anomalies about m by ρ with the innovation-based estimate

    ρ² = max(1, (νᵀ ν − tr R) / tr(H C Hᵀ))     (Li, Kalnay & Miyoshi 2009, QJRMS 135, the innovation estimate)

so that the predictive's spread matches the innovation's. The inflated likelihood then collapses the bootstrap
weights, so the automatic choice of γ hands the step to the Kalman flow, which pulls the cloud onto the
observations. Without the flow the inflation alone does not help: the bootstrap weights of a cloud that wide are
degenerate.
"""

from __future__ import annotations

from functools import lru_cache

import torch
from mpflow.operators import gaussian
from mpflow.operators.models.base import ModelFamily

#: the false-alarm probability of one step's test: far below one a stream's lifetime, so that only a lost cloud
#: is inflated (the χ²₅ quantile is 42.5)
DIVERGENCE_P = 1e-7


@lru_cache(maxsize=64)
def _quantiles(k_max: int) -> torch.Tensor:
    """The χ²_k quantiles of 1 − :data:`DIVERGENCE_P` for k = 0 … k_max (float64; +inf for k = 0)."""
    from scipy.stats import chi2  # here, not at import: scipy.stats is ~10% of a server worker's start-up

    return torch.tensor([float("inf")] + [float(chi2.isf(DIVERGENCE_P, k)) for k in range(1, k_max + 1)])


def inflate_diverged(
    model: ModelFamily, obs: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, cov: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The predicted cloud x [B, N, d] with weighted moments ``mean`` [B, d], ``cov`` [B, d, d], its anomalies
    inflated by ρ (module docstring) on the streams whose innovation fails the consistency test → (x, cov, the
    inflated streams [B] bool). A partial observation's gaps (H's zero rows) count neither in k nor in tr R."""
    H, R = (t.to(torch.float64) for t in model.observation_affine())
    cov64 = cov.to(torch.float64)
    nu = model.observation_residual(obs, model.observation_function(mean[:, None].to(x.dtype)))[:, 0]
    nu = nu.to(torch.float64)
    HCH = H @ cov64 @ H.mT
    z = torch.linalg.solve_triangular(gaussian.cholesky(HCH + R), nu[..., None], upper=False)[..., 0]
    seen = H.abs().sum(-1) > 0  # [B, k]
    k = seen.sum(-1)
    diverged = z.square().sum(-1) > _quantiles(H.shape[-2])[k]
    if not bool(diverged.any()):
        return x, cov, diverged
    spread = HCH.diagonal(dim1=-2, dim2=-1).sum(-1).clamp_min(torch.finfo(torch.float64).tiny)
    noise = (R.diagonal(dim1=-2, dim2=-1) * seen).sum(-1)
    rho2 = torch.where(diverged, ((nu.square().sum(-1) - noise) / spread).clamp_min(1.0), 1.0)
    return gaussian.inflated(x, mean, rho2.sqrt()), cov * rho2.to(cov.dtype)[:, None, None], diverged


__all__ = ["DIVERGENCE_P", "inflate_diverged"]

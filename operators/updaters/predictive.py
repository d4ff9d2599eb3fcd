"""Forecasts: the j-step-ahead predictive distributions of one stream, j = 1..k, of the state and of the
observation (``GET /v1/streams/{id}/forecast``).

From the filtering posterior p(x_m | o_≤m), with the transition of a step of duration Δ (and no inputs) and no
measurement in between,

    p(x_{m+j} | o_≤m) = ∫ p(x_{m+j} | x_{m+j−1}) p(x_{m+j−1} | o_≤m) dx_{m+j−1},
    p(o_{m+j} | o_≤m) = ∫ p(o | x) p(x_{m+j} | o_≤m) dx.

* Exactly (:func:`gaussian_predictive`, ``kalman``): m_j = F m_{j−1} + c, P_j = F P_{j−1} Fᵀ + Q, and the
  observation N(H m_j, H P_j Hᵀ + R).
* By propagating the particles (:func:`particle_predictive`, every other method): x_i ← x_i' ~ p(x' | x_i), j times,
  weights unchanged, and one o_i ~ p(o | x_i) per particle and horizon; the moments are the weighted ones.

Every draw comes from the generator the caller gives (the service seeds it from the stream's seed and step), so a
forecast is reproducible and never touches the stream's own generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from mpflow.operators import gaussian
from mpflow.operators.models.base import ModelFamily
from mpflow.operators.references.exact_kalman import kalman_predict


@dataclass
class Predictive:
    """The predictive of one stream for horizons j = 1..k (float64). ``state_cloud`` [k, M, d] and
    ``observation_cloud`` [k, M, o] with ``log_weights`` [M] (normalised) are the propagated particles, None where the
    predictive is the exact Gaussian of its mean and covariance; the observation parts are None for a family whose
    observation has no predictive (``logistic``: the features are the caller's)."""

    state_mean: torch.Tensor  # [k, d]
    state_cov: torch.Tensor  # [k, d, d]
    observation_mean: torch.Tensor | None  # [k, o]
    observation_cov: torch.Tensor | None  # [k, o, o]
    state_cloud: torch.Tensor | None = None
    observation_cloud: torch.Tensor | None = None
    log_weights: torch.Tensor | None = None


def gaussian_predictive(mean: torch.Tensor, cov: torch.Tensor, model: ModelFamily, steps: int) -> Predictive:
    """The exact predictive of the Gaussian N(mean [1, d], cov [1, d, d]) through a linear-Gaussian ``model``."""
    H, R = (t.to(torch.float64) for t in model.observation_affine())
    means, covs, obs_means, obs_covs = [], [], [], []
    m, P = mean.to(torch.float64), cov.to(torch.float64)
    for _ in range(steps):
        m, P = kalman_predict(m, P, model)
        means.append(m[0])
        covs.append(P[0])
        obs_means.append((H @ m[..., None])[0, :, 0])
        S = H @ P @ H.transpose(-1, -2) + R
        obs_covs.append((0.5 * (S + S.transpose(-1, -2)))[0])
    return Predictive(torch.stack(means), torch.stack(covs), torch.stack(obs_means), torch.stack(obs_covs))


def particle_predictive(
    particles: torch.Tensor, log_weights: torch.Tensor, model: ModelFamily, steps: int, gen: torch.Generator
) -> Predictive:
    """The predictive of the weighted cloud (particles [1, N, d], log_weights [1, N]) by propagation (module
    docstring)."""
    lw = torch.log_softmax(log_weights.to(torch.float64), -1)
    x = particles
    clouds, obs_clouds = [], []
    for _ in range(steps):
        x = model.transition(x, [gen])
        clouds.append(x[0].to(torch.float64))
        o = model.observation_draws(x, gen)
        if o is not None:
            obs_clouds.append(o[0].flatten(1).to(torch.float64))
    cloud = torch.stack(clouds)  # [k, N, d]
    k = cloud.shape[0]
    mean, cov = gaussian.moments(cloud, lw.expand(k, -1))
    obs_cloud = torch.stack(obs_clouds) if obs_clouds else None
    obs_mean = obs_cov = None
    if obs_cloud is not None:
        obs_mean, obs_cov = gaussian.moments(obs_cloud, lw.expand(k, -1))
    return Predictive(mean, cov, obs_mean, obs_cov, cloud, obs_cloud, lw[0])


__all__ = ["Predictive", "gaussian_predictive", "particle_predictive"]

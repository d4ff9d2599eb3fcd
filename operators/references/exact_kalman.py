"""The Kalman filter in float64 (exact filtering for the ``lds`` family; with F = I, Q = 0 it is the
conjugate posterior of ``linear_gaussian``).

Predict:  m⁻ = F m + c,  P⁻ = F P Fᵀ + Q.     Update: :func:`mpflow.operators.references.conjugate.conjugate_update`.
The filter returns the filtering means/covariances and log p(o_m | o_<m) for every step.
"""

from __future__ import annotations

import torch
from mpflow.operators import gaussian
from mpflow.operators.models.base import ModelFamily
from mpflow.operators.references.conjugate import conjugate_update


def kalman_predict(mean, cov, model: ModelFamily) -> tuple[torch.Tensor, torch.Tensor]:
    """One predict step (identity for static families)."""
    if not model.dynamic:
        return mean, cov
    F, c, Q = (t.to(torch.float64) for t in model.transition_affine())
    return gaussian.affine_push(mean.to(torch.float64), cov.to(torch.float64), F, c, Q)


def kalman_filter(
    mean: torch.Tensor, cov: torch.Tensor, model: ModelFamily, observations: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Filter observations [B, T, k] from the prior N(mean [B, d], cov [B, d, d]) of x_0.

    Returns means [B, T, d], covs [B, T, d, d] of p(x_t | o_1..t) and log p(o_t | o_<t) [B, T], float64.
    """
    if not model.linear_gaussian:
        raise ValueError(f"method: kalman needs a linear-Gaussian family, not {model.name}")
    H, R = model.observation_affine()
    m, P = mean.to(torch.float64), cov.to(torch.float64)
    means, covs, logz = [], [], []
    for t in range(observations.shape[1]):
        m, P = kalman_predict(m, P, model)
        m, P, lz = conjugate_update(m, P, H, R, observations[:, t])
        means.append(m)
        covs.append(P)
        logz.append(lz)
    return torch.stack(means, 1), torch.stack(covs, 1), torch.stack(logz, 1)

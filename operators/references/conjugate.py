"""The conjugate Gaussian update (the Kalman measurement update), in float64.

Prior x ~ N(m, P), observation o ~ N(Hx, R):

    S = H P Hᵀ + R,   K = P Hᵀ S⁻¹,
    m' = m + K (o − H m),   P' = (I − K H) P (I − K H)ᵀ + K R Kᵀ   (Joseph form, stays PD),
    log p(o) = log N(o; H m, S)     (the predictive log-evidence increment).
"""

from __future__ import annotations

import torch
from mpflow.operators import gaussian


def kalman_gain(cov: torch.Tensor, H: torch.Tensor, R: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(K = P Hᵀ S⁻¹ [B, d, k], the Cholesky factor of S = H P Hᵀ + R [B, k, k]) for P = ``cov`` [B, d, d],
    H [B, k, d], R [B, k, k], in their dtype."""
    S = H @ cov @ H.transpose(-1, -2) + R
    L = gaussian.cholesky(0.5 * (S + S.transpose(-1, -2)))
    return torch.cholesky_solve(H @ cov, L).transpose(-1, -2), L


def conjugate_update(
    mean: torch.Tensor, cov: torch.Tensor, H: torch.Tensor, R: torch.Tensor, obs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mean [B, d], cov [B, d, d], H [B, k, d], R [B, k, k], obs [B, k] → (m', P', log p(o)) in float64."""
    mean, cov, H, R, obs = (t.to(torch.float64) for t in (mean, cov, H, R, obs))
    K, L = kalman_gain(cov, H, R)
    pred = torch.einsum("bkd,bd->bk", H, mean)
    log_pred = gaussian.log_prob(obs[:, None], pred, L)[:, 0]
    m = mean + torch.einsum("bdk,bk->bd", K, obs - pred)
    eye = torch.eye(cov.shape[-1], dtype=cov.dtype)
    IKH = eye - K @ H
    P = IKH @ cov @ IKH.transpose(-1, -2) + K @ R @ K.transpose(-1, -2)
    return m, 0.5 * (P + P.transpose(-1, -2)), log_pred

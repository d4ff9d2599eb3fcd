"""The corrected flow with part of the likelihood weighted, for a linear observation: the ensemble Kalman particle
filter (EnKPF; Frei & Künsch 2013, "Bridging the ensemble Kalman and particle filters", Biometrika 100(4), §2).

Why. With o = H x + N(0, R) the base flow is the exact Bayes update of the predictive's Gaussian fit, so the
corrected flow's weights against that fit (:mod:`~mpflow.operators.mpf.correction`) are uniform: they correct
the likelihood's curvature, of which a linear observation has none, and never the fit itself. Under a perfect
model (``lorenz96`` at Bocquet 2010's settings) the fit is the error: the predictive is the cloud mapped through
the dynamics, far from Gaussian, and the flow is an ensemble square-root filter with its floor (analysis RMSE
0.30 at any N, against the particle filter's 0.25). Split the likelihood p(o | x) = p(o | x)^γ p(o | x)^{1−γ}
(γ = ``flow_fraction``) and let the flow take γ, the weights the rest:

1. move     each predicted particle xᵢ by the Kalman map of the tempered likelihood N(o; H x, R/γ), with the
            predictive's covariance C (its Gaussian fit, the flow's):
                νᵢ = xᵢ + K_γ (o − H xᵢ),   K_γ = C Hᵀ (H C Hᵀ + R/γ)⁻¹                          (Frei & Künsch eq. 4)
            and read the moved cloud as the Gaussian mixture Σᵢ N(νᵢ, Q_γ), Q_γ = K_γ (R/γ) K_γᵀ: the stochastic
            EnKF's perturbation K_γ ε, ε ~ N(0, R/γ), as a kernel (its covariance is the tempered Kalman
            posterior's, and each component keeps its particle's place in the non-Gaussian cloud);
2. weight   the mixture's components by the rest of the likelihood, exactly (a linear-Gaussian update of each):
                αᵢ ∝ N(o; H νᵢ, H Q_γ Hᵀ + R/(1−γ))                                          (eq. 6)
3. resample the components by α (systematic), then draw from each its posterior by the perturbed-observation
            update of the kernel: u = ν_I + K_γ ε₁, x = u + K̃ (o + ε₂ − H u), ε₁ ~ N(0, R/γ), ε₂ ~ N(0, R/(1−γ)),
            K̃ = Q_γ Hᵀ (H Q_γ Hᵀ + R/(1−γ))⁻¹                                              (eq. 7)
            (Q_γ has rank ≤ dim o: drawing it through K_γ needs no factor of it).

γ = 1 is the stochastic EnKF, γ → 0 the bootstrap filter with no kernel. Between them the flow keeps the weights
from degenerating (the particle filter at N = 400 loses the truth on some of Bocquet's experiments) and the weights
keep the predictive's shape. Measured on Bocquet 2010 (``benchmarks.lorenz96``, 4 experiments × 2000 steps):
docs/benchmarks.md.

Innovations are the family's residuals (:meth:`~mpflow.operators.models.base.ModelFamily.observation_residual` of
``observation_function``): 0 at a partial observation's gaps, where H's row is 0 and R's entry 1
(``observation_affine``), so a gap moves and weighs nothing.
"""

from __future__ import annotations

import torch
from mpflow.operators import gaussian
from mpflow.operators.models.base import ModelFamily
from mpflow.operators.references.conjugate import kalman_gain
from mpflow.operators.rng import Generators, randn
from mpflow.operators.state import systematic_resample


def kalman_particle_step(
    model: ModelFamily,
    obs: torch.Tensor,
    x: torch.Tensor,
    cov: torch.Tensor,
    gamma: float,
    u: torch.Tensor,
    gens: Generators,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One EnKPF step (module docstring) of the predicted cloud x [B, N, d] with the predictive's covariance
    ``cov`` [B, d, d], flow fraction ``gamma`` ∈ (0, 1) and resampling uniforms ``u`` [B] → (the posterior cloud
    [B, N, d], uniformly weighted, in x's dtype; the log-weights α [B, N] of step 2, normalised).

    The observation being linear, every quantity of a particle is affine in its residual eᵢ = o − H xᵢ: the moved
    point's residual is o − H νᵢ = (I − H K_γ) eᵢ, its component's posterior mean νᵢ + K̃ (I − H K_γ) eᵢ
    = xᵢ + G eᵢ with G = K_γ + K̃ (I − H K_γ), and a draw's two perturbations enter as [ξ₁, ξ₂] M with ξ standard
    normal and M = [L₁ᵀ (K_γ − K̃ H K_γ)ᵀ; L₂ᵀ K̃ᵀ] (L₁ L₁ᵀ = R/γ, L₂ L₂ᵀ = R/(1−γ)): one product each."""
    N = x.shape[1]
    H, R = (t.to(torch.float64) for t in model.observation_affine())
    e = model.observation_residual(obs, model.observation_function(x)).to(torch.float64)  # [B, N, k]
    K, _ = kalman_gain(cov.to(torch.float64), H, R / gamma)
    K_rest, L_rest = kalman_gain(K @ (R / gamma) @ K.transpose(-1, -2), H, R / (1.0 - gamma))
    HK = H @ K
    k = R.shape[-1]
    moved = torch.eye(k, dtype=torch.float64) - HK  # eᵢ ↦ o − H νᵢ
    white = torch.linalg.solve_triangular(L_rest, moved @ e.transpose(-1, -2), upper=False)
    log_alpha = torch.log_softmax(-0.5 * white.square().sum(-2), -1)
    G = K + K_rest @ moved
    mean = x.to(torch.float64) + e @ G.transpose(-1, -2)  # each component's posterior mean
    M = torch.cat(
        [
            gaussian.cholesky(R / gamma).transpose(-1, -2) @ (K - K_rest @ HK).transpose(-1, -2),
            gaussian.cholesky(R / (1.0 - gamma)).transpose(-1, -2) @ K_rest.transpose(-1, -2),
        ],
        -2,
    )
    idx = systematic_resample(log_alpha, u)[..., None].expand(-1, -1, mean.shape[-1])
    noise = randn(gens, [N, 2 * k], x.dtype).to(torch.float64)
    return torch.baddbmm(torch.gather(mean, 1, idx), noise, M).to(x.dtype), log_alpha

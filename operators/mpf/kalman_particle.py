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

γ = ``"auto"`` (:func:`adaptive_kalman_particle_step`) chooses the share per stream and step as Frei & Künsch
(§3) propose: the smallest γ whose weights keep an effective sample size of at least a floor (``ess_threshold``·N),
so that the update stays as close to the particle filter's as the weights allow. On most steps of a well-tuned
cloud that is γ = 0, the bootstrap update with no flow and no Gaussian bias; the flow enters on the steps whose
likelihood would collapse the weights. The weights are then carried between steps (w ← w α) and each particle is
drawn from its own component's posterior without resampling; the updater resamples when the carried weights' ESS
falls below the floor, as ``smc`` does.

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
from mpflow.operators.state import ess, systematic_resample

#: the shares γ the automatic choice tries, smallest first, after γ = 0 (the bootstrap update); the largest is
#: taken where none keeps the floor
AUTO_FLOW_FRACTIONS = (0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9)


def tempered_maps(
    cov: torch.Tensor, H: torch.Tensor, R: torch.Tensor, gammas: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The affine maps of one EnKPF step (module docstring) for each share γ of ``gammas`` [G] (each in (0, 1)),
    given the predictive's covariance C = ``cov`` [B, d, d] and the observation's H [B, k, d], R [B, k, k]
    → float64 (A [G, B, k, k], G [G, B, d, k], M [G, B, 2k, d]).

    A particle's every quantity is affine in its residual eᵢ = o − H xᵢ: the moved point's residual is
    o − H νᵢ = (I − H K_γ) eᵢ, so its component's weight is log αᵢ = −½ ‖A eᵢ‖² + const with A = L⁻¹ (I − H K_γ),
    L Lᵀ = H Q_γ Hᵀ + R/(1−γ) (eq. 6); the component's posterior mean is νᵢ + K̃ (I − H K_γ) eᵢ = xᵢ + G eᵢ with
    G = K_γ + K̃ (I − H K_γ); and a draw's two perturbations enter as [ξ₁, ξ₂] M with ξ standard normal and
    M = [L₁ᵀ (K_γ − K̃ H K_γ)ᵀ; L₂ᵀ K̃ᵀ] (L₁ L₁ᵀ = R/γ, L₂ L₂ᵀ = R/(1−γ); eq. 7)."""
    g = gammas.to(torch.float64)[:, None, None, None]
    cov, H, R = (t.to(torch.float64).expand(len(gammas), *t.shape) for t in (cov, H, R))
    R_flow, R_rest = R / g, R / (1.0 - g)
    K, _ = kalman_gain(cov, H, R_flow)
    K_rest, L_rest = kalman_gain(K @ R_flow @ K.mT, H, R_rest)
    HK = H @ K
    moved = torch.eye(R.shape[-1], dtype=torch.float64) - HK  # eᵢ ↦ o − H νᵢ
    A = torch.linalg.solve_triangular(L_rest, moved, upper=False)
    G = K + K_rest @ moved
    M = torch.cat([gaussian.cholesky(R_flow).mT @ (K - K_rest @ HK).mT, gaussian.cholesky(R_rest).mT @ K_rest.mT], -2)
    return A, G, M


def _residuals(model: ModelFamily, obs: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(e = o − H x [B, N, k], H, R) in float64."""
    H, R = (t.to(torch.float64) for t in model.observation_affine())
    return model.observation_residual(obs, model.observation_function(x)).to(torch.float64), H, R


def _component_weights(e: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
    """Normalised log αᵢ = −½ ‖A eᵢ‖² [..., B, N] of residuals e [B, N, k] under maps A [..., B, k, k]."""
    return torch.log_softmax(-0.5 * (e @ A.mT).square().sum(-1), -1)


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
    [B, N, d], uniformly weighted, in x's dtype; the log-weights α [B, N] of step 2, normalised). One product per
    quantity through :func:`tempered_maps`."""
    N = x.shape[1]
    e, H, R = _residuals(model, obs, x)
    A, G, M = (t[0] for t in tempered_maps(cov, H, R, torch.tensor([gamma])))
    log_alpha = _component_weights(e, A)
    mean = x.to(torch.float64) + e @ G.mT  # each component's posterior mean
    idx = systematic_resample(log_alpha, u)[..., None].expand(-1, -1, mean.shape[-1])
    noise = randn(gens, [N, M.shape[-2]], x.dtype).to(torch.float64)
    return torch.baddbmm(torch.gather(mean, 1, idx), noise, M).to(x.dtype), log_alpha


def adaptive_kalman_particle_step(
    model: ModelFamily,
    obs: torch.Tensor,
    x: torch.Tensor,
    log_likelihood: torch.Tensor,
    cov: torch.Tensor,
    ess_floor: float,
    gens: Generators,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The EnKPF step with γ chosen per stream (module docstring) for the predicted cloud x [B, N, d], its
    log-likelihoods [B, N] and the predictive's covariance ``cov`` [B, d, d] → (the moved cloud in x's dtype, the
    step's normalised log-weights log α [B, N] — the particles' incremental weights — and γ [B], 0 for the
    bootstrap update). γ is the smallest of 0 and :data:`AUTO_FLOW_FRACTIONS` whose α have an ESS of at least
    ``ess_floor``·N (the largest where none does); a stream with γ > 0 draws its particles from their components'
    posteriors from its own generator, so a stream's random sequence does not depend on its batch."""
    B, N, _ = x.shape
    log_alpha = torch.log_softmax(log_likelihood.to(torch.float64), -1)
    gamma = torch.zeros(B, dtype=torch.float64)
    flows = ess(log_alpha) < ess_floor * N
    if not bool(flows.any()):
        return x, log_alpha, gamma
    rows = flows.nonzero().flatten()
    e, H, R = _residuals(model.select(rows), obs[rows], x[rows])
    shares = torch.tensor(AUTO_FLOW_FRACTIONS, dtype=torch.float64)
    A, G, M = tempered_maps(cov[rows], H, R, shares)
    candidates = _component_weights(e, A)  # [G, b, N]
    keeps = ess(candidates) >= ess_floor * N
    pick = torch.where(keeps.any(0), keeps.to(torch.int8).argmax(0), len(shares) - 1)
    b = torch.arange(len(rows))
    noise = randn([gens[i] for i in rows.tolist()], [N, M.shape[-2]], torch.float64)
    moved = x[rows].to(torch.float64) + e @ G[pick, b].mT + noise @ M[pick, b]
    return (
        x.index_copy(0, rows, moved.to(x.dtype)),
        log_alpha.index_copy(0, rows, candidates[pick, b]),
        gamma.index_copy(0, rows, shares[pick]),
    )

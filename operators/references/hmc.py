"""MCMC reference for a static family with a smooth log-concave posterior (``logistic``), with its own
diagnostics.

At step t the target is π_t(x) ∝ N(x; m₀, C₀) Π_{k≤t} p(o_k | x), all sequences at once. Hamiltonian Monte
Carlo (Neal 2011, "MCMC using Hamiltonian dynamics", §5.2, leapfrog eq. 5.18–5.20) with the mass matrix M⁻¹ =
Σ, the Laplace covariance at the mode (−∇² log π_t(x̂))⁻¹ (found by Newton's method), so that the
preconditioned target is close to N(0, I); ``chains`` chains per sequence start from draws of that Laplace
approximation. During warm-up the step size ε is tuned towards an acceptance rate of 0.8, and halfway through
the mass matrix is re-estimated from the pooled draws of the second quarter (the Laplace covariance understates
a skewed posterior, e.g. nearly separable minibatches); the number of leapfrog steps is drawn per iteration
from [L/2, 3L/2] so that no trajectory length resonates with the target.

Diagnostics (Vehtari et al. 2021, "Rank-normalization, folding, and localization: an improved R-hat",
Bayesian Analysis 16(2)): the split R-hat per dimension, and the effective sample size per dimension from the
chains' autocorrelations (Geyer's initial positive sequence, pooled over chains). A step whose worst R-hat
exceeds ``max_rhat`` or whose smallest ESS is below ``min_ess`` raises :class:`ReferenceRejectedError`. The Monte
Carlo error of a posterior mean is about 1/√ESS posterior sd.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from mpflow.operators.models.base import ModelFamily

F64 = torch.float64


class ReferenceRejectedError(RuntimeError):
    """An MCMC reference failed its diagnostics: its moments are not a reference."""


@dataclass(frozen=True)
class MCMCReference:
    means: torch.Tensor  # [B, T, d]
    covs: torch.Tensor  # [B, T, d, d]
    ess: torch.Tensor  # [B, T] smallest per-dimension ESS
    rhat: torch.Tensor  # [B, T] largest per-dimension split R-hat


def _data_upto(model: ModelFamily, obs: torch.Tensor, t: int) -> list[torch.Tensor]:
    """The observations 1..t+1 of ``obs`` [B, T, *obs_shape], as few observations as the family allows: a
    minibatch family (a variable number of rows per observation, ``obs_shape[0] == -1``) takes all rows at once
    as one observation — its likelihood is the product over rows — and any other family one per step."""
    if model.obs_shape and model.obs_shape[0] == -1:
        B, _, M, k = obs.shape
        return [obs[:, : t + 1].reshape(B, (t + 1) * M, k)]
    return [obs[:, k] for k in range(t + 1)]


def _log_target_and_grad(model, data: list[torch.Tensor], x, m0, P0) -> tuple[torch.Tensor, torch.Tensor]:
    """log π(x) up to a constant and ∇ log π(x) for x [B, C, d]."""
    diff = x - m0
    grad = -diff @ P0
    lp = 0.5 * (grad * diff).sum(-1)
    for o in data:
        lp = lp + model.log_likelihood(o, x)
        grad = grad + model.score(o, x)
    return lp, grad


def _laplace(model, data, m0, P0, start: torch.Tensor, iterations: int = 30) -> tuple[torch.Tensor, torch.Tensor]:
    """(mode [B, d], Laplace covariance [B, d, d]) by Newton's method, the Hessian by autograd per sequence."""
    x = start.clone()
    B, d = x.shape
    eye = torch.eye(d, dtype=F64)

    def hessians(x: torch.Tensor) -> torch.Tensor:
        rows = []
        for b in range(B):
            one = [o[b : b + 1] for o in data]

            def f(z, one=one):
                return _log_target_and_grad(model, one, z[None, None], m0, P0)[0][0, 0]

            rows.append(torch.func.hessian(f)(x[b]))
        return torch.stack(rows)

    for _ in range(iterations):
        _, grad = _log_target_and_grad(model, data, x[:, None], m0, P0)
        step = torch.linalg.solve(-hessians(x), grad[:, 0])
        x = x + step
        if float(step.abs().max()) < 1e-9:
            break
    cov = torch.linalg.inv(-hessians(x))
    return x, 0.5 * (cov + cov.transpose(-1, -2)) + 1e-12 * eye


def split_rhat(draws: torch.Tensor) -> torch.Tensor:
    """Split R-hat per dimension of draws [B, C, S, d] (Vehtari et al. 2021, eq. 1–4 without rank
    normalisation) → [B, d]."""
    B, C, S, d = draws.shape
    half = S // 2
    chains = torch.cat([draws[:, :, :half], draws[:, :, half : 2 * half]], 1)  # [B, 2C, half, d]
    within = chains.var(2).mean(1)
    between = half * chains.mean(2).var(1)
    var_plus = (half - 1) / half * within + between / half
    return torch.sqrt(var_plus / within)


def effective_sample_size(draws: torch.Tensor) -> torch.Tensor:
    """ESS per dimension of draws [B, C, S, d] (Vehtari et al. 2021 §3.2: autocorrelations pooled over chains,
    Geyer's initial positive sequence) → [B, d]."""
    B, C, S, d = draws.shape
    centred = draws - draws.mean(2, keepdim=True)
    n = 2 ** math.ceil(math.log2(2 * S))
    spec = torch.fft.rfft(centred, n=n, dim=2)
    acov = torch.fft.irfft(spec * spec.conj(), n=n, dim=2)[:, :, :S] / S  # [B, C, S, d]
    within = acov[:, :, 0].mean(1) * S / (S - 1)
    var_plus = within * (S - 1) / S + draws.mean(2).var(1) if C > 1 else within
    rho = 1 - (within[:, None] - acov.mean(1)) / var_plus[:, None]  # [B, S, d]
    pairs = rho[:, : S - S % 2].reshape(B, -1, 2, d).sum(2)  # Γ_k = ρ_2k + ρ_2k+1
    positive = torch.cumprod((pairs > 0).to(F64), 1)
    tau = -1 + 2 * (pairs * positive).sum(1)
    return C * S / tau.clamp_min(1e-3)


def hmc_reference(
    model: ModelFamily,
    prior_mean: torch.Tensor,
    prior_cov: torch.Tensor,
    observations: torch.Tensor,
    chains: int = 16,
    draws: int = 600,
    warmup: int = 200,
    leapfrog: int = 8,
    min_ess: float = 1000.0,
    max_rhat: float = 1.01,
    seed: int = 0,
) -> MCMCReference:
    """Posterior moments at every step of B sequences ``observations`` [B, T, *obs_shape] (module docstring)."""
    model = model.to(F64)
    m0, C0 = prior_mean.to(F64), prior_cov.to(F64)
    P0 = torch.linalg.inv(C0)
    obs = observations.to(F64)
    B, T = obs.shape[:2]
    d = m0.shape[0]
    gen = torch.Generator().manual_seed(seed)
    means = torch.empty(B, T, d, dtype=F64)
    covs = torch.empty(B, T, d, d, dtype=F64)
    ess = torch.empty(B, T, dtype=F64)
    rhat = torch.empty(B, T, dtype=F64)
    mode = m0.expand(B, d).clone()
    for t in range(T):
        data = _data_upto(model, obs, t)
        mode, cov = _laplace(model, data, m0, P0, mode)
        centre, L = mode, torch.linalg.cholesky(cov)  # x = centre + L u: u is near N(0, I)
        u = torch.randn(B, chains, d, dtype=F64, generator=gen)
        eps = torch.full((B, 1, 1), 1.2 / d**0.25, dtype=F64)
        kept, adapt = [], []
        for it in range(warmup + draws):
            if it == warmup // 2:  # re-precondition with the draws of the second quarter (Stan's windowed metric)
                x_now = centre[:, None] + u @ L.transpose(-1, -2)
                pooled = torch.cat(adapt, 1)
                centre = pooled.mean(1)
                diff = pooled - centre[:, None]
                emp = diff.transpose(-1, -2) @ diff / (pooled.shape[1] - 1)
                L = torch.linalg.cholesky(emp + 1e-9 * torch.eye(d, dtype=F64))
                u = torch.linalg.solve_triangular(L, (x_now - centre[:, None]).transpose(-1, -2), upper=False)
                u = u.transpose(-1, -2)
            if it in (0, warmup // 2):
                lp, g = _log_target_and_grad(model, data, centre[:, None] + u @ L.transpose(-1, -2), m0, P0)
                g = g @ L  # ∇_u = Lᵀ ∇_x
            p = torch.randn(B, chains, d, dtype=F64, generator=gen)
            h0 = lp - 0.5 * (p * p).sum(-1)
            steps = int(torch.randint(leapfrog // 2, 3 * leapfrog // 2 + 1, (1,), generator=gen))
            un, pn, gn = u, p + 0.5 * eps * g, g
            for k in range(steps):
                un = un + eps * pn
                lpn, gn = _log_target_and_grad(model, data, centre[:, None] + un @ L.transpose(-1, -2), m0, P0)
                gn = gn @ L
                pn = pn + (eps if k < steps - 1 else 0.5 * eps) * gn
            log_accept = torch.nan_to_num(lpn - 0.5 * (pn * pn).sum(-1) - h0, nan=-math.inf).clamp_max(0.0)
            accept = torch.rand(B, chains, dtype=F64, generator=gen).log() < log_accept
            u = torch.where(accept[..., None], un, u)
            lp = torch.where(accept, lpn, lp)
            g = torch.where(accept[..., None], gn, g)
            if it < warmup:  # towards an acceptance rate of 0.8, per sequence
                rate = log_accept.exp().mean(1)[:, None, None]
                eps = eps * torch.exp(0.5 * (rate - 0.8))
                if warmup // 4 <= it < warmup // 2:
                    adapt.append(centre[:, None] + u @ L.transpose(-1, -2))
            else:
                kept.append(centre[:, None] + u @ L.transpose(-1, -2))
        chain_draws = torch.stack(kept, 2)  # [B, C, S, d]
        flat = chain_draws.reshape(B, -1, d)
        means[:, t] = flat.mean(1)
        diff = flat - means[:, t, None]
        covs[:, t] = diff.transpose(-1, -2) @ diff / (flat.shape[1] - 1)
        ess[:, t] = effective_sample_size(chain_draws).min(-1).values
        rhat[:, t] = split_rhat(chain_draws).max(-1).values
        worst = int(torch.argmin(ess[:, t] / min_ess - (rhat[:, t] - max_rhat).clamp_min(0) * 1e6))
        if float(ess[worst, t]) < min_ess or float(rhat[:, t].max()) > max_rhat:
            raise ReferenceRejectedError(
                f"HMC reference at step {t + 1}: min ESS {float(ess[:, t].min()):.0f} (need ≥ {min_ess:.0f}), "
                f"max R-hat {float(rhat[:, t].max()):.4f} (need ≤ {max_rhat})"
            )
    return MCMCReference(means, covs, ess, rhat)

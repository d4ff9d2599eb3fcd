"""The exact Daum–Huang flow: the base velocity the MPF network corrects.

For a Gaussian prior N(m, P) and a Gaussian likelihood in information form,
log p(o | x) = −½ xᵀ Λ x + ηᵀ x + const (Λ = Hᵀ R⁻¹ H, η = Hᵀ R⁻¹ o for o ~ N(Hx, R)), the affine field

    dx/dλ = A(λ) x + b(λ),   λ ∈ [0, 1],
    A(λ) = −½ P Hᵀ (λ H P Hᵀ + R)⁻¹ H = −½ P (I + λ Λ P)⁻¹ Λ,
    b(λ) = (I + 2λA) [ (I + λA) P η + A m ],

moves every sample of the prior onto the posterior N(m⁺, P⁺) at λ = 1 (Daum & Huang 2010, "exact flow";
the second form of A needs no R⁻¹ and stays defined when Λ is singular). Its divergence is tr A(λ), so
the log-density change along the flow is exact too (MPF eq. 8).

For likelihoods that are not Gaussian, :func:`statistical_linearisation` fits (Λ, η) to the particles'
scores s_i = ∇x log p(o | x_i) by Stein's identity: for a Gaussian cloud and a quadratic log-likelihood,
E[s (x − m)ᵀ] = −Λ C and E[s] = η − Λ m, so Λ̂ = −sym(E[s (x − m)ᵀ] C⁻¹) (negative eigenvalues clipped
to 0) and η̂ = E[s] + Λ̂ m. This is exact for ``linear_gaussian`` and ``lds`` and a moment-matched
(unscented-like) approximation otherwise — the MPF network learns the remaining residual
(MPF §2.4: the likelihood enters through ∇x log p(o | x)).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from operators import gaussian


@dataclass
class GaussianLikelihood:
    """log p(o | x) ≈ −½ xᵀ Λ x + ηᵀ x: precision Λ [B, d, d] (PSD) and information vector η [B, d]."""

    precision: torch.Tensor
    information: torch.Tensor


def linear_gaussian_likelihood(H: torch.Tensor, R: torch.Tensor, obs: torch.Tensor) -> GaussianLikelihood:
    """Exact (Λ, η) = (Hᵀ R⁻¹ H, Hᵀ R⁻¹ o) for o ~ N(Hx, R); H [B, k, d], R [B, k, k], obs [B, k]."""
    L = gaussian.cholesky(R)
    RinvH = torch.cholesky_solve(H, L)  # R⁻¹ H  [B, k, d]
    prec = H.transpose(-1, -2) @ RinvH
    return GaussianLikelihood(0.5 * (prec + prec.transpose(-1, -2)), torch.einsum("bkd,bk->bd", RinvH, obs))


def statistical_linearisation(
    x: torch.Tensor,
    score: torch.Tensor,
    log_weights: torch.Tensor | None = None,
    whitened: gaussian.Whitened | None = None,
) -> GaussianLikelihood:
    """Fit (Λ, η) to the likelihood scores ``score`` [B, N, d] at the particles ``x`` [B, N, d] by Stein's
    identity (module docstring). Computed in float64. ``whitened``: x's (unweighted) :class:`Whitened` form
    when the caller has it (its mean and Cholesky factor are reused)."""
    x64, s64 = x.to(torch.float64), score.to(torch.float64)
    w = (
        torch.full(x.shape[:2], 1.0 / x.shape[1], dtype=torch.float64)
        if log_weights is None
        else torch.softmax(log_weights.to(torch.float64), -1)
    )
    if whitened is not None and log_weights is None:
        mean, chol = whitened.mean, whitened.chol
    else:
        mean, cov = gaussian.moments(x64, log_weights)
        chol = gaussian.cholesky(cov)
    xc = x64 - mean[:, None]
    cross = torch.einsum("bn,bni,bnj->bij", w, s64, xc)  # E[s (x − m)ᵀ] ≈ −Λ C
    prec = -torch.cholesky_solve(cross.transpose(-1, -2), chol).transpose(-1, -2)
    prec = 0.5 * (prec + prec.transpose(-1, -2))
    eig, vec = torch.linalg.eigh(prec)
    prec = vec @ torch.diag_embed(eig.clamp_min(0.0)) @ vec.transpose(-1, -2)
    info = torch.einsum("bn,bnd->bd", w, s64) + torch.einsum("bij,bj->bi", prec, mean)
    return GaussianLikelihood(prec, info)


class DaumHuangFlow:
    """The affine field dx/dλ = A(λ) x + b(λ) from N(m, P) to the posterior under a Gaussian likelihood.

    ``mean`` [B, d], ``cov`` [B, d, d] (the prior of this step), ``likelihood`` (Λ, η). All in the dtype of
    ``mean``; ``velocity`` casts to the dtype of x.
    """

    def __init__(self, mean: torch.Tensor, cov: torch.Tensor, likelihood: GaussianLikelihood):
        self.mean, self.cov = mean, cov
        self.prec = likelihood.precision.to(mean.dtype)
        self.info = likelihood.information.to(mean.dtype)
        self.eye = torch.eye(mean.shape[-1], dtype=mean.dtype)

    def matrices(self, lam: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A(λ) [B, d, d] and b(λ) [B, d] for λ [B] (or a number)."""
        lam = torch.as_tensor(lam, dtype=self.mean.dtype).expand(self.mean.shape[0])[:, None, None]
        P, Lam = self.cov, self.prec
        A = -0.5 * P @ torch.linalg.solve(self.eye + lam * Lam @ P, Lam)
        IA = self.eye + lam * A
        inner = torch.einsum("bij,bj->bi", IA @ P, self.info) + torch.einsum("bij,bj->bi", A, self.mean)
        b = torch.einsum("bij,bj->bi", self.eye + 2 * lam * A, inner)
        return A, b

    def velocity(self, x: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
        """A(λ) x + b(λ) for x [B, N, d] → [B, N, d]."""
        A, b = self.matrices(lam)
        return x @ A.transpose(-1, -2).to(x.dtype) + b[:, None].to(x.dtype)

    def divergence(self, lam: torch.Tensor) -> torch.Tensor:
        """∇·(A x + b) = tr A(λ) → [B]."""
        return torch.diagonal(self.matrices(lam)[0], dim1=-2, dim2=-1).sum(-1)


def linearised_likelihood(
    model,
    obs: torch.Tensor,
    x: torch.Tensor,
    whitened: gaussian.Whitened | None = None,
    score: torch.Tensor | None = None,
) -> GaussianLikelihood:
    """The Gaussian likelihood of one MPF step: exact (Hᵀ R⁻¹ H, Hᵀ R⁻¹ o) for linear-Gaussian families,
    else :func:`statistical_linearisation` of the scores at the (detached) particles x [B, N, d] (``whitened``:
    x's :class:`~operators.gaussian.Whitened` form, reused when given; ``score``: ∇x log p(o | x) at x, when
    the caller has it)."""
    if model.linear_gaussian:
        H, R = model.observation_affine()
        return linear_gaussian_likelihood(H.double(), R.double(), obs.double())
    x = x.detach()
    return statistical_linearisation(x, model.score(obs, x) if score is None else score, whitened=whitened)

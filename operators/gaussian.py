"""Batched multivariate Gaussian algebra used across the package.

Shapes: a batch of B streams, N points in R^d. ``mean`` [B, d], ``cov`` [B, d, d], ``x`` [B, N, d].
All functions work in the dtype of their inputs (references and metrics call them in float64).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

LOG_2PI = math.log(2 * math.pi)


class NotPositiveDefinite(ValueError):  # noqa: N818 (reads as the condition, like LinAlgError's messages)
    """A covariance that stays non-positive-definite with every jitter :func:`cholesky` tries (a collapsed or
    overflowed particle cloud, a degenerate prior)."""


def cholesky(cov: torch.Tensor, jitter: float = 0.0) -> torch.Tensor:
    """Lower Cholesky factor of ``cov``, retrying with growing jitter·mean(diag)·I if it is not PD
    (:class:`NotPositiveDefinite` otherwise). A positive-definite ``cov`` (the usual case) costs one
    factorisation and one check. The jitter goes only to the matrices of the batch that need it, so one
    stream's degenerate covariance does not change another's factor (a stream's result does not depend on its
    batch)."""
    L, info = _cholesky_ex(cov + jitter * _scaled_eye(cov) if jitter else cov)
    bad = info != 0
    if not bool(bad.any()):
        return L
    eye = _scaled_eye(cov)
    for j in [1e-10, 1e-8, 1e-6, 1e-4, 1e-2]:
        if j <= jitter:
            continue
        retry, info = _cholesky_ex(cov + j * eye)
        L = torch.where(bad[..., None, None], retry, L)
        bad = bad & (info != 0)
        if not bool(bad.any()):
            return L
    raise NotPositiveDefinite("covariance is not positive definite even with jitter")


#: batches of at least this many small (d ≤ :data:`SMALL_DIM`) matrices are factorised column by column over the
#: whole batch (:func:`_columnwise_cholesky`): LAPACK's batched call loops over the matrices, ~30 µs each on a CPU
MANY_MATRICES = 256
SMALL_DIM = 8


def _cholesky_ex(cov: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(L, info) as :func:`torch.linalg.cholesky_ex`, column by column for many small matrices."""
    if cov.dim() > 2 and cov.shape[-1] <= SMALL_DIM and cov[..., 0, 0].numel() >= MANY_MATRICES:
        return _columnwise_cholesky(cov)
    return torch.linalg.cholesky_ex(cov)


def _columnwise_cholesky(cov: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The Cholesky–Banachiewicz recursion L_jj = √(C_jj − Σ_{k<j} L_jk²), L_ij = (C_ij − Σ_{k<j} L_ik L_jk) / L_jj,
    vectorised over the batch (d steps of tensor operations); info ≠ 0 where a pivot is not positive."""
    d = cov.shape[-1]
    L = torch.zeros_like(cov)
    info = torch.zeros(cov.shape[:-2], dtype=torch.int32)
    for j in range(d):
        pivot = cov[..., j, j] - (L[..., j, :j] ** 2).sum(-1)
        info = torch.where((info == 0) & ~(pivot > 0), j + 1, info)
        root = pivot.clamp_min(torch.finfo(cov.dtype).tiny).sqrt()
        L[..., j, j] = root
        if j + 1 < d:
            off = cov[..., j + 1 :, j] - (L[..., j + 1 :, :j] * L[..., None, j, :j]).sum(-1)
            L[..., j + 1 :, j] = off / root[..., None]
    return L, info


def _scaled_eye(cov: torch.Tensor) -> torch.Tensor:
    """mean(diag(cov))·I for each matrix of the batch (the unit of :func:`cholesky`'s jitter)."""
    eye = torch.eye(cov.shape[-1], dtype=cov.dtype, device=cov.device)
    return torch.diagonal(cov, dim1=-2, dim2=-1).abs().mean(-1).clamp_min(1e-30)[..., None, None] * eye


def log_prob(x: torch.Tensor, mean: torch.Tensor, chol: torch.Tensor) -> torch.Tensor:
    """log N(x; m, LLᵀ) for x [B, N, d], m [B, d], L [B, d, d] → [B, N]."""
    d = x.shape[-1]
    diff = (x - mean[:, None, :]).transpose(-1, -2)  # [B, d, N]
    z = torch.linalg.solve_triangular(chol, diff, upper=False)
    half_logdet = torch.log(torch.diagonal(chol, dim1=-2, dim2=-1)).sum(-1)  # [B]
    return -0.5 * (z * z).sum(-2) - half_logdet[:, None] - 0.5 * d * LOG_2PI


def precision_times(diff: torch.Tensor, chol: torch.Tensor) -> torch.Tensor:
    """Σ⁻¹ (x − m) for diff [B, N, d], Σ = LLᵀ → [B, N, d]."""
    return torch.cholesky_solve(diff.transpose(-1, -2), chol).transpose(-1, -2)


def entropy(chol: torch.Tensor) -> torch.Tensor:
    """H[N(m, LLᵀ)] = ½ log|2πe Σ| → [B]."""
    d = chol.shape[-1]
    return torch.log(torch.diagonal(chol, dim1=-2, dim2=-1)).sum(-1) + 0.5 * d * (1 + LOG_2PI)


def matvec(A: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """A v for a batch of matrices A [..., m, n] and vectors v [..., n] → [..., m] (a matmul: torch.einsum's
    Python dispatch costs more than the product at these sizes)."""
    return (A @ v[..., None])[..., 0]


def moments(x: torch.Tensor, log_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted mean [B, d] and covariance [B, d, d] of a particle cloud (the 1/N, biased estimate,
    as GPF eq. 15 uses: C = Σ_i w_i (x_i − m)(x_i − m)ᵀ)."""
    if log_weights is None:
        mean = x.mean(1)
        diff = x - mean[:, None, :]
        cov = diff.transpose(-1, -2) @ diff / x.shape[1]
    else:
        w = torch.softmax(log_weights.to(x.dtype), dim=-1)
        mean = (w[:, None] @ x)[:, 0]
        diff = x - mean[:, None, :]
        cov = (diff * w[..., None]).transpose(-1, -2) @ diff
    return mean, 0.5 * (cov + cov.transpose(-1, -2))


def affine_push(
    mean: torch.Tensor, cov: torch.Tensor, F: torch.Tensor, c: torch.Tensor, Q: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Moments of F x + c + N(0, Q) for x ~ N(mean, cov) (the Kalman predict step)."""
    m = matvec(F, mean) + c
    C = F @ cov @ F.transpose(-1, -2) + Q
    return m, 0.5 * (C + C.transpose(-1, -2))


#: Liu & West (2001) choose a = (3δ − 1) / (2δ) from a discount factor δ ∈ [0.95, 0.99], so a ∈ [0.974, 0.995]
def inflated(x: torch.Tensor, mean: torch.Tensor, rho: float | torch.Tensor) -> torch.Tensor:
    """The cloud x [B, N, d] with its anomalies about ``mean`` [B, d] multiplied by ρ (a float, or [B] per stream):
    m + ρ (x − m), the multiplicative inflation of ensemble filters (Anderson & Anderson 1999), which scales the
    cloud's covariance by ρ²."""
    if isinstance(rho, torch.Tensor):
        rho = rho.to(x.dtype)[:, None, None]
    centre = mean.to(x.dtype)[:, None]
    return centre + rho * (x - centre)


LIU_WEST_SHRINKAGE = 0.98


def liu_west(x: torch.Tensor, mean: torch.Tensor, chol: torch.Tensor, a: float, xi: torch.Tensor) -> torch.Tensor:
    """The Liu–West (1999) shrinkage kernel a x + (1 − a) m + √(1 − a²) L ξ for x, ξ [..., n, d], m [..., d],
    L [..., d, d] (LLᵀ = C): a draw from the kernel density of a cloud with mean m and covariance C whose
    centres are shrunk towards m so that the mixture keeps m and C exactly (a² C + (1 − a²) C = C) — unlike a
    plain KDE, wider than its cloud by the kernel."""
    return a * x + (1.0 - a) * mean[..., None, :] + math.sqrt(1.0 - a * a) * xi @ chol.transpose(-1, -2)


@dataclass(frozen=True)
class Whitened:
    """A cloud x [B, N, d] as x = m + z Lᵀ: its mean m [B, d], the Cholesky factor L [B, d, d] of its
    covariance (LLᵀ = C) and its whitened points z = L⁻¹ (x − m) [B, N, d] (empirical mean 0, covariance I)."""

    mean: torch.Tensor
    chol: torch.Tensor
    z: torch.Tensor

    def points(self) -> torch.Tensor:
        """x = m + z Lᵀ [B, N, d]."""
        return self.mean[:, None, :] + self.z @ self.chol.transpose(-1, -2)

    def select(self, rows: torch.Tensor) -> Whitened:
        """The clouds ``rows`` (indices) of the batch."""
        return Whitened(self.mean[rows], self.chol[rows], self.z[rows])


def whiten(x: torch.Tensor) -> Whitened:
    """The cloud x [B, N, d] in the coordinates of its own (unweighted) mean and covariance (N > d)."""
    mean, cov = moments(x)
    chol = cholesky(cov)
    z = torch.linalg.solve_triangular(chol, (x - mean[:, None]).transpose(-1, -2), upper=False)
    return Whitened(mean, chol, z.transpose(-1, -2))


def matched(x: torch.Tensor, mean: torch.Tensor, cov: torch.Tensor) -> Whitened:
    """The cloud x mapped affinely onto (mean, cov) exactly — x' = m + L_target L_emp⁻¹ (x − m_emp) — as
    :class:`Whitened` (its whitened points are x's own). Needs N > d (a full-rank empirical covariance)."""
    return Whitened(mean, cholesky(cov), whiten(x).z)


def match_moments(x: torch.Tensor, mean: torch.Tensor, cov: torch.Tensor) -> torch.Tensor:
    """Affinely map the cloud x so that its empirical mean and covariance equal (mean, cov) exactly:
    x' = m + L_target L_emp⁻¹ (x − m_emp) (:func:`matched`). Needs N > d."""
    return matched(x, mean, cov).points()


def moment_matched(x: torch.Tensor, mean: torch.Tensor, cov: torch.Tensor) -> torch.Tensor:
    """:func:`match_moments` in float64 where the cloud can carry a full covariance (N > d), else x as is."""
    if x.shape[1] <= x.shape[2]:
        return x
    return match_moments(x.to(torch.float64), mean.to(torch.float64), cov.to(torch.float64)).to(x.dtype)

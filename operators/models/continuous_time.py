"""Exact discretisation of linear continuous-time dynamics over a step of length Δ (irregular time steps).

Linear SDE  dx = (F x + C u) dt + dW,  Cov[dW] = Qc dt,  with the input u held over the step (zero-order hold):

    x(t + Δ) = A x(t) + Γ C u + w,   A = e^{FΔ},   Γ = ∫₀^Δ e^{Fs} ds,   w ~ N(0, Q),   Q = ∫₀^Δ e^{Fs} Qc e^{Fᵀs} ds.

Van Loan (1978, "Computing integrals involving the matrix exponential", IEEE TAC 23(3), Theorem 1): with

    M = [[−F, Qc], [0, Fᵀ]] Δ,   e^M = [[·, G₁₂], [0, G₂₂]],   A = G₂₂ᵀ,   Q = A G₁₂,

and Γ from e^{[[F, I], [0, 0]] Δ} = [[A, Γ], [0, I]]. The matrix exponentials are scipy's (``scipy.linalg.expm``,
Al-Mohy & Higham's scaling and squaring), in float64.

The scalar Ornstein–Uhlenbeck process dx = −θ (x − μ) dt + s √(2θ) dW (stationary variance s²) is the special case
used by ``stochastic_volatility``: over Δ, x' = μ + φ^Δ (x − μ) + N(0, s² (1 − φ^{2Δ})) with φ = e^{−θ}, the
one-unit autoregression coefficient — so its discrete parameters (φ, σ, σ² = s² (1 − φ²)) give every Δ exactly.
"""

from __future__ import annotations

import numpy as np
import torch


def van_loan(F: torch.Tensor, Qc: torch.Tensor, dt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(A, Q, Γ) of the module docstring for F [B, d, d], Qc [B, d, d] and step lengths dt [B] → float64 tensors
    [B, d, d] each."""
    import scipy.linalg  # here, not at import: scipy is a large share of a server worker's start-up

    F64 = F.detach().to(torch.float64).numpy()
    Qc64 = Qc.detach().to(torch.float64).numpy()
    steps = dt.detach().to(torch.float64).numpy()
    B, d, _ = F64.shape
    M = np.zeros((B, 2 * d, 2 * d))
    M[:, :d, :d] = -F64
    M[:, :d, d:] = Qc64
    M[:, d:, d:] = F64.transpose(0, 2, 1)
    G = scipy.linalg.expm(M * steps[:, None, None])
    A = G[:, d:, d:].transpose(0, 2, 1)
    Q = A @ G[:, :d, d:]
    Q = 0.5 * (Q + Q.transpose(0, 2, 1))
    N = np.zeros((B, 2 * d, 2 * d))
    N[:, :d, :d] = F64
    N[:, :d, d:] = np.eye(d)
    gain = scipy.linalg.expm(N * steps[:, None, None])[:, :d, d:]
    return torch.from_numpy(A), torch.from_numpy(Q), torch.from_numpy(gain)


def ou_step(phi: torch.Tensor, sigma: torch.Tensor, dt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The AR(1) coefficient and innovation sd over Δ = dt [B] of the OU process whose one-unit step has
    coefficient ``phi`` ∈ (0, 1) and innovation sd ``sigma`` ([B, d] each): φ^Δ and σ √((1 − φ^{2Δ}) / (1 − φ²))."""
    phi64, sigma64, dt64 = phi.to(torch.float64), sigma.to(torch.float64), dt.to(torch.float64)[:, None]
    phi_dt = phi64**dt64
    sigma_dt = sigma64 * torch.sqrt((1 - phi_dt**2) / (1 - phi64**2))
    return phi_dt, sigma_dt


__all__ = ["ou_step", "van_loan"]

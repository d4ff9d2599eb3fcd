"""The MPF flow velocity f_θ(X_m, o_{m+1}, x(t), t) (MPF §2.3–2.4, eq. 16–18).

    f(x, λ) = DH(x, λ) + L · h_θ( ctx, z, Lᵀ ∇x log p(o | x), λ ),     z = L⁻¹ (x − m),   λ ∈ [0, 1]

* DH is the exact Daum–Huang flow of :mod:`operators.mpf.gaussian_flow` from the Gaussian fitted to the
  prior particles (m, P = LLᵀ) under the statistically linearised likelihood — already right for Gaussian
  problems, so the network only learns the residual a non-Gaussian prior or likelihood needs.
* h_θ works in the prior's whitened coordinates (normalised inputs): the particle z(t), the likelihood
  score at the moving particle in the same coordinates (eq. 15 and §2.4 (ii): the likelihood enters as
  ∇x log p(o | x), so one operator serves a whole family of likelihood parameters), and a context
  ctx = [mean_n φ(z_m^n), summary of the linearised likelihood] — the DeepSet embedding of the prior
  particles (eq. 16: permutation invariant, computed once per Bayes step from the detached particles).
* h_θ = Gated_k(… [ctx, Gated_1([ctx, input], λ)] …, λ) with Gated_j(y, λ) = (W_j y + b_j) · σ(λ v_j + c_j)
  + λ c_j (eq. 17–18; the reference's ConcatSquash layers with ``-layer_cond concat``), tanh between layers,
  and the last layer initialised to zero, so an untrained operator is exactly the Daum–Huang flow.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import nn

from operators import gaussian
from operators.mpf.gaussian_flow import DaumHuangFlow, GaussianLikelihood


class Gated(nn.Module):
    """Gated_j(y, λ) = (W y + b) · σ(λ v + c) + λ c  (MPF eq. 18)."""

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.linear = nn.Linear(n_in, n_out)
        self.gate_v = nn.Parameter(torch.zeros(n_out))
        self.gate_c = nn.Parameter(torch.zeros(n_out))
        nn.init.xavier_uniform_(self.linear.weight)  # Glorot init, zero biases (reference code)
        nn.init.zeros_(self.linear.bias)

    def forward(self, y: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
        lam = lam[:, None, None]  # [B] → broadcast over particles and features
        return self.linear(y) * torch.sigmoid(lam * self.gate_v + self.gate_c) + lam * self.gate_c


@dataclass
class StepContext:
    """Everything f_θ needs that is fixed during one Bayes step (computed once from the prior cloud)."""

    mean: torch.Tensor  # [B, d]
    chol: torch.Tensor  # [B, d, d], P = LLᵀ
    embedding: torch.Tensor  # [B, E]: DeepSet of the prior particles + likelihood summary
    base: DaumHuangFlow | None


class MPFVelocity(nn.Module):
    def __init__(self, dim: int, hidden: int = 64, layers: int = 3, embed: int = 64, use_base: bool = True):
        super().__init__()
        self.dim, self.use_base = dim, use_base
        self.phi = nn.Sequential(nn.Linear(dim, embed), nn.Tanh(), nn.Linear(embed, embed), nn.Tanh())
        n_lik = dim * (dim + 1) // 2 + dim  # upper triangle of the whitened Λ, and the whitened η
        self.ctx_dim = embed + n_lik
        widths = [2 * dim, *([hidden] * (layers - 1)), dim]
        self.layers = nn.ModuleList(Gated(self.ctx_dim + a, b) for a, b in itertools.pairwise(widths))
        nn.init.zeros_(self.layers[-1].linear.weight)  # f starts as the base flow (torchdiffeq FAQ)
        self._triu = torch.triu_indices(dim, dim)

    # ------------------------------------------------------------------ per Bayes step
    def context(self, prior_particles: torch.Tensor, likelihood: GaussianLikelihood) -> StepContext:
        """Moments, DeepSet embedding and base flow from the (detached) prior particles [B, N, d]."""
        x = prior_particles.detach()
        mean64, cov64 = gaussian.moments(x.to(torch.float64))
        chol64 = gaussian.cholesky(cov64)
        xc = (x.to(torch.float64) - mean64[:, None]).transpose(-1, -2)
        z = torch.linalg.solve_triangular(chol64, xc, upper=False)
        dtype = x.dtype
        emb = self.phi(z.transpose(-1, -2).to(dtype)).mean(1)  # eq. 16: mean_n φ(x_m^n)
        # the likelihood in whitened coordinates: Λ_z = Lᵀ Λ L, η_z = Lᵀ (η − Λ m)
        lam_z = chol64.transpose(-1, -2) @ likelihood.precision.to(torch.float64) @ chol64
        eta_z = torch.einsum(
            "bji,bj->bi",
            chol64,
            likelihood.information.to(torch.float64)
            - torch.einsum("bij,bj->bi", likelihood.precision.to(torch.float64), mean64),
        )
        lik = torch.cat([torch.asinh(lam_z[:, self._triu[0], self._triu[1]]), torch.asinh(eta_z)], -1)
        base = DaumHuangFlow(mean64, cov64, likelihood) if self.use_base else None
        return StepContext(mean64.to(dtype), chol64.to(dtype), torch.cat([emb, lik.to(dtype)], -1), base)

    # ------------------------------------------------------------------ the field
    def forward(self, x: torch.Tensor, lam: torch.Tensor, score: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """f(x, λ) [B, N, d] for particles x [B, N, d], λ [B], likelihood score ∇x log p(o | x) [B, N, d]."""
        L = ctx.chol
        z = torch.linalg.solve_triangular(L, (x - ctx.mean[:, None]).transpose(-1, -2), upper=False).transpose(-1, -2)
        s_z = torch.asinh(score @ L)  # Lᵀ s as row vectors; asinh tames extreme observations
        c = ctx.embedding[:, None].expand(-1, x.shape[1], -1)
        h = torch.cat([z, s_z], -1)
        for j, layer in enumerate(self.layers):
            h = layer(torch.cat([c, h], -1), lam)
            if j < len(self.layers) - 1:
                h = torch.tanh(h)
        v = h @ L.transpose(-1, -2)  # back to x coordinates
        if ctx.base is not None:
            v = v + ctx.base.velocity(x, lam)
        return v

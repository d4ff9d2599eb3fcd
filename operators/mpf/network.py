"""The MPF flow velocity f_θ(X_m, o_{m+1}, x(t), t) (MPF §2.3–2.4, eq. 16–18).

The field works in the prior's whitened coordinates z = L⁻¹ (x − m) (prior moments m, P = LLᵀ of the
step's particles — the normalised inputs):

    f_z(z, λ) = DH_z(z, λ) + U Φ(λ) Uᵀ h_θ( ctx, z, asinh(Lᵀ ∇x log p(o | x)), λ ),   f_x = L f_z,   λ ∈ [0, 1].

* DH_z is the exact Daum–Huang flow (:mod:`operators.mpf.gaussian_flow`) of the whitened prior N(0, I)
  under the whitened, statistically linearised likelihood (Λ_z, η_z) = (Lᵀ Λ L, Lᵀ (η − Λ m)). With the
  eigendecomposition Λ_z = U diag(e) Uᵀ and y = Uᵀ z it is diagonal:

      dy_k/dλ = a_k(λ) y_k + (1 + 2λ a_k)(1 + λ a_k) (Uᵀ η_z)_k,    a_k(λ) = −½ e_k / (1 + λ e_k),

  which is A(λ) = −½ P (I + λΛP)⁻¹ Λ, b(λ) = (I + 2λA)(I + λA) P η + … of the Daum–Huang flow seen in
  whitened coordinates (L⁻¹ A L = −½ (I + λΛ_z)⁻¹ Λ_z). It is already right for Gaussian problems, so the
  network only learns the residual that a non-Gaussian prior or likelihood needs.
* h_θ sees the particle z(t), the likelihood score at the moving particle in the same coordinates (eq. 15
  and §2.4 (ii): the likelihood enters as ∇x log p(o | x), so one operator serves a whole family of
  likelihood parameters; asinh tames extreme observations), and a context ctx = [mean_n φ(z_m^n), the
  upper triangle of asinh Λ_z, asinh η_z] — the DeepSet embedding of the prior particles (eq. 16:
  permutation invariant, computed once per Bayes step from the detached particles) and a summary of the
  linearised likelihood. For minibatch observations (``logistic``) (Λ, η) is the sum over the minibatch —
  a permutation-invariant set embedding of the observations (§3.3).
* h_θ = Gated_k(… Gated_1([ctx, z, s_z], λ) …, λ), Gated_j(y, λ) = (W_j y + b_j) · σ(λ v_j + c_j) + λ c_j
  (eq. 17–18, the reference's ConcatSquash layers), tanh between layers, and the last layer initialised to
  zero, so an untrained operator is exactly the Daum–Huang flow. The ctx part W_j^c ctx + b_j of every layer
  is the same for all particles and all λ of a Bayes step, so it is computed once per step.
Divergence is invariant under the affine change x = m + L z, so d log q/dλ = −∇_z·f_z (eq. 8).

The base flow is stiff when the observation is much more informative than the prior (e_k ≫ 1: one RK4
step would blow up), but it has the closed-form solution y(λ) = Φ(λ) y(0) + ψ(λ) (:meth:`StepContext.frame`).
:func:`operators.mpf.step.flow_step` therefore integrates in the co-moving frame w = Φ⁻¹ (y − ψ), where only
the residual remains: dw/dλ = Uᵀ h_θ (so dz/dλ = DH_z + U Φ(λ) Uᵀ h_θ: the learned residual is measured in
the whitened scale of the current posterior) — exact for an untrained operator, whatever the step count.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import nn

from operators import gaussian
from operators.mpf.gaussian_flow import DaumHuangFlow, GaussianLikelihood


def tanh(x: torch.Tensor) -> torch.Tensor:
    """tanh(x) = 2 σ(2x) − 1, the same function evaluated through σ: this CPU build's vectorised ``torch.tanh``
    is about 3× slower than ``torch.sigmoid`` plus the two affine ops on a [256, 64] float32 block (it was a
    quarter of an MPF update's time). Differentiable (no in-place ops on σ's saved output)."""
    return torch.sigmoid(x * 2.0).mul(2.0).sub(1.0)


class Tanh(nn.Module):
    """:func:`tanh` as a layer (holds no parameters, so state dicts are those of ``nn.Tanh``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tanh(x)


class Gated(nn.Module):
    """Gated_j([ctx, h], λ) = (W^c ctx + W^h h + b) · σ(λ v + c) + λ c  (MPF eq. 18), with W^c ctx + b
    computed once per Bayes step by :meth:`context_bias`."""

    def __init__(self, n_ctx: int, n_in: int, n_out: int):
        super().__init__()
        self.ctx = nn.Linear(n_ctx, n_out)  # carries the bias b
        self.linear = nn.Linear(n_in, n_out, bias=False)
        self.gate_v = nn.Parameter(torch.zeros(n_out))
        self.gate_c = nn.Parameter(torch.zeros(n_out))
        for lin in (self.ctx, self.linear):  # Glorot init, zero biases (reference code)
            nn.init.xavier_uniform_(lin.weight)
        nn.init.zeros_(self.ctx.bias)

    def context_bias(self, ctx: torch.Tensor) -> torch.Tensor:
        """W^c ctx + b for ctx [B, C] → [B, 1, out]."""
        return self.ctx(ctx)[:, None]

    def forward(self, h: torch.Tensor, bias: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
        """h [B, N, in], bias [B, 1, out] (:meth:`context_bias`), λ [B] → [B, N, out]; fused into one batched
        matmul-add and one multiply-add (per-op overhead dominates at serving sizes)."""
        B, N, _ = h.shape
        lam = lam[:, None, None]  # [B] → broadcast over particles and features
        pre = torch.baddbmm(bias.expand(B, N, -1), h, self.linear.weight.t().expand(B, -1, -1))
        return torch.addcmul(lam * self.gate_c, pre, torch.sigmoid(lam * self.gate_v + self.gate_c))


@dataclass
class StepContext:
    """Everything f_θ needs that is fixed during one Bayes step (computed once from the prior cloud)."""

    mean: torch.Tensor  # [B, d]
    chol: torch.Tensor  # [B, d, d], P = LLᵀ
    embedding: torch.Tensor  # [B, E]: DeepSet of the prior particles + likelihood summary
    biases: list[torch.Tensor]  # per layer W^c ctx + b, [B, 1, out]
    eigvec: torch.Tensor  # [B, d, d] U of Λ_z = U diag(e) Uᵀ
    eigval: torch.Tensor  # [B, d] e ≥ 0
    eta_y: torch.Tensor  # [B, d] Uᵀ η_z
    use_base: bool
    likelihood: GaussianLikelihood

    def frame(self, lam: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The exact solution of the whitened base flow from λ = 0, y(λ) = Φ(λ) ⊙ y(0) + ψ(λ) with
        Φ = (1 + λe)^{-1/2}, ψ = λ Uᵀη_z / (1 + λe) → (Φ, ψ), each [B, d] (λ a number or [B])."""
        la = torch.as_tensor(lam, dtype=self.eigval.dtype, device=self.eigval.device).reshape(-1, 1)
        one = 1.0 + la * self.eigval
        return torch.rsqrt(one), la * self.eta_y / one

    def base_z(self, z: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
        """The whitened Daum–Huang velocity (module docstring) at z [B, N, d], λ [B] → [B, N, d]."""
        la = lam[:, None]
        a = -0.5 * self.eigval / (1.0 + la * self.eigval)
        b = (1.0 + 2.0 * la * a) * (1.0 + la * a) * self.eta_y
        return ((z @ self.eigvec) * a[:, None] + b[:, None]) @ self.eigvec.transpose(-1, -2)

    def to_z(self, x: torch.Tensor) -> torch.Tensor:
        """z = L⁻¹ (x − m) for x [B, N, d]."""
        xc = (x - self.mean[:, None]).transpose(-1, -2)
        return torch.linalg.solve_triangular(self.chol, xc, upper=False).transpose(-1, -2)

    def to_x(self, z: torch.Tensor) -> torch.Tensor:
        """x = m + L z for z [B, N, d]."""
        return self.mean[:, None] + z @ self.chol.transpose(-1, -2)


class MPFVelocity(nn.Module):
    def __init__(
        self,
        dim: int,
        hidden: int = 64,
        layers: int = 3,
        embed: int = 64,
        use_base: bool = True,
        residual_bound: float = 4.0,
    ):
        super().__init__()
        self.dim, self.use_base, self.residual_bound = dim, use_base, residual_bound
        self.phi = nn.Sequential(nn.Linear(dim, embed), Tanh(), nn.Linear(embed, embed), Tanh())
        n_lik = dim * (dim + 1) // 2 + dim  # upper triangle of the whitened Λ, and the whitened η
        self.ctx_dim = embed + n_lik
        widths = [2 * dim, *([hidden] * (layers - 1)), dim]
        self.layers = nn.ModuleList(Gated(self.ctx_dim, a, b) for a, b in itertools.pairwise(widths))
        nn.init.zeros_(self.layers[-1].linear.weight)  # f starts as the base flow (torchdiffeq FAQ)
        nn.init.zeros_(self.layers[-1].ctx.weight)
        self.register_buffer("_triu", torch.triu_indices(dim, dim), persistent=False)

    # ------------------------------------------------------------------ per Bayes step
    def context(self, prior_particles: torch.Tensor, likelihood: GaussianLikelihood) -> StepContext:
        """Moments, DeepSet embedding, whitened likelihood and per-layer context biases from the (detached)
        prior particles [B, N, d]. The Gaussian algebra runs in float64."""
        x = prior_particles.detach()
        dtype = x.dtype
        mean64, cov64 = gaussian.moments(x.to(torch.float64))
        chol64 = gaussian.cholesky(cov64)
        xc = (x.to(torch.float64) - mean64[:, None]).transpose(-1, -2)
        z = torch.linalg.solve_triangular(chol64, xc, upper=False).transpose(-1, -2)
        emb = self.phi(z.to(dtype)).mean(1)  # eq. 16: mean_n φ(x_m^n)
        prec = likelihood.precision.to(torch.float64)
        lam_z = chol64.transpose(-1, -2) @ prec @ chol64
        lam_z = 0.5 * (lam_z + lam_z.transpose(-1, -2))
        eta_z = torch.einsum(
            "bji,bj->bi", chol64, likelihood.information.to(torch.float64) - torch.einsum("bij,bj->bi", prec, mean64)
        )
        lik = torch.cat([torch.asinh(lam_z[:, self._triu[0], self._triu[1]]), torch.asinh(eta_z)], -1)
        embedding = torch.cat([emb, lik.to(dtype)], -1)
        eigval, eigvec = torch.linalg.eigh(lam_z)
        eigval = eigval.clamp_min(0.0)
        eta_y = torch.einsum("bji,bj->bi", eigvec, eta_z)
        if not self.use_base:  # Φ ≡ 1, ψ ≡ 0: the network is the whole field
            eigval, eta_y = torch.zeros_like(eigval), torch.zeros_like(eta_y)
        return StepContext(
            mean=mean64.to(dtype),
            chol=chol64.to(dtype),
            embedding=embedding,
            biases=[layer.context_bias(embedding) for layer in self.layers],
            eigvec=eigvec.to(dtype),
            eigval=eigval.to(dtype),
            eta_y=eta_y.to(dtype),
            use_base=self.use_base,
            likelihood=likelihood,
        )

    # ------------------------------------------------------------------ the field
    def residual_z(self, z: torch.Tensor, lam: torch.Tensor, score_z: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """h_θ(ctx, z, s_z, λ) [B, N, d] in whitened coordinates, ``score_z`` = Lᵀ ∇x log p(o | x) at x = m + L z."""
        h = torch.cat([z, torch.asinh(score_z)], -1)
        last = len(self.layers) - 1
        for j, (layer, bias) in enumerate(zip(self.layers, ctx.biases, strict=True)):
            h = layer(h, bias, lam)
            if j < last:
                h = tanh(h)
        return self.residual_bound * tanh(h / self.residual_bound)

    def field_z(self, z: torch.Tensor, lam: torch.Tensor, score_z: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """f_z = DH_z + U Φ(λ) Uᵀ h_θ [B, N, d], the whole whitened field (the module docstring)."""
        U = ctx.eigvec
        h = ((self.residual_z(z, lam, score_z, ctx) @ U) * ctx.frame(lam)[0][:, None]) @ U.transpose(-1, -2)
        return h + ctx.base_z(z, lam) if ctx.use_base else h

    def forward(self, x: torch.Tensor, lam: torch.Tensor, score: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """f(x, λ) [B, N, d] in x coordinates for particles x [B, N, d], λ [B], score ∇x log p(o | x)."""
        return self.field_z(ctx.to_z(x), lam, score @ ctx.chol, ctx) @ ctx.chol.transpose(-1, -2)

    def base_flow(self, ctx: StepContext) -> DaumHuangFlow:
        """The base flow of a step in x coordinates (for checks: L DH_z(L⁻¹(x − m)) equals it)."""
        return DaumHuangFlow(ctx.mean.double(), ctx.chol.double() @ ctx.chol.double().transpose(-1, -2), ctx.likelihood)

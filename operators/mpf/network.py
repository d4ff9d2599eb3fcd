"""The MPF flow velocity f_θ(X_m, o_{m+1}, x(t), t) (MPF §2.3–2.4, eq. 16–18).

The field works in the prior's whitened coordinates z = L⁻¹ (x − m) (prior moments m, P = LLᵀ of the
step's particles — the normalised inputs):

    f_z(z, λ) = DH_z(z, λ) + U Φ(λ) Uᵀ g h_θ( ctx, z, asinh(Lᵀ ∇x log p(o | x)), λ ),   f_x = L f_z,   λ ∈ [0, 1].

* DH_z is the exact Daum–Huang flow (:mod:`mpflow.operators.mpf.daum_huang`) of the whitened prior N(0, I)
  under the whitened, linearised likelihood (Λ_z, η_z) = (Lᵀ Λ L, Lᵀ (η − Λ m)), fitted to a non-Gaussian
  likelihood by Stein's identity (``linearisation="stein"``, Λ_z ⪰ 0; ``"posterior"``: re-fitted at the
  posterior it gives, Λ_z ⪰ 0) or to the cloud's moments after reweighting by the likelihood (``"importance"``,
  e > −1: it may widen; right for multimodal clouds). With the
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
* The residual gate (``residual_gate="information"``; "none" keeps g ≡ 1): the residual is scaled by
  g = 1 − exp(−KL^{3/2}) ∈ [0, 1), KL the information (nats) that the linearised step gains, the KL
  divergence of its Gaussian posterior from the whitened prior (:func:`information_gate`). The base flow is
  exact for the quadratic part of the log-likelihood over the cloud; what the residual must correct is the
  rest, led by its third-order term, which in whitened coordinates scales as (posterior sd)³ ∝ KL^{3/2} for
  a smooth likelihood whose information piles up (KL ~ 1/m after m observations). So the gate lets the
  correction through where a step is informative or the cloud is multimodal (KL = O(1)), and makes it vanish
  at the rate the exact correction does where the posterior has become nearly Gaussian. Without it a small
  relative bias ε of h_θ in every step adds up: for a static model the posterior sd shrinks as m^{-1/2}, so
  an ungated ε moves the mean by O(ε m) posterior sd after m steps (tests/unit/test_mpf_network.py).
* h_θ = Gated_k(… Gated_1([ctx, z, s_z], λ) …, λ), Gated_j(y, λ) = (W_j y + b_j) · σ(λ v_j + c_j) + λ c_j
  (eq. 17–18, the reference's ConcatSquash layers), tanh between layers, and the last layer initialised to
  zero, so an untrained operator is exactly the Daum–Huang flow. The ctx part W_j^c ctx + b_j of every layer
  is the same for all particles and all λ of a Bayes step, so it is computed once per step. h_θ (and φ) are
  evaluated through σ with each gate and the affine parts of the tanh around a layer folded into its weights
  (:class:`FoldedWeights`): one matmul-add and one σ per layer over the particles (per-op overhead and passes
  over the activations are what an update costs at serving sizes).
Divergence is invariant under the affine change x = m + L z, so d log q/dλ = −∇_z·f_z (eq. 8).

The base flow is stiff when the observation is much more informative than the prior (e_k ≫ 1: one RK4
step would blow up), but it has the closed-form solution y(λ) = Φ(λ) y(0) + ψ(λ) (:meth:`StepContext.frame`).
:func:`mpflow.operators.mpf.step.flow_step` therefore integrates in the co-moving frame w = Φ⁻¹ (y − ψ), where only
the residual remains: dw/dλ = Uᵀ h_θ (so dz/dλ = DH_z + U Φ(λ) Uᵀ h_θ: the learned residual is measured in
the whitened scale of the current posterior) — exact for an untrained operator, whatever the step count.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from mpflow.operators import gaussian
from mpflow.operators.mpf.daum_huang import LINEARISATIONS, DaumHuangFlow, GaussianLikelihood, whitened_likelihood
from torch import nn


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
        """h [B, N, in], bias [B, 1, out] (:meth:`context_bias`), λ [B] → [B, N, out] (eq. 18 as written; the
        network evaluates it through :meth:`folded`)."""
        lam = lam[:, None, None]  # [B] → broadcast over particles and features
        pre = torch.baddbmm(bias, h, self.linear.weight.t().expand(h.shape[0], -1, -1))
        return pre * torch.sigmoid(lam * self.gate_v + self.gate_c) + lam * self.gate_c


RESIDUAL_GATES = ("none", "information")
#: the lowest eigenvalue of an importance-fitted Λ_z: at most a √10-fold widening per step and direction
EXPANSION_FLOOR = -0.9


def information_gate(eigval: torch.Tensor, eta_y: torch.Tensor) -> torch.Tensor:
    """g = 1 − exp(−KL^{3/2}) [B] of the whitened, linearised step (module docstring), from the eigenvalues
    e [B, d] of Λ_z and η_y = Uᵀ η_z [B, d]. The step's Gaussian posterior of the prior N(0, I) is N(μ, Σ)
    with Σ = diag(1 / (1 + e)) and μ = η_y / (1 + e) in the eigenbasis, so

        KL(N(μ, Σ) ‖ N(0, I)) = ½ Σ_k [ log(1 + e_k) − e_k / (1 + e_k) + η_y,k² / (1 + e_k)² ].

    For small steps KL ≈ ½ |η_y|² + ¼ Σ e_k² and g ≈ KL^{3/2}; for very informative ones g → 1."""
    one = 1.0 + eigval
    kl = 0.5 * (torch.log1p(eigval) - eigval / one + (eta_y / one).square()).sum(-1)
    return -torch.expm1(-kl.clamp_min(0.0).pow(1.5))


@dataclass
class FoldedWeights:
    """θ rewritten for evaluation through σ (tanh u = 2σ(2u) − 1), fixed while θ is.

    Layer j of h_θ with input s and output rescaled, out_scale_j · Gated_j(in_scale_j · s + in_shift_j, λ), is
    s M_j(λ) + β_j(λ) with

        M_j(λ) = weights[j] ⊙ g_j(λ),   weights[j] = out_scale · in_scale · W_jᵀ   [in, out],
        β_j(λ) = (ctx Wc + cb)_j ⊙ g_j(λ) + λ · out_scale · c_j,   g_j(λ) = σ(λ v_j + c_j),

    where Wc [C, Σ out] and cb [Σ out] hold out_scale · W^cᵀ and out_scale · (b + in_shift · W 1) of all layers
    side by side (layer j owns the columns ``cols[j]``; the gates v, c likewise, so one σ gives every gate). A
    tanh input is 2s − 1 of the previous σ-output s (in_scale 2, in_shift −1) and a tanh output needs 2u
    (out_scale 2; the last layer's r_b tanh(u / r_b) needs 2u / r_b): each layer is s' = σ(s M + β), one
    batched matmul-add and one in-place σ over the particles, the gate folded into the [in, out] weights
    (O(in · out) per λ, not two passes over [N, out]). The DeepSet φ likewise: s₁ = σ(z phi[0] + phi[1]),
    s₂ = σ(s₁ phi[2] + phi[3]), φ = 2 s₂ − 1."""

    weights: list[torch.Tensor]
    ctx_weight: torch.Tensor
    ctx_bias: torch.Tensor
    gate_v: torch.Tensor
    gate_c: torch.Tensor
    gate_c_scaled: torch.Tensor
    cols: list[slice]
    phi: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass
class FoldedNetwork:
    """h_θ for one Bayes step: :class:`FoldedWeights`, the step's context term ctx Wc + cb [B, 1, Σ out], and
    the map from the last layer's σ-output to h_θ U (:meth:`MPFVelocity.residual`)."""

    weights: FoldedWeights
    bias: torch.Tensor
    head: tuple[torch.Tensor, torch.Tensor]  # (2 r_b g U [B, d, d], −r_b g 1ᵀU [B, 1, d]): g h_θ U from the last σ
    gate: torch.Tensor | None  # g [B, 1, 1] (:func:`information_gate`), None when ungated

    def layer_maps(self, lam: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(M_j(λ) [B, in, out], β_j(λ) [B, 1, out]) of every layer at λ [B] (:class:`FoldedWeights`)."""
        w = self.weights
        lam = lam[:, None, None]
        gates = torch.sigmoid(torch.addcmul(w.gate_c, lam, w.gate_v))  # [B, 1, Σ out]
        betas = torch.addcmul(lam * w.gate_c_scaled, self.bias, gates)
        return [(weight * gates[..., c], betas[..., c]) for weight, c in zip(w.weights, w.cols, strict=True)]


@dataclass
class StepContext:
    """Everything f_θ needs that is fixed during one Bayes step (computed once from the prior cloud)."""

    mean: torch.Tensor  # [B, d]
    chol: torch.Tensor  # [B, d, d], P = LLᵀ
    embedding: torch.Tensor | None  # [B, E]: DeepSet of the prior particles + likelihood summary (None: no residual)
    network: FoldedNetwork | None  # h_θ's layers with W^c ctx + b and everything else λ-independent folded in
    eigvec: torch.Tensor  # [B, d, d] U of Λ_z = U diag(e) Uᵀ
    eigval: torch.Tensor  # [B, d] e ≥ 0
    eta_y: torch.Tensor  # [B, d] Uᵀ η_z
    use_base: bool
    likelihood: GaussianLikelihood

    def frame(self, lam: torch.Tensor | float) -> tuple[torch.Tensor, torch.Tensor]:
        """The exact solution of the whitened base flow from λ = 0, y(λ) = Φ(λ) ⊙ y(0) + ψ(λ) with
        Φ = (1 + λe)^{-1/2}, ψ = λ Uᵀη_z / (1 + λe) → (Φ, ψ), each [B, d] (λ a number or [B])."""
        if isinstance(lam, torch.Tensor):
            la = lam.reshape(-1, 1)
        else:
            la = torch.full((1, 1), float(lam), dtype=self.eigval.dtype, device=self.eigval.device)
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
        residual_gate: str = "none",
        linearisation: str = "stein",
    ):
        super().__init__()
        if residual_gate not in RESIDUAL_GATES:
            raise ValueError(f"residual_gate: must be one of {RESIDUAL_GATES}, got {residual_gate!r}")
        if linearisation not in LINEARISATIONS:
            raise ValueError(f"linearisation: must be one of {LINEARISATIONS}, got {linearisation!r}")
        self.dim, self.use_base, self.residual_bound = dim, use_base, residual_bound
        self.residual_gate, self.linearisation = residual_gate, linearisation
        # Stein's fit is clipped to Λ ⪰ 0; the importance fit may expand, down to e > −1 (S⁻¹ − I, S ≻ 0)
        self._eig_floor = EXPANSION_FLOOR if linearisation == "importance" else 0.0
        self.phi = nn.Sequential(nn.Linear(dim, embed), nn.Tanh(), nn.Linear(embed, embed), nn.Tanh())
        n_lik = dim * (dim + 1) // 2 + dim  # upper triangle of the whitened Λ, and the whitened η
        self.ctx_dim = embed + n_lik
        widths = [2 * dim, *([hidden] * (layers - 1)), dim]
        self.layers = nn.ModuleList(Gated(self.ctx_dim, a, b) for a, b in itertools.pairwise(widths))
        nn.init.zeros_(self.layers[-1].linear.weight)  # f starts as the base flow (torchdiffeq FAQ)
        nn.init.zeros_(self.layers[-1].ctx.weight)
        self.register_buffer("_triu", torch.triu_indices(dim, dim), persistent=False)
        ends = list(itertools.accumulate(widths[1:]))
        self._gate_slices = [slice(a, b) for a, b in zip([0, *ends[:-1]], ends, strict=True)]
        self._folded_cache: tuple[tuple, FoldedWeights] | None = None

    # ------------------------------------------------------------------ per Bayes step
    def context(
        self,
        prior_particles: torch.Tensor,
        likelihood: GaussianLikelihood,
        whitened: gaussian.Whitened | None = None,
        residual: bool = True,
    ) -> StepContext:
        """Moments, DeepSet embedding, whitened likelihood and per-layer context biases from the (detached)
        prior particles [B, N, d] (``whitened``: their float64 :class:`~mpflow.operators.gaussian.Whitened` form, when
        the caller has it). The Gaussian algebra runs in float64. ``residual=False``: only the base flow's frame
        (moments, eigenbasis, e, η_y) — no embedding and no network biases, which a zero residual never reads."""
        x = prior_particles.detach()
        dtype = x.dtype
        white = whitened if whitened is not None else gaussian.whiten(x.to(torch.float64))
        mean64, chol64, z = white.mean, white.chol, white.z
        lik_z = whitened_likelihood(white, likelihood)
        lam_z, eta_z, eigvec, eta_y = lik_z.precision, lik_z.information, lik_z.eigvec, lik_z.eta_y
        eigval = lik_z.eigval.clamp_min(self._eig_floor)
        embedding = network = None
        if residual:
            folded = self.folded_weights()
            emb = self.deepset(z.to(dtype), folded)  # eq. 16: mean_n φ(x_m^n)
            lik = torch.cat([torch.asinh(lam_z[:, self._triu[0], self._triu[1]]), torch.asinh(eta_z)], -1)
            embedding = torch.cat([emb, lik.to(dtype)], -1)
            gate = information_gate(eigval, eta_y).to(dtype) if self.residual_gate == "information" else None
            network = self._fold(embedding, folded, eigvec.to(dtype), gate)
        if not self.use_base:  # Φ ≡ 1, ψ ≡ 0: the network is the whole field
            eigval, eta_y = torch.zeros_like(eigval), torch.zeros_like(eta_y)
        return StepContext(
            mean=mean64.to(dtype),
            chol=chol64.to(dtype),
            embedding=embedding,
            network=network,
            eigvec=eigvec.to(dtype),
            eigval=eigval.to(dtype),
            eta_y=eta_y.to(dtype),
            use_base=self.use_base,
            likelihood=likelihood,
        )

    # ------------------------------------------------------------------ the field
    def folded_weights(self) -> FoldedWeights:
        """θ as :class:`FoldedWeights`. Cached while θ is unchanged (keyed by the parameters' version counters,
        which every in-place update bumps) when no gradient is being recorded — serving; with grad mode on
        (training) it is rebuilt on every call so that gradients reach θ."""
        params = tuple(self.parameters())
        if torch.is_grad_enabled() and any(p.requires_grad for p in params):
            return self._fold_weights()
        key = tuple((id(p), p._version) for p in params)
        if self._folded_cache is None or self._folded_cache[0] != key:
            with torch.no_grad():
                self._folded_cache = (key, self._fold_weights())
        return self._folded_cache[1]

    def _fold_weights(self) -> FoldedWeights:
        last = len(self.layers) - 1
        out_scales = [2.0 if j < last else 2.0 / self.residual_bound for j in range(last + 1)]
        in_scales = [1.0 if j == 0 else 2.0 for j in range(last + 1)]
        in_shifts = [0.0 if j == 0 else -1.0 for j in range(last + 1)]
        layers = list(self.layers)
        first, second = self.phi[0], self.phi[2]
        return FoldedWeights(
            weights=[lay.linear.weight.t() * (k * a) for lay, k, a in zip(layers, out_scales, in_scales, strict=True)],
            ctx_weight=torch.cat([lay.ctx.weight.t() * k for lay, k in zip(layers, out_scales, strict=True)], 1),
            ctx_bias=torch.cat(
                [
                    (lay.ctx.bias + sh * lay.linear.weight.sum(1)) * k
                    for lay, k, sh in zip(layers, out_scales, in_shifts, strict=True)
                ]
            ),
            gate_v=torch.cat([lay.gate_v for lay in layers]),
            gate_c=torch.cat([lay.gate_c for lay in layers]),
            gate_c_scaled=torch.cat([lay.gate_c * k for lay, k in zip(layers, out_scales, strict=True)]),
            cols=self._gate_slices,
            phi=(
                first.weight.t() * 2.0,
                first.bias * 2.0,
                second.weight.t() * 4.0,
                (second.bias - second.weight.sum(1)) * 2.0,
            ),
        )

    def deepset(self, z: torch.Tensor, folded: FoldedWeights | None = None) -> torch.Tensor:
        """mean_n φ(z_n) [B, E] for z [B, N, d] (eq. 16), φ = tanh ∘ W₂ ∘ tanh ∘ W₁ evaluated through σ
        (:class:`FoldedWeights`): two matmuls and two in-place σ over the particles, then 2 mean s₂ − 1."""
        w1, b1, w2, b2 = (folded or self.folded_weights()).phi
        B, N, d = z.shape
        s = torch.addmm(b1, z.reshape(B * N, d), w1).sigmoid_()
        s = torch.addmm(b2, s, w2).sigmoid_()
        return s.reshape(B, N, -1).mean(1) * 2.0 - 1.0

    def _fold(
        self, embedding: torch.Tensor, folded: FoldedWeights, eigvec: torch.Tensor, gate: torch.Tensor | None
    ) -> FoldedNetwork:
        """h_θ for one Bayes step: the context term of every layer in one matmul, and the head from the last
        σ-output s to g h_θ U = s (2 r_b g U) − r_b g 1ᵀU (:class:`FoldedNetwork`; g ≡ 1 ungated)."""
        rb = self.residual_bound
        g = None if gate is None else gate[:, None, None]
        scale = eigvec if g is None else eigvec * g
        return FoldedNetwork(
            folded,
            torch.addmm(folded.ctx_bias, embedding, folded.ctx_weight)[:, None],
            (scale * (2.0 * rb), scale.sum(-2, keepdim=True) * -rb),
            g,
        )

    @staticmethod
    def features(z: torch.Tensor, score_z: torch.Tensor) -> torch.Tensor:
        """h_θ's per-particle input [z, asinh s_z] [B, N, 2d] (asinh tames extreme scores)."""
        return torch.cat([z, torch.asinh(score_z)], -1)

    def residual(
        self, features: torch.Tensor, lam: torch.Tensor, ctx: StepContext, *, eigenbasis: bool = False
    ) -> torch.Tensor:
        """g h_θ [B, N, d] from :meth:`features` at λ [B] — or, with ``eigenbasis``, g h_θ U (row vectors: the
        co-moving frame's dw/dλ = Uᵀ g h_θ of :func:`mpflow.operators.mpf.step.flow_step`); g the residual gate of the
        step (:func:`information_gate`; 1 when the network has none).

        h_θ = r_b tanh(u / r_b), u = Gated_k(tanh(… tanh(Gated_1(features))…)), is evaluated through σ
        (:class:`FoldedWeights`): each hidden layer as s' = σ(s M_j(λ) + β_j(λ)) on the previous σ-output s, and
        the last with out_scale 2 / r_b, so that h_θ = 2 r_b s − r_b and h_θ U = s (2 r_b U) − r_b 1ᵀU (one
        matmul-add). The same function as eq. 17–18 written layer by layer, to float rounding
        (tests/unit/test_mpf_network.py)."""
        s = features
        for M, beta in ctx.network.layer_maps(lam):
            s = torch.baddbmm(beta, s, M).sigmoid_()
        rb = self.residual_bound
        if eigenbasis:
            weight, bias = ctx.network.head
            return torch.baddbmm(bias, s, weight)
        h = s * (2.0 * rb) - rb
        return h if ctx.network.gate is None else h * ctx.network.gate

    def residual_z(self, z: torch.Tensor, lam: torch.Tensor, score_z: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """g h_θ(ctx, z, s_z, λ) [B, N, d] in whitened coordinates, ``score_z`` = Lᵀ ∇x log p(o | x) at x = m + L z."""
        return self.residual(self.features(z, score_z), lam, ctx)

    def field_z(self, z: torch.Tensor, lam: torch.Tensor, score_z: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """f_z = DH_z + U Φ(λ) Uᵀ g h_θ [B, N, d], the whole whitened field (the module docstring)."""
        U = ctx.eigvec
        h = ((self.residual_z(z, lam, score_z, ctx) @ U) * ctx.frame(lam)[0][:, None]) @ U.transpose(-1, -2)
        return h + ctx.base_z(z, lam) if ctx.use_base else h

    def forward(self, x: torch.Tensor, lam: torch.Tensor, score: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """f(x, λ) [B, N, d] in x coordinates for particles x [B, N, d], λ [B], score ∇x log p(o | x)."""
        return self.field_z(ctx.to_z(x), lam, score @ ctx.chol, ctx) @ ctx.chol.transpose(-1, -2)

    def base_flow(self, ctx: StepContext) -> DaumHuangFlow:
        """The base flow of a step in x coordinates (for checks: L DH_z(L⁻¹(x − m)) equals it)."""
        return DaumHuangFlow(ctx.mean.double(), ctx.chol.double() @ ctx.chol.double().transpose(-1, -2), ctx.likelihood)

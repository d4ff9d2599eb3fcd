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

Stein's identity assumes a Gaussian cloud; on a multimodal one it reads the spread between the modes as
curvature and the flow pulls the modes together. :func:`importance_linearisation` fits (Λ, η) instead to the
moments of the cloud reweighted by the likelihood, holding the weights of separated modes (:func:`mode_split`),
so the base flow keeps the modes where they are and the residual only has to move mass between them.

Stein's fit at the prior cloud reads the likelihood where the prior puts its mass, not where the posterior will
(the error of prior linearisation, which tempered stages reduce at K times the cost). :func:`posterior_linearisation`
re-fits it at the cloud the fitted flow produces, a few times: the iterated posterior linearisation of
García-Fernández, Svensson, Morelande & Särkkä (2015, "Posterior linearization filter: principles and
implementation using sigma points", IEEE TSP 63(20), Alg. 1), with Stein's fit as its statistical linear
regression. Its fixed point is the Gaussian variational posterior: with Λ = E_q[−∇²ℓ] and η = E_q[∇ℓ] + Λ m_q
at q = N(m_q, P_q), q = N(m, P) · N-lik(Λ, η) gives P_q⁻¹ = P⁻¹ + E_q[−∇²ℓ] and m_q = m + P E_q[∇ℓ], the
stationarity conditions of KL(q ‖ posterior) over Gaussians (Opper & Archambeau 2009, "The variational Gaussian
approximation revisited", Neural Computation 21(3), eq. 9–10).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from mpflow.operators import gaussian, state
from mpflow.operators.mpf import correction


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
    cross = (s64 * w[..., None]).transpose(-1, -2) @ xc  # E[s (x − m)ᵀ] ≈ −Λ C
    prec = -torch.cholesky_solve(cross.transpose(-1, -2), chol).transpose(-1, -2)
    prec = 0.5 * (prec + prec.transpose(-1, -2))
    eig, vec = torch.linalg.eigh(prec)
    prec = vec @ torch.diag_embed(eig.clamp_min(0.0)) @ vec.transpose(-1, -2)
    info = (w[:, None] @ s64)[:, 0] + gaussian.matvec(prec, mean)
    return GaussianLikelihood(prec, info)


#: separability η = σ²_between / σ²_total of the best two-way split along the cloud's leading axis at which the
#: importance fit starts / fully holds the two groups' weights (a Gaussian: η = 2/π ≈ 0.64; two equal modes
#: of sd σ whose centres are 3σ apart: η ≈ 0.75, 4σ apart: η ≈ 0.81). At (0.8, 0.9) the hold came too late for
#: a gmm cloud that was still one ridge with two bumps: a weight shift between the bumps dragged the whole cloud
#: into one mode (how this was found and checked: operators/pretrained/gmm-d2-v4/README.md).
MODE_SPLIT_ETA = (0.7, 0.8)
MIN_MODE_FRACTION = 0.05  # a group of fewer particles than this is not a mode
#: effective sample sizes, in units of d + 1, between which the importance fit hands over to Stein's
FALLBACK_ESS = (2.0, 4.0)


@functools.lru_cache(maxsize=16)
def _split_sizes(N: int, dtype: torch.dtype, device: torch.device) -> tuple[int, torch.Tensor]:
    """(lo, 1 / (k (N − k)) for the admissible first-group sizes k = lo..N − lo) of :func:`mode_split`."""
    lo = max(1, math.ceil(MIN_MODE_FRACTION * N))
    k = torch.arange(lo, N - lo + 1, dtype=dtype, device=device)
    return lo, 1.0 / (k * (N - k))


def mode_split(whitened: gaussian.Whitened) -> tuple[torch.Tensor, torch.Tensor]:
    """A cloud (as :class:`~mpflow.operators.gaussian.Whitened`, N points) split in two along its leading principal
    axis → (labels [B, N] bool, η [B]).

    The split is the exact one-dimensional 2-means (Otsu's threshold) of the projections p_i = uᵀ(x_i − m)
    = (Lᵀu)ᵀ z_i, u the leading eigenvector of C = LLᵀ (the p have mean 0 and variance |Lᵀu|² = λ_max(C),
    as z has mean 0 and covariance I): among the splits after k of the sorted p with both groups
    ≥ ``MIN_MODE_FRACTION`` of the particles, the one of largest between-group variance
    σ²_B(k) = (k/N)(1 − k/N)(μ₁ − μ₂)² = S_k² / (k (N − k)), S_k the sum of the k smallest p; η = σ²_B / λ_max
    ∈ [0, 1] says how well it separates the cloud (``MODE_SPLIT_ETA``)."""
    z, L = whitened.z, whitened.chol
    N = z.shape[1]
    lo, inv_sizes = _split_sizes(N, z.dtype, z.device)
    eigval, eigvec = torch.linalg.eigh(L @ L.transpose(-1, -2))
    p = (z @ (L.transpose(-1, -2) @ eigvec[..., -1:]))[..., 0]  # [B, N]
    ps = p.sort(-1).values
    best, at = (ps.cumsum(-1)[:, lo - 1 : N - lo].square_() * inv_sizes).max(-1)
    eta = best / eigval[..., -1].clamp_min(1e-300)
    return p > ps.gather(-1, at[:, None] + (lo - 1)), eta


def importance_linearisation(
    log_likelihood: torch.Tensor,
    whitened: gaussian.Whitened,
    fallback: Callable[[], GaussianLikelihood] | None = None,
) -> GaussianLikelihood:
    """The Gaussian likelihood whose Daum–Huang flow moves the cloud's Gaussian N(m, C) onto the moments of
    the cloud reweighted by the likelihood (an assumed-density / moment-matching step).

    With weights w_i (below) and the cloud in its whitened coordinates z_i (``whitened``: empirical mean 0,
    covariance I), the one-step posterior has the importance estimates μ = Σ w_i z_i and
    S = Σ w_i (z_i − μ)(z_i − μ)ᵀ, and N(0, I) · exp(−½ zᵀ Λ_z z + η_zᵀ z) = N(μ, S) for

        Λ_z = S⁻¹ − I,    η_z = S⁻¹ μ;    in x:  Λ = L⁻ᵀ Λ_z L⁻¹,  η = Λ m + L⁻ᵀ η_z.

    Unlike Stein's fit this needs no Gaussian cloud: a bimodal cloud's modes are not pulled together (Stein's
    global fit reads the between-mode spread as curvature). Λ_z may have negative eigenvalues, down to −1
    (S ≻ 0): where the reweighted cloud is wider than the cloud, the flow widens it.

    Weights. Plain importance weights w_i ∝ p(o | x_i) (``log_likelihood`` [B, N]) also move weight between
    separated modes; an affine map cannot move particles from one mode to the other, it would translate the
    whole cloud towards the mode that gains and drag the other one along. So where the cloud splits into two
    separated groups (:func:`mode_split`, separability η), the weights are renormalised within each group,
    keeping the groups' particle fractions: w = (1 − α) w_plain + α w_held, α rising linearly from 0 to 1
    over ``MODE_SPLIT_ETA``. Moving weight between modes is left to the learned residual.

    Few effective particles. The estimates rest on the particles the likelihood weights: where it lies outside
    the cloud (an outlier, an observation far in the tail) the effective sample size 1 / Σ w_i² falls to a
    handful and S degenerates, and the reweighted cloud cannot reach beyond the particles anyway. There the fit
    blends into ``fallback`` (Stein's fit from the scores, which extrapolates): β Λ_imp + (1 − β) Λ_fallback and
    likewise η, β rising from 0 to 1 as the effective sample size goes over ``FALLBACK_ESS`` × (d + 1)."""
    w = torch.softmax(log_likelihood.to(torch.float64), -1)
    if fallback is None:
        return _reweighted_fit(w, whitened)
    lo, hi = (k * (whitened.z.shape[-1] + 1) for k in FALLBACK_ESS)
    beta = ((w.square().sum(-1).reciprocal() - lo) / (hi - lo)).clamp(0.0, 1.0)  # [B]
    if bool((beta == 1).all()):
        return _reweighted_fit(w, whitened)
    other = fallback()
    if bool((beta == 0).all()):
        return other
    fit = _reweighted_fit(w, whitened)
    b2, b1 = beta[:, None, None], beta[:, None]
    return GaussianLikelihood(  # torch.where: a fit from too few particles may be non-finite where β = 0
        torch.where(b2 > 0, b2 * fit.precision + (1 - b2) * other.precision, other.precision),
        torch.where(b1 > 0, b1 * fit.information + (1 - b1) * other.information, other.information),
    )


def _reweighted_fit(w: torch.Tensor, whitened: gaussian.Whitened) -> GaussianLikelihood:
    """:func:`importance_linearisation` from the plain importance weights w [B, N]: the mode hold, then the
    reweighted moments μ, S and (Λ, η)."""
    z, L = whitened.z, whitened.chol
    labels, eta = mode_split(whitened)
    lo, hi = MODE_SPLIT_ETA
    alpha = ((eta - lo) / (hi - lo)).clamp(0.0, 1.0)[:, None]
    if bool((alpha > 0).any()):
        share = labels.to(w.dtype).mean(-1, keepdim=True)  # the first group's particle fraction
        mass = (w * labels).sum(-1, keepdim=True)  # and its importance weight
        rescale = torch.where(labels, share / mass.clamp_min(1e-300), (1 - share) / (1 - mass).clamp_min(1e-300))
        w = w * (1 + alpha * (rescale - 1))  # (1 − α) w + α w_held
        w = w / w.sum(-1, keepdim=True)
    mu = w[:, None] @ z  # [B, 1, d]
    cov = (z * w[..., None]).transpose(-1, -2) @ z - mu.transpose(-1, -2) @ mu
    eye = torch.eye(z.shape[-1], dtype=z.dtype, device=z.device)
    s_inv = torch.cholesky_inverse(gaussian.cholesky(cov))
    l_inv = torch.linalg.solve_triangular(L, eye.expand_as(L), upper=False)
    prec = l_inv.transpose(-1, -2) @ (s_inv - eye) @ l_inv  # Λ = L⁻ᵀ Λ_z L⁻¹
    info = prec @ whitened.mean[..., None] + l_inv.transpose(-1, -2) @ (s_inv @ mu.transpose(-1, -2))
    return GaussianLikelihood(0.5 * (prec + prec.transpose(-1, -2)), info[..., 0])


#: re-fits of :func:`posterior_linearisation`. Measured on ``logistic`` d = 30 (10 minibatches of 32, N = 256, one
#: stage, against HMC): mean error 0.361 sd with Stein's fit at the prior, 0.190 after one re-fit, 0.187 after two,
#: 0.171 after three, 0.172 after six (16 tempered stages of Stein's fit: 0.203 at 5× the cost); an exact
#: Gaussian moment match at every step (assumed-density filtering by importance sampling, ESS ≥ 2379) gives 0.156
POSTERIOR_ITERATIONS = 3


@dataclass
class WhitenedLikelihood:
    """A Gaussian likelihood in a cloud's whitened coordinates z = L⁻¹(x − m), float64: Λ_z = Lᵀ Λ L (symmetrised)
    = U diag(e) Uᵀ and η_z = Lᵀ (η − Λ m), with η_y = Uᵀ η_z (the eigenvalues e are not clipped)."""

    precision: torch.Tensor  # Λ_z [B, d, d]
    information: torch.Tensor  # η_z [B, d]
    eigval: torch.Tensor  # e [B, d]
    eigvec: torch.Tensor  # U [B, d, d]
    eta_y: torch.Tensor  # [B, d]


def whitened_likelihood(white: gaussian.Whitened, likelihood: GaussianLikelihood) -> WhitenedLikelihood:
    """``likelihood`` in the whitened coordinates of the cloud ``white``, with its eigenbasis."""
    L, m = white.chol.to(torch.float64), white.mean.to(torch.float64)
    prec = likelihood.precision.to(torch.float64)
    lam_z = L.transpose(-1, -2) @ prec @ L
    lam_z = 0.5 * (lam_z + lam_z.transpose(-1, -2))
    eta_z = gaussian.matvec(L.transpose(-1, -2), likelihood.information.to(torch.float64) - gaussian.matvec(prec, m))
    eigval, eigvec = torch.linalg.eigh(lam_z)
    return WhitenedLikelihood(lam_z, eta_z, eigval, eigvec, gaussian.matvec(eigvec.transpose(-1, -2), eta_z))


def gaussian_posterior_points(white: gaussian.Whitened, likelihood: GaussianLikelihood) -> torch.Tensor:
    """The cloud ``white`` moved by the base flow's exact map (the Daum–Huang flow at λ = 1) onto the Gaussian
    posterior of N(m, LLᵀ) under ``likelihood``: in the eigenbasis of Λ_z = U diag(e) Uᵀ (e clipped at 0),
    y = Uᵀ z ↦ y / √(1 + e) + Uᵀη_z / (1 + e), x₁ = m + L U y₁ → [B, N, d] float64."""
    w = whitened_likelihood(white, likelihood)
    one = 1.0 + w.eigval.clamp_min(0.0)
    y1 = (white.z.to(torch.float64) @ w.eigvec) * one.rsqrt()[:, None] + (w.eta_y / one)[:, None]
    L = white.chol.to(torch.float64)
    return white.mean.to(torch.float64)[:, None] + y1 @ (L @ w.eigvec).transpose(-1, -2)


@dataclass(frozen=True)
class PosteriorFit:
    """What :func:`posterior_fit` leaves: the kept fit, its Gaussian posterior's points x₁ (in the cloud's dtype)
    and the normalised log-weights [B, N] that would correct them to the exact Bayes update of the cloud's
    Gaussian (:func:`~mpflow.operators.mpf.correction.log_weights`) — the base flow's output and the corrected
    flow's weights, had it run with this fit."""

    likelihood: GaussianLikelihood
    points: torch.Tensor
    log_weights: torch.Tensor


def posterior_fit(
    model, obs: torch.Tensor, x: torch.Tensor, white: gaussian.Whitened, score: torch.Tensor, iterations: int
) -> PosteriorFit:
    """Stein's fit re-fitted ``iterations`` (≥ 1) times at the Gaussian posterior the previous fit gives (module
    docstring): (Λ, η) ← :func:`statistical_linearisation` at :func:`gaussian_posterior_points` (``white``: the
    prior cloud x [B, N, d], float64; ``score``: ∇x log p(o | x) at x).

    The re-fit is a fixed-point iteration, and on a strongly non-linear likelihood it can run away (``range_bearing``,
    a target passing close to the sensor: 6–9 posterior sd off in 2 of 32 streams). So the last re-fit and Stein's
    fit are scored by the effective sample size of the importance weights that would correct the Gaussian
    posterior each gives to the exact Bayes update of N(m, C) (:func:`~mpflow.operators.mpf.correction.log_weights`,
    the flow's own health signal), and each stream keeps the better of the two, with its points and weights."""
    stein = statistical_linearisation(x, score, whitened=white)

    def moved(fit: GaussianLikelihood) -> tuple[torch.Tensor, torch.Tensor]:
        """(the posterior points of ``fit`` in x's dtype, their correction's log-weights [B, N])."""
        x1 = gaussian_posterior_points(white, fit).to(x.dtype)
        return x1, correction.log_weights(model, obs, white, x1)

    stein_x1, stein_lw = moved(stein)
    x1 = stein_x1
    for iteration in range(iterations):
        lik = statistical_linearisation(x1, model.score(obs, x1))
        if iteration < iterations - 1:
            x1 = gaussian_posterior_points(white, lik).to(x.dtype)
    lik_x1, lik_lw = moved(lik)
    keep = state.ess(lik_lw) >= state.ess(stein_lw)
    return PosteriorFit(
        GaussianLikelihood(
            torch.where(keep[:, None, None], lik.precision, stein.precision),
            torch.where(keep[:, None], lik.information, stein.information),
        ),
        torch.where(keep[:, None, None], lik_x1, stein_x1),
        torch.where(keep[:, None], lik_lw, stein_lw),
    )


def posterior_linearisation(
    model, obs: torch.Tensor, x: torch.Tensor, white: gaussian.Whitened, score: torch.Tensor, iterations: int
) -> GaussianLikelihood:
    """The likelihood of :func:`posterior_fit` (Stein's own fit with no ``iterations``)."""
    if not iterations:
        return statistical_linearisation(x, score, whitened=white)
    return posterior_fit(model, obs, x, white, score, iterations).likelihood


LINEARISATIONS = ("stein", "importance", "posterior")


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
    method: str = "stein",
) -> GaussianLikelihood:
    """The Gaussian likelihood of one MPF step: exact (Hᵀ R⁻¹ H, Hᵀ R⁻¹ o) for a linear observation
    (``ModelFamily.linear_observation``),
    else fitted to the (detached) particles x [B, N, d] — ``method`` "stein": :func:`statistical_linearisation`
    of the scores; "posterior": :func:`posterior_linearisation`; "importance": :func:`importance_linearisation`
    (``whitened``: x's :class:`~mpflow.operators.gaussian.Whitened` form, reused when given; ``score``:
    ∇x log p(o | x) at x, when the caller has it)."""
    if method not in LINEARISATIONS:
        raise ValueError(f"linearisation: must be one of {LINEARISATIONS}, got {method!r}")
    if model.linear_observation():
        H, R = model.observation_affine()
        return linear_gaussian_likelihood(H.double(), R.double(), obs.double())
    x = x.detach()
    white = whitened if whitened is not None or method == "stein" else gaussian.whiten(x.double())

    def stein() -> GaussianLikelihood:
        return statistical_linearisation(x, model.score(obs, x) if score is None else score, whitened=white)

    if method == "importance":
        return importance_linearisation(model.log_likelihood(obs, x), white, fallback=stein)
    if method == "posterior":
        score = model.score(obs, x) if score is None else score
        return posterior_linearisation(model, obs, x, white, score, POSTERIOR_ITERATIONS)
    return stein()

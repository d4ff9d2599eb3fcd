"""One MPF Bayes step, shared by serving (:class:`mpflow.operators.updaters.mpf.MPFUpdater`) and meta-training
(:func:`mpflow.training.meta_train.task_loss`), so the two can never drift apart.

Given the particles x [B, N, d] of p(x | o_<m) and their log-density log q:

1. :func:`predict` (dynamic families only; MPF §5 LDS: "predict with the transition, then apply F"): move
   the particles through the transition, mapped affinely onto the pushed moments (F m + c, F C Fᵀ + Q) of
   the previous cloud so the moments carry no Monte Carlo noise; their log-density becomes that
   Gaussian's at the predicted particles (exact for linear-Gaussian models);
2. :func:`flow_step`: linearise the likelihood of o_m
(:func:`mpflow.operators.mpf.daum_huang.linearised_likelihood`),
   build the network's context from the detached cloud (eq. 16), whiten z = L⁻¹ (x − m) and integrate
   dz/dλ = f_z(X_m, o_m, z(λ), λ) with d log q/dλ = −∇_z·f_z over λ ∈ [0, 1] (eq. 4, 8; the divergence is
   invariant under the affine map), then map back x = m + L z. The likelihood score enters f along the
   path (§2.4 (ii)). The integration runs in the base flow's co-moving frame (w with z = U(Φ(λ) w + ψ(λ)),
   :mod:`mpflow.operators.mpf.network`): dw/dλ = Uᵀ h_θ, i.e. dz/dλ = DH_z(z, λ) + U Φ(λ) Uᵀ h_θ — the residual
   is expressed in units of the current (λ) posterior's whitened scale — and d log q_w/dλ = −∇_w·(dw/dλ);
   then log q_z = log q_w + ½ Σ log(1 + e_k) adds the base flow's exact −∫ tr A dλ.
"""

from __future__ import annotations

import torch
from mpflow.operators import gaussian
from mpflow.operators.models.base import ModelFamily
from mpflow.operators.mpf.daum_huang import linearised_likelihood
from mpflow.operators.mpf.network import MPFVelocity
from mpflow.operators.mpf.ode import integrate
from mpflow.operators.rng import Generators


def predict(
    model: ModelFamily,
    x: torch.Tensor,
    gens: Generators,
    log_weights: torch.Tensor | None = None,
    *,
    density=True,
    inflation: float = 1.0,
    propagated: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, gaussian.Whitened | None]:
    """The transition step of a dynamic family (module docstring, 1.) → (x_pred, log N(x_pred; F m + c, F C Fᵀ + Q)
    (the density only when ``density``), x_pred whitened (float64, for :func:`flow_step`; None when N ≤ d));
    static families return (x, None, None). ``inflation`` ρ scales the predictive's covariance by ρ² (its
    anomalies by ρ: the multiplicative inflation of ensemble filters, Anderson & Anderson 1999), which a small
    cloud under a perfect model needs against the spread it loses to sampling error. ``propagated``: the transition
    draw and its moments, (x', mean, cov) of :meth:`~mpflow.operators.models.base.ModelFamily.propagate`, where the
    caller has already made it (the updater's one predict per step)."""
    if not model.dynamic:
        return x, None, None
    moved, mean, cov = propagated[:3] if propagated is not None else model.propagate(x, gens, log_weights)
    if inflation != 1.0:
        cov = cov * inflation**2
    white = None
    if x.shape[1] > x.shape[2]:  # no Monte Carlo noise in the moments
        white = gaussian.matched(moved.double(), mean, cov)
        moved = white.points().to(x.dtype)
    if not density:
        return moved, None, white
    chol = white.chol if white is not None else gaussian.cholesky(cov)
    return moved, gaussian.log_prob(moved.double(), mean, chol).to(x.dtype), white


def flow_step(
    net: MPFVelocity,
    model: ModelFamily,
    obs: torch.Tensor,
    x: torch.Tensor,
    log_q: torch.Tensor | None,
    *,
    method: str = "rk4",
    steps: int = 1,
    divergence: str = "auto",
    create_graph: bool = False,
    adjoint: bool = False,
    probes: torch.Tensor | None = None,
    whitened: gaussian.Whitened | None = None,
    residual: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Transport (x, log q) through one observation → (x1, log_q1). ``residual=False`` (a network whose residual
    is identically zero: the untrained base flow) skips the integration: in the co-moving frame dw/dλ = 0, so
    x1 = m + L U (Φ(1) ⊙ w(0) + ψ(1)) and log q1 = log q + ½ Σ_k log(1 + e_k) in closed form.
    ``divergence="none"`` skips the density (log_q1 is None: serving, where nobody reads it). ``create_graph``
    keeps the graph for training; serving calls it under ``torch.no_grad()``. ``adjoint`` (training) takes
    gradients by torchdiffeq's adjoint method: O(1) memory in the ODE steps, θ its parameters.
    ``probes`` [P, B, N, d]: Hutchinson probes, used by ``divergence="auto"`` when d > 8. ``whitened``: x in
    float64 whitened coordinates when the caller has them (:func:`predict`), else computed here."""
    if whitened is None:
        white = gaussian.whiten(x.detach().double())
    else:
        white = gaussian.Whitened(whitened.mean.detach(), whitened.chol.detach(), whitened.z.detach())
    exact = model.linear_observation() and net.use_base  # (Λ, η) is the likelihood itself, not a fit
    score0 = None if exact else model.score(obs, x.detach())  # at the start: the fit's (non-linear) and f's
    lik = linearised_likelihood(model, obs, x, white, score0, net.linearisation)
    ctx = net.context(x, lik, white, residual=residual or not net.use_base)
    L, U = ctx.chol, ctx.eigvec
    w0 = ctx.to_z(x) @ U  # w(0) = y(0) = Uᵀ z(0), from x itself: in training x carries the graph of earlier steps

    def position(w: torch.Tensor, lam: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(y, z) with y = Φ(λ) ⊙ w + ψ(λ) and z = U y, for w [B, N, d] (row vectors)."""
        phi, psi = ctx.frame(lam)
        y = torch.addcmul(psi[:, None], w, phi[:, None])
        return y, y @ U.transpose(-1, -2)

    if not residual and net.use_base:  # the base flow alone: closed form (docstring)
        log_q1 = None if divergence == "none" or log_q is None else log_q + _log_det_frame(ctx)
        return ctx.to_x(position(w0, 1.0)[1]), log_q1

    if exact:
        # [z, s_z] is affine in w: with y = Φ ⊙ w + ψ, z = y Uᵀ and s_z = Lᵀ(η − Λx) = (Uᵀη_z − e ⊙ y) Uᵀ,
        # [z, s_z] = w (diag(Φ) K) + (ψ K + k₀), K = [Uᵀ | −diag(e) Uᵀ] [B, d, 2d], k₀ = [0 | η_y Uᵀ] [B, 1, 2d]
        Ut = U.transpose(-1, -2)
        K = torch.cat([Ut, -ctx.eigval[:, :, None] * Ut], -1)
        k0 = torch.cat([torch.zeros_like(ctx.eta_y), (ctx.eta_y[:, None] @ Ut)[:, 0]], -1)[:, None]
        d = x.shape[-1]

        def features(w: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
            phi, psi = ctx.frame(lam)
            zs = torch.baddbmm(torch.baddbmm(k0, psi[:, None], K), w, phi[:, :, None] * K)
            return torch.cat([zs[..., :d], torch.asinh(zs[..., d:])], -1)
    else:
        # Serving (no density): the first stage's features are those of the start point, whose score the
        # linearisation already took. Every torchdiffeq solver passes the initial state itself (w0, the same
        # object) only at λ = 0. With the density tracked, ∇·f differentiates f in w, so nothing is reused.
        start = net.features(white.z.to(x.dtype), score0 @ L) if divergence == "none" else None

        def features(w: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
            if w is w0 and start is not None:
                return start
            _, z = position(w, lam)
            return net.features(z, model.score(obs, ctx.to_x(z)) @ L)

    def velocity(w: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
        return net.residual(features(w, lam), lam, ctx, eigenbasis=True)  # dw/dλ = Uᵀ h

    if divergence == "none":
        log_q = None
    w1, log_q1 = integrate(
        velocity,
        w0,
        log_q,
        0.0,
        1.0,
        method=method,
        steps=steps,
        divergence=divergence,
        probes=probes,
        create_graph=create_graph,
        adjoint=adjoint,
        # θ only: the per-step context biases hold their graph to θ, so the adjoint's vjp w.r.t. θ already
        # runs through them — listing them too would count that path twice
        adjoint_params=list(net.parameters()) if adjoint else (),
    )
    if log_q1 is not None:
        log_q1 = log_q1 + _log_det_frame(ctx)
    return ctx.to_x(position(w1, 1.0)[1]), log_q1


def _log_det_frame(ctx) -> torch.Tensor:
    """log q_z − log q_w = −log|det Φ(1)| = ½ Σ_k log(1 + e_k) → [B, 1]."""
    return 0.5 * torch.log1p(ctx.eigval).sum(-1, keepdim=True)

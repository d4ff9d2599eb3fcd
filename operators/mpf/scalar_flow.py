"""The base flow in one dimension, in closed form: what :func:`~mpflow.operators.mpf.step.flow_step` computes for
d = 1 with a zero residual, in a handful of element-wise operations instead of the general d × d algebra (the
eigenbasis, the co-moving frame, Cholesky solves) — the per-dimension corrected flow of a factorised family
(:mod:`mpflow.operators.mpf.correction`) runs entirely in d = 1.

One stage with the cloud's moments (m, c) and the likelihood p(o | x)^β:

* Stein's fit of the likelihood (:func:`~mpflow.operators.mpf.daum_huang.statistical_linearisation`): with
  sᵢ = β ∂ₓ log p(o | xᵢ), λ = max(0, −mean(s (x − m)) / c) and η = mean(s) + λ m;
* the Gaussian update c₁ = c / (1 + λ c), m₁ = c₁ (m / c + η);
* with ``iterations`` > 0 (``linearisation="posterior"``,
  :func:`~mpflow.operators.mpf.daum_huang.posterior_linearisation`) the fit is repeated that many times at the
  points x₁ below, with their moments (m₁, c₁) in place of (m, c), and each stream keeps the fit whose x₁ has the
  larger ESS of the weights p(o | x₁)^β N(x₁; m, c) / N(x; m, c), Stein's or the last. The map is affine, so
  N(x; m, c) = |∂x₁/∂x| N(x₁; m₁, c₁) with a slope shared by the cloud: in one stage (β = 1) these are the step's
  health weights (:func:`~mpflow.operators.mpf.health.flow_ess`), whose ESS the flow therefore returns;
* the exact Daum–Huang flow from N(m, c) to N(m₁, c₁) (Daum & Huang 2010). Its field is affine with
  A(λ') = −½ c λ / (1 + λ' λ c), so its map has slope exp ∫₀¹ A = (1 + λ c)^{−½} = √(c₁ / c) and sends m to m₁:
  x₁ = m₁ + √(c₁ / c) (x − m).
"""

from __future__ import annotations

import torch
from mpflow.operators.models.base import ModelFamily
from mpflow.operators.models.tempered import tempered
from mpflow.operators.state import ess


def scalar_base_flow(
    model: ModelFamily,
    obs: torch.Tensor,
    x: torch.Tensor,
    stages: int,
    moments: tuple[torch.Tensor, ...] | None = None,
    iterations: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [B, N, 1] moved through one observation in ``stages`` tempered stages (module docstring) → (x₁ in x's
    dtype, the step's health ESS [B] float64 when it ran one stage with ``iterations`` > 0, else None); float64
    algebra. ``moments``: the cloud's mean and variance ([B, 1, 1] each, float64) when the caller has them (a
    moment-matched cloud); else computed. Each stage's map sends the cloud's moments to (m₁, c₁) exactly, so the
    next stage starts from them without a pass over the particles."""
    stage_model = tempered(model, stages)
    x64 = x.to(torch.float64)
    m, c = moments if moments is not None else (x64.mean(1, keepdim=True), None)
    xc = x64 - m
    if c is None:
        c = xc.square().mean(1, keepdim=True)
    n_eff = None
    for _ in range(stages):
        fit_m, fit_c, fit_xc = m, c, xc  # where the fit reads the scores: the cloud, then the posterior points
        stein = None
        for _ in range(iterations + 1):
            s = stage_model.score(obs, (fit_m + fit_xc).to(x.dtype)).to(torch.float64)
            lam = (-(s * fit_xc).mean(1, keepdim=True) / fit_c).clamp_min(0.0)
            eta = s.mean(1, keepdim=True) + lam * fit_m
            fit_c = c / (1.0 + lam * c)
            fit_m = fit_c * (m / c + eta)
            fit_xc = torch.sqrt(fit_c / c) * xc
            if stein is None:
                stein = fit_m, fit_c, fit_xc
        if iterations:  # Stein's fit or the last re-fit, whichever scores better (posterior_linearisation)
            sm, sc, sx = stein
            last = _score(stage_model, obs, m, c, xc, fit_m + fit_xc, x.dtype)
            first = _score(stage_model, obs, m, c, xc, sm + sx, x.dtype)
            keep = last >= first
            fit_m, fit_c, fit_xc = (torch.where(keep, a, b) for a, b in ((fit_m, sm), (fit_c, sc), (fit_xc, sx)))
            n_eff = torch.maximum(last, first)[:, 0, 0] if stages == 1 else None
        m, c, xc = fit_m, fit_c, fit_xc
    return (m + xc).to(x.dtype), n_eff


def _score(model, obs, m, c, xc, x1, dtype) -> torch.Tensor:
    """ESS [B, 1, 1] of the weights p(o | x₁)^β N(x₁; m, c) / N(x; m, c) of the points x₁ [B, N, 1] that a fit
    moved the cloud m + xc to (the normalising constants cancel)."""
    log_w = (
        model.log_likelihood(obs, x1.to(dtype)).to(torch.float64)
        + 0.5 * (xc.square() - (x1 - m).square())[..., 0] / c[..., 0]
    )
    return ess(log_w)[:, None, None]

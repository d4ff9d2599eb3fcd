"""The base flow in one dimension, in closed form: what :func:`~mpflow.operators.mpf.step.flow_step` computes for
d = 1 with a zero residual, in a handful of element-wise operations instead of the general d × d algebra (the
eigenbasis, the co-moving frame, Cholesky solves) — the per-dimension corrected flow of a factorised family
(:mod:`mpflow.operators.mpf.correction`) runs entirely in d = 1.

One stage with the cloud's moments (m, c) and the likelihood p(o | x)^β:

* Stein's fit of the likelihood (:func:`~mpflow.operators.mpf.gaussian_flow.statistical_linearisation`): with
  sᵢ = β ∂ₓ log p(o | xᵢ), λ = max(0, −mean(s (x − m)) / c) and η = mean(s) + λ m;
* the Gaussian update c₁ = c / (1 + λ c), m₁ = c₁ (m / c + η);
* the exact Daum–Huang flow from N(m, c) to N(m₁, c₁) (Daum & Huang 2010). Its field is affine with
  A(λ') = −½ c λ / (1 + λ' λ c), so its map has slope exp ∫₀¹ A = (1 + λ c)^{−½} = √(c₁ / c) and sends m to m₁:
  x₁ = m₁ + √(c₁ / c) (x − m).
"""

from __future__ import annotations

import torch
from mpflow.operators.models.base import ModelFamily
from mpflow.operators.models.tempered import tempered


def scalar_base_flow(
    model: ModelFamily, obs: torch.Tensor, x: torch.Tensor, stages: int, moments: tuple[torch.Tensor, ...] | None = None
) -> torch.Tensor:
    """x [B, N, 1] moved through one observation in ``stages`` tempered stages (module docstring); float64
    algebra, returned in x's dtype. ``moments``: the cloud's mean and variance ([B, 1, 1] each, float64) when the
    caller has them (a moment-matched cloud); else computed. Each stage's map sends the cloud's moments to (m₁, c₁)
    exactly, so the next stage starts from them without a pass over the particles."""
    stage_model = tempered(model, stages)
    x64 = x.to(torch.float64)
    m, c = moments if moments is not None else (x64.mean(1, keepdim=True), None)
    xc = x64 - m
    if c is None:
        c = xc.square().mean(1, keepdim=True)
    for _ in range(stages):
        s = stage_model.score(obs, (m + xc).to(x.dtype)).to(torch.float64)
        lam = (-(s * xc).mean(1, keepdim=True) / c).clamp_min(0.0)
        c1 = c / (1.0 + lam * c)
        m = c1 * (m / c + s.mean(1, keepdim=True) + lam * m)
        xc = torch.sqrt(c1 / c) * xc
        c = c1
    return (m + xc).to(x.dtype)

"""``gmm``: the two-mode example of the MPF paper (§5.2, after Welling & Teh 2011)

    x ∈ R²,   o ~ ½ N(x₁, s²) + ½ N(x₁ + x₂, s²),   s = 1 by default.

With true x = (1, −2) the posterior has two modes, near (1, −2) and (−1, 2).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from mpflow.operators import validation
from mpflow.operators.models.base import ModelFamily, span
from mpflow.operators.models.spec import FamilySpec, parse_positive
from mpflow.operators.rng import Generators, rand, randn


class GMM(ModelFamily):
    name = "gmm"
    dynamic = False
    fixed_state_dim = 2
    spec = FamilySpec(
        description="o ~ ½ N(x1, s²) + ½ N(x1 + x2, s²); static, bimodal posterior",
        observation="a number (or [number])",
        params=(("s", parse_positive, lambda d, dtype: torch.tensor(1.0, dtype=dtype)),),
    )

    @classmethod
    def task_domain(cls, options: dict[str, Any]) -> dict[str, list[float]]:
        """s = 1 and the prior N(0, c² I) of every task (c = ``prior_scale``); the DP-mixture prior: the base's."""
        if options.get("prior", "gaussian") == "dpgmm":
            return {"s": [1.0, 1.0], **super().task_domain(options)}
        c2 = float(options.get("prior_scale", 1.0)) ** 2
        return {"s": [1.0, 1.0], "prior mean": [0.0, 0.0], "prior variance": [c2, c2]}

    def domain_measures(self, prior_mean: torch.Tensor, prior_cov: torch.Tensor) -> dict[str, tuple[float, float]]:
        return {"s": span(self.params["s"]), **super().domain_measures(prior_mean, prior_cov)}

    @classmethod
    def posterior_modes(cls, x_true: torch.Tensor) -> torch.Tensor:
        """x and (x₁ + x₂, −x₂) for true states x [B, 2] → [B, 2, 2] (float64): the likelihood
        ½N(o; x₁, s²) + ½N(o; x₁ + x₂, s²) is invariant under (x₁, x₂) ↦ (x₁ + x₂, −x₂), so the posterior has a
        mode near each — (1, −2) and (−1, 2) in the paper's setting."""
        x = x_true.to(torch.float64)
        return torch.stack([x, torch.stack([x[:, 0] + x[:, 1], -x[:, 1]], -1)], 1)

    @property
    def obs_shape(self) -> tuple[int, ...]:
        return (1,)

    def parse_observation(self, value, field: str = "observation", dtype=torch.float32) -> torch.Tensor:
        t = validation.as_tensor(field, value, dtype)
        if t.dim() == 0:
            t = t[None]
        return validation.check_shape(field, t, [1])

    def observation_cdf(self, obs: torch.Tensor, x: torch.Tensor, gens: Generators) -> torch.Tensor:
        """P(O ≤ o | x) = ½ Φ((o − x₁)/s) + ½ Φ((o − x₁ − x₂)/s) → [B, N, 1]."""
        s = self.params["s"].to(torch.float64)[:, None]
        o, x = obs[:, :1].to(torch.float64), x.to(torch.float64)
        m1, m2 = x[..., 0], x[..., 0] + x[..., 1]
        return (0.5 * torch.special.ndtr((o - m1) / s) + 0.5 * torch.special.ndtr((o - m2) / s))[..., None]

    def observation_log_tails(
        self, obs: torch.Tensor, x: torch.Tensor, gens: Generators, cdf: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """log(½ Φ(±(o − x₁)/s) + ½ Φ(±(o − x₁ − x₂)/s)) by ``log_ndtr`` and logaddexp (no saturation)."""
        s = self.params["s"].to(torch.float64)[:, None]
        o, x = obs[:, :1].to(torch.float64), x.to(torch.float64)
        z1, z2 = (o - x[..., 0]) / s, (o - x[..., 0] - x[..., 1]) / s
        log_ndtr, half = torch.special.log_ndtr, math.log(0.5)
        lower = torch.logaddexp(log_ndtr(z1), log_ndtr(z2)) + half
        upper = torch.logaddexp(log_ndtr(-z1), log_ndtr(-z2)) + half
        return lower[..., None], upper[..., None]

    def log_likelihood(self, obs: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        s = self.params["s"][:, None]  # [B, 1]
        o = obs[:, :1]  # [B, 1]
        m1, m2 = x[..., 0], x[..., 0] + x[..., 1]
        norm = -torch.log(s) - 0.5 * math.log(2 * math.pi) + math.log(0.5)
        l1 = -0.5 * ((o - m1) / s) ** 2
        l2 = -0.5 * ((o - m2) / s) ** 2
        return torch.logaddexp(l1, l2) + norm

    def score(self, obs: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """∇x log p(o | x) = (w₁ d₁ + w₂ d₂, w₂ d₂) / s² = (d₁ − w₂ x₂, w₂ d₂) / s², with the residuals
        d₁ = o − x₁, d₂ = o − x₁ − x₂ = d₁ − x₂ and the responsibility of the second component
        w₂ = σ(l₂ − l₁), l₂ − l₁ = (d₁² − d₂²) / 2s² = x₂ (d₁ + d₂) / 2s² (closed form; differentiable in x
        when x is; few tensor ops: it runs at every RK4 stage of an MPF step)."""
        inv_s2 = self.params["s"].reciprocal().square()[:, None, None]  # [B, 1, 1]
        x1, x2 = x.unbind(-1)
        d1 = obs[:, :1] - x1
        d2 = d1 - x2
        w2 = torch.sigmoid((d1 + d2) * x2 * (0.5 * inv_s2[..., 0]))
        return torch.stack([torch.addcmul(d1, w2, x2, value=-1.0), w2 * d2], -1) * inv_s2

    def observation_draws(self, x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        """o_{b,i} = x_{b,i,1} (+ x_{b,i,2} with probability ½) + s_b ξ_{b,i}."""
        pick = torch.rand(x.shape[:2], generator=gen, dtype=x.dtype) < 0.5
        centre = torch.where(pick, x[..., 0], x[..., 0] + x[..., 1])
        s = self.params["s"].to(x.dtype)[:, None]
        return (centre + s * torch.randn(x.shape[:2], generator=gen, dtype=x.dtype))[..., None]

    def sample_observation(self, x: torch.Tensor, gens: Generators) -> torch.Tensor:
        pick = rand(gens, [1], x.dtype)[:, 0] < 0.5
        centre = torch.where(pick, x[:, 0], x[:, 0] + x[:, 1])
        return (centre + self.params["s"] * randn(gens, [1], x.dtype)[:, 0])[:, None]

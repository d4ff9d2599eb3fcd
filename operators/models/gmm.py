"""``gmm``: the two-mode example of the MPF paper (§5.2, after Welling & Teh 2011)

    x ∈ R²,   o ~ ½ N(x₁, s²) + ½ N(x₁ + x₂, s²),   s = 1 by default.

With true x = (1, −2) the posterior has two modes, near (1, −2) and (−1, 2).
"""

from __future__ import annotations

import math

import torch

from operators import validation
from operators.models.base import ModelFamily, parse_positive
from operators.rng import Generators, rand, randn


class GMM(ModelFamily):
    name = "gmm"
    dynamic = False
    fixed_state_dim = 2
    param_specs = (("s", parse_positive, lambda d, dtype: torch.tensor(1.0, dtype=dtype)),)

    @property
    def obs_shape(self) -> tuple[int, ...]:
        return (1,)

    def parse_observation(self, value, field: str = "observation", dtype=torch.float32) -> torch.Tensor:
        t = validation.as_tensor(field, value, dtype)
        if t.dim() == 0:
            t = t[None]
        return validation.check_shape(field, t, [1])

    def log_likelihood(self, obs: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        s = self.params["s"][:, None]  # [B, 1]
        o = obs[:, :1]  # [B, 1]
        m1, m2 = x[..., 0], x[..., 0] + x[..., 1]
        norm = -torch.log(s) - 0.5 * math.log(2 * math.pi) + math.log(0.5)
        l1 = -0.5 * ((o - m1) / s) ** 2
        l2 = -0.5 * ((o - m2) / s) ** 2
        return torch.logaddexp(l1, l2) + norm

    def score(self, obs: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """∇x log p(o | x) = w₁ r₁ (1, 0) + w₂ r₂ (1, 1), r_k = (o − μ_k)/s², w_k the component
        responsibilities (closed form; differentiable in x when x is)."""
        s2 = (self.params["s"] ** 2)[:, None]
        o = obs[:, :1]
        r1 = (o - x[..., 0]) / s2
        r2 = (o - x[..., 0] - x[..., 1]) / s2
        w1 = torch.sigmoid(-0.5 * s2 * (r1**2 - r2**2))  # l1 − l2 = −½ s² (r1² − r2²)
        w2r2 = (1 - w1) * r2
        return torch.stack([w1 * r1 + w2r2, w2r2], -1)

    def sample_observation(self, x: torch.Tensor, gens: Generators) -> torch.Tensor:
        pick = rand(gens, [1], x.dtype)[:, 0] < 0.5
        centre = torch.where(pick, x[:, 0], x[:, 0] + x[:, 1])
        return (centre + self.params["s"] * randn(gens, [1], x.dtype)[:, 0])[:, None]

"""``poisson_counts``: a static state x ∈ R^d of log-rates seen through counts, o_j ~ Poisson(exp(x_j + b_j)).

log p(o | x) = Σ_j [ o_j η_j − e^{η_j} − log o_j! ],   η = x + b   (b: ``offset``, 0 by default).

Besides what every family must give, it gives the two optional methods — without them a family is admitted with a
warning and loses predictive p-values and observation forecasts: ``observation_cdf`` (the randomised Poisson CDF,
P(O < o) + v P(O = o), v ~ U(0, 1), uniform under the model) and ``observation_draws`` (Poisson draws).
"""

from __future__ import annotations

import torch
from mpflow.operators.models.base import ModelFamily
from mpflow.operators.models.spec import FamilySpec, filled, parse_per_dim
from mpflow.operators.rng import Generators, rand
from scipy import stats


class PoissonCounts(ModelFamily):
    name = "poisson_counts"  # the entry point's name
    spec = FamilySpec(
        description="counts o_j ~ Poisson(exp(x_j + offset_j)); static",
        observation="vector of d counts",
        params=(("offset", parse_per_dim, filled(0.0)),),
    )
    latency_benchmark = False  # not one of mpflow's own benchmarks

    @property
    def obs_shape(self) -> tuple[int, ...]:
        return (self.state_dim,)

    def parse_observation(self, value, field: str = "observation", dtype=torch.float32) -> torch.Tensor:
        """d counts: whole numbers ≥ 0 (the service answers 422 naming the entry for anything else, e.g. 2.5)."""
        t = super().parse_observation(value, field, dtype)
        bad = ((t < 0) | (t != torch.round(t))).nonzero()
        if len(bad):
            j = int(bad[0, 0])
            raise ValueError(f"{field}[{j}]: a count is a whole number ≥ 0, got {float(t[j]):g}")
        return t

    def log_likelihood(self, obs: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        eta = x + self.params["offset"][:, None].to(x.dtype)
        o = obs[:, None].to(x.dtype)
        return (o * eta - torch.exp(eta) - torch.lgamma(o + 1)).sum(-1)

    def sample_observation(self, x: torch.Tensor, gens: Generators) -> torch.Tensor:
        """Each stream's counts from its own generator: the Poisson quantiles of uniform draws."""
        rate = torch.exp(x + self.params["offset"].to(x.dtype)).double()
        u = rand(gens, [self.state_dim], torch.float64)
        return torch.as_tensor(stats.poisson.ppf(u.numpy(), rate.detach().numpy()), dtype=x.dtype)

    def _rate(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(x.double() + self.params["offset"][:, None].double())

    def observation_cdf(self, obs: torch.Tensor, x: torch.Tensor, gens: Generators) -> torch.Tensor:
        """P(O_j < o_j | x) + v_j P(O_j = o_j | x), v_j ~ U(0, 1) (a randomised CDF for counts) → [B, N, d]."""
        rate, o = self._rate(x), obs[:, None].double()
        below = torch.where(o > 0, torch.special.gammaincc(o.clamp_min(1), rate), torch.zeros_like(rate))  # P(O < o)
        at = torch.exp(o * torch.log(rate) - rate - torch.lgamma(o + 1))  # P(O = o)
        v = rand(gens, [self.state_dim], torch.float64)[:, None]
        return below + v * at

    def observation_draws(self, x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        """One count vector o ~ Poisson(exp(x + offset)) per state → [B, N, d]."""
        return torch.poisson(self._rate(x), generator=gen).to(x.dtype)

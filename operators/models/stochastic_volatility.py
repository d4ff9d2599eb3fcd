"""``stochastic_volatility``: a multivariate log-volatility model (Kim, Shephard & Chib 1998)

    x_m = μ + φ (x_{m-1} − μ) + σ ε_m,   ε_m ~ N(0, I),
    o_m ~ N(0, diag(exp(x_m))),
    log p(o|x) = Σ_d −½ (log 2π + x_d + o_d² e^{−x_d}),   ∇x log p(o|x) = −½ + ½ o² e^{−x}.

μ = 0, φ = 0.95, σ = 0.3 by default; each may be a number or a vector of length d. A step of another duration Δ
than 1 moves the log-volatility as the Ornstein–Uhlenbeck process of which (φ, σ) is the one-unit step
(:meth:`StochasticVolatility.at_step`). A partial observation conditions on its observed dimensions (the
likelihood factorises per dimension).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from mpflow.operators.models.base import DEFAULT_SCALE_RANGE, ModelFamily, check_dt, span, subfield
from mpflow.operators.models.continuous_time import ou_step
from mpflow.operators.models.spec import FamilySpec, filled, parse_per_dim
from mpflow.operators.rng import Generators, randn


class StochasticVolatility(ModelFamily):
    name = "stochastic_volatility"
    dynamic = True
    factorised = True
    spec = FamilySpec(
        description="x_m = mu + phi (x_{m-1} − mu) + sigma N(0, I); o ~ N(0, diag(exp(x_m)))",
        observation="vector of length d",
        params=(
            ("mu", parse_per_dim, filled(0.0)),
            ("phi", parse_per_dim, filled(0.95)),
            ("sigma", parse_per_dim, filled(0.3)),
        ),
    )

    #: σ is a scale (positive) and φ keeps the log-volatility stationary: priors must lie inside
    param_domains = {"sigma": (0.0, math.inf), "phi": (-1.0, 1.0)}

    @classmethod
    def state_names(cls, d: int) -> list[str]:
        """x_i is the log-variance of o_i (o_i ~ N(0, exp(x_i))): ``log-vol[i]``."""
        return [f"log-vol[{i}]" for i in range(d)]

    #: the default task distribution's ranges (what ``stochastic_volatility-d2-v1`` was trained on; μ's is the 3-sd
    #: span of its N(0, 0.5²) draw)
    TASK_RANGES = {"mu_range": (-1.5, 1.5), "phi_range": (0.85, 0.98), "sigma_range": (0.2, 0.5)}

    observer_params = (("mu", "identity", True), ("phi", "atanh", False), ("sigma", "log", False))
    #: the parameter observer's task domain (:meth:`observer_tasks`; ``stochastic_volatility-d1-v1``'s broad one):
    #: μ and φ uniform, σ log-uniform on their ranges
    OBSERVER_TASKS = {"mu_range": (-3.0, 3.0), "phi_range": (0.5, 0.995), "sigma_range": (0.05, 1.0)}

    def observer_context(self) -> torch.Tensor | None:
        """Nothing besides the observations (a [B, 0] tensor) for d = 1; None otherwise."""
        return torch.zeros(self.batch_size, 0, dtype=torch.float64) if self.state_dim == 1 else None

    @classmethod
    def observer_tasks(cls, n: int, gen: torch.Generator):
        """:attr:`OBSERVER_TASKS`; x_0 from the stationary law N(μ, σ² / (1 − φ²))."""
        t = cls.OBSERVER_TASKS
        r = torch.rand(n, 3, generator=gen, dtype=torch.float64)
        mu = t["mu_range"][0] + (t["mu_range"][1] - t["mu_range"][0]) * r[:, 0]
        phi = t["phi_range"][0] + (t["phi_range"][1] - t["phi_range"][0]) * r[:, 1]
        lo, hi = (math.log(v) for v in t["sigma_range"])
        sigma = torch.exp(lo + (hi - lo) * r[:, 2])
        x0 = mu + sigma / (1 - phi * phi).sqrt() * torch.randn(n, generator=gen, dtype=torch.float64)
        params = {"mu": mu[:, None], "phi": phi[:, None], "sigma": sigma[:, None]}
        return cls(params, 1), {"mu": mu, "phi": phi, "sigma": sigma}, x0[:, None]

    @classmethod
    def task_ranges(cls, options: dict[str, Any]) -> dict[str, tuple[float, float]]:
        """The (lo, hi) of μ, φ and σ that tasks draw from: ``options`` over :attr:`TASK_RANGES`; ValueError
        naming the option when a range is not ordered or leaves the model's domain (φ ∈ (−1, 1), σ > 0)."""
        ranges = {}
        for key, default in cls.TASK_RANGES.items():
            value = options.get(key, default)
            numbers = isinstance(value, list | tuple) and all(
                isinstance(v, int | float) and not isinstance(v, bool) for v in value
            )
            if not numbers or len(value) != 2 or not value[0] <= value[1]:
                raise ValueError(f"task options.{key}: a range [lo, hi] of numbers with lo <= hi, got {value!r}")
            ranges[key] = (float(value[0]), float(value[1]))
        if not -1 < ranges["phi_range"][0] <= ranges["phi_range"][1] < 1:
            raise ValueError(f"task options.phi_range: inside (-1, 1), got {list(ranges['phi_range'])}")
        if not ranges["sigma_range"][0] > 0:
            raise ValueError(f"task options.sigma_range: positive, got {list(ranges['sigma_range'])}")
        return ranges

    @classmethod
    def task_domain(cls, options: dict[str, Any]) -> dict[str, list[float]]:
        """μ, φ, σ within their task ranges; the prior centred at μ (offset 0) with variances ``scale_range`` × the
        stationary variance σ²/(1 − φ²)."""
        lo, hi = options.get("scale_range", DEFAULT_SCALE_RANGE)
        ranges = cls.task_ranges(options)
        return {
            "mu": list(ranges["mu_range"]),
            "phi": list(ranges["phi_range"]),
            "sigma": list(ranges["sigma_range"]),
            "prior mean - mu (stationary sd)": [0.0, 0.0],
            "prior variance / stationary variance": [float(lo), float(hi)],
        }

    def domain_measures(self, prior_mean: torch.Tensor, prior_cov: torch.Tensor) -> dict[str, tuple[float, float]]:
        mu, phi, sigma = (self.params[k][0].to(torch.float64) for k in ("mu", "phi", "sigma"))
        stationary = sigma**2 / (1 - phi**2).clamp_min(1e-12)
        var = torch.linalg.eigvalsh(prior_cov.to(torch.float64))
        return {
            "mu": span(mu),
            "phi": span(phi),
            "sigma": span(sigma),
            "prior mean - mu (stationary sd)": span((prior_mean.to(torch.float64) - mu) / stationary.sqrt()),
            "prior variance / stationary variance": (
                float(var.min() / stationary.max()),
                float(var.max() / stationary.min()),
            ),
        }

    def check(self) -> None:
        if bool((self.params["sigma"] <= 0).any()):
            raise ValueError("model.params.sigma: must be positive")

    @property
    def obs_shape(self) -> tuple[int, ...]:
        return (self.state_dim,)

    def at_step(self, dt: float = 1.0, u: torch.Tensor | None = None, field: str = "observation") -> ModelFamily:
        """A step of duration ``dt``: the log-volatility is the Ornstein–Uhlenbeck process whose one-unit step is
        (φ, σ), so over Δ it is exactly φ^Δ and σ √((1 − φ^{2Δ}) / (1 − φ²))
        (:func:`mpflow.operators.models.continuous_time.ou_step`); φ must lie in (0, 1) for Δ ≠ 1."""
        dt = check_dt(dt, field)
        if u is not None:
            raise ValueError(f"{subfield(field, 'u')}: the {self.name} family takes no inputs")
        if dt == 1.0:
            return self
        phi = self.params["phi"]
        if bool(((phi <= 0) | (phi >= 1)).any()):
            raise ValueError(
                f"{subfield(field, 'dt')}: steps of other durations than 1 need an Ornstein–Uhlenbeck log-volatility, "
                "model.params.phi in (0, 1)"
            )
        phi_dt, sigma_dt = ou_step(phi, self.params["sigma"], torch.full((self.batch_size,), dt))
        dtype = phi.dtype
        if not bool((sigma_dt.to(dtype) > 0).all()):
            raise ValueError(
                f"{subfield(field, 'dt')}: dt = {dt:g} is too short for the log-volatility's noise to be represented"
            )
        return type(self)({**self.params, "phi": phi_dt.to(dtype), "sigma": sigma_dt.to(dtype)}, self.state_dim)

    def transition_affine(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mu, phi, sigma = (self.params[k] for k in ("mu", "phi", "sigma"))
        return torch.diag_embed(phi), (1 - phi) * mu, torch.diag_embed(sigma**2)

    def per_dimension(self, streams: int) -> StochasticVolatility:
        """The d independent univariate models (diagonal φ, σ; o_j ~ N(0, e^{x_j}))."""
        return type(self)({k: v.expand(streams, -1).reshape(-1, 1) for k, v in self.params.items()}, 1)

    partial_observations = True

    def observed_part(self, obs: torch.Tensor) -> tuple[ModelFamily, torch.Tensor]:
        """The likelihood factorises per dimension, so the observed entries S condition alone:
        log p(o_S | x) = Σ_{d∈S} −½ (log 2π + x_d + o_d² e^{−x_d}); ``obs_mask`` [B, d] (1 on S) keeps the sum
        to S."""
        params = self.expanded(obs.shape[0])
        params["obs_mask"] = (~torch.isnan(obs)).to(params["mu"].dtype)
        return type(self)(params, self.state_dim), obs.nan_to_num(0.0)

    def _masked(self, terms: torch.Tensor) -> torch.Tensor:
        """Per-dimension terms [B, N, d] with the unobserved dimensions of a partial observation zeroed."""
        mask = self.params.get("obs_mask")
        return terms if mask is None else terms * mask[:, None].to(terms.dtype)

    def log_likelihood(self, obs: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        o2 = (obs**2)[:, None, :]
        return self._masked(-0.5 * (math.log(2 * math.pi) + x + o2 * torch.exp(-x))).sum(-1)

    def score(self, obs: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self._masked(-0.5 + 0.5 * (obs**2)[:, None, :] * torch.exp(-x))

    def observation_cdf(self, obs: torch.Tensor, x: torch.Tensor, gens: Generators) -> torch.Tensor:
        """P(O_j ≤ o_j | x) = Φ(o_j e^{−x_j/2}) (o_j ~ N(0, e^{x_j}))."""
        return torch.special.ndtr(obs.to(torch.float64)[:, None, :] * torch.exp(-0.5 * x.to(torch.float64)))

    def observation_log_tails(
        self, obs: torch.Tensor, x: torch.Tensor, gens: Generators, cdf: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """log Φ(±o_j e^{−x_j/2}) (no saturation)."""
        z = obs.to(torch.float64)[:, None, :] * torch.exp(-0.5 * x.to(torch.float64))
        return torch.special.log_ndtr(z), torch.special.log_ndtr(-z)

    def observation_draws(self, x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        """o_{b,i} = e^{x_{b,i} / 2} ⊙ ξ_{b,i} (no parameter enters it)."""
        return torch.exp(0.5 * x) * torch.randn(x.shape, generator=gen, dtype=x.dtype)

    def sample_observation(self, x: torch.Tensor, gens: Generators) -> torch.Tensor:
        return torch.exp(0.5 * x) * randn(gens, [self.state_dim], x.dtype)

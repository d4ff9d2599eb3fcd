"""Priors of unknown static model parameters (``"R": {"prior": {...}}`` in a model's ``params``).

A scalar parameter θ — or a covariance read as θ·I, a per-dimension vector as θ·1 — given as a prior instead of a
number is learned online by the ``smc2`` method (:mod:`mpflow.operators.updaters.smc2`). Three priors:

* ``{"type": "lognormal", "mean": μ, "sd": s}``: log θ ~ N(μ, s²) (log-space mean and sd), support (0, ∞);
* ``{"type": "uniform", "low": a, "high": b}``: θ ~ U(a, b), support (a, b);
* ``{"type": "normal", "mean": m, "sd": s}``: θ ~ N(m, s²), support ℝ.

A prior must lie inside the parameter's domain (a variance is positive, a stationary SV φ lies in (−1, 1); the
family declares it: :meth:`~mpflow.operators.models.base.ModelFamily.param_domain`).

The θ-particles move (jitter, :mod:`mpflow.operators.updaters.smc2`) in the unconstrained coordinate u of the
support (lo, hi), which the state stores with them, so no prior is needed after step 0:

    u = θ (ℝ),   u = log(θ − lo) (lo, ∞),   u = logit((θ − lo) / (hi − lo)) (lo, hi).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

PRIOR_TYPES = {"lognormal": ("mean", "sd"), "uniform": ("low", "high"), "normal": ("mean", "sd")}
#: the largest |hyperparameter| accepted (θ draws stay far inside float32)
MAX_HYPER = 1e6
#: the largest log-space sd of a lognormal prior (e^{±4·30} would leave float64's useful range)
MAX_LOG_SD = 30.0


def is_prior(value: Any) -> bool:
    """Whether a JSON parameter value is a prior (``{"prior": {...}}``) rather than a number or an array."""
    return isinstance(value, dict) and "prior" in value


@dataclass(frozen=True)
class ParamPrior:
    """One unknown scalar parameter's prior: ``type`` and its two hyperparameters (a, b): (μ, s) for lognormal and
    normal, (low, high) for uniform."""

    type: str
    a: float
    b: float

    @property
    def support(self) -> tuple[float, float]:
        if self.type == "lognormal":
            return 0.0, math.inf
        if self.type == "uniform":
            return self.a, self.b
        return -math.inf, math.inf

    def sample(self, gen: torch.Generator, n: int) -> torch.Tensor:
        """n draws [n] (float64) from ``gen``."""
        return self.from_normal(torch.randn(n, generator=gen, dtype=torch.float64))

    def from_normal(self, z: torch.Tensor) -> torch.Tensor:
        """The draws θ made of standard-normal draws z (any shape, float64): one θ per z."""
        if self.type == "lognormal":
            return torch.exp(self.a + self.b * z)
        if self.type == "normal":
            return self.a + self.b * z
        u = torch.special.ndtr(z)  # a uniform from the same normal draw
        return self.a + (self.b - self.a) * u

    def log_density(self, theta: torch.Tensor) -> torch.Tensor:
        """log p(θ) (−inf outside the support)."""
        theta = theta.to(torch.float64)
        if self.type == "uniform":
            inside = (theta > self.a) & (theta < self.b)
            return torch.where(inside, -math.log(self.b - self.a), -math.inf)
        if self.type == "normal":
            return -0.5 * ((theta - self.a) / self.b) ** 2 - math.log(self.b * math.sqrt(2 * math.pi))
        log_theta = torch.log(theta.clamp_min(1e-300))
        lp = -0.5 * ((log_theta - self.a) / self.b) ** 2 - log_theta - math.log(self.b * math.sqrt(2 * math.pi))
        return torch.where(theta > 0, lp, -math.inf)

    def to_json(self) -> dict[str, Any]:
        first, second = PRIOR_TYPES[self.type]
        return {"type": self.type, first: self.a, second: self.b}


def parse_prior(field: str, value: Any, domain: tuple[float, float]) -> ParamPrior:
    """A ``{"prior": {...}}`` JSON value → :class:`ParamPrior`; ValueError naming ``field`` and the fix when it is
    malformed or puts mass outside the parameter's ``domain`` (lo, hi)."""
    if not isinstance(value, dict) or set(value) != {"prior"} or not isinstance(value["prior"], dict):
        raise ValueError(f'{field}: a prior is {{"prior": {{"type": ..., ...}}}} and nothing else')
    spec = value["prior"]
    kind = spec.get("type")
    if kind not in PRIOR_TYPES:
        raise ValueError(
            f"{field}.prior.type: one of lognormal (mean, sd of log θ), uniform (low, high), normal (mean, sd); "
            f"got {kind!r}"
        )
    keys = PRIOR_TYPES[kind]
    unknown = sorted(set(spec) - {"type", *keys})
    if unknown or any(k not in spec for k in keys):
        raise ValueError(f"{field}.prior: a {kind} prior takes exactly {', '.join(keys)} (got {sorted(spec)})")
    a, b = (spec[k] for k in keys)
    for k, v in zip(keys, (a, b), strict=True):
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or abs(v) > MAX_HYPER:
            raise ValueError(f"{field}.prior.{k}: a finite number of magnitude at most {MAX_HYPER:g}, got {v!r}")
    if kind in ("lognormal", "normal") and not b > 0:
        raise ValueError(f"{field}.prior.sd: must be positive, got {b!r}")
    if kind == "lognormal" and b > MAX_LOG_SD:
        raise ValueError(f"{field}.prior.sd: a log-space sd of at most {MAX_LOG_SD:g}, got {b!r}")
    if kind == "uniform" and not a < b:
        raise ValueError(f"{field}.prior: low < high, got low = {a!r}, high = {b!r}")
    prior = ParamPrior(kind, float(a), float(b))
    lo, hi = prior.support
    if lo < domain[0] or hi > domain[1]:
        fix = (
            f"a uniform prior with {domain[0]:g} <= low < high <= {domain[1]:g}"
            if math.isfinite(domain[0]) and math.isfinite(domain[1])
            else "a lognormal prior, or a uniform one with low >= 0"
            if domain[0] == 0.0
            else f"a uniform prior inside ({domain[0]:g}, {domain[1]:g})"
        )
        raise ValueError(
            f"{field}.prior: a {kind} prior puts mass on ({lo:g}, {hi:g}), outside the parameter's domain "
            f"({domain[0]:g}, {domain[1]:g}); use {fix}"
        )
    return prior


# ------------------------------------------------------------------ the unconstrained coordinate (module docstring)
def to_unconstrained(theta: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """u of θ inside (lo, hi) (tensors broadcasting with θ; ±inf for an open end)."""
    lower, upper = torch.isfinite(lo), torch.isfinite(hi)
    lo0, span = torch.where(lower, lo, 0.0), torch.where(upper & lower, hi - lo, 1.0)
    shifted = torch.log((theta - lo0).clamp_min(1e-300))
    p = ((theta - lo0) / span).clamp(1e-15, 1 - 1e-15)
    return torch.where(upper & lower, torch.logit(p), torch.where(lower, shifted, theta))


def from_unconstrained(u: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """θ of u: the inverse of :func:`to_unconstrained`."""
    lower, upper = torch.isfinite(lo), torch.isfinite(hi)
    lo0, span = torch.where(lower, lo, 0.0), torch.where(upper & lower, hi - lo, 1.0)
    bounded = lo0 + span * torch.sigmoid(u)
    return torch.where(upper & lower, bounded, torch.where(lower, lo0 + torch.exp(u), u))


__all__ = ["PRIOR_TYPES", "ParamPrior", "from_unconstrained", "is_prior", "parse_prior", "to_unconstrained"]

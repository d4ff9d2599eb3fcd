"""``stochastic_volatility``'s meta-training tasks, evaluation and benchmark settings
(:class:`StochasticVolatilityTasks`)."""

from __future__ import annotations

import math
from typing import Any

import torch
from mpflow.operators.models.base import ModelFamily
from mpflow.operators.models.priors import GaussianMixture
from mpflow.operators.models.stochastic_volatility import StochasticVolatility
from mpflow.operators.rng import Generators, randn
from mpflow.training.task_distribution import FamilyTasks, register_tasks, stack_params
from mpflow.training.task_priors import DEFAULT_SCALE_RANGE, gaussian_prior, uniform


@register_tasks
class StochasticVolatilityTasks(FamilyTasks):
    family = StochasticVolatility

    eval_steps = 50

    benchmark_model = "mu = 0, phi = 0.95, sigma = 0.3"

    task_options = ("mu_range", "phi_range", "sigma_range")

    def sample_task_models(
        self, gens: Generators, d: int, dtype: torch.dtype, options: dict[str, Any]
    ) -> tuple[ModelFamily, GaussianMixture]:
        """Per task μ per dimension, φ ~ U(``phi_range``) and σ (the same φ, σ in every dimension); the prior is the
        Gaussian task prior centred at μ with its covariance scaled by the stationary variance σ²/(1 − φ²) of the
        log-volatility (the ``prior`` option does not apply). μ ~ U(``mu_range``) when given, else N(0, 0.5²); σ is
        log-uniform over ``sigma_range`` when given (a range over decades), else U[0.2, 0.5] — the defaults are the
        distribution ``stochastic_volatility-d2-v1`` was trained on."""
        ranges = self.family.task_ranges(options)
        if "mu_range" in options:
            mu = uniform(gens, [d], *ranges["mu_range"], torch.float64)
        else:
            mu = 0.5 * randn(gens, [d], torch.float64)
        phi = uniform(gens, [1], *ranges["phi_range"], torch.float64)
        if "sigma_range" in options:
            sigma = torch.exp(uniform(gens, [1], *(math.log(v) for v in ranges["sigma_range"]), torch.float64))
        else:
            sigma = uniform(gens, [1], *ranges["sigma_range"], torch.float64)
        params = [
            {"mu": mu[b].tolist(), "phi": [float(phi[b, 0])] * d, "sigma": [float(sigma[b, 0])] * d}
            for b in range(len(gens))
        ]
        stationary = (sigma[:, 0] ** 2 / (1 - phi[:, 0] ** 2)).to(dtype)
        scale_range = options.get("scale_range", DEFAULT_SCALE_RANGE)
        prior = gaussian_prior(gens, d, dtype, scale_range, mu.to(dtype), stationary)
        return stack_params(self.family, params, d, dtype), prior

"""``lorenz96``'s meta-training tasks, evaluation and benchmark settings (:class:`Lorenz96Tasks`)."""

from __future__ import annotations

from typing import Any

import torch
from mpflow.operators.models.base import ModelFamily
from mpflow.operators.models.lorenz96 import TASK_R_RANGE, TASK_SPIN_UP, Lorenz96
from mpflow.operators.models.priors import GaussianMixture
from mpflow.operators.rng import Generators, randn
from mpflow.training.task_distribution import FamilyTasks, register_tasks, stack_params
from mpflow.training.task_priors import DEFAULT_SCALE_RANGE, gaussian_prior, uniform


@register_tasks
class Lorenz96Tasks(FamilyTasks):
    family = Lorenz96

    benchmark_model = "DAPPER sakov2008: F = 8, Δ = 0.05, every variable observed, R = 1"

    latency_benchmark = False

    eval_steps = 100

    #: meta-training task options (:meth:`Lorenz96.sample_task_models`)
    task_options = ("R_range", "arctan", "Q")

    def sample_task_models(
        self, gens: Generators, d: int, dtype: torch.dtype, options: dict[str, Any]
    ) -> tuple[ModelFamily, GaussianMixture]:
        """The defaults (F = 8, Δ = 0.05, every variable observed: one observation shape for the batch) with R ~
        U[``R_range``] per task (default ``TASK_R_RANGE``), the sensor ``arctan`` (0 or 1, default 0) and the model
        noise ``Q`` (default 0) of every task; the prior N(c + ξ, Σ) is centred near the attractor — c is
        F + N(0, I) carried by ``TASK_SPIN_UP`` noise-free steps, ξ ~ N(0, I) as in a twin experiment — with Σ of
        eigenvalues in ``scale_range`` (:func:`~mpflow.training.task_priors.gaussian_prior`)."""
        lo, hi = options.get("R_range", TASK_R_RANGE)
        R = uniform(gens, [1], float(lo), float(hi), torch.float64)[:, 0]
        fixed = {"arctan": float(options.get("arctan", 0)), "Q": float(options.get("Q", 0.0))}
        model = stack_params(self.family, [{"R": float(r), **fixed} for r in R], d, dtype)
        x = 8.0 + randn(gens, [1, d], torch.float64)
        spin = model.to(torch.float64)
        for _ in range(TASK_SPIN_UP):
            x = spin.transition_mean(x)
        centre = (x[:, 0] + randn(gens, [d], torch.float64)).to(dtype)
        prior = gaussian_prior(gens, d, dtype, options.get("scale_range", DEFAULT_SCALE_RANGE), centre)
        return model, prior

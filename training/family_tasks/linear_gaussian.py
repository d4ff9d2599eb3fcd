"""``linear_gaussian``'s meta-training tasks, evaluation and benchmark settings (:class:`LinearGaussianTasks`)."""

from __future__ import annotations

from typing import Any

import torch
from mpflow.operators.models.base import ModelFamily
from mpflow.operators.models.linear_gaussian import LinearGaussian
from mpflow.operators.models.priors import GaussianMixture
from mpflow.operators.rng import Generators
from mpflow.training.task_distribution import FamilyTasks, register_tasks
from mpflow.training.task_priors import task_prior


@register_tasks
class LinearGaussianTasks(FamilyTasks):
    family = LinearGaussian

    task_options = ("obs_var",)

    eval_steps = 100  # MPF §5.1

    benchmark_model = "H = I, R = 3I"

    def sample_task_models(
        self, gens: Generators, d: int, dtype: torch.dtype, options: dict[str, Any]
    ) -> tuple[ModelFamily, GaussianMixture]:
        """MPF §5.1: o ~ N(x, r I) for every task (H = I, r = ``obs_var``, 3 as in the paper), the task prior."""
        r = options.get("obs_var", 3.0)
        if not r > 0:
            raise ValueError(f"obs_var: must be positive, got {r!r}")
        one = self.family.from_params({"R": (r * torch.eye(d)).tolist()}, d, dtype)
        return self.family.stack([one] * len(gens)), task_prior(gens, d, dtype, options)

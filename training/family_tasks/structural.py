"""``structural``'s meta-training tasks, evaluation and benchmark settings (:class:`StructuralTasks`)."""

from __future__ import annotations

import math
from typing import Any

import torch
from mpflow.operators.models.base import ModelFamily
from mpflow.operators.models.priors import GaussianMixture
from mpflow.operators.models.structural import Structural
from mpflow.operators.rng import Generators
from mpflow.training.task_distribution import FamilyTasks, register_tasks, stack_params
from mpflow.training.task_priors import task_prior, uniform


@register_tasks
class StructuralTasks(FamilyTasks):
    family = Structural

    eval_steps = 48  # two days of hourly steps of the demonstration model's daily season

    benchmark_model = "the demonstration layout for d (level, a slope when d is even, daily/weekly harmonics in hours)"

    def sample_task_models(
        self, gens: Generators, d: int, dtype: torch.dtype, options: dict[str, Any]
    ) -> tuple[ModelFamily, GaussianMixture]:
        """The demonstration layout for d (:meth:`Structural.example_params`) with, per task, every sd and √R
        log-uniform on [0.1, 1] (the level's) or [0.01, 0.3] (the trend's and seasons'); the task prior. Kalman is
        exact for every task: these serve a learned operator's training only."""
        base = Structural.example_params(d)
        log_u = uniform(gens, [4], 0.0, 1.0, torch.float64)  # [B, 4]: one row per task

        def between(col: int, lo: float, hi: float) -> torch.Tensor:
            return torch.exp(math.log(lo) + (math.log(hi) - math.log(lo)) * log_u[:, col])

        level, trend, season = between(0, 0.1, 1.0), between(1, 0.01, 0.3), between(2, 0.01, 0.3)
        noise = between(3, 0.1, 1.0) ** 2
        params = []
        for b in range(len(gens)):
            p: dict[str, Any] = {"level_sd": float(level[b]), "R": float(noise[b])}
            if "trend_sd" in base:
                p["trend_sd"] = float(trend[b])
            if "seasonal" in base:
                p["seasonal"] = [{**c, "sd": float(season[b])} for c in base["seasonal"]]
            params.append(p)
        return stack_params(self.family, params, d, dtype), task_prior(gens, d, dtype, options)

    def benchmark_params(self, d: int, gen: torch.Generator) -> dict[str, Any]:
        """The demonstration model of dimension d (:meth:`Structural.example_params`)."""
        return Structural.example_params(d)

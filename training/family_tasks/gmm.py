"""``gmm``'s meta-training tasks, evaluation and benchmark settings (:class:`GMMTasks`)."""

from __future__ import annotations

from typing import Any

import torch
from mpflow.operators.models.base import ModelFamily
from mpflow.operators.models.gmm import GMM
from mpflow.operators.models.priors import GaussianMixture
from mpflow.operators.rng import Generators
from mpflow.training.task_distribution import FamilyTasks, register_tasks
from mpflow.training.task_priors import task_prior


@register_tasks
class GMMTasks(FamilyTasks):
    family = GMM

    task_options = ("prior_scale",)

    paper_true_x = (1.0, -2.0)  # MPF §5.2

    eval_steps = 30  # MPF §5.2: the posterior "after 30 observations"

    benchmark_model = "s = 1"

    def sample_task_models(
        self, gens: Generators, d: int, dtype: torch.dtype, options: dict[str, Any]
    ) -> tuple[ModelFamily, GaussianMixture]:
        """MPF §5.2: s = 1 for every task and the prior N(0, c² I), c = ``prior_scale`` (default 1), or the
        DP-mixture task prior with ``prior="dpgmm"``. The true x defaults to the paper's (1, −2)
        (``paper_true_x``; ``true_x="prior"`` draws it from the prior instead)."""
        model = self.family.stack([self.family.from_params(None, d, dtype)] * len(gens))
        if options.get("prior", "gaussian") == "dpgmm":
            return model, task_prior(gens, d, dtype, options)
        scale = options.get("prior_scale", 1.0)
        if not scale > 0:
            raise ValueError(f"prior_scale: must be positive, got {scale!r}")
        eye = torch.eye(d, dtype=dtype).expand(len(gens), d, d)
        return model, GaussianMixture.gaussian(torch.zeros(len(gens), d, dtype=dtype), scale**2 * eye.clone())

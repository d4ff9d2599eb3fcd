"""``linear_gaussian``: a static state x ∈ R^d seen through o ~ N(H x, R), H = I, R = 3I by default
(the MPF paper's Gaussian experiment, §5.1). The exact posterior is conjugate Gaussian
(:mod:`mpflow.operators.references.conjugate`)."""

from __future__ import annotations

from typing import Any

import torch
from mpflow.operators.models.base import ModelFamily, identity, parse_cov, parse_matrix
from mpflow.operators.models.linear_observation import LinearObservationFamily
from mpflow.operators.models.priors import GaussianMixture
from mpflow.operators.models.task_priors import task_prior
from mpflow.operators.rng import Generators


class LinearGaussian(LinearObservationFamily):
    name = "linear_gaussian"
    dynamic = False
    param_specs = (("H", parse_matrix, identity()), ("R", parse_cov, identity(3.0)))

    description = "o ~ N(H x, R); static"
    observation_format = "vector of length k (the rows of H; k = d by default)"
    task_options = ("obs_var",)
    eval_steps = 100  # MPF §5.1
    benchmark_model = "H = I, R = 3I"

    @classmethod
    def sample_task_models(
        cls, gens: Generators, d: int, dtype: torch.dtype, options: dict[str, Any]
    ) -> tuple[ModelFamily, GaussianMixture]:
        """MPF §5.1: o ~ N(x, r I) for every task (H = I, r = ``obs_var``, 3 as in the paper), the task prior."""
        r = options.get("obs_var", 3.0)
        if not r > 0:
            raise ValueError(f"obs_var: must be positive, got {r!r}")
        one = cls.from_params({"R": (r * torch.eye(d)).tolist()}, d, dtype)
        return cls.stack([one] * len(gens)), task_prior(gens, d, dtype, options)

"""``linear_gaussian``: a static state x ∈ R^d seen through o ~ N(H x, R), H = I, R = 3I by default
(the MPF paper's Gaussian experiment, §5.1). The exact posterior is conjugate Gaussian
(:mod:`mpflow.operators.references.conjugate`)."""

from __future__ import annotations

import math
from typing import Any

import torch
from mpflow.operators.models.base import span
from mpflow.operators.models.linear_observation import LinearObservationFamily
from mpflow.operators.models.spec import FamilySpec, identity, parse_cov, parse_matrix


class LinearGaussian(LinearObservationFamily):
    name = "linear_gaussian"
    dynamic = False
    spec = FamilySpec(
        description="o ~ N(H x, R); static",
        observation="vector of length k (the rows of H; k = d by default)",
        params=(("H", parse_matrix, identity()), ("R", parse_cov, identity(3.0))),
    )

    observer_params = (("R", "log", True),)
    #: the parameter observer's task domain (:meth:`observer_tasks`): |H| log-uniform on H_RANGE, log R uniform on
    #: LOG_R_RANGE, x ~ N(0, X_SD²)
    OBSERVER_TASKS = {"H_RANGE": (0.2, 5.0), "LOG_R_RANGE": (-8.0, 6.0), "X_SD": 10.0}

    def observer_context(self) -> torch.Tensor | None:
        """[log H²] of a scalar model (the parameter observer's domain); None otherwise."""
        if self.state_dim != 1 or self.observation_size() != 1:
            return None
        return torch.log(self.params["H"].to(torch.float64)[:, 0, 0] ** 2)[:, None]

    @classmethod
    def observer_tasks(cls, n: int, gen: torch.Generator):
        """:attr:`OBSERVER_TASKS`."""
        t = cls.OBSERVER_TASKS
        r = torch.rand(n, 3, generator=gen, dtype=torch.float64)
        lo, hi = (math.log(v) for v in t["H_RANGE"])
        H = torch.where(r[:, 0] < 0.5, -1.0, 1.0) * torch.exp(lo + (hi - lo) * r[:, 1])
        R = torch.exp(t["LOG_R_RANGE"][0] + (t["LOG_R_RANGE"][1] - t["LOG_R_RANGE"][0]) * r[:, 2])
        x0 = t["X_SD"] * torch.randn(n, 1, generator=gen, dtype=torch.float64)
        return cls({"H": H[:, None, None], "R": R[:, None, None]}, 1), {"R": R}, x0

    @classmethod
    def task_domain(cls, options: dict[str, Any]) -> dict[str, list[float]]:
        """H = I and R = r I (r = ``obs_var``) in every task, and the task prior."""
        r = float(options.get("obs_var", 3.0))
        return {"|H - I|": [0.0, 0.0], "R variance": [r, r], **super().task_domain(options)}

    def domain_measures(self, prior_mean: torch.Tensor, prior_cov: torch.Tensor) -> dict[str, tuple[float, float]]:
        H, R = (t[0].to(torch.float64) for t in self.observation_affine())
        off = (H - torch.eye(*H.shape, dtype=H.dtype)).abs().max() if H.shape[0] == H.shape[1] else torch.tensor(1e9)
        return {
            "|H - I|": (float(off), float(off)),
            "R variance": span(torch.linalg.eigvalsh(R)),
            **super().domain_measures(prior_mean, prior_cov),
        }

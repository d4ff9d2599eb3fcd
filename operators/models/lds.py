"""``lds``: the linear dynamical system of the MPF paper (§5 LDS)

    x_m = A x_{m-1} + N(0, Q),    o_m = B x_m + N(0, R),     Q = I, R = I by default.

A and B are required. Exact filtering: the Kalman filter (:mod:`operators.references.kalman`).
"""

from __future__ import annotations

import torch

from operators.models.base import identity, parse_cov, parse_matrix
from operators.models.linear_observation import LinearObservationFamily


class LDS(LinearObservationFamily):
    name = "lds"
    dynamic = True
    obs_matrix_name = "B"
    obs_cov_name = "R"
    param_specs = (
        ("A", parse_matrix, None),
        ("Q", parse_cov, identity()),
        ("B", parse_matrix, None),
        ("R", parse_cov, identity()),
    )

    def check(self) -> None:
        d = self.state_dim
        if tuple(self.params["A"].shape[1:]) != (d, d):
            raise ValueError(
                f"model.params.A: expected {d}x{d} (the prior's dimension), got {list(self.params['A'].shape[1:])}"
            )
        if tuple(self.params["Q"].shape[1:]) != (d, d):
            raise ValueError(
                f"model.params.Q: expected {d}x{d} (the prior's dimension), got {list(self.params['Q'].shape[1:])}"
            )
        super().check()

    def transition_affine(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        A = self.params["A"]
        return A, torch.zeros(A.shape[:2], dtype=A.dtype), self.params["Q"]

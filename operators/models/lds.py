"""``lds``: the linear dynamical system of the MPF paper (§5 LDS)

    x_m = A x_{m-1} + N(0, Q),    o_m = B x_m + N(0, R),     Q = I, R = I by default.

A and B are required. Exact filtering: the Kalman filter (:mod:`mpflow.operators.references.kalman`).
"""

from __future__ import annotations

from typing import Any

import torch
from mpflow.operators.models.base import ModelFamily, identity, parse_cov, parse_matrix, span
from mpflow.operators.models.linear_observation import LinearObservationFamily
from mpflow.operators.models.priors import GaussianMixture
from mpflow.operators.models.task_priors import task_prior, uniform
from mpflow.operators.rng import Generators, haar_orthogonal, randn

#: the spectral radius of the demonstration and benchmark transitions A (``example_params``, ``benchmark_params``)
EXAMPLE_A_SCALE = 0.9


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

    description = "x_m = A x_{m-1} + N(0, Q); o_m = B x_m + N(0, R)"
    observation_format = "vector of length k (the rows of B)"
    task_options = ("rho_range",)
    eval_steps = 25  # MPF §5 LDS
    eval_particles = (64, 256, 1024)
    benchmark_model = f"A = {EXAMPLE_A_SCALE}·Haar-orthogonal, B ~ N(0, 1) entries, Q = R = I (drawn per seed)"

    @classmethod
    def sample_task_models(
        cls, gens: Generators, d: int, dtype: torch.dtype, options: dict[str, Any]
    ) -> tuple[ModelFamily, GaussianMixture]:
        """MPF §5 LDS with a random pair per task: A = ρ·U, U a Haar rotation and ρ ~ U[ρ_lo, ρ_hi]
        (``rho_range``, default [0.7, 1.0]: every singular value of A is ρ, a stable or marginal rotation),
        B with N(0, 1) entries, Q = R = I; the task prior. Evaluation draws new pairs, unseen in training."""
        lo, hi = options.get("rho_range", (0.7, 1.0))
        rho = uniform(gens, [1], lo, hi, torch.float64)
        A = rho[:, :, None] * haar_orthogonal(gens, d, torch.float64)
        Bm = randn(gens, [d, d], torch.float64)
        params = [{"A": A[b].tolist(), "B": Bm[b].tolist()} for b in range(len(gens))]
        return cls._stack_params(params, d, dtype), task_prior(gens, d, dtype, options)

    @classmethod
    def task_domain(cls, options: dict[str, Any]) -> dict[str, list[float]]:
        """Every singular value of A in ``rho_range``, Q = R = I, and the task prior (B is drawn N(0, 1))."""
        lo, hi = options.get("rho_range", (0.7, 1.0))
        return {
            "A singular values": [float(lo), float(hi)],
            "Q variance": [1.0, 1.0],
            "R variance": [1.0, 1.0],
            **super().task_domain(options),
        }

    def domain_measures(self, prior_mean: torch.Tensor, prior_cov: torch.Tensor) -> dict[str, tuple[float, float]]:
        p = {k: self.params[k][0].to(torch.float64) for k in ("A", "Q", "R")}
        return {
            "A singular values": span(torch.linalg.svdvals(p["A"])),
            "Q variance": span(torch.linalg.eigvalsh(p["Q"])),
            "R variance": span(torch.linalg.eigvalsh(p["R"])),
            **super().domain_measures(prior_mean, prior_cov),
        }

    @classmethod
    def example_params(cls, d: int) -> dict[str, Any]:
        """A = 0.9 I, B = I."""
        return {"A": (EXAMPLE_A_SCALE * torch.eye(d)).tolist(), "B": torch.eye(d).tolist()}

    @classmethod
    def benchmark_params(cls, d: int, gen: torch.Generator) -> dict[str, Any]:
        """A = 0.9·U with U Haar-orthogonal (QR of a Gaussian matrix, signs fixed by diag R: every singular value
        0.9, a stable rotation), B with N(0, 1) entries; Q = R = I (the defaults)."""
        U = haar_orthogonal([gen], d)[0]
        B = torch.randn(d, d, generator=gen, dtype=torch.float64)
        return {"A": (EXAMPLE_A_SCALE * U).tolist(), "B": B.tolist()}

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

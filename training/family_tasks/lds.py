"""``lds``'s meta-training tasks, evaluation and benchmark settings (:class:`LDSTasks`)."""

from __future__ import annotations

from typing import Any

import torch
from mpflow.operators.models.base import ModelFamily
from mpflow.operators.models.lds import EXAMPLE_A_SCALE, LDS
from mpflow.operators.models.priors import GaussianMixture
from mpflow.operators.rng import Generators, haar_orthogonal, randn
from mpflow.training.task_distribution import FamilyTasks, register_tasks, stack_params
from mpflow.training.task_priors import task_prior, uniform


@register_tasks
class LDSTasks(FamilyTasks):
    family = LDS

    task_options = ("rho_range",)

    eval_steps = 25  # MPF §5 LDS

    eval_particles = (64, 256, 1024)

    benchmark_model = f"A = {EXAMPLE_A_SCALE}·Haar-orthogonal, B ~ N(0, 1) entries, Q = R = I (drawn per seed)"

    def sample_task_models(
        self, gens: Generators, d: int, dtype: torch.dtype, options: dict[str, Any]
    ) -> tuple[ModelFamily, GaussianMixture]:
        """MPF §5 LDS with a random pair per task: A = ρ·U, U a Haar rotation and ρ ~ U[ρ_lo, ρ_hi]
        (``rho_range``, default [0.7, 1.0]: every singular value of A is ρ, a stable or marginal rotation),
        B with N(0, 1) entries, Q = R = I; the task prior. Evaluation draws new pairs, unseen in training."""
        lo, hi = options.get("rho_range", (0.7, 1.0))
        rho = uniform(gens, [1], lo, hi, torch.float64)
        A = rho[:, :, None] * haar_orthogonal(gens, d, torch.float64)
        Bm = randn(gens, [d, d], torch.float64)
        params = [{"A": A[b].tolist(), "B": Bm[b].tolist()} for b in range(len(gens))]
        return stack_params(self.family, params, d, dtype), task_prior(gens, d, dtype, options)

    def benchmark_params(self, d: int, gen: torch.Generator) -> dict[str, Any]:
        """A = 0.9·U with U Haar-orthogonal (QR of a Gaussian matrix, signs fixed by diag R: every singular value
        0.9, a stable rotation), B with N(0, 1) entries; Q = R = I (the defaults)."""
        U = haar_orthogonal([gen], d)[0]
        B = torch.randn(d, d, generator=gen, dtype=torch.float64)
        return {"A": (EXAMPLE_A_SCALE * U).tolist(), "B": B.tolist()}

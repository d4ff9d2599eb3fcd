"""A family's likelihood raised to a power β ∈ (0, 1]: p(o | x)^β, for flows that split one Bayes update into
stages.

Bayes' rule with one observation factorises into K tempered stages,
    p(x | o) ∝ p(x) p(o | x) = p(x) Π_{k=1..K} p(o | x)^{1/K},
so a flow may condition on p(o | x)^{1/K} K times, re-fitting its Gaussian likelihood to the cloud before each
stage (progressive Bayesian update: Hanebeck, Briechle & Rauh 2003, "Progressive Bayes: a new framework for
nonlinear state estimation", SPIE 5099; in particle flows: the exact Daum–Huang flow is this with K → ∞ and a
re-linearisation at every λ). log p(o | x)^β = β log p(o | x), ∇ₓ = β ∇ₓ log p(o | x); for a linear-Gaussian
likelihood N(o; Hx, R)^β ∝ N(o; Hx, R/β), so the exact affine path stays exact.
"""

from __future__ import annotations

from typing import Any

import torch
from mpflow.operators.models.base import ModelFamily


class Tempered:
    """``model`` with its likelihood raised to ``beta`` (module docstring); everything else is ``model``'s."""

    def __init__(self, model: ModelFamily, beta: float):
        if not 0.0 < beta <= 1.0:
            raise ValueError(f"tempering: beta must be in (0, 1], got {beta}")
        self.model = model
        self.beta = beta

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def log_likelihood(self, obs: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.beta * self.model.log_likelihood(obs, x)

    def score(self, obs: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.beta * self.model.score(obs, x)

    def observation_affine(self) -> tuple[torch.Tensor, torch.Tensor]:
        H, R = self.model.observation_affine()
        return H, R / self.beta


def tempered(model: ModelFamily, stages: int) -> ModelFamily | Tempered:
    """``model`` itself for one stage, else its likelihood to the power 1/``stages``."""
    return model if stages == 1 else Tempered(model, 1.0 / stages)

"""The data an evaluation passes around (:mod:`mpflow.training.evaluate` builds them, :mod:`mpflow.training.eval_plots`
draws them; both import this module, neither imports the other's internals): the reference posterior
(:class:`Reference`), one method's per-step metrics (:class:`MethodRun`) and task-batch slicing."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from mpflow.operators import gaussian
from mpflow.operators.models.base import ModelFamily
from mpflow.operators.models.priors import GaussianMixture


def slice_model(model: ModelFamily, sl: slice) -> ModelFamily:
    """The streams ``sl`` of a batched model (a B = 1 model broadcasts to any batch: returned as is)."""
    if model.batch_size == 1:
        return model
    return type(model)({k: v[sl] for k, v in model.params.items()}, model.state_dim)


def slice_prior(prior: GaussianMixture, sl: slice) -> GaussianMixture:
    """The streams ``sl`` of a batched mixture prior."""
    return GaussianMixture(prior.weights[sl], prior.means[sl], prior.covs[sl])


@dataclass
class Reference:
    """The reference posterior of every task and step (float64): moments, samples, log p(o_t | o_<t)."""

    kind: str  # "kalman" | "importance" | "smc"
    means: torch.Tensor  # [B, T, d]
    covs: torch.Tensor  # [B, T, d, d]
    log_z: torch.Tensor  # [B, T]
    samples: torch.Tensor  # [B, T, M, d]
    particles: int | None = None  # particle count of a particle reference
    ess: torch.Tensor | None = None  # [B, T] its effective sample size
    mode_fraction: torch.Tensor | None = None  # [B, T, K] (families with posterior_modes: gmm)

    @property
    def exact(self) -> bool:
        return self.kind == "kalman"

    def entropy(self) -> torch.Tensor | None:
        """H(p_t) = ½ log|2πeΣ_t| [B, T] for Gaussian references (the cross-entropy's floor), else None."""
        if not self.exact:
            return None
        return gaussian.entropy(gaussian.cholesky(self.covs.flatten(0, 1))).unflatten(0, self.covs.shape[:2])


@dataclass
class MethodRun:
    """Per-step metrics of one method at one N: each value [T, B] (``var_ratio_per_dim`` [T, B, d],
    ``mode_fraction`` [T, B, K]), update times in ms [T], and particle snapshots of task 0."""

    method: str
    particles: int
    values: dict[str, torch.Tensor] = field(default_factory=dict)
    ms: list[float] = field(default_factory=list)
    snapshots: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    error: str | None = None


__all__ = ["MethodRun", "Reference", "slice_model", "slice_prior"]

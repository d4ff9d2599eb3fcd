"""Meta-training tasks for MPF (Chen, Dai & Song, §3.1 and Algorithm 1).

A task T = (π(x), p(· | x), O_M) is a prior, a likelihood (one stream of a model family) and an observation
sequence. :func:`sample_tasks` draws a batch of B tasks at once, each from its own torch.Generator
(:mod:`operators.rng`), so task b is the same whatever the batch around it:

* ``linear_gaussian`` (MPF §5.1): o ~ N(H x, R) with H = I, R = r I (r = 3 by default, as in the paper);
  the prior is N(μ, Σ) with μ ~ N(0, I) and Σ = Q diag(s) Qᵀ, log s_i ~ U[log s_lo, log s_hi]
  (default [0.5, 2]) and Q a Haar-random rotation; the true x is drawn from the prior.
* ``gmm`` (MPF §5.2): o ~ ½ N(x₁, 1) + ½ N(x₁ + x₂, 1) in R², prior N(0, scale² I) (scale = 1 by default)
  and the paper's true x = (1, −2) — or, with ``true_x="prior"``, a true x drawn from the prior.

Observations [B, T, *obs_shape] are simulated with the family's ``simulate``. The per-task generators are
returned with the task: the trainer draws the initial particles X_0 ~ π from them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from operators.models import make_model
from operators.models.base import ModelFamily
from operators.models.priors import GaussianMixture
from operators.rng import generator, haar_orthogonal, rand, randn

TASK_FAMILIES = ("linear_gaussian", "gmm")


@dataclass
class Tasks:
    """A batch of B tasks: model (B streams), prior, observations [B, T, ...], true states [B, d]."""

    model: ModelFamily
    prior: GaussianMixture
    obs: torch.Tensor
    x_true: torch.Tensor
    gens: list[torch.Generator]

    @property
    def batch_size(self) -> int:
        return self.obs.shape[0]

    @property
    def length(self) -> int:
        return self.obs.shape[1]


def _linear_gaussian_prior(
    gens: list[torch.Generator], d: int, dtype: torch.dtype, scale_range: tuple[float, float]
) -> GaussianMixture:
    lo, hi = scale_range
    if not 0 < lo <= hi:
        raise ValueError(f"scale_range: must satisfy 0 < lo <= hi, got {scale_range!r}")
    mean = randn(gens, [d], dtype)
    log_s = math.log(lo) + (math.log(hi) - math.log(lo)) * rand(gens, [d], dtype)
    Q = haar_orthogonal(gens, d, dtype)
    cov = Q @ torch.diag_embed(torch.exp(log_s)) @ Q.transpose(-1, -2)
    return GaussianMixture.gaussian(mean, 0.5 * (cov + cov.transpose(-1, -2)))


def sample_tasks(
    family: str,
    dim: int,
    batch: int,
    T: int,
    gen: torch.Generator,
    *,
    obs_var: float = 3.0,
    scale_range: tuple[float, float] = (0.5, 2.0),
    prior_scale: float = 1.0,
    true_x: str | tuple[float, ...] = "paper",
    dtype: torch.dtype = torch.float32,
) -> Tasks:
    """Draw ``batch`` tasks of ``T`` observations of ``family`` in dimension ``dim`` (module docstring).

    ``gen`` seeds one generator per task. ``obs_var``, ``scale_range``: linear_gaussian; ``prior_scale``,
    ``true_x`` ("paper" = (1, −2), "prior", or a point): gmm.
    """
    if family not in TASK_FAMILIES:
        raise ValueError(f"family: meta-training tasks exist for {list(TASK_FAMILIES)}, got {family!r}")
    for name, value in (("dim", dim), ("batch", batch), ("T", T)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: must be a positive integer, got {value!r}")
    seeds = torch.randint(0, 2**62, (batch,), generator=gen).tolist()
    gens = [generator(s) for s in seeds]
    if family == "linear_gaussian":
        if not obs_var > 0:
            raise ValueError(f"obs_var: must be positive, got {obs_var!r}")
        one = make_model(family, {"R": (obs_var * torch.eye(dim)).tolist()}, dim, dtype)
        prior = _linear_gaussian_prior(gens, dim, dtype, scale_range)
        x0 = prior.sample(1, gens)[:, 0]
    else:
        if dim != 2:
            raise ValueError(f"dim: the gmm family has a 2-dimensional state, got {dim}")
        if not prior_scale > 0:
            raise ValueError(f"prior_scale: must be positive, got {prior_scale!r}")
        one = make_model(family, None, dim, dtype)
        eye = torch.eye(dim, dtype=dtype).expand(batch, dim, dim)
        prior = GaussianMixture.gaussian(torch.zeros(batch, dim, dtype=dtype), prior_scale**2 * eye.clone())
        if true_x == "prior":
            x0 = prior.sample(1, gens)[:, 0]
        else:
            point = (1.0, -2.0) if true_x == "paper" else true_x
            if isinstance(point, str) or len(point) != dim:
                raise ValueError(f"true_x: must be 'paper', 'prior' or a point of length {dim}, got {true_x!r}")
            x0 = torch.tensor(point, dtype=dtype).expand(batch, dim).clone()
    model = type(one).stack([one] * batch)
    _, obs = model.simulate(T, x0, gens)
    return Tasks(model, prior, obs, x0, gens)

"""Meta-training tasks for MPF (Chen, Dai & Song, §3.1 and Algorithm 1).

A task T = (π(x), p(· | x), O_M) is a prior, a likelihood (one stream of a model family, with its own
parameters where the family has them) and an observation sequence. :func:`sample_tasks` draws a batch of B
tasks at once, each from its own torch.Generator (:mod:`mpflow.operators.rng`), so task b is the same whatever the
batch around it. Posteriors after k observations come in through sequence segmentation (eq. 21,
:mod:`mpflow.training.meta_train`).

Each family has a task distribution (:func:`mpflow.training.task_distribution.task_distribution`): its
``sample_task_models`` draws the B task models and priors (the built-ins' are :mod:`mpflow.training.family_tasks`,
documented there — ``linear_gaussian`` MPF §5.1, ``lds`` §5 LDS with a random
(A, B) per task, ``gmm`` §5.2, ``logistic`` §5.4, ``stochastic_volatility``), from the diverse priors of
:mod:`mpflow.training.task_priors` (random Gaussians, or Dirichlet-process Gaussian mixtures with
``prior="dpgmm"``). This module adds what every family shares: the true state x_0 (drawn from the prior, or
the family's ``paper_true_x`` — gmm's (1, −2) — or a given point) and the observations [B, T, *obs_shape],
simulated with the family's ``simulate``. The per-task generators are returned with the task: the trainer draws
the initial particles X_0 ~ π from them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from mpflow.operators.models import FAMILIES, ModelFamily
from mpflow.operators.models.priors import GaussianMixture
from mpflow.operators.rng import generator
from mpflow.training.task_distribution import task_distribution
from mpflow.training.task_priors import SHARED_TASK_OPTIONS, dp_mixture_prior, random_covariance

#: the families with a task distribution (:func:`task_distribution`): every family mpf runs, those with
#: a nonlinear transition (lorenz96: its predictive is fitted by ``predicted_moments``) and plugins included
TASK_FAMILIES = tuple(FAMILIES)
#: every task option: the shared prior options, then each family's own (accepted for every family, read by some)
TASK_OPTIONS = tuple(
    dict.fromkeys([*SHARED_TASK_OPTIONS, *(o for name in FAMILIES for o in task_distribution(name).task_options)])
)
#: family → its task-model sampler ``(gens, d, dtype, options) -> (model, prior)`` (kept for older callers)
BUILDERS = {name: task_distribution(name).sample_task_models for name in FAMILIES}


@dataclass
class Tasks:
    """A batch of B tasks: model (B streams), prior, observations [B, T, ...], true initial states [B, d] and the
    true states at the observations [B, T, d] (``states``: what a scoring-rule loss rates the clouds against; a
    static family's repeat x_true)."""

    model: ModelFamily
    prior: GaussianMixture
    obs: torch.Tensor
    x_true: torch.Tensor
    gens: list[torch.Generator]
    states: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.obs.shape[0]

    @property
    def length(self) -> int:
        return self.obs.shape[1]


def sample_tasks(
    family: str, dim: int, batch: int, T: int, gen: torch.Generator, *, dtype: torch.dtype = torch.float32, **options
) -> Tasks:
    """Draw ``batch`` tasks of ``T`` observations of ``family`` in dimension ``dim`` (module docstring).

    ``gen`` seeds one generator per task. ``options`` (see :data:`TASK_OPTIONS`): the shared ``scale_range``,
    ``prior`` ("gaussian" | "dpgmm", with ``dp_alpha``, ``dp_components``, ``dp_shrink``) and ``true_x``
    ("prior", "paper" = the family's ``paper_true_x``, or a point; the default is "paper" where the family has
    a paper point, else "prior"), and each family's own (``task_options``: ``obs_var`` linear_gaussian,
    ``rho_range`` lds, ``prior_scale`` gmm).
    """
    if family not in FAMILIES:
        raise ValueError(f"family: meta-training tasks exist for {list(TASK_FAMILIES)}, got {family!r}")
    cls = FAMILIES[family]
    unknown = sorted(set(options) - set(TASK_OPTIONS))
    if unknown:
        raise ValueError(f"task options: unknown {unknown}; allowed: {list(TASK_OPTIONS)}")
    for name, value in (("dim", dim), ("batch", batch), ("T", T)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: must be a positive integer, got {value!r}")
    if cls.fixed_state_dim is not None and dim != cls.fixed_state_dim:
        raise ValueError(f"dim: the {family} family has a {cls.fixed_state_dim}-dimensional state, got {dim}")
    seeds = torch.randint(0, 2**62, (batch,), generator=gen).tolist()
    gens = [generator(s) for s in seeds]
    tasks = task_distribution(family)
    model, prior = tasks.sample_task_models(gens, dim, dtype, options)
    true_x = options.get("true_x", "paper" if tasks.paper_true_x is not None else "prior")
    if true_x == "prior":
        x0 = prior.sample(1, gens)[:, 0]
    else:
        if true_x == "paper" and tasks.paper_true_x is None:
            raise ValueError(f"true_x: the {family} family has no paper point; use 'prior' or a point of length {dim}")
        point = tasks.paper_true_x if true_x == "paper" else true_x
        if isinstance(point, str) or len(point) != dim:
            raise ValueError(f"true_x: must be 'paper', 'prior' or a point of length {dim}, got {true_x!r}")
        x0 = torch.tensor(point, dtype=dtype).expand(batch, dim).clone()
    xs, obs = model.simulate(T, x0, gens)  # dynamic families: x0 ~ π is x_0, moved before the first observation
    return Tasks(model, prior, obs, x0, gens, xs)


__all__ = [
    "BUILDERS",
    "TASK_FAMILIES",
    "TASK_OPTIONS",
    "Tasks",
    "dp_mixture_prior",
    "random_covariance",
    "sample_tasks",
]

"""What meta-training, evaluation and the benchmarks need of a model family: its task distribution (MPF §3.1).

A family's class (:mod:`mpflow.operators.models`) is its probabilistic model; how tasks are drawn to train an
operator for it, how long an evaluation runs and which model a benchmark uses are the training side's, declared
by a :class:`TaskDistribution`:

* ``sample_task_models(gens, d, dtype, options)`` → (model, prior): B = len(gens) task models (one stream each,
  batched) and their priors, task b drawn from ``gens[b]`` only; ``options`` are the task options
  (:data:`mpflow.training.tasks.TASK_OPTIONS`): the family reads its own (``task_options``) and the shared prior
  options of :func:`mpflow.training.task_priors.task_prior`. The true state and the observations are drawn
  afterwards, by :func:`mpflow.training.tasks.sample_tasks`;
* ``paper_true_x``: the true state of the paper's experiment, a task's default ``true_x`` ("paper"); None: x ~ prior;
* ``eval_steps``, ``eval_particles``: ``mpflow evaluate``'s default sequence length T and particle counts N;
* ``benchmark_params(d, gen)`` (JSON parameters of a held-out benchmark model; {} = the family's defaults),
  ``benchmark_model`` (those in words) and ``latency_benchmark`` (one of ``benchmarks.mpf_latency``'s defaults).

The built-in families' distributions are classes of :mod:`mpflow.training.family_tasks`, one module per family,
each registered where it is defined (:func:`register_tasks`). A family without one — a plugin — gets
:class:`FamilyTasks`: the family's defaults and the task prior for every task, where any of the names above that
the family's own class defines (a plugin may implement the protocol in its one class) overrides the default.

The region a task distribution covers — what a trained operator has seen — stays with the family
(:meth:`ModelFamily.task_domain <mpflow.operators.models.base.ModelFamily.task_domain>`): the service checks
streams against it for operators whose config.json does not record it, and the service does not import training.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
from mpflow.operators.models import FAMILIES, ModelFamily
from mpflow.operators.models.priors import GaussianMixture
from mpflow.operators.rng import Generators
from mpflow.training.task_priors import task_prior


@runtime_checkable
class TaskDistribution(Protocol):
    """A family's meta-training tasks, evaluation and benchmark settings (module docstring)."""

    task_options: tuple[str, ...]
    paper_true_x: tuple[float, ...] | None
    eval_steps: int
    eval_particles: tuple[int, ...]
    benchmark_model: str
    latency_benchmark: bool

    def sample_task_models(
        self, gens: Generators, d: int, dtype: torch.dtype, options: dict[str, Any]
    ) -> tuple[ModelFamily, GaussianMixture]: ...

    def benchmark_params(self, d: int, gen: torch.Generator) -> dict[str, Any]: ...


#: the names of :class:`TaskDistribution`: a family's own class may define any of them (a plugin's one class)
PROTOCOL_NAMES = (
    "task_options",
    "paper_true_x",
    "eval_steps",
    "eval_particles",
    "benchmark_model",
    "latency_benchmark",
    "sample_task_models",
    "benchmark_params",
)


class FamilyTasks:
    """The default task distribution of ``family`` and the base of the built-ins' (module docstring): every task
    has the family's default parameters, the prior is :func:`task_prior`'s."""

    family: ClassVar[type[ModelFamily]]
    #: the task options this distribution reads besides ``task_priors.SHARED_TASK_OPTIONS``
    task_options: tuple[str, ...] = ()
    paper_true_x: tuple[float, ...] | None = None
    eval_steps: int = 20
    eval_particles: tuple[int, ...] = (256,)
    benchmark_model: str = "the family's default parameters"
    latency_benchmark: bool = True

    def __init__(self, family: type[ModelFamily] | None = None):
        if family is not None:
            self.family = family
        for name in PROTOCOL_NAMES:  # a plugin's own class implementing (part of) the protocol
            if hasattr(self.family, name):
                setattr(self, name, getattr(self.family, name))

    def sample_task_models(
        self, gens: Generators, d: int, dtype: torch.dtype, options: dict[str, Any]
    ) -> tuple[ModelFamily, GaussianMixture]:
        one = self.family.from_params(None, d, dtype)
        return self.family.stack([one] * len(gens)), task_prior(gens, d, dtype, options)

    def benchmark_params(self, d: int, gen: torch.Generator) -> dict[str, Any]:
        return {}


#: family name → the class of its task distribution (the built-ins', registered by :func:`register_tasks`)
REGISTERED: dict[str, type[FamilyTasks]] = {}


def register_tasks(tasks: type[FamilyTasks]) -> type[FamilyTasks]:
    """Class decorator: ``tasks`` is the task distribution of ``tasks.family``."""
    REGISTERED[tasks.family.name] = tasks
    return tasks


def task_distribution(family: str | type[ModelFamily]) -> TaskDistribution:
    """The task distribution of a family (a name of :data:`~mpflow.operators.models.FAMILIES`, or the class):
    its registered one (or that of the built-in family it subclasses), else :class:`FamilyTasks` over the family's
    own class."""
    import mpflow.training.family_tasks  # noqa: F401  (registers the built-ins)

    cls = FAMILIES[family] if isinstance(family, str) else family
    for base in cls.__mro__:  # a subclass of a built-in family under its own name keeps the built-in's tasks
        registered = REGISTERED.get(getattr(base, "name", ""))
        if registered is not None and registered.family is base:
            return registered(cls)
    return FamilyTasks(cls)


def stack_params(family: type[ModelFamily], params: list[dict[str, Any]], d: int, dtype: torch.dtype) -> ModelFamily:
    """Validate one parameter dict per task and batch them into one model of ``family``."""
    return family.stack([family.from_params(p, d, dtype) for p in params])


__all__ = ["FamilyTasks", "TaskDistribution", "register_tasks", "stack_params", "task_distribution"]

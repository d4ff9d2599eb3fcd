"""A family's task distribution lives on the training side (mpflow.training.task_distribution): every built-in has
its registered one, a family without one gets the defaults, and a plugin may implement the protocol in its own one
class; a subclass of a built-in under another name keeps the built-in's tasks."""

from __future__ import annotations

import torch
from mpflow.operators.models import FAMILIES
from mpflow.operators.models.base import ModelFamily
from mpflow.operators.models.linear_gaussian import LinearGaussian
from mpflow.operators.models.plugins import CATALOGUE_ORDER
from mpflow.operators.rng import generator
from mpflow.training.family_tasks.linear_gaussian import LinearGaussianTasks
from mpflow.training.task_distribution import (
    PROTOCOL_NAMES,
    REGISTERED,
    FamilyTasks,
    TaskDistribution,
    task_distribution,
)
from mpflow.training.task_priors import task_prior


def test_every_built_in_family_has_its_registered_distribution_and_no_family_class_carries_one():
    assert sorted(REGISTERED) == sorted(CATALOGUE_ORDER)
    for name in CATALOGUE_ORDER:
        tasks = task_distribution(name)
        assert type(tasks) is REGISTERED[name] and tasks.family is FAMILIES[name]
        assert isinstance(tasks, TaskDistribution)
        assert not any(hasattr(FAMILIES[name], n) for n in PROTOCOL_NAMES), name  # the model is its maths
    assert not any(hasattr(ModelFamily, n) for n in PROTOCOL_NAMES)


def test_a_family_without_one_gets_the_defaults():
    class Counts(LinearGaussian):
        name = "counts_without_tasks"

    class Bare(ModelFamily):
        name = "bare"

    tasks = task_distribution(Bare)
    assert type(tasks) is FamilyTasks and tasks.family is Bare
    assert (tasks.eval_steps, tasks.eval_particles, tasks.task_options, tasks.paper_true_x) == (20, (256,), (), None)
    assert tasks.benchmark_params(2, generator(0)) == {} and tasks.latency_benchmark
    # a subclass of a built-in under its own name keeps the built-in's distribution, for itself
    sub = task_distribution(Counts)
    assert type(sub) is LinearGaussianTasks and sub.family is Counts
    model, prior = sub.sample_task_models([generator(0), generator(1)], 2, torch.float64, {"obs_var": 2.0})
    assert type(model) is Counts and torch.allclose(model.params["R"], 2.0 * torch.eye(2, dtype=torch.float64))


def test_a_plugin_implements_the_protocol_in_its_one_class():
    calls = []

    class Plugin(LinearGaussian):
        name = "plugin_with_tasks"
        eval_steps = 7
        task_options = ("spread",)

        @classmethod
        def sample_task_models(cls, gens, d, dtype, options):
            calls.append(options)
            one = cls.from_params({"R": (options["spread"] * torch.eye(d)).tolist()}, d, dtype)
            return cls.stack([one] * len(gens)), task_prior(gens, d, dtype, {})

    tasks = task_distribution(Plugin)
    assert tasks.eval_steps == 7 and tasks.task_options == ("spread",) and tasks.eval_particles == (256,)
    model, _ = tasks.sample_task_models([generator(0)], 2, torch.float64, {"spread": 5.0})
    assert calls == [{"spread": 5.0}] and float(model.params["R"][0, 0, 0]) == 5.0

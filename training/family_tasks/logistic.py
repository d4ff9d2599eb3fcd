"""``logistic``'s meta-training tasks, evaluation and benchmark settings (:class:`LogisticTasks`)."""

from __future__ import annotations

from mpflow.operators.models.logistic import Logistic
from mpflow.training.task_distribution import FamilyTasks, register_tasks


@register_tasks
class LogisticTasks(FamilyTasks):
    """MPF §5.4, synthetic: the default distribution — every task the same (parameter-free) model, the task prior;
    ``Logistic.simulate`` draws minibatches of 32 rows a ~ N(0, I_d), y ~ Bernoulli(σ(wᵀa))."""

    family = Logistic
    eval_steps = 20
    benchmark_model = "no parameters; minibatches of 32 rows a ~ N(0, I_d)"
    # not among the latency benchmark's defaults: the shipped operator is d = 10, the benchmark's d is 2
    latency_benchmark = False

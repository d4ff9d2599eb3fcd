"""Meta-training task distributions (MPF §3.1): every family draws valid batched tasks, task b does not depend
on the batch around it, lds pairs (A, B) differ per task, DP-mixture priors are proper mixtures, and bad
options are refused by name."""

from __future__ import annotations

import pytest
import torch
from mpflow.operators.rng import generator
from mpflow.operators.trained_operators import outside_domain
from mpflow.training.tasks import TASK_FAMILIES, sample_tasks

DIMS = {"gmm": 2, "logistic": 4, "range_bearing": 4, "lorenz96": 6}


@pytest.mark.parametrize("family", TASK_FAMILIES)
def test_tasks_are_valid_and_independent_of_the_batch(family):
    d = DIMS.get(family, 3)
    many = sample_tasks(family, d, 4, 3, generator(0))
    assert many.obs.shape[:2] == (4, 3) and many.x_true.shape == (4, d)
    assert bool(torch.isfinite(many.obs).all())
    assert many.model.batch_size == 4 and many.prior.dim == d
    x = many.prior.sample(8, many.gens)
    assert many.model.log_likelihood(many.obs[:, 0], x).shape == (4, 8)
    # the same seed stream, a batch of one: task 0 is the same task
    one = sample_tasks(family, d, 1, 3, generator(0))
    assert torch.equal(one.obs[0], many.obs[0]) and torch.equal(one.x_true[0], many.x_true[0])


def test_lds_tasks_draw_their_own_stable_dynamics():
    tasks = sample_tasks("lds", 2, 3, 2, generator(1))
    A = tasks.model.params["A"]
    assert not torch.allclose(A[0], A[1])
    radius = torch.linalg.svdvals(A.double())  # ρ·rotation: all singular values ρ ∈ [0.7, 1.0]
    assert bool((radius >= 0.7 - 1e-5).all() and (radius <= 1.0 + 1e-5).all())


def test_dp_mixture_priors_are_normalised_mixtures():
    tasks = sample_tasks("linear_gaussian", 2, 5, 2, generator(2), prior="dpgmm", dp_components=4)
    w = tasks.prior.weights
    assert w.shape == (5, 4) and torch.allclose(w.sum(1), torch.ones(5)) and bool((w > 0).all())
    assert bool((torch.linalg.eigvalsh(tasks.prior.covs) > 0).all())


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"bogus": 1}, "task options"), ({"prior": "wishart"}, "prior"), ({"obs_var": -1.0}, "obs_var")],
)
def test_bad_task_options_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        sample_tasks("linear_gaussian", 2, 2, 2, generator(0), **kwargs)


def test_gmm_needs_two_dimensions():
    with pytest.raises(ValueError, match="dim"):
        sample_tasks("gmm", 3, 2, 2, generator(0))


def test_lorenz96_tasks_start_near_the_attractor_inside_their_domain():
    """A task's prior is centred on a spun-up state (within the attractor's range), R in its range, and the
    domain the operator records holds every task drawn."""
    from mpflow.operators.models.lorenz96 import ATTRACTOR_RANGE, TASK_R_RANGE, Lorenz96

    tasks = sample_tasks("lorenz96", 10, 6, 2, generator(3))
    R = tasks.model.params["R"]
    lo, hi = TASK_R_RANGE
    assert bool(((R - lo >= 0) & (hi - R >= 0)).all()) and len(set(R.tolist())) == 6
    mean, cov = tasks.prior.moments()
    assert float(mean.std()) > 2.0  # spread over the attractor, not around 0 or F
    assert ATTRACTOR_RANGE[0] < float(mean.min()) and float(mean.max()) < ATTRACTOR_RANGE[1]
    domain = Lorenz96.task_domain({})
    for b in range(6):
        one = tasks.model.select(torch.tensor([b]))
        assert outside_domain(one, domain, mean[b], cov[b]) == []


def test_lorenz96_arctan_tasks_observe_through_the_bounded_sensor_and_say_so_in_their_domain():
    """``arctan``, ``R_range`` and ``Q`` set every task's sensor, noise range and model noise; the domain recorded for
    the operator says arctan 1 (so an arctan stream is inside it, a linear one outside), and the default draw is
    unchanged by the new options (``lorenz96-d10-v1``'s command still reproduces it)."""
    from mpflow.operators.models import make_model
    from mpflow.operators.models.lorenz96 import Lorenz96

    options = {"arctan": 1, "R_range": [0.02, 0.1], "Q": 0.05}
    tasks = sample_tasks("lorenz96", 10, 5, 3, generator(4), **options)
    p = tasks.model.params
    assert p["arctan"].tolist() == [1.0] * 5 and torch.allclose(p["Q"], torch.full((5,), 0.05))
    assert bool(((p["R"] >= 0.02) & (p["R"] <= 0.1)).all())
    assert float(tasks.obs.abs().max()) < torch.pi / 2 + 5 * 0.1**0.5  # arctan's range plus the noise
    domain = Lorenz96.task_domain(options)
    assert domain["arctan"] == [1.0, 1.0] and domain["R"] == [0.02, 0.1]
    mean, cov = tasks.prior.moments()
    assert outside_domain(tasks.model.select(torch.tensor([0])), domain, mean[0], cov[0]) == []
    linear = make_model("lorenz96", {"R": 0.05}, 10)
    assert any("arctan" in why for why in outside_domain(linear, domain, mean[0], cov[0]))
    assert sample_tasks("lorenz96", 10, 5, 3, generator(4), Q=0.0, arctan=0).obs.allclose(
        sample_tasks("lorenz96", 10, 5, 3, generator(4)).obs
    )


def test_stochastic_volatility_tasks_cover_the_ranges_asked_for():
    """``mu_range``, ``phi_range``, ``sigma_range`` (σ log-uniform: a range over decades) set the task distribution and
    the domain recorded for the operator; without them the draw is the one ``stochastic_volatility-d2-v1`` saw (its
    README's command must still reproduce it); a bad range is refused naming the option."""
    from mpflow.operators.models import FAMILIES

    options = {"mu_range": [-3.0, 3.0], "phi_range": [0.5, 0.995], "sigma_range": [0.05, 1.0]}
    tasks = sample_tasks("stochastic_volatility", 1, 512, 3, generator(4), **options)
    mu, phi, sigma = (tasks.model.params[k][:, 0] for k in ("mu", "phi", "sigma"))
    assert -3 <= float(mu.min()) < -2.5 and 2.5 < float(mu.max()) <= 3
    assert float(phi.min()) >= 0.5 and float(phi.max()) <= 0.995
    assert 0.05 <= float(sigma.min()) < 0.07 and 0.8 < float(sigma.max()) <= 1.0
    assert 0.15 < float(sigma.median()) < 0.3  # log-uniform: the geometric mean, 0.22, not the midpoint
    domain = FAMILIES["stochastic_volatility"].task_domain(options)
    assert (domain["phi"], domain["sigma"]) == ([0.5, 0.995], [0.05, 1.0])
    default = sample_tasks("stochastic_volatility", 2, 256, 3, generator(4))
    assert float(default.model.params["sigma"].min()) >= 0.2 and float(default.model.params["phi"].max()) <= 0.98
    assert 0.4 < float(default.model.params["mu"].std()) < 0.6  # N(0, 0.5²)
    for bad, field in (({"phi_range": [0.5, 1.0]}, "phi_range"), ({"sigma_range": [0.0, 1.0]}, "sigma_range")):
        with pytest.raises(ValueError, match=rf"task options\.{field}"):
            sample_tasks("stochastic_volatility", 1, 2, 3, generator(0), **bad)
    for bad in ([1.0, -1.0], 0.5, "ab", [0.1, "x"], [0.1, 0.2, 0.3]):
        with pytest.raises(ValueError, match=r"task options\.mu_range: a range"):
            sample_tasks("stochastic_volatility", 1, 2, 3, generator(0), mu_range=bad)

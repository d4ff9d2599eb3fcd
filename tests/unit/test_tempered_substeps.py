"""``mpf``'s ``substeps``: K tempered stages p(o | x)^{1/K} per observation (mpflow.operators.models.tempered)."""

from __future__ import annotations

import pytest
import torch
from mpflow.operators import gaussian
from mpflow.operators.metrics import mean_error_sd
from mpflow.operators.models import make_model
from mpflow.operators.models.priors import GaussianMixture
from mpflow.operators.models.tempered import Tempered, tempered
from mpflow.operators.references import kalman_filter
from mpflow.operators.references.grid import diagonal_grid_filter
from mpflow.operators.rng import generator
from mpflow.operators.updaters import get_updater


def test_tempering_scales_the_likelihood_and_keeps_the_rest() -> None:
    model = make_model("linear_gaussian", {}, 2)
    obs, x = torch.randn(1, 2), torch.randn(1, 5, 2)
    quarter = tempered(model, 4)
    assert isinstance(quarter, Tempered) and tempered(model, 1) is model
    assert torch.allclose(quarter.log_likelihood(obs, x), 0.25 * model.log_likelihood(obs, x))
    assert torch.allclose(quarter.score(obs, x), 0.25 * model.score(obs, x))
    assert torch.allclose(quarter.observation_affine()[1], 4 * model.observation_affine()[1])
    assert quarter.state_dim == 2 and quarter.linear_gaussian
    with pytest.raises(ValueError, match="beta"):
        Tempered(model, 0.0)


def _run(method: str, model, obs, prior, **options) -> list[torch.Tensor]:
    up = get_updater(method, **options)
    B = obs.shape[0]
    state = up.init(prior, model, 256, list(range(B)))
    means = []
    for t in range(obs.shape[1]):
        state, _ = up.update(state, obs[:, t], model)
        means.append(gaussian.moments(state.particles.double())[0])
    return means


def test_stages_stay_exact_on_a_linear_gaussian_model() -> None:
    model = make_model("linear_gaussian", {}, 2)
    batch = type(model).stack([model] * 3)
    _, obs = batch.simulate(5, torch.zeros(3, 2), [generator(i) for i in range(3)])
    prior = GaussianMixture.gaussian(torch.zeros(3, 2), torch.eye(2).expand(3, 2, 2))
    km, kc, _ = kalman_filter(torch.zeros(3, 2), torch.eye(2).expand(3, 2, 2), batch, obs)
    for t, mean in enumerate(_run("mpf", batch, obs, prior, substeps=4)):
        assert float(mean_error_sd(mean, km[:, t], kc[:, t]).max()) < 1e-4


def test_stages_shrink_the_base_flow_error_on_stochastic_volatility() -> None:
    model = make_model("stochastic_volatility", {}, 3)
    batch = type(model).stack([model] * 8)
    gens = [generator(100 + i) for i in range(8)]
    _, obs = batch.simulate(10, torch.zeros(8, 3), gens)
    prior = GaussianMixture.gaussian(torch.zeros(8, 3), torch.eye(3).expand(8, 3, 3))
    gm, gc = diagonal_grid_filter(model, torch.zeros(3), torch.ones(3), obs, points=400)

    def error(**options) -> float:
        means = _run("mpf", batch, obs, prior, **options)
        return sum(float(mean_error_sd(m, gm[:, t], gc[:, t]).mean()) for t, m in enumerate(means)) / len(means)

    one, four = error(), error(substeps=4)
    assert four < 0.8 * one, (one, four)


@pytest.mark.parametrize("bad", [0, 65, 2.5, True, "4"])
def test_substeps_must_be_a_small_positive_integer(bad) -> None:
    with pytest.raises(ValueError, match="substeps"):
        get_updater("mpf", substeps=bad)

"""``mpf``'s ``substeps``: K tempered stages p(o | x)^{1/K} per observation (mpflow.operators.models.tempered)."""

from __future__ import annotations

import pytest
import torch
from mpflow.operators import gaussian
from mpflow.operators.accuracy import mean_error_sd
from mpflow.operators.filtering import run_filter
from mpflow.operators.models import make_model
from mpflow.operators.models.priors import GaussianMixture
from mpflow.operators.models.tempered import Tempered, tempered
from mpflow.operators.mpf.health import flow_ess
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


#: the mechanisms below (stages, health, re-staging) are those of Stein's single fit at the prior, whose error on a
#: curved likelihood they exist to shrink; the default fit (re-fitted at the posterior) leaves them little to do
STEIN = {"linearisation": "stein"}


def _run(method: str, model, obs, prior, **options) -> torch.Tensor:
    """The posterior means [T, B, d] of ``method`` with 256 particles, one stream per row of ``obs``."""
    return run_filter(get_updater(method, **options), model, prior, obs, 256, list(range(obs.shape[0]))).means


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
        means = _run("mpf", batch, obs, prior, **STEIN, marginal=False, **options)  # the flow's own stages
        return sum(float(mean_error_sd(m, gm[:, t], gc[:, t]).mean()) for t, m in enumerate(means)) / len(means)

    one, four = error(), error(substeps=4)
    assert four < 0.8 * one, (one, four)


@pytest.mark.parametrize("bad", [0, 65, 2.5, True, "4"])
def test_substeps_must_be_a_small_positive_integer(bad) -> None:
    with pytest.raises(ValueError, match="substeps"):
        get_updater("mpf", substeps=bad)


# ---------------------------------------------------------------------------------------------- health and correction
def _logistic(streams: int, d: int = 6):
    model = make_model("logistic", {}, d)
    gens = [generator(40 + i) for i in range(streams)]
    x0 = torch.stack([2.0 * torch.randn(d, generator=g) for g in gens])  # sharp likelihoods: a curved first step
    _, obs = type(model).stack([model] * streams).simulate(3, x0, gens)
    prior = GaussianMixture.gaussian(torch.zeros(streams, d), torch.eye(d).expand(streams, d, d))
    return model, obs, prior


def _first_step(model, obs, prior, **options):
    up = get_updater("mpf", **STEIN, **options)
    state = up.init(prior, model, 256, list(range(obs.shape[0])))
    return up.update(state, obs[:, 0], model)


def test_the_flow_health_is_n_where_the_step_is_exact_and_lower_where_it_is_not() -> None:
    lg = make_model("linear_gaussian", {}, 2)
    batch = type(lg).stack([lg] * 3)
    _, obs = batch.simulate(2, torch.zeros(3, 2), [generator(i) for i in range(3)])
    prior = GaussianMixture.gaussian(torch.zeros(3, 2), torch.eye(2).expand(3, 2, 2))
    state, info = _first_step(batch, obs, prior)
    assert torch.equal(info.ess, torch.full((3,), 256.0, dtype=torch.float64))  # exact: reported, not computed
    # ... and indeed exact: the weights that would correct the closed-form flow are uniform
    start = get_updater("mpf").init(prior, batch, 256, list(range(3)))
    ess = flow_ess(batch, obs[:, 0], gaussian.whiten(start.particles.double()), state.particles)
    assert torch.allclose(ess, torch.full((3,), 256.0, dtype=torch.float64), rtol=1e-4)
    model, obs, prior = _logistic(4)
    _, one = _first_step(model, obs, prior)
    _, eight = _first_step(model, obs, prior, substeps=8)
    assert float(one.ess.min()) < 200  # a curved likelihood: the single Gaussian fit is off
    assert bool((eight.ess > one.ess).all())  # more stages, a healthier step


def test_a_low_ess_triggers_more_stages_for_that_stream_only() -> None:
    model, obs, prior = _logistic(4)
    plain, plain_info = _first_step(model, obs, prior)
    fixed, _ = _first_step(model, obs, prior, substeps=16)
    corrected, info = _first_step(model, obs, prior, max_substeps=16, ess_threshold=0.5)
    low = plain_info.ess < 0.5 * 256
    assert bool(low.any()) and not bool(low.all()), plain_info.ess  # the test needs both kinds of stream
    for b in range(4):
        if low[b]:
            assert float(info.ess[b]) > float(plain_info.ess[b])
            assert not torch.equal(corrected.particles[b], plain.particles[b])
        else:  # healthy streams keep their one-stage step
            assert torch.equal(corrected.particles[b], plain.particles[b])
    # alone or batched, a stream's result is the same
    alone, _ = _first_step(model, obs[:1], GaussianMixture(prior.weights[:1], prior.means[:1], prior.covs[:1]),
                           max_substeps=16, ess_threshold=0.5)  # fmt: skip
    assert torch.allclose(alone.particles[0], corrected.particles[0], atol=1e-5)
    assert fixed.particles.shape == corrected.particles.shape


@pytest.mark.parametrize(
    ("options", "field"),
    [({"substeps": 4, "max_substeps": 2}, "max_substeps"), ({"ess_threshold": 1.5}, "ess_threshold")],
)
def test_correction_options_are_checked(options, field) -> None:
    with pytest.raises(ValueError, match=field):
        get_updater("mpf", **options)

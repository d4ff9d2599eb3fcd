"""``mpf``'s ``flow_fraction`` γ < 1 with ``correct``: the flow takes γ of a linear observation's likelihood and
importance weights the rest (the ensemble Kalman particle filter; mpflow.operators.mpf.kalman_particle)."""

from __future__ import annotations

import math

import pytest
import torch
from mpflow.operators.models import make_model
from mpflow.operators.models.priors import GaussianMixture
from mpflow.operators.references import kalman_filter
from mpflow.operators.rng import generator
from mpflow.operators.updaters import get_updater

N = 20000


def _one_step(prior: GaussianMixture, obs: torch.Tensor, **options) -> torch.Tensor:
    """The cloud [B, N, 1] after one step of linear_gaussian (d = 1, o = x + N(0, 1)) from ``prior``."""
    model = make_model("linear_gaussian", {"H": [[1.0]], "R": [[1.0]]}, 1)
    batch = type(model).stack([model] * prior.batch_size)
    u = get_updater("mpf", correct=True, rejuvenate="never", **options)
    state = u.init(prior, batch, N, seed=list(range(prior.batch_size)))
    state, info = u.update(state, obs, batch)
    assert float(info.ess.min()) > 0.3 * N
    return state.particles.double()


def test_a_gaussian_prior_gets_the_kalman_posterior_at_any_fraction() -> None:
    """With a Gaussian predictive every γ is exact: the mixture of step 1 is the tempered posterior, step 2 its
    exact update; the cloud's moments are Kalman's up to Monte Carlo noise."""
    prior = GaussianMixture.gaussian(torch.zeros(1, 1), 2.0 * torch.ones(1, 1, 1))
    obs = torch.tensor([[1.7]])
    # conjugate: precision 1/2 + 1, mean (1.7) / (1.5)
    exact_mean, exact_var = 1.7 / 1.5, 1 / 1.5
    for gamma in (0.2, 0.5, 0.9):
        x = _one_step(prior, obs, flow_fraction=gamma)
        assert abs(float(x.mean()) - exact_mean) < 0.03, gamma
        assert abs(float(x.var()) / exact_var - 1) < 0.05, gamma


def test_the_weights_carry_what_the_gaussian_fit_misses() -> None:
    """A bimodal prior ½ N(−2, 0.5²) + ½ N(2, 0.5²) observed at o = 1 (R = 1): the posterior mean is 1.67 (the right
    mode has 96 % of the mass). The whole likelihood by the flow (γ = 1, the exact update of the prior's Gaussian
    fit) gives 0.81; the smaller γ, the more of the likelihood the weights take and the closer the mean comes —
    slowly here, because the fit's variance (4.25) makes even a small share's Kalman move and kernel wide."""
    prior = GaussianMixture(torch.tensor([[0.5, 0.5]]), torch.tensor([[[-2.0], [2.0]]]), torch.full((1, 2, 1, 1), 0.25))
    obs = torch.tensor([[1.0]])
    right = 1.0 / (1.0 + math.exp(-3.2))  # each mode's evidence N(1; ±2, 0.25 + 1): log ratio 3.2
    exact = right * 1.8 - (1 - right) * 1.4  # the modes' posterior means (4·(±2) + 1) / 5
    errors = [abs(float(_one_step(prior, obs, flow_fraction=g).mean()) - exact) for g in (1.0, 0.25, 0.05)]
    assert errors[0] > errors[1] + 0.02 > errors[2] + 0.2, errors  # measured 0.86, 0.84, 0.55


def test_lorenz96_partial_observation_and_inflation() -> None:
    """Bocquet 2010's Lorenz-96 (d = 10, every other variable, R = 1.5) with a gap in the observation: the step
    runs, the gap's variable moves only through its correlations, and the filter tracks the truth."""
    model = make_model("lorenz96", {"R": 1.5, "obs_every": 2}, 10)
    batch = type(model).stack([model] * 2)
    gens = [generator(b) for b in range(2)]
    x0 = 8.0 + torch.stack([torch.randn(10, generator=g, dtype=torch.float64) for g in gens])
    for _ in range(500):
        x0 = batch.transition_mean(x0[:, None])[:, 0]
    xs, obs = batch.simulate(60, x0, gens)
    obs = obs.float()
    obs[:, 30, 1] = float("nan")
    prior = GaussianMixture.gaussian(x0.float(), torch.eye(10).expand(2, 10, 10))
    u = get_updater("mpf", correct=True, flow_fraction=0.5, inflation=1.01)
    state = u.init(prior, batch.to(torch.float32), 400, seed=[0, 1])
    errors = []
    for t in range(60):
        state, info = u.update(state, obs[:, t], batch.to(torch.float32))
        assert torch.isfinite(state.particles).all() and float(info.ess.min()) > 1
        errors.append(float((state.particles.double().mean(1) - xs[:, t]).pow(2).mean().sqrt()))
    assert sum(errors[20:]) / 40 < 0.6  # Bocquet's bootstrap filter: 0.29 at N = 800; obs noise sd 1.22


def test_flow_fraction_is_checked_and_refused_where_it_cannot_run() -> None:
    assert "flow_fraction" in get_updater("mpf").stream_options
    for bad in (0, 1.5, "half", True):
        with pytest.raises(ValueError, match=r"options\.flow_fraction"):
            get_updater("mpf", correct=True, flow_fraction=bad)
    with pytest.raises(ValueError, match=r"options\.flow_fraction: .*correct"):
        get_updater("mpf", flow_fraction=0.5)
    u = get_updater("mpf", correct=True, flow_fraction=0.5)
    with pytest.raises(ValueError, match=r"options\.flow_fraction: .*linear observation"):
        u.check_compatible(make_model("range_bearing", {}, 4))
    with pytest.raises(ValueError, match=r"options\.flow_fraction"):
        u.check_compatible(make_model("lorenz96", {"arctan": True}, 10))
    u.check_compatible(make_model("lorenz96", {}, 10))


def test_kalman_filter_reference_agrees_on_a_linear_dynamic_model() -> None:
    """lds (a Gaussian predictive at every step): the split filter follows Kalman's means over a sequence."""
    lds = {"A": [[0.9, -0.2], [0.2, 0.9]], "Q": [[0.3, 0.0], [0.0, 0.3]], "B": [[1.0, 0.0]], "R": [[0.5]]}
    model = make_model("lds", lds, 2)
    batch = type(model).stack([model] * 4)
    _, obs = batch.simulate(8, torch.zeros(4, 2), [generator(10 + b) for b in range(4)])
    km, kc, _ = kalman_filter(torch.zeros(4, 2), torch.eye(2).expand(4, 2, 2), batch, obs)
    u = get_updater("mpf", correct=True, flow_fraction=0.4)
    prior = GaussianMixture.gaussian(torch.zeros(4, 2), torch.eye(2).expand(4, 2, 2))
    state = u.init(prior, batch, 4096, seed=list(range(4)))
    for t in range(8):
        state, _ = u.update(state, obs[:, t], batch)
        err = state.particles.double().mean(1) - km[:, t]
        sd = kc[:, t].diagonal(0, -2, -1).sqrt()
        assert float((err / sd).abs().max()) < 0.15, t

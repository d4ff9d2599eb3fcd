"""Predictive p-values (``info.extras["pit"]``) and the flow's Gaussian-fit evidence against closed forms: the
Kalman predictive's Φ, Monte Carlo draws of the predictive, the exact Kalman increments at an outlier, and the 1-D
quadrature of a Gaussian predictive."""

import math

import pytest
import torch
from mpflow.operators import evidence
from mpflow.operators.models import make_model
from mpflow.operators.models.priors import GaussianMixture
from mpflow.operators.references import kalman_filter
from mpflow.operators.rng import generator
from mpflow.operators.updaters import get_updater

LDS = {
    "A": [[0.9, 0.1], [0.0, 0.8]],
    "Q": [[0.3, 0.0], [0.0, 0.2]],
    "B": [[1.0, 0.0], [0.0, 1.0]],
    "R": [[0.5, 0.0], [0.0, 0.4]],
}


def _prior(mean, var):
    d = len(mean)
    return GaussianMixture.gaussian(
        torch.tensor([mean], dtype=torch.float64), torch.eye(d, dtype=torch.float64)[None] * var
    )


def test_kalman_pit_is_the_closed_form_and_smc_agrees_by_monte_carlo():
    model = make_model("lds", LDS, 2)
    prior = _prior([0.0, 0.5], 1.0)
    obs = torch.tensor([[1.2, -0.7]])
    kal = get_updater("kalman")
    _, info = kal.update(kal.init(prior, model, 16, 0), obs, model)
    F, Q, R = (torch.tensor(LDS[k], dtype=torch.float64) for k in ("A", "Q", "R"))
    m = F @ torch.tensor([0.0, 0.5], dtype=torch.float64)
    S = F @ F.T + Q + R
    exact = torch.special.ndtr((obs[0].double() - m) / S.diagonal().sqrt())
    torch.testing.assert_close(info.extras["pit"][0], exact, atol=1e-6, rtol=0)
    smc = get_updater("smc")
    _, info = smc.update(smc.init(prior, model, 20000, 1), obs, model)
    assert (info.extras["pit"][0] - exact).abs().max() < 0.01  # 20000 draws: sd ≈ 0.0035


def test_stochastic_volatility_pit_against_draws_of_its_predictive():
    model = make_model("stochastic_volatility", {"mu": -1.0, "phi": 0.95, "sigma": 0.3}, 1)
    prior = _prior([-1.0], 0.4)
    obs = torch.tensor([[1.1]])
    smc = get_updater("smc")
    _, info = smc.update(smc.init(prior, model, 4096, 2), obs, model)
    g = generator(5)  # o = e^{x/2} ξ with x ~ the predictive N(−1, 0.95² 0.4 + 0.3²)
    x = -1.0 + math.sqrt(0.95**2 * 0.4 + 0.09) * torch.randn(200000, generator=g, dtype=torch.float64)
    draws = torch.exp(0.5 * x) * torch.randn(200000, generator=g, dtype=torch.float64)
    assert abs(float(info.extras["pit"][0, 0]) - float((draws <= 1.1).double().mean())) < 0.015


def test_logistic_pit_is_randomised_and_uniform_under_the_model():
    model = make_model("logistic", {}, 2)
    g = generator(3)
    w = torch.tensor([1.0, -0.5], dtype=torch.float64)
    up = get_updater("smc")
    state = up.init(_prior([1.0, -0.5], 1e-6), model, 64, 0)  # the predictive is Bernoulli(σ(wᵀa)) itself
    a = torch.randn(1, 400, 2, generator=g, dtype=torch.float64)
    y = (torch.rand(1, 400, generator=g, dtype=torch.float64) < torch.sigmoid(a @ w)).double()
    _, info = up.update(state, torch.cat([a, y[..., None]], -1), model)
    pit = info.extras["pit"][0]
    assert pit.shape == (400,) and float(pit.min()) > 0 and float(pit.max()) < 1
    counts = torch.histc(pit, bins=4, min=0, max=1)  # uniform: 100 per quarter, sd ≈ 8.7
    assert (counts - 100).abs().max() < 35


@pytest.mark.parametrize("options", [{}, {"correct": True}])
def test_flow_evidence_is_the_kalman_increment_at_an_outlier(options):
    model = make_model("lds", LDS, 2)
    prior = _prior([0.0, 0.5], 1.0)
    obs = torch.tensor([[[0.3, 0.1], [0.5, -0.2], [9.0, 0.3], [0.2, 0.0]]])  # step 3: a ~10 sd outlier
    _, _, logz = kalman_filter(prior.means[:, 0], prior.covs[:, 0], model, obs.double())
    up = get_updater("mpf", **options)
    state = up.init(prior, model, 256, 0)
    for t in range(obs.shape[1]):
        state, info = up.update(state, obs[:, t], model)
        assert abs(float(info.log_evidence_increment[0]) - float(logz[0, t])) < 1e-3, t


def test_gaussian_fit_quadrature_matches_a_fine_grid():
    model = make_model("stochastic_volatility", {"mu": -1.0, "phi": 0.95, "sigma": 0.3}, 2)
    mean = torch.tensor([[-1.0, -0.5]], dtype=torch.float64)
    cov = torch.diag(torch.tensor([0.2, 0.5], dtype=torch.float64))[None]
    obs = torch.tensor([[2.5, -0.1]], dtype=torch.float64)
    got = evidence.gaussian_fit(model, obs, mean, cov)
    x = torch.linspace(-8, 6, 20001, dtype=torch.float64)
    total = 0.0
    for j in range(2):
        log_n = -0.5 * (x - mean[0, j]) ** 2 / cov[0, j, j] - 0.5 * torch.log(2 * math.pi * cov[0, j, j])
        ll = -0.5 * (math.log(2 * math.pi) + x + obs[0, j] ** 2 * torch.exp(-x))
        total += float(torch.logsumexp(log_n + ll, 0) + torch.log(x[1] - x[0]))
    assert abs(float(got[0]) - total) < 1e-6

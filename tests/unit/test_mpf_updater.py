"""The MPF updater pipeline with the untrained (zero-residual) network: the exact Daum–Huang filter, which
must track the Kalman posterior — particles and their tracked log-density — on linear-Gaussian models."""

import pytest
import torch

from operators import gaussian
from operators.models import make_model
from operators.models.priors import prior_from_spec
from operators.references import kalman_filter
from operators.rng import generator
from operators.updaters.mpf import MPFUpdater

PRIOR2 = {"type": "gaussian", "mean": [0.0, 0.0], "cov": [[1.0, 0.0], [0.0, 1.0]]}


@pytest.mark.parametrize(
    ("family", "params"),
    [("linear_gaussian", {}), ("lds", {"A": [[0.9, 0.2], [-0.1, 0.9]], "B": [[1.0, 0.0], [0.5, 1.0]]})],
)
def test_untrained_mpf_is_the_exact_daum_huang_filter(family, params):
    model = make_model(family, params, 2)
    _, obs = model.simulate(20, torch.tensor([[1.0, -1.0]]), [generator(3)])
    means, covs, logz = kalman_filter(torch.zeros(1, 2), torch.eye(2)[None], model, obs)
    up = MPFUpdater(steps=4, track_density=True)
    state = up.init(prior_from_spec(PRIOR2, 2), model, 256, 0)
    for t in range(20):
        state, info = up.update(state, obs[:, t], model)
        m, C = gaussian.moments(state.particles.double())
        sd = covs[0, t].diagonal().sqrt()
        assert float(((m[0] - means[0, t]) / sd).abs().max()) < 0.02, t
        assert float((C[0].diagonal() / covs[0, t].diagonal() - 1).abs().max()) < 0.03, t
    if family == "linear_gaussian":  # static: the tracked log q (eq. 8) is the exact posterior density
        exact = gaussian.log_prob(state.particles.double(), means[:, -1], torch.linalg.cholesky(covs[:, -1]))
        assert float((state.log_density.double() - exact).abs().max()) < 0.05
    assert abs(float(state.log_evidence[0] - logz.sum())) < 1.0


def test_non_gaussian_likelihood_runs_and_stays_finite():
    model = make_model("stochastic_volatility", {}, 2)
    _, obs = model.simulate(10, torch.zeros(1, 2), [generator(5)])
    up = MPFUpdater(track_density=True)
    state = up.init(prior_from_spec(PRIOR2, 2), model, 128, 0)
    for t in range(10):
        state, _ = up.update(state, obs[:, t], model)
    assert bool(torch.isfinite(state.particles).all()) and bool(torch.isfinite(state.log_density).all())


def test_network_option_is_validated():
    with pytest.raises(ValueError, match=r"^options\.network"):
        MPFUpdater(network="lds-d2-v1")

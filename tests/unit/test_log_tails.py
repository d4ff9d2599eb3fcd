"""Non-saturating predictive log tails (``info.extras["log_tail_lower"]``/``["log_tail_upper"]``, issue 56):

* Gaussian path (``kalman``): log Φ(±z) by ``log_ndtr`` equals scipy's ``norm.logcdf``/``norm.logsf`` at z = 40,
  where the p-value has saturated at exactly 1.0;
* particle path: the log-sum-exp over the weighted particles equals a float64 reference, and for a family with
  additive Gaussian noise it does not saturate either; a family with only a CDF falls back to log F, log(1 − F);
* the log tails are the log of the p-value and of its complement wherever the p-value has not saturated — the
  same predicted cloud, for every kind of method (``smc``, ``smc2``'s θ-mixture, ``ienkf``, the flows) — and the
  overrides of ``stochastic_volatility`` and ``gmm`` agree with their CDFs.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from mpflow.operators import evidence
from mpflow.operators.models import make_model
from mpflow.operators.models.base import saturating_log_tails
from mpflow.operators.models.priors import GaussianMixture
from mpflow.operators.rng import generator
from mpflow.operators.updaters import get_updater
from scipy.special import logsumexp
from scipy.stats import norm

LDS1 = {"A": [[0.5]], "Q": [[0.1]], "B": [[1.0]], "R": [[1.0]]}


def _prior(mean, var):
    d = len(mean)
    return GaussianMixture.gaussian(
        torch.tensor([mean], dtype=torch.float64), torch.eye(d, dtype=torch.float64)[None] * var
    )


def test_gaussian_log_tails_match_scipy_at_40_sd_where_pit_saturates():
    z = torch.tensor([[40.0, -40.0, 0.3, -8.5]], dtype=torch.float64)
    mean, cov = torch.zeros(1, 4, dtype=torch.float64), torch.eye(4, dtype=torch.float64)[None]
    lower, upper = evidence.gaussian_log_tails(z, mean, cov)
    np.testing.assert_allclose(lower[0].numpy(), norm.logcdf(z[0].numpy()), rtol=1e-12)
    np.testing.assert_allclose(upper[0].numpy(), norm.logsf(z[0].numpy()), rtol=1e-12)
    assert float(evidence.gaussian_pit(z, mean, cov)[0, 0]) == 1.0  # what the log tails are for


def test_kalman_step_reports_the_closed_form_log_tails_of_a_40_sd_reading():
    model, kal = make_model("lds", LDS1, 1), get_updater("kalman")
    state = kal.init(_prior([0.0], 1.0), model, 16, 0)
    S = 0.25 * 1.0 + 0.1 + 1.0  # A P Aᵀ + Q + R
    o = 40.0 * math.sqrt(S)
    _, info = kal.update(state, torch.tensor([[o]]), model)
    z = o / math.sqrt(S)
    assert float(info.extras["pit"][0, 0]) == 1.0
    assert float(info.extras["log_tail_upper"][0, 0]) == pytest.approx(norm.logsf(z), rel=1e-6)
    assert float(info.extras["log_tail_lower"][0, 0]) == pytest.approx(norm.logcdf(z), abs=1e-12)


def test_particle_log_tails_equal_a_float64_logsumexp_reference():
    g = generator(3)
    lw = torch.randn(2, 50, generator=g, dtype=torch.float64) * 3
    lower = -torch.rand(2, 50, 3, generator=g, dtype=torch.float64) * 900  # down to e^-900: below float64's range
    upper = -torch.rand(2, 50, 3, generator=g, dtype=torch.float64) * 5
    got_lo, got_up = evidence.particle_log_tails(lower, upper, lw.float())
    w = lw.float().double().numpy()
    w = w - logsumexp(w, axis=1, keepdims=True)
    np.testing.assert_allclose(got_lo.numpy(), logsumexp(w[..., None] + lower.numpy(), axis=1), rtol=1e-10)
    np.testing.assert_allclose(got_up.numpy(), logsumexp(w[..., None] + upper.numpy(), axis=1), rtol=1e-10)
    uniform_lo, _ = evidence.particle_log_tails(lower, upper, None)
    np.testing.assert_allclose(uniform_lo.numpy(), logsumexp(lower.numpy(), axis=1) - math.log(50), rtol=1e-10)
    assert bool(torch.isfinite(got_lo).all())  # every F_i underflows to 0 in linear space


@pytest.mark.parametrize("method", ["smc", "enkf", "gpf", "ienkf", "ukf"])
def test_log_tails_are_the_log_of_pit_and_do_not_saturate(method):
    model, up = make_model("lds", LDS1, 1), get_updater(method)
    state = up.init(_prior([0.0], 1.0), model, 256, 1)
    state, info = up.update(state, torch.tensor([[0.7]]), model)
    pit = info.extras["pit"].double()
    torch.testing.assert_close(info.extras["log_tail_lower"].exp(), pit, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(info.extras["log_tail_upper"].exp(), 1 - pit, rtol=1e-9, atol=1e-12)
    _, info = up.update(state, torch.tensor([[60.0]]), model)  # ~ 50 predictive sd
    assert float(info.extras["pit"][0, 0]) == 1.0
    upper = float(info.extras["log_tail_upper"][0, 0])
    assert math.isfinite(upper) and upper < -500


def test_log_tails_are_nan_where_not_observed_and_absent_rows_too():
    model, up = make_model("lds", {"A": np.eye(2).tolist(), "B": np.eye(2).tolist()}, 2), get_updater("smc")
    state = up.init(_prior([0.0, 0.0], 1.0), model.select(torch.tensor([0])), 64, 0)
    _, info = up.update(state, torch.tensor([[0.3, math.nan]]), model)
    for key in ("pit", "log_tail_lower", "log_tail_upper"):
        assert math.isnan(float(info.extras[key][0, 1])) and not math.isnan(float(info.extras[key][0, 0]))


def test_smc2_mixes_the_log_tails_over_theta_in_log_space():
    eye = [[1.0]]
    model = make_model(
        "lds", {"A": eye, "B": eye, "Q": [[0.01]], "R": {"prior": {"type": "lognormal", "mean": -4.6, "sd": 0.1}}}, 1
    )
    up = get_updater("smc2")
    state = up.init(GaussianMixture.gaussian(torch.zeros(1, 1), 0.01 * torch.eye(1)[None]), model, 256, 0)
    tails = up.predictive(state, torch.tensor([[0.05]]), model)
    torch.testing.assert_close(tails["log_tail_lower"].exp(), tails["pit"], rtol=1e-9, atol=1e-12)
    far = up.predictive(state, torch.tensor([[30.0]]), model)  # ~ 200 sd
    assert float(far["pit"][0, 0]) == 1.0 and float(far["log_tail_upper"][0, 0]) < -1000


@pytest.mark.parametrize(
    ("family", "params", "d", "obs"),
    [
        ("stochastic_volatility", {"mu": -1.0, "phi": 0.95, "sigma": 0.3}, 1, [[1.1]]),
        ("gmm", {"s": 1.0}, 2, [[0.4]]),
    ],
)
def test_family_log_tail_overrides_agree_with_their_cdf(family, params, d, obs):
    model = make_model(family, params, d)
    x = torch.randn(1, 32, d, generator=generator(0), dtype=torch.float64)
    o = torch.tensor(obs, dtype=torch.float64)
    cdf = model.observation_cdf(o, x, [generator(1)])
    lower, upper = model.observation_log_tails(o, x, [generator(1)])
    torch.testing.assert_close(lower.exp(), cdf, rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(upper.exp(), 1 - cdf, rtol=1e-9, atol=1e-14)
    far = torch.full_like(o, 1e4)
    lower, upper = model.observation_log_tails(far, x, [generator(1)])
    assert bool(torch.isfinite(upper).all()) and float(upper.max()) < -100


def test_the_fallback_of_a_cdf_only_family_is_clamped():
    cdf = torch.tensor([0.0, 0.3, 1.0], dtype=torch.float64)
    lower, upper = saturating_log_tails(cdf)
    assert bool(torch.isfinite(lower).all()) and bool(torch.isfinite(upper).all())
    assert float(lower[1]) == pytest.approx(math.log(0.3)) and float(upper[1]) == pytest.approx(math.log(0.7))
    model = make_model("logistic", {}, 2)
    obs = model.sample_observation(torch.zeros(1, 2), [generator(0)])
    x = torch.randn(1, 8, 2, generator=generator(1))
    cdf = model.observation_cdf(obs, x, [generator(2)])
    lower, upper = model.observation_log_tails(obs, x, [generator(3)], cdf=cdf)  # the caller's CDF: no new draw
    torch.testing.assert_close(lower.exp(), cdf, rtol=1e-12, atol=1e-300)

"""``smc2``'s predictive p-values are those of its own predictive, the mixture over the θ-particles (docs/methods.md
eq. P7), not the family's default parameters:

* Kalman filters per θ (``lds`` with R learned, a tight prior around R = 0.01): each entry's p-value is
  Σ_j ω̄_j Φ((o − m_j⁻) / √(P_j⁻ + R_j)) computed here in numpy from the state's θ_j, ω_j, m_j, P_j — at step 0 and
  after steps that made the weights unequal —, NaN for an entry not observed, and the update's own p-value is the
  same number. Under R = 1 (the family's default, what the method answered before) an observation 3 predictive sd
  above the mean got about 0.7; the exact answer is 0.9987.
* Particle filters per θ (a two-component prior): the same mixture within Monte Carlo error.
* The cost model prices the Kalman algebra of every θ.
* Calibration: on a well-specified stream the p-values are uniform by Kolmogorov–Smirnov; under a wrong fixed R they
  are not (``benchmarks/params.py --ks`` at length).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from mpflow.operators.models import make_model
from mpflow.operators.models.priors import GaussianMixture
from mpflow.operators.updaters import get_updater
from scipy.stats import kstest, norm

from tests.unit.test_smc2 import GAUSS1, A, lds_model, simulate

Q, P0, R_MEDIAN = 0.01, 0.01, 0.01
R_PRIOR = {"prior": {"type": "lognormal", "mean": math.log(R_MEDIAN), "sd": 0.1}}


def lds(d: int):
    eye = np.eye(d).tolist()
    return make_model("lds", {"A": eye, "B": eye, "Q": (Q * np.eye(d)).tolist(), "R": R_PRIOR}, d)


def exact_pit(state, obs: np.ndarray) -> np.ndarray:
    """Σ_j ω̄_j Φ((o − m_j⁻) / √(P_j⁻ + R_j)) per entry (A = B = I, Q = 0.01 I, R_j I): the Kalman predictive of each
    θ-particle's filter, mixed by the θ-weights."""
    w = torch.softmax(state.extras["param_log_weights"][0].double(), -1).numpy()  # [M]
    r = state.extras["param.R"][0].double().numpy()  # [M]
    m = state.extras["theta_mean"][0].double().numpy()  # [M, d]
    var = np.diagonal(state.extras["theta_cov"][0].double().numpy(), axis1=1, axis2=2) + Q  # [M, d]: P⁻
    return (w[:, None] * norm.cdf((obs[None] - m) / np.sqrt(var + r[:, None]))).sum(0)


def test_the_p_value_is_the_mixture_over_theta_of_each_kalman_predictive():
    model, updater = lds(2), get_updater("smc2")
    prior = GaussianMixture.gaussian(torch.zeros(1, 2), P0 * torch.eye(2)[None])
    state = updater.init(prior, model, 512, 0)
    sd = math.sqrt(P0 + Q + R_MEDIAN)
    first = np.array([3 * sd, -0.1])
    got = updater.pit(state, torch.tensor([first.tolist()]), model)[0].numpy()
    np.testing.assert_allclose(got, exact_pit(state, first), rtol=0, atol=1e-7)  # o read in float32
    assert got[0] > 0.998  # the learned R's: under R = 1 it was Φ(0.52 / √1.02) ≈ 0.70
    for o in ([0.2, -0.1], [0.35, 0.05], [0.1, 0.2]):  # the θ-weights move away from uniform
        state, _ = updater.update(state, torch.tensor([o]), model)
    w = torch.softmax(state.extras["param_log_weights"][0].double(), -1)
    assert float(w.max() / w.min()) > 1.05
    o = np.array([0.4, math.nan])
    new, info = updater.update(state, torch.tensor([o.tolist()], dtype=torch.float32), model)
    got = info.extras["pit"][0].numpy()
    assert math.isnan(got[1])
    np.testing.assert_allclose(got[0], exact_pit(state, np.array([0.4, 0.0]))[0], rtol=0, atol=1e-6)
    np.testing.assert_allclose(updater.pit(state, torch.tensor([o.tolist()]), model)[0].numpy(), got, atol=1e-12)


def test_particle_filters_per_theta_mix_their_predictive_cdfs():
    model, updater = lds(1), get_updater("smc2")
    two = GaussianMixture(torch.tensor([[0.5, 0.5]]), torch.zeros(1, 2, 1), P0 * torch.ones(1, 2, 1, 1))
    state = updater.init(two, model, 4096, 1)
    assert "theta_mean" not in state.extras  # a bootstrap filter of N_x particles per θ (64 × 64)
    w = torch.softmax(state.extras["param_log_weights"][0].double(), -1).numpy()
    r = state.extras["param.R"][0].double().numpy()
    o = 3 * math.sqrt(P0 + Q + R_MEDIAN)
    exact = float((w * norm.cdf(o / np.sqrt(P0 + Q + r))).sum())
    _, info = updater.update(state, torch.tensor([[o]]), model)
    assert abs(float(info.extras["pit"][0, 0]) - exact) < 0.005, (float(info.extras["pit"][0, 0]), exact)


@pytest.mark.parametrize("d", [8, 32])
def test_the_p_values_price_the_kalman_algebra_of_every_theta(d):
    model, n = lds(d), 1024
    smc2 = get_updater("smc2")
    own = n * smc2.KALMAN_PIT_FACTOR * (4 * d**3 + 4 * d**3)
    assert smc2.pit_work(model, n).flops >= get_updater("smc").pit_work(model, n).flops + own


def test_p_values_pass_ks():
    """Calibration, and the test's power: over 300 steps of the well-specified lds R case (R = 2 learned from a
    lognormal(0, 1) prior) the predictive p-values after a burn-in of 20 are U(0, 1) by Kolmogorov–Smirnov
    (p > 0.01); the same data under a wrong fixed R = 0.2 (a predictive too narrow) fail it (p < 0.01)."""
    ys = simulate(7, 320)
    wrong = make_model("lds", {"A": [[A]], "B": [[1.0]], "Q": [[1.0]], "R": [[0.2]]}, 1)
    p_values = {}
    for name, model in (("learned R", lds_model()), ("wrong fixed R", wrong)):
        updater = get_updater("smc2", theta_particles=128)
        state = updater.init(GAUSS1, model, 128, 0)
        ps = []
        for y in ys:
            obs = torch.tensor([[y]], dtype=torch.float32)
            ps.append(float(updater.pit(state, obs, model)[0, 0]))
            state, _ = updater.update(state, obs, model)
        p_values[name] = kstest(ps[20:], "uniform").pvalue
    assert p_values["learned R"] > 0.01, p_values
    assert p_values["wrong fixed R"] < 0.01, p_values

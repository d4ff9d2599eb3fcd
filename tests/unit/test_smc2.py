"""``smc2`` (unknown static parameters learned online) against references computed here in plain numpy.

* A linear-Gaussian stream with R unknown (log R ~ N(0, 1)), 200 observations: the posterior mean and sd of R within
  0.1 posterior sd and 15 % of a grid posterior from exact Kalman likelihoods.
* Priors are parsed by the family's parameter specs: bad ones refused naming the field and the fix.
* Streams batched together get what each gets alone (θ-particles, inner filters, rejuvenation draws; up to float64
  rounding), and the state
  keeps its size as it steps.
* The forecast moves each (θ, x) pair under its own θ: on ``lds`` d = 1 with Q and R learned and two known θ,
  each θ's pairs have the closed-form mean and variance at every horizon, and so has the whole predictive, within
  Monte Carlo error; the same generator gives the same forecast, and it draws once a horizon whatever N.
* The forecast's observation predictive observes each pair under its own θ: each θ's observations have x's mean
  and x's variance + R_j at horizons 1–3 (and the whole predictive the mixture's), within Monte Carlo error, drawn in
  one call a horizon; the same generator gives the same; every family's N-row model draws the numbers its one-row
  model draws for the same N states.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from mpflow.operators.models import make_model
from mpflow.operators.models.priors import GaussianMixture
from mpflow.operators.rng import generator
from mpflow.operators.state import ParticleState
from mpflow.operators.updaters import get_updater

LOGNORMAL = {"prior": {"type": "lognormal", "mean": 0.0, "sd": 1.0}}
A, Q, R_TRUE, T = 0.9, 1.0, 2.0, 200


def simulate(seed: int, n: int = T) -> np.ndarray:
    """n observations of x_m = A x_{m-1} + N(0, Q), o_m = x_m + N(0, R_TRUE), from x_0 = 0."""
    rng = np.random.default_rng(seed)
    x, ys = 0.0, []
    for _ in range(n):
        x = A * x + math.sqrt(Q) * rng.standard_normal()
        ys.append(x + math.sqrt(R_TRUE) * rng.standard_normal())
    return np.array(ys)


def kalman_loglik(ys: np.ndarray, r: np.ndarray, m0: float = 0.0, p0: float = 1.0) -> np.ndarray:
    """log p(o_1:T | R = r) of the model of :func:`simulate` for each r, by the exact Kalman filter from
    x_0 ~ N(m0, p0)."""
    m, P, ll = np.full_like(r, m0), np.full_like(r, p0), np.zeros_like(r)
    for y in ys:
        m, P = A * m, A * A * P + Q
        S = P + r
        ll += -0.5 * (np.log(2 * np.pi * S) + (y - m) ** 2 / S)
        K = P / S
        m, P = m + K * (y - m), (1 - K) * P
    return ll


def theta_moments(state, name: str = "R") -> tuple[float, float]:
    """The weighted mean and sd of a ``smc2`` state's θ-particles of parameter ``name`` (stream 0)."""
    w = torch.softmax(state.extras["param_log_weights"][0], -1)
    theta = state.extras[f"param.{name}"][0]
    mean = float((w * theta).sum())
    return mean, float((w * (theta - mean) ** 2).sum().sqrt())


def grid_posterior(ys: np.ndarray) -> tuple[float, float]:
    """Mean and sd of R | o_1:T: exact Kalman log-likelihoods (x_0 ~ N(0, 1)) on 4000 log-spaced points in
    [0.02, 50], times the lognormal(0, 1) density, with the grid's measure dR ∝ R."""
    r = np.exp(np.linspace(math.log(0.02), math.log(50.0), 4000))
    ll = kalman_loglik(ys, r)
    lp = ll - 0.5 * np.log(r) ** 2 - np.log(r) + np.log(r)
    w = np.exp(lp - lp.max())
    w /= w.sum()
    mean = float((w * r).sum())
    return mean, float(math.sqrt((w * (r - mean) ** 2).sum()))


def lds_model():
    return make_model("lds", {"A": [[A]], "B": [[1.0]], "Q": [[Q]], "R": LOGNORMAL}, 1)


GAUSS1 = GaussianMixture.gaussian(torch.zeros(1, 1), torch.eye(1)[None])


def test_R_posterior_matches_a_grid_of_exact_kalman_likelihoods():
    ys = simulate(1)
    ref_mean, ref_sd = grid_posterior(ys)
    model = lds_model()
    updater = get_updater("smc2")
    state = updater.init(GAUSS1, model, 1024, 5)
    for y in ys:
        state, _ = updater.update(state, torch.tensor([[y]], dtype=torch.float32), model)
    mean, sd = theta_moments(state)
    assert abs(mean - ref_mean) <= 0.1 * ref_sd, (mean, ref_mean, ref_sd)
    assert abs(sd - ref_sd) <= 0.15 * ref_sd, (sd, ref_sd)
    assert ref_sd < 0.5 * math.sqrt((math.e - 1) * math.e)  # the data taught something: the prior's sd is 2.16


BAD = {
    "unknown type": ({"R": {"prior": {"type": "beta", "a": 1}}}, "model.params.R.prior.type"),
    "missing sd": ({"R": {"prior": {"type": "lognormal", "mean": 0}}}, "takes exactly mean, sd"),
    "zero sd": ({"R": {"prior": {"type": "lognormal", "mean": 0, "sd": 0}}}, "model.params.R.prior.sd"),
    "normal variance": ({"R": {"prior": {"type": "normal", "mean": 1, "sd": 1}}}, "use a lognormal prior"),
    "uniform below 0": ({"R": {"prior": {"type": "uniform", "low": -1, "high": 1}}}, "outside the parameter's domain"),
    "matrix": ({"A": {"prior": {"type": "normal", "mean": 0, "sd": 1}}}, "model.params.A: a prior may stand"),
    "extra key": ({"R": {"prior": {"type": "normal", "mean": 0, "sd": 1}, "x": 1}}, "model.params.R"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_priors_are_refused_naming_the_field_and_the_fix(case):
    params, says = BAD[case]
    with pytest.raises(ValueError) as refused:
        make_model("lds", {"A": [[A]], "B": [[1.0]], **params}, 1)
    assert says in str(refused.value)


def test_sv_phi_must_stay_stationary_and_sigma_positive():
    with pytest.raises(ValueError, match=r"model\.params\.phi\.prior"):
        make_model("stochastic_volatility", {"phi": {"prior": {"type": "uniform", "low": 0.5, "high": 1.5}}}, 1)
    with pytest.raises(ValueError, match=r"model\.params\.sigma\.prior"):
        make_model("stochastic_volatility", {"sigma": {"prior": {"type": "normal", "mean": 0.3, "sd": 0.1}}}, 1)


def test_covariance_priors_are_read_as_r_times_identity():
    model = make_model("linear_gaussian", {"H": [[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], "R": LOGNORMAL}, 2)
    per_theta = model.at_values({"R": torch.tensor([0.5, 3.0])}, 2)
    assert torch.equal(per_theta.params["R"][1], 3.0 * torch.eye(3))
    assert per_theta.params["H"].shape == (2, 3, 2)


@pytest.mark.parametrize("family", ["lds", "stochastic_volatility"])
def test_batched_streams_get_what_each_gets_alone(family):
    if family == "lds":
        model, n = lds_model(), 64
        obs = [[[0.5], [1.5]], [[-1.0], [2.0]], [[float("nan")], [0.2]]]
    else:
        sv = {"phi": {"prior": {"type": "uniform", "low": 0.5, "high": 0.99}}, "sigma": LOGNORMAL}
        model, n = make_model("stochastic_volatility", sv, 1), 64
        obs = [[[0.5], [3.0]], [[-4.0], [0.1]], [[float("nan")], [2.5]]]
    updater = get_updater("smc2", ess_threshold=0.9)  # rejuvenate often, so the batch mixes moving and still rows
    states = [updater.init(GAUSS1, model, n, s) for s in (1, 2)]
    alone = []
    for b, state in enumerate(states):
        for o in obs:
            state, _ = updater.update(state, torch.tensor([o[b]]), model)
        alone.append(state)
    batched = ParticleState.stack(states)
    stacked = type(model).stack([model, model])
    for o in obs:
        batched, _ = updater.update(batched, torch.tensor(o), stacked)
    for b, state in enumerate(alone):
        for name, t in state.fields().items():
            # equal up to float64 rounding (a reduction over a batch may add in another order)
            torch.testing.assert_close(t, batched.fields()[name][b : b + 1], rtol=1e-9, atol=1e-12, msg=name)


def test_the_state_keeps_its_size_as_it_steps():
    model = lds_model()
    updater = get_updater("smc2")
    state = updater.init(GAUSS1, model, 256, 0)
    size = len(state.to_bytes())
    for y in simulate(0)[:50]:
        state, _ = updater.update(state, torch.tensor([[y]], dtype=torch.float32), model)
    assert len(state.to_bytes()) == size


def test_the_catalogue_says_which_parameters_may_be_priors():
    from mpflow.service.engine import catalogue

    fams = {f["family"]: {p["name"]: p["learnable"] for p in f["parameters"]} for f in catalogue.models(8)}
    assert fams["lds"]["R"] and fams["lds"]["Q"] and not fams["lds"]["A"] and not fams["lds"]["B"]
    assert fams["stochastic_volatility"] == {"mu": True, "phi": True, "sigma": True}
    assert fams["lorenz96"]["F"] and not fams["lorenz96"]["delta"] and not fams["lorenz96"]["obs_every"]
    assert "smc2" not in {m for f in catalogue.models(8) for m in f["methods"]}


#: the forecast's test: two θ-particles, (Q, R) = (0.5, 0.3) and (3, 2) (the unit Q and R are 1), of N_x = 8192
#: pairs each, x₀ ~ N(1.5, 0.4)
FORECAST_Q, FORECAST_R, FORECAST_NX, X0_MEAN, X0_VAR, HORIZONS = (0.5, 3.0), (0.3, 2.0), 8192, 1.5, 0.4, 6


def forecast_state() -> tuple:
    """An ``smc2`` state of ``lds`` d = 1 (A = 0.9, H = 1, Q and R learned) at known θ: θ-particle j holds (Q_j, R_j)
    and its N_x pairs' states x₀ ~ N(1.5, 0.4), drawn here; all weights equal."""
    model = make_model("lds", {"A": [[A]], "B": [[1.0]], "Q": LOGNORMAL, "R": LOGNORMAL}, 1)
    updater = get_updater("smc2", theta_particles=len(FORECAST_Q))
    n = len(FORECAST_Q) * FORECAST_NX
    state = updater.init(GAUSS1, model, n, 0)
    x0 = X0_MEAN + math.sqrt(X0_VAR) * torch.randn(1, n, 1, generator=generator(2026))
    extras = {
        **state.extras,
        "param.Q": torch.tensor([FORECAST_Q], dtype=torch.float64),
        "param.R": torch.tensor([FORECAST_R], dtype=torch.float64),
    }
    state = state.replace(particles=x0.to(state.particles.dtype), log_weights=torch.zeros(1, n), extras=extras)
    return updater, model, state


def closed_form(q: float, k: int) -> tuple[float, float]:
    """Mean and variance of x_k of x_m = A x_{m−1} + N(0, q) from x₀ ~ N(1.5, 0.4)."""
    return A**k * X0_MEAN, A ** (2 * k) * X0_VAR + q * sum(A ** (2 * i) for i in range(k))


def assert_closed_form(cloud, mean, cov, noise: tuple[float, ...]) -> None:
    """Each θ's draws at horizon k (cloud [k, N], θ-particle j's N_x consecutive) have the closed form's mean and
    variance plus noise[j] (0: the state; R_j: its observation), and the whole predictive's mean [k] and variance
    [k] are the equal mixture's, within 4 standard errors."""
    cloud = cloud.reshape(cloud.shape[0], len(FORECAST_Q), FORECAST_NX)  # [k, θ, pairs]
    for k in range(1, cloud.shape[0] + 1):
        v = []
        for j, (q, r) in enumerate(zip(FORECAST_Q, noise, strict=True)):
            m, var = closed_form(q, k)
            var += r
            v.append(var)
            x = cloud[k - 1, j]
            # 4 standard errors: of the mean √(var / N_x), of the variance var √(2 / N_x) (Gaussian)
            assert abs(float(x.mean()) - m) < 4 * math.sqrt(var / FORECAST_NX), (k, q, r, float(x.mean()), m)
            assert abs(float(x.var()) - var) < 4 * var * math.sqrt(2 / FORECAST_NX), (k, q, r, float(x.var()), var)
        # the whole predictive: the equal mixture of the two θ's Gaussians (same mean, the mean of the variances)
        # (a scale mixture: the variance's standard error from its fourth moment, 3 × the mean of var_j²)
        n, mixture_var = len(v) * FORECAST_NX, sum(v) / len(v)
        se_var = math.sqrt((3 * sum(u * u for u in v) / len(v) - mixture_var**2) / n)
        assert abs(float(mean[k - 1]) - closed_form(0.0, k)[0]) < 4 * math.sqrt(mixture_var / n)
        assert abs(float(cov[k - 1]) - mixture_var) < 4 * se_var


def test_the_forecast_moves_each_pair_under_its_own_theta():
    updater, model, state = forecast_state()
    p = updater.forecast(state, model, HORIZONS, generator(3))
    assert_closed_form(p.state_cloud[..., 0], p.state_mean[:, 0], p.state_cov[:, 0, 0], (0.0,) * len(FORECAST_Q))


def test_the_forecast_is_reproducible_and_draws_once_a_horizon(monkeypatch):
    from mpflow.operators import rng

    updater, model, state = forecast_state()
    first = updater.forecast(state, model, 3, generator(3))
    assert torch.equal(first.state_cloud, updater.forecast(state, model, 3, generator(3)).state_cloud)
    assert not torch.equal(first.state_cloud, updater.forecast(state, model, 3, generator(4)).state_cloud)
    calls = []
    original = rng._draw_generators

    def counted(gens):
        out = original(gens)
        calls.append(len(out))
        return out

    monkeypatch.setattr(rng, "_draw_generators", counted)
    updater.forecast(state, model, 3, generator(3))
    assert calls == [1, 1, 1]  # one generator's call a horizon for all 16384 pairs (it was one per pair)


def test_the_forecast_observes_each_pair_under_its_own_theta():
    """o = x + N(0, R_j) for θ-particle j's pairs: mean and variance x's + R_j (the closed form) at horizons 1–3,
    and the whole observation predictive the equal mixture's."""
    updater, model, state = forecast_state()
    p = updater.forecast(state, model, 3, generator(5))
    assert p.observation_cloud is not None and p.observation_cloud.shape == (3, len(FORECAST_Q) * FORECAST_NX, 1)
    obs_mean, obs_cov = p.observation_mean[:, 0], p.observation_cov[:, 0, 0]
    assert_closed_form(p.observation_cloud[..., 0], obs_mean, obs_cov, FORECAST_R)


def test_the_observation_predictive_is_reproducible_and_drawn_once_a_horizon(monkeypatch):
    updater, model, state = forecast_state()
    first = updater.forecast(state, model, 3, generator(3))
    again = updater.forecast(state, model, 3, generator(3))
    assert torch.equal(first.observation_cloud, again.observation_cloud)
    assert torch.equal(first.observation_cov, again.observation_cov)
    other = updater.forecast(state, model, 3, generator(4))
    assert not torch.equal(first.observation_cloud, other.observation_cloud)
    calls, original = [], torch.randn

    def counted(*args, **kwargs):
        out = original(*args, **kwargs)
        if kwargs.get("generator") is not None:
            calls.append(out.numel())
        return out

    monkeypatch.setattr(torch, "randn", counted)
    updater.forecast(state, model, 3, generator(3))
    n = len(FORECAST_Q) * FORECAST_NX
    assert calls == [n, n] * 3  # a horizon: the pairs' transition noise, then their observations' — a call each


@pytest.mark.parametrize(
    "family,params,d",
    [
        ("lds", {"A": [[0.9, 0.1], [0.0, 0.8]], "B": [[1.0, 0.5]], "R": [[0.7]]}, 2),
        ("lorenz96", {}, 8),
        ("range_bearing", {}, 4),
        ("stochastic_volatility", {}, 2),
        ("gmm", {}, 2),
    ],
)
def test_a_model_of_a_row_per_state_draws_the_observations_of_one_row(family, params, d):
    """``observation_draws`` of the N-row model (a state a row, what ``smc2``'s forecast observes) is that of the
    one-row model of N states, number for number, from the same generator."""
    model = make_model(family, params, d)
    x = 3.0 + torch.randn(1, 50, d, generator=generator(1))
    one = model.observation_draws(x, generator(7))
    rows = model.at_values({}, 50).observation_draws(x.transpose(0, 1), generator(7))
    assert one.shape == (1, 50, model.observation_size()) and torch.equal(rows.transpose(0, 1), one)

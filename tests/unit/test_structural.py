"""The ``structural`` family (issue 56): structural time series in continuous time, an ``lds`` in F, Qc.

The reference is written here in numpy float64, independently of the family and of the service's Van Loan
discretisation: F and Qc built by hand from the components, A = e^{FΔ} by ``scipy.linalg.expm`` directly and Q in
closed form (the local linear trend's [[σ_l²Δ + σ_s²Δ³/3, σ_s²Δ²/2], [σ_s²Δ²/2, σ_s²Δ]], a harmonic pair's σ²Δ I₂,
checked once against quadrature), then a textbook Kalman filter."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.integrate
import scipy.linalg
import scipy.stats
import torch
from mpflow.operators.models import FAMILIES, make_model
from mpflow.operators.models.priors import prior_from_spec
from mpflow.operators.models.structural import MAX_STATE_DIM, Structural
from mpflow.operators.rng import generator
from mpflow.operators.updaters import get_updater
from mpflow.service.engine.default_methods import default_method

PARAMS = {
    "level_sd": 0.3,
    "trend_sd": 0.05,
    "seasonal": [{"period": 24.0, "harmonics": 2, "sd": 0.1}, {"period": 7.5, "harmonics": 1, "sd": 0.2}],
    "R": 0.4,
}
D = 2 + 2 * 3


def by_hand(params: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(F, Qc, B) of the components, written out."""
    blocks_F, blocks_Q, row = [], [], []
    if "trend_sd" in params:
        blocks_F.append(np.array([[0.0, 1.0], [0.0, 0.0]]))
        blocks_Q.append(np.diag([params["level_sd"] ** 2, params["trend_sd"] ** 2]))
        row += [1.0, 0.0]
    else:
        blocks_F.append(np.zeros((1, 1)))
        blocks_Q.append(np.array([[params["level_sd"] ** 2]]))
        row += [1.0]
    for comp in params.get("seasonal", []):
        for k in range(1, comp["harmonics"] + 1):
            w = 2 * math.pi * k / comp["period"]
            blocks_F.append(np.array([[0.0, w], [-w, 0.0]]))
            blocks_Q.append(comp["sd"] ** 2 * np.eye(2))
            row += [1.0, 0.0]
    return scipy.linalg.block_diag(*blocks_F), scipy.linalg.block_diag(*blocks_Q), np.array([row])


def discretise(params: dict, dt: float) -> tuple[np.ndarray, np.ndarray]:
    """A = expm(F Δ); Q in closed form per block (module docstring)."""
    F, _, _ = by_hand(params)
    blocks = []
    sl2 = params["level_sd"] ** 2
    if "trend_sd" in params:
        ss2 = params["trend_sd"] ** 2
        blocks.append(np.array([[sl2 * dt + ss2 * dt**3 / 3, ss2 * dt**2 / 2], [ss2 * dt**2 / 2, ss2 * dt]]))
    else:
        blocks.append(np.array([[sl2 * dt]]))
    for comp in params.get("seasonal", []):
        blocks += [comp["sd"] ** 2 * dt * np.eye(2)] * comp["harmonics"]
    return scipy.linalg.expm(F * dt), scipy.linalg.block_diag(*blocks)


def reference_filter(params, m0, P0, obs, dts):
    """The textbook Kalman filter: (means [T, d], covs [T, d, d], log-evidence increments [T])."""
    b = by_hand(params)[2][0]
    B = b[None]
    R = params.get("R", 1.0)
    m, P = np.array(m0, float), np.array(P0, float)
    means, covs, incs = [], [], []
    for y, dt in zip(obs, dts, strict=True):
        A, Q = discretise(params, dt)
        m, P = A @ m, A @ P @ A.T + Q
        S = float(b @ P @ b) + R
        incs.append(float(scipy.stats.norm(float(b @ m), math.sqrt(S)).logpdf(y)))
        K = P @ b / S
        m = m + K * (y - float(b @ m))
        IKB = np.eye(len(m)) - K[:, None] @ B
        P = IKB @ P @ IKB.T + R * K[:, None] @ K[None]  # Joseph form
        means.append(m)
        covs.append(P)
    return np.array(means), np.array(covs), np.array(incs)


def run_kalman(params, m0, P0, obs, dts, dtype=torch.float64):
    """The family's model and the ``kalman`` updater, one step of its own dt at a time."""
    d = len(m0)
    model = make_model("structural", params, d, dtype)
    prior = prior_from_spec({"type": "gaussian", "mean": list(m0), "cov": np.asarray(P0).tolist()}, d)
    kf = get_updater("kalman")
    state = kf.init(prior, model, num_particles=16, seed=0)
    means, covs, incs = [], [], []
    for y, dt in zip(obs, dts, strict=True):
        state, info = kf.update(state, torch.tensor([[float(y)]], dtype=dtype), model.at_step(float(dt)))
        m, P = kf.filtered_moments(state)
        means.append(m[0].double().numpy())
        covs.append(P[0].double().numpy())
        incs.append(float(info.log_evidence_increment[0]))
    return np.array(means), np.array(covs), np.array(incs)


def simulate(params, x0, dts, seed):
    """States and observations drawn from the reference's exact steps."""
    rng = np.random.default_rng(seed)
    b = by_hand(params)[2][0]
    x, xs, ys = np.array(x0, float), [], []
    for dt in dts:
        A, Q = discretise(params, dt)
        x = A @ x + np.linalg.cholesky(Q) @ rng.standard_normal(len(x))
        xs.append(x)
        ys.append(float(b @ x) + math.sqrt(params.get("R", 1.0)) * rng.standard_normal())
    return np.array(xs), np.array(ys)


# ------------------------------------------------------------------------------------------------ the model
def test_the_model_is_the_lds_of_its_components():
    model = make_model("structural", PARAMS, D, torch.float64)
    F, Qc, B = by_hand(PARAMS)
    np.testing.assert_allclose(model.params["F"][0].numpy(), F, atol=1e-12)
    np.testing.assert_allclose(model.params["Qc"][0].numpy(), Qc, atol=1e-12)
    np.testing.assert_allclose(model.params["B"][0].numpy(), B)
    assert float(model.params["R"][0, 0, 0]) == pytest.approx(0.4)
    assert isinstance(model, FAMILIES["lds"]) and model.continuous and model.linear_gaussian and model.dynamic
    assert Structural.state_names(D) == ["level", "slope"] + [f"harmonic[{j}]{s}" for j in range(3) for s in ("", "*")]
    assert Structural.state_names(1) == ["level"]


@pytest.mark.parametrize("dt", [0.013, 0.5, 1.0, 3.7, 40.0])
def test_each_step_is_the_exact_discretisation(dt):
    """A and Q of a step equal expm(FΔ) and the closed-form Q (which quadrature confirms once)."""
    step = make_model("structural", PARAMS, D, torch.float64).at_step(dt)
    A, Q = discretise(PARAMS, dt)
    np.testing.assert_allclose(step.params["A"][0].numpy(), A, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(step.params["Q"][0].numpy(), Q, rtol=1e-9, atol=1e-12)
    if dt == 3.7:
        F, Qc, _ = by_hand(PARAMS)
        quad, _ = scipy.integrate.quad_vec(lambda s: scipy.linalg.expm(F * s) @ Qc @ scipy.linalg.expm(F * s).T, 0, dt)
        np.testing.assert_allclose(Q, quad, rtol=1e-8, atol=1e-12)


def test_the_transition_draws_the_exact_step():
    """x' ~ N(A x, Q) over a step of dt = 2 (200 000 draws, 5 standard errors)."""
    params = {"level_sd": 0.5, "trend_sd": 0.3, "seasonal": [{"period": 5.0, "harmonics": 1, "sd": 0.4}]}
    step = make_model("structural", params, 4, torch.float64).at_step(2.0)
    A, Q = discretise(params, 2.0)
    x0 = torch.tensor([1.0, -0.5, 2.0, 0.3], dtype=torch.float64)
    M = 200_000
    y = step.transition(x0.expand(1, M, 4).clone(), [generator(3)])[0].numpy()
    assert np.all(np.abs(y.mean(0) - A @ x0.numpy()) <= 5 * y.std(0) / math.sqrt(M))
    assert np.all(np.abs(np.cov(y.T) - Q) <= 5 * np.sqrt(2.0 / M) * np.sqrt(np.outer(np.diag(Q), np.diag(Q))) + 1e-4)


# ------------------------------------------------------------------------------------------------ exactness
def test_kalman_equals_the_float64_reference_with_irregular_dt():
    rng = np.random.default_rng(11)
    T = 80
    dts = rng.exponential(0.7, T) + 0.01  # irregular timestamps, from 0.01 to several units
    m0 = np.zeros(D)
    P0 = np.diag([4.0, 0.1] + [1.0] * 6)
    _, obs = simulate(PARAMS, rng.standard_normal(D), dts, seed=2)
    want_m, want_P, want_inc = reference_filter(PARAMS, m0, P0, obs, dts)
    got_m, got_P, got_inc = run_kalman(PARAMS, m0, P0, obs, dts)
    scale_m = np.abs(want_m).max()
    np.testing.assert_allclose(got_m, want_m, rtol=1e-6, atol=1e-6 * scale_m)
    np.testing.assert_allclose(got_P, want_P, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(got_inc, want_inc, rtol=1e-6, atol=1e-8)
    assert got_inc.sum() == pytest.approx(want_inc.sum(), rel=1e-6)


def test_the_float32_model_of_the_service_is_close_to_the_reference():
    rng = np.random.default_rng(5)
    dts = rng.exponential(1.0, 40) + 0.05
    m0, P0 = np.zeros(D), np.eye(D)
    _, obs = simulate(PARAMS, rng.standard_normal(D), dts, seed=4)
    want_m, _, want_inc = reference_filter(PARAMS, m0, P0, obs, dts)
    got_m, _, got_inc = run_kalman(PARAMS, m0, P0, obs, dts, dtype=torch.float32)
    np.testing.assert_allclose(got_m, want_m, atol=1e-3 * max(1.0, np.abs(want_m).max()))
    assert got_inc.sum() == pytest.approx(want_inc.sum(), abs=1e-3 * len(dts))


def test_a_daily_season_in_seconds_is_recovered_from_irregular_samples():
    """A slowly wandering level plus 2 sin(2π t / 1 day) + 0.5 cos(4π t / 1 day), t in seconds, sampled every 15
    minutes on average at random times for 6 days, noise sd 0.3. After the first day the filtered seasonal part
    (the sum of the γ's) is within 0.1 of the truth on average — less than a tenth of the season's sd, 1.41 — and its
    error is consistent with the filter's own sd (RMS z-score between 0.5 and 2)."""
    day = 86400.0
    rng = np.random.default_rng(8)
    dts = rng.exponential(900.0, 6 * 96) + 1.0
    t = np.cumsum(dts)
    level = 5.0 + np.cumsum(0.5 / math.sqrt(day) * np.sqrt(dts) * rng.standard_normal(len(dts)))
    season = 2.0 * np.sin(2 * math.pi * t / day) + 0.5 * np.cos(4 * math.pi * t / day)
    obs = level + season + 0.3 * rng.standard_normal(len(dts))
    params = {
        "level_sd": 0.5 / math.sqrt(day),
        "seasonal": [{"period": day, "harmonics": 2, "sd": 0.05 / math.sqrt(day)}],
        "R": 0.09,
    }
    d = 5
    m0, P0 = np.zeros(d), np.diag([100.0, 4.0, 4.0, 4.0, 4.0])
    means, covs, _ = run_kalman(params, m0, P0, obs, dts)
    B_season = np.array([0.0, 1.0, 0.0, 1.0, 0.0])
    est = means @ B_season
    sd = np.sqrt(np.einsum("i,tij,j->t", B_season, covs, B_season))
    after = t > day
    err = est[after] - season[after]
    assert np.mean(np.abs(err)) < min(0.1, 0.1 * season.std())  # 0.081 at this seed
    z = err / sd[after]
    assert 0.5 < math.sqrt(np.mean(z**2)) < 2.0
    assert np.mean(np.abs(means[after, 0] - level[after])) < 0.15


# ------------------------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize(
    "params,d,field",
    [
        ({"seasonal": [{"period": 0, "harmonics": 1}]}, 3, r"model\.params\.seasonal\[0\]\.period: must be positive"),
        ({"seasonal": [{"period": 24, "harmonics": 1}, {"period": -7}]}, 5, r"model\.params\.seasonal\[1\]\.period"),
        ({"seasonal": [{"harmonics": 1}]}, 3, r"model\.params\.seasonal\[0\]\.period: required"),
        ({"seasonal": [{"period": 24, "harmonics": 0}]}, 3, r"model\.params\.seasonal\[0\]\.harmonics"),
        ({"seasonal": [{"period": 24, "harmonics": 13}]}, 27, r"model\.params\.seasonal\[0\]\.harmonics: at most 12"),
        ({"seasonal": [{"period": 24, "harmonics": 1.5}]}, 3, r"model\.params\.seasonal\[0\]\.harmonics"),
        ({"seasonal": [{"period": 24, "sd": -1}]}, 3, r"model\.params\.seasonal\[0\]\.sd: must be non-negative"),
        ({"seasonal": [{"period": 24, "phase": 1}]}, 3, r"model\.params\.seasonal\[0\]: unknown parameter"),
        ({"seasonal": {"period": 24}}, 3, r"model\.params\.seasonal: expected a list"),
        ({"seasonal": [24]}, 3, r"model\.params\.seasonal\[0\]: expected an object"),
        ({"level_sd": -1}, 1, r"model\.params\.level_sd: must be non-negative"),
        ({"trend_sd": [0.1, 0.2]}, 2, r"model\.params\.trend_sd: expected a single number"),
        ({"R": 0}, 1, r"model\.params\.R: must be positive"),
        ({"R": [[1.0, 0.0], [0.0, 1.0]]}, 1, r"model\.params\.R: expected a single number"),
        ({"level_sd": 0}, 1, r"model\.params\.level_sd: the level's sd or some season's must be positive"),
        ({"trend_sd": 0}, 2, r"model\.params\.trend_sd: must be positive"),
        ({"A": [[1.0]]}, 1, r"model\.params: unknown parameter\(s\) \['A'\]"),
        ({"trend_sd": 0.1}, 1, r"prior: the structural model of model\.params has a 2-dimensional state"),
        (PARAMS, 6, r"prior: .* has a 8-dimensional state .* must have 8 entries; got 6"),
        (
            {"seasonal": [{"period": p, "harmonics": 12} for p in (24, 168, 720)]},
            73,
            r"model\.params\.seasonal: the components give a 73-dimensional state, more than .* limit of 64",
        ),
    ],
)
def test_bad_params_are_refused_naming_the_field(params, d, field):
    with pytest.raises(ValueError, match=field):
        make_model("structural", params, d)


def test_inputs_and_bad_durations_are_refused_naming_the_step():
    model = make_model("structural", {}, 1)
    with pytest.raises(ValueError, match=r"observations\[2\]\.u: the structural family takes no inputs"):
        model.at_step(1.0, torch.ones(1), "observations[2]")
    with pytest.raises(ValueError, match=r"observations\[0\]\.dt"):
        model.at_step(0.0, None, "observations[0]")


def test_a_zero_sd_is_raised_to_the_floor_and_the_limits_hold():
    """A season's sd of 0 is 1e-4 × the level's; a slope's sd is in other units, never floored, and may be many
    orders below the level's (per second: 1e-9 beside 1e-3)."""
    model = make_model("structural", {"trend_sd": 0.01, "seasonal": [{"period": 24.0, "sd": 0}]}, 4, torch.float64)
    assert torch.allclose(
        torch.diagonal(model.params["Qc"][0]), torch.tensor([1.0, 1e-4, 1e-8, 1e-8], dtype=torch.float64)
    )
    assert bool((torch.linalg.eigvalsh(model.at_step(0.01).params["Q"][0]) > 0).all())
    per_second = make_model("structural", {"level_sd": 1e-3, "trend_sd": 1e-9}, 2)
    assert bool((torch.linalg.cholesky_ex(per_second.at_step(900.0).params["Q"]).info == 0).all())
    biggest = {
        "trend_sd": 0.1,
        "seasonal": [{"period": p, "harmonics": 12} for p in (24.0, 168.0)] + [{"period": 8760.0, "harmonics": 7}],
    }
    assert make_model("structural", biggest, MAX_STATE_DIM).state_dim == 64


def test_observations_are_one_number_and_kalman_is_the_default():
    model = make_model("structural", {}, 1)
    assert model.read_observation(1.5).tolist() == [1.5] and model.read_observation([1.5]).tolist() == [1.5]
    assert torch.isnan(model.read_observation(None)).all()
    for d in (1, 2, 4, 9):
        assert default_method("structural", d, Structural.linear_gaussian).method == "kalman"
        assert make_model("structural", Structural.example_params(d), d).state_dim == d
        assert len(Structural.state_names(d)) == d


def test_a_learned_observation_noise_scales_R():
    model = make_model("structural", {"R": {"prior": {"type": "lognormal", "mean": 0.0, "sd": 1.0}}}, 1)
    assert set(model.unknown) == {"R"}
    two = model.at_values({"R": torch.tensor([0.5, 2.0])}, 2)
    assert two.params["R"][:, 0, 0].tolist() == [0.5, 2.0]


def test_a_continuous_time_step_is_computed_once_per_duration():
    """``LDS.at_step`` keeps the exact step of each duration (``STEP_CACHE`` of them, the oldest dropped first):
    a regularly sampled stream pays for its matrix exponentials once; the kept step equals a fresh one."""
    from mpflow.operators.models import lds as lds_module

    model = make_model("lds", {"F": [[-0.5]], "Qc": [[0.3]], "B": [[1.0]]}, 1)
    first = model.at_step(0.25)
    assert model.at_step(0.25) is first
    fresh = make_model("lds", {"F": [[-0.5]], "Qc": [[0.3]], "B": [[1.0]]}, 1).at_step(0.25)
    assert torch.equal(first.params["A"], fresh.params["A"]) and torch.equal(first.params["Q"], fresh.params["Q"])
    for i in range(lds_module.STEP_CACHE + 5):
        model.at_step(1.0 + i)
    assert len(model.__dict__["_steps"]) == lds_module.STEP_CACHE
    assert model.at_step(0.25) is not first  # the oldest duration was dropped, then computed again

"""``smc2``'s ``mh`` kernel (:mod:`mpflow.operators.updaters.smc2_mh`): resample-move with MH moves accepted by the
exact Kalman likelihood of the kept window.

* The move leaves the exact posterior invariant: on a 1-D lds with R unknown and 20 observations, a cloud drawn
  from the grid posterior keeps its mean and sd after 10 moves, within Monte Carlo error, over 3 seeds; a stream
  that rejuvenates at every step ends at the grid posterior.
* The replay's likelihood and filter are a plain Kalman filter's; a window shorter than the stream conditions on
  the window's start.
* The history is part of the state: it survives to_bytes / from_bytes, and a stream read back continues as if it
  had never left; it keeps its size as it steps.
* Bad options are refused naming the field; mh on a family without an exact filter per θ is refused at creation.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from mpflow.operators.models import make_model
from mpflow.operators.models.param_priors import ParamPrior
from mpflow.operators.rng import generator
from mpflow.operators.state import ParticleState
from mpflow.operators.updaters import get_updater, smc2_mh

from tests.unit.test_smc2 import GAUSS1, LOGNORMAL, A, Q, kalman_loglik, lds_model, theta_moments
from tests.unit.test_smc2 import simulate as lds_data

T = 20
GRID = np.exp(np.linspace(math.log(0.01), math.log(80.0), 20000))


def simulate(seed: int, n: int = T) -> np.ndarray:
    """:func:`tests.unit.test_smc2.simulate`'s model (the same A, Q, R), ``n`` steps (default this file's T)."""
    return lds_data(seed, n)


def grid_weights(ys: np.ndarray) -> np.ndarray:
    """The posterior of R | ys on :data:`GRID` (lognormal(0, 1) prior, the log-spaced grid's measure dR ∝ R)."""
    lp = kalman_loglik(ys, GRID) - 0.5 * np.log(GRID) ** 2
    w = np.exp(lp - lp.max())
    return w / w.sum()


def moments(w: np.ndarray) -> tuple[float, float]:
    mean = float((w * GRID).sum())
    return mean, float(math.sqrt((w * (GRID - mean) ** 2).sum()))


def history_extras(ys: np.ndarray, H: int = 64) -> dict[str, torch.Tensor]:
    extras = smc2_mh.init_extras(1, H, 1, torch.zeros(1, 1), torch.eye(1)[None])
    model = lds_model()
    for y in ys:
        extras = smc2_mh.append(extras, torch.tensor([[y]]), model, {"R": torch.ones(1, dtype=torch.float64)})
    return extras


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_move_leaves_the_exact_posterior_invariant(seed):
    ys = simulate(seed)
    w = grid_weights(ys)
    ref_mean, ref_sd = moments(w)
    rng = np.random.default_rng(100 + seed)
    M = 2000
    draws = GRID[rng.choice(len(GRID), size=M, p=w)] * np.exp(rng.uniform(-0.5, 0.5, M) * np.log(GRID[1] / GRID[0]))
    theta = torch.tensor(draws, dtype=torch.float64)[None, :, None]
    support = {"R": (torch.tensor([0.0], dtype=torch.float64), torch.tensor([math.inf], dtype=torch.float64))}
    th, m, P, acc = smc2_mh.mh_move(
        lds_model(), ["R"], {"R": ParamPrior("lognormal", 0.0, 1.0)}, support, theta, history_extras(ys),
        [generator(seed)], 10,
    )  # fmt: skip
    moved = th[0, :, 0].numpy()
    assert 0.2 < float(acc[0]) < 0.95
    assert np.mean(np.abs(moved - draws) > 0) > 0.5  # the particles did move
    se = ref_sd / math.sqrt(M / 10)  # correlated draws: a tenth of M independent ones, generously
    assert abs(moved.mean() - ref_mean) < 4 * se, (moved.mean(), ref_mean, ref_sd)
    assert abs(moved.std() / ref_sd - 1) < 0.1, (moved.std(), ref_sd)
    # each moved particle's filter is its own θ's exact Kalman filter at the last step
    r = th[0, :5, 0].numpy()
    mk, Pk = np.zeros_like(r), np.ones_like(r)
    for y in ys:
        mk, Pk = A * mk, A * A * Pk + Q
        mk, Pk = mk + Pk / (Pk + r) * (y - mk), (1 - Pk / (Pk + r)) * Pk
    assert np.allclose(m[0, :5, 0].numpy(), mk) and np.allclose(P[0, :5, 0, 0].numpy(), Pk)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_stream_moved_at_every_step_ends_at_the_grid_posterior(seed):
    ys = simulate(seed)
    ref_mean, ref_sd = moments(grid_weights(ys))
    model = lds_model()
    updater = get_updater("smc2", kernel="mh", ess_threshold=1.0, mh_moves=3, theta_particles=512)
    state = updater.init(GAUSS1, model, 512, seed)
    for y in ys:
        state, _ = updater.update(state, torch.tensor([[y]], dtype=torch.float32), model)
    mean, sd = theta_moments(state)
    assert abs(mean - ref_mean) < 0.25 * ref_sd, (mean, ref_mean, ref_sd)
    assert abs(sd / ref_sd - 1) < 0.2, (sd, ref_sd)


def test_the_replay_is_a_kalman_filter_and_a_short_window_starts_from_its_gaussian():
    ys = simulate(4, 30)
    r = np.array([0.5, 2.0, 7.0])
    theta = torch.tensor(r, dtype=torch.float64)[None, :, None]
    full = history_extras(ys, H=64)
    ll, _, _ = smc2_mh.replay(
        lds_model(), ["R"], theta, full["mh_history"], full["mh_length"], full["mh_start_mean"], full["mh_start_cov"]
    )
    assert np.allclose(ll[0].numpy(), kalman_loglik(ys, r))
    short = history_extras(ys, H=10)  # the 20 oldest left the window, conditioning its start under θ̄ = 1
    assert float(short["mh_length"][0]) == 10
    m0, p0 = 0.0, 1.0
    for y in ys[:20]:
        m0, p0 = A * m0, A * A * p0 + Q
        m0, p0 = m0 + p0 / (p0 + 1.0) * (y - m0), (1 - p0 / (p0 + 1.0)) * p0
    assert math.isclose(float(short["mh_start_mean"][0, 0]), m0, rel_tol=1e-6) and math.isclose(
        float(short["mh_start_cov"][0, 0, 0]), p0, rel_tol=1e-6
    )
    ll, _, _ = smc2_mh.replay(
        lds_model(), ["R"], theta, short["mh_history"], short["mh_length"], short["mh_start_mean"],
        short["mh_start_cov"],
    )  # fmt: skip
    assert np.allclose(ll[0].numpy(), kalman_loglik(ys[20:], r, m0, p0), rtol=1e-6)


def test_missing_observations_are_kept_and_replayed_as_predictions():
    ys = simulate(5, 12)
    model = lds_model()
    extras = smc2_mh.init_extras(1, 16, 1, torch.zeros(1, 1), torch.eye(1)[None])
    for i, y in enumerate(ys):
        obs = None if i in (3, 7) else torch.tensor([[y]])
        extras = smc2_mh.append(extras, obs, model, {"R": torch.ones(1, dtype=torch.float64)})
    theta = torch.tensor([[[1.5]]], dtype=torch.float64)
    ll, _, _ = smc2_mh.replay(
        model, ["R"], theta, extras["mh_history"], extras["mh_length"], extras["mh_start_mean"], extras["mh_start_cov"],
        extras["mh_observed"],
    )  # fmt: skip
    m, P, ref = 0.0, 1.0, 0.0
    for i, y in enumerate(ys):
        m, P = A * m, A * A * P + Q
        if i in (3, 7):
            continue
        S = P + 1.5
        ref += -0.5 * (math.log(2 * math.pi * S) + (y - m) ** 2 / S)
        m, P = m + P / S * (y - m), (1 - P / S) * P
    assert math.isclose(float(ll[0, 0]), ref, rel_tol=1e-6)


def test_the_history_survives_the_state_round_trip_and_the_stream_continues_the_same():
    ys = simulate(6, 40)
    model = lds_model()
    updater = get_updater("smc2", kernel="mh", history=25, theta_particles=128)
    state = updater.init(GAUSS1, model, 128, 3)
    sizes = set()
    for y in ys[:30]:
        state, _ = updater.update(state, torch.tensor([[y]], dtype=torch.float32), model)
        sizes.add(tuple((k, tuple(v.shape)) for k, v in sorted(state.fields().items())))
    assert len(sizes) == 1  # the state keeps its size
    assert float(state.extras["mh_length"][0]) == 25
    back = ParticleState.from_bytes(state.to_bytes())
    for name, t in state.fields().items():
        assert torch.equal(t.nan_to_num(123.0), back.fields()[name].nan_to_num(123.0)), name
    for y in ys[30:]:
        obs = torch.tensor([[y]], dtype=torch.float32)
        state, _ = updater.update(state, obs, model)
        back, _ = updater.update(back, obs, model)
    for name, t in state.fields().items():
        assert torch.equal(t.nan_to_num(123.0), back.fields()[name].nan_to_num(123.0)), name
    kept = updater.kept(state, model)
    assert any(b.field == "extras.mh_length" for b in kept.bounds)
    assert "extras.mh_start_cov" in kept.covariances


BAD_OPTIONS = {
    "history 0": ({"history": 0}, "options.history"),
    "history too long": ({"history": smc2_mh.MAX_HISTORY + 1}, "options.history"),
    "history a float": ({"history": 10.5}, "options.history"),
    "moves 0": ({"mh_moves": 0}, "options.mh_moves"),
    "moves a bool": ({"mh_moves": True}, "options.mh_moves"),
    "moves too many": ({"mh_moves": smc2_mh.MAX_MOVES + 1}, "options.mh_moves"),
    "kernel": ({"kernel": "pmmh"}, "options.kernel"),
}


@pytest.mark.parametrize("case", sorted(BAD_OPTIONS))
def test_bad_options_are_refused_naming_the_field(case):
    options, says = BAD_OPTIONS[case]
    with pytest.raises(ValueError, match=says.replace(".", r"\.")):
        get_updater("smc2", **options)


def test_mh_needs_an_exact_filter_per_theta():
    sv = make_model("stochastic_volatility", {"mu": 0.0, "phi": 0.95, "sigma": LOGNORMAL}, 1)
    with pytest.raises(ValueError, match=r"options\.kernel: mh needs an exact Kalman filter"):
        get_updater("smc2", kernel="mh").init(GAUSS1, sv, 64, 0)


def test_the_price_holds_the_move_on_every_step_it_may_fire():
    model = lds_model()
    plain = get_updater("smc2").step_work(model, 1024)
    short = get_updater("smc2", kernel="mh", history=100, mh_moves=3).step_work(model, 1024)
    long = get_updater("smc2", kernel="mh", history=1000, mh_moves=3).step_work(model, 1024)
    move = long.flops - plain.flops
    assert short.flops > plain.flops and move > 9 * (short.flops - plain.flops)
    per_replayed_step = move / (4 * 1000)
    assert per_replayed_step >= smc2_mh.REPLAY_STEP_FLOPS[True]

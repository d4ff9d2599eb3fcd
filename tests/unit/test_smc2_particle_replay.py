"""``smc2``'s particle replay of a kept window (:mod:`mpflow.operators.updaters.smc2_particle_replay`): the bootstrap
filter's likelihood estimate of SMC²'s PMMH move, against exact references computed here.

* On a 1-D lds with R unknown, 30 observations: with N_x = 4000 the log-likelihood estimate is the exact Kalman one
  (:func:`smc2_mh.replay`) within 0.03 nat per observation at four θ; with N_x = 128, exp(log p̂ − log p) averaged over
  2000 independent filters is 1 within 4 Monte Carlo standard errors (the estimate is unbiased; its log is not).
* On stochastic_volatility d = 1 with φ, σ unknown, 40 observations: the estimate agrees with a point-mass filter's
  log-likelihood (plain numpy, converged: two grid resolutions agree to 1e-3) within 4 of its own Monte Carlo sds
  (measured from replicates) plus 0.02.
* Windows of different lengths in one batch give each stream what it gets alone with the same generator (an empty
  window: the start's draws, log p̂ = 0); an unobserved step is a predict only (all unobserved: log p̂ = 0, uniform
  weights and the Kalman predict's moments), and a partial observation conditions on its observed entries (2-D lds
  against the Kalman replay).
* The same generators give the same output; other seeds another.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from mpflow.operators.models import make_model
from mpflow.operators.rng import StreamRNG, generator
from mpflow.operators.updaters import smc2_mh
from mpflow.operators.updaters.smc2_particle_replay import particle_replay_work, replay_particles

from tests.unit.test_smc2 import lds_model
from tests.unit.test_smc2 import simulate as lds_data

SV_PARAMS = {
    "mu": 0.0,
    "phi": {"prior": {"type": "uniform", "low": 0.5, "high": 0.995}},
    "sigma": {"prior": {"type": "lognormal", "mean": math.log(0.3), "sd": 0.5}},
}


def window(ys: np.ndarray, H: int, k: int = 1) -> dict[str, torch.Tensor]:
    """A stream's kept window after the observations ``ys`` [T, k] (NaN: not observed; T ≤ H), right-aligned in a
    history of H, from N(0, I): what :mod:`smc2_mh` keeps (built here, not by its helpers)."""
    ys = torch.tensor(np.asarray(ys, dtype=np.float64).reshape(len(ys), k))
    hist = torch.zeros(1, H, k, dtype=torch.float64)
    seen = torch.zeros(1, H, k, dtype=torch.float64)
    if len(ys):
        hist[0, H - len(ys) :] = ys.nan_to_num(0.0)
        seen[0, H - len(ys) :] = (~torch.isnan(ys)).to(torch.float64)
    return {
        "hist": hist,
        "seen": seen,
        "length": torch.tensor([float(len(ys))], dtype=torch.float64),
        "mean": torch.zeros(1, k, dtype=torch.float64),
        "cov": torch.eye(k, dtype=torch.float64)[None],
    }


def args(e, theta: torch.Tensor):
    return (theta, e["hist"], e["length"], e["mean"], e["cov"], e["seen"])


def test_the_estimate_is_the_kalman_likelihood_at_large_Nx():
    ys = lds_data(3, 30)
    extras = window(ys, 40)
    theta = torch.tensor([0.5, 1.0, 2.0, 4.0], dtype=torch.float64)[None, :, None]
    exact, m, P = smc2_mh.replay(lds_model(), ["R"], *args(extras, theta))
    ll, x, lw = replay_particles(lds_model(), ["R"], *args(extras, theta), 4000, [generator(0)])
    assert ll.dtype == x.dtype == lw.dtype == torch.float64
    assert x.shape == (1, 4, 4000, 1) and lw.shape == (1, 4, 4000)
    assert torch.allclose(torch.logsumexp(lw, -1), torch.zeros(1, 4, dtype=torch.float64))
    assert float((ll - exact).abs().max()) < 0.03 * 30, (ll, exact)
    # the filter at the window's end is the Kalman filter's, within Monte Carlo error
    w = torch.softmax(lw, -1)
    mean = (w * x[..., 0]).sum(-1)
    var = (w * (x[..., 0] - mean[..., None]) ** 2).sum(-1)
    assert float(((mean - m[..., 0]).abs() / P[..., 0, 0].sqrt()).max()) < 0.15
    assert float((var / P[..., 0, 0] - 1).abs().max()) < 0.15


def test_exp_of_the_estimate_is_unbiased():
    ys = lds_data(5, 30)
    extras = window(ys, 30)
    copies = 2000
    for r in (1.0, 2.0):
        theta = torch.full((1, copies, 1), r, dtype=torch.float64)  # independent filters of one θ
        exact, _, _ = smc2_mh.replay(lds_model(), ["R"], *args(extras, theta[:, :1]))
        ll, _, _ = replay_particles(lds_model(), ["R"], *args(extras, theta), 128, [generator(int(10 * r))])
        error = ll[0] - exact[0, 0]
        ratio = torch.exp(error)
        se = float(ratio.std()) / math.sqrt(copies)
        assert abs(float(ratio.mean()) - 1.0) < 4 * se, (float(ratio.mean()), se)
        assert 0.005 < se < 0.05  # the check has power: the estimate does vary (var log p̂ about 0.4 to 1)
        # its log is biased low (Jensen: about −var/2), which is not what is tested
        assert float(error.mean()) < -0.25 * float(error.var())


def sv_data(seed: int, n: int, phi: float = 0.95, sigma: float = 0.3) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x, ys = rng.standard_normal(), []
    for _ in range(n):
        x = phi * x + sigma * rng.standard_normal()
        ys.append(math.exp(x / 2) * rng.standard_normal())
    return np.array(ys)


def sv_grid_loglik(ys: np.ndarray, phi: float, sigma: float, n_points: int) -> float:
    """log p(o_1:T | φ, σ) from x_0 ~ N(0, 1) by a point-mass filter on ``n_points`` in [−8, 8] (the transition's
    density evaluated on the grid and normalised per column; benchmarks/params.py's ``_sv_loglik``)."""
    points = np.linspace(-8.0, 8.0, n_points)
    p = np.exp(-0.5 * points**2)
    p /= p.sum()
    kernel = np.exp(-0.5 * ((points[:, None] - phi * points[None, :]) / sigma) ** 2)
    kernel /= kernel.sum(0, keepdims=True)
    ll = 0.0
    for y in ys:
        p = kernel @ p
        lik = np.exp(-0.5 * (np.log(2 * np.pi) + points + y**2 * np.exp(-points)))
        z = float(p @ lik)
        ll += math.log(z)
        p = p * lik / z
    return ll


def test_stochastic_volatility_against_a_point_mass_filter():
    model = make_model("stochastic_volatility", SV_PARAMS, 1)
    names = sorted(model.unknown)
    assert names == ["phi", "sigma"]
    T, reps = 40, 8
    ys = sv_data(7, T)
    hist = torch.tensor(ys, dtype=torch.float64)[None, :, None]
    cases = [(0.95, 0.3), (0.8, 0.5), (0.98, 0.15)]
    theta = torch.tensor([c for c in cases for _ in range(reps)], dtype=torch.float64)[None]  # [1, 3·reps, 2]
    ll, x, lw = replay_particles(
        model, names, theta, hist, torch.tensor([float(T)]), torch.zeros(1, 1), torch.eye(1)[None],
        torch.ones_like(hist), 1000, [generator(3)],
    )  # fmt: skip
    est = ll[0].reshape(len(cases), reps)
    for (phi, sigma), row in zip(cases, est, strict=True):
        ref = sv_grid_loglik(ys, phi, sigma, 600)
        assert abs(sv_grid_loglik(ys, phi, sigma, 300) - ref) < 1e-3  # the grid has converged
        sd = float(row.std())
        assert 0 < sd < 0.3
        # one estimate is within 4 of its Monte Carlo sds of the exact value (its log's bias, −sd²/2, is inside that)
        assert float((row - ref).abs().max()) < 4 * sd + 0.02, (phi, sigma, row, ref)


def test_windows_of_different_lengths_batched_as_alone():
    ys = lds_data(2, 25)
    H = 25
    full = window(ys, H)
    short = window(ys[:12], H)  # 12 kept, right-aligned
    empty = window(ys[:0], H)
    e = {k: torch.cat([full[k], short[k], empty[k]]) for k in full}
    theta = torch.tensor([[[1.0], [2.0], [3.0]], [[0.5], [1.5], [2.5]], [[1.0], [1.0], [1.0]]], dtype=torch.float64)
    for make in (lambda s: [generator(s) for s in s], StreamRNG.from_seeds):
        ll, x, lw = replay_particles(lds_model(), ["R"], *args(e, theta), 50, make([11, 12, 13]))
        for r, (one, seed) in enumerate(zip((full, short, empty), (11, 12, 13), strict=True)):
            a, b, c = replay_particles(lds_model(), ["R"], *args(one, theta[r : r + 1]), 50, make([seed]))
            assert torch.equal(ll[r : r + 1], a) and torch.equal(x[r : r + 1], b) and torch.equal(lw[r : r + 1], c)
    assert torch.equal(ll[2], torch.zeros(3, dtype=torch.float64))  # an empty window: the start's draws
    assert bool((ll[:2] < -10).all())
    exact, _, _ = smc2_mh.replay(lds_model(), ["R"], *args(e, theta))
    assert float((ll - exact).abs().max()) < 0.3 * 25  # a sanity bound at N_x = 50


def test_an_unobserved_step_is_a_predict_only():
    ys = lds_data(4, 10)
    H = 10
    gaps = window(np.full(10, np.nan), H)
    theta = torch.tensor([[[0.5], [2.0]]], dtype=torch.float64)
    ll, x, lw = replay_particles(lds_model(), ["R"], *args(gaps, theta), 4000, [generator(1)])
    assert torch.equal(ll, torch.zeros(1, 2, dtype=torch.float64))
    assert torch.equal(lw, torch.full_like(lw, -math.log(4000)))
    _, m, P = smc2_mh.replay(lds_model(), ["R"], *args(gaps, theta))  # ten Kalman predicts
    se = P[0, :, 0, 0].sqrt() / math.sqrt(4000)
    assert float(((x[0, :, :, 0].mean(-1) - m[0, :, 0]).abs() / se).max()) < 4
    assert float((x[0, :, :, 0].var(-1) / P[0, :, 0, 0] - 1).abs().max()) < 0.1
    # a gap inside the window: the Kalman replay's likelihood, which predicts through it
    holed = ys.copy()
    holed[[3, 4, 7]] = np.nan
    e = window(holed, H)
    exact, _, _ = smc2_mh.replay(lds_model(), ["R"], *args(e, theta))
    ll, _, _ = replay_particles(lds_model(), ["R"], *args(e, theta), 4000, [generator(2)])
    assert float((ll - exact).abs().max()) < 0.03 * 7, (ll, exact)
    observed, _, _ = smc2_mh.replay(lds_model(), ["R"], *args(window(ys, H), theta))
    assert float((observed - exact).abs().min()) > 1.0  # the gaps matter


def test_a_partial_observation_conditions_on_its_observed_entries():
    model = make_model(
        "lds",
        {"A": [[0.9, 0.0], [0.2, 0.8]], "B": [[1.0, 0.0], [0.0, 1.0]], "Q": [[1.0, 0.0], [0.0, 1.0]],
         "R": {"prior": {"type": "lognormal", "mean": 0.0, "sd": 1.0}}},
        2,
    )  # fmt: skip
    rng = np.random.default_rng(6)
    ys = rng.standard_normal((12, 2)) * 1.5
    ys[2, 0] = ys[5, 1] = ys[9, 1] = np.nan
    ys[7] = np.nan
    e = window(ys, 12, 2)
    theta = torch.tensor([[[0.7], [2.0]]], dtype=torch.float64)
    exact, _, _ = smc2_mh.replay(model, ["R"], *args(e, theta))
    ll, _, _ = replay_particles(model, ["R"], *args(e, theta), 4000, [generator(8)])
    assert float((ll - exact).abs().max()) < 0.03 * 11, (ll, exact)


def test_the_same_generators_give_the_same_output():
    model = make_model("stochastic_volatility", SV_PARAMS, 1)
    ys = sv_data(1, 20)
    hist = torch.tensor(ys, dtype=torch.float64)[None, :, None].expand(2, 20, 1)
    theta = torch.tensor([[0.9, 0.3], [0.95, 0.2], [0.7, 0.5]], dtype=torch.float64)[None].expand(2, 3, 2)

    def run(seeds):
        return replay_particles(
            model, ["phi", "sigma"], theta, hist, torch.tensor([20.0, 15.0]), torch.zeros(2, 1),
            torch.eye(1)[None].expand(2, 1, 1), None, 64, StreamRNG.from_seeds(seeds),
        )  # fmt: skip

    one, two, other = run([1, 2]), run([1, 2]), run([1, 3])
    assert all(torch.equal(a, b) for a, b in zip(one, two, strict=True))
    assert torch.equal(one[0][0], other[0][0]) and not torch.equal(one[0][1], other[0][1])


def test_the_price_grows_with_the_particles_and_the_window():
    model = make_model("stochastic_volatility", SV_PARAMS, 1)
    small, big = particle_replay_work(model, 4096, 1000), particle_replay_work(model, 8192, 1000)
    assert 0 < small < big < 2 * small
    assert particle_replay_work(model, 4096, 500) == small / 2
    assert particle_replay_work(model, 4096, 1000, 64) == small  # M = 64: smc2's automatic count at 4096
    assert particle_replay_work(model, 4096, 1000, 8) < small < particle_replay_work(model, 4096, 1000, 512)
    # about what one replay of H = 1000 steps took at M = N_x = 64 on the loaded development machine (0.90 s)
    assert 0.8 < small / 25e9 < 1.2

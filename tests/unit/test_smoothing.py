"""Fixed-lag smoothing (:mod:`mpflow.operators.smoothing`) against a plain-numpy Rauch–Tung–Striebel smoother.

* ``kalman``, lag 10: every smoothed mean and covariance equals the numpy RTS (written here, independently of the
  code under test) to 1e-6 posterior sd;
* ``enkf`` (ensemble RTS) and ``smc`` (backward simulation at N = 4096) at the default N of a smoothing stream
  (2048, 4096): every single run's smoothed means within 0.1 posterior sd of the RTS, smoothed sd within 10 % — on
  data where the smoothed and the filtered estimates differ by up to ~0.9 sd (checked), so a "smoother" answering
  the filter would fail;
* fewer steps than the lag, predict-only steps, static families and the window's bytes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from mpflow.operators.models import make_model
from mpflow.operators.models.priors import prior_from_spec
from mpflow.operators.smoothing import attach, split
from mpflow.operators.updaters import get_updater

from tests.harness.rts import LAG, PARAMS, PRIOR, A, Q, T, data, numpy_rts


def run(method: str, seed: int, ys: list, n: int = 256, lag: int = LAG, family: str = "lds", params=None):
    model = make_model(family, params or PARAMS, 2)
    updater = get_updater(method)
    state = updater.init(prior_from_spec(PRIOR), model, n, seed, smoothing_lag=lag)
    for y in ys:
        obs = torch.tensor([[np.nan] if y is None else y], dtype=torch.float32)
        state, _ = updater.update(state, obs, model)
    return updater, state, updater.smoothed(state)


def test_kalman_lag_10_is_the_numpy_rts_smoother():
    ys = data()
    filtered, means, covs = numpy_rts(ys, LAG)
    _, _, out = run("kalman", 0, ys)
    sd = np.sqrt(np.diagonal(covs, axis1=1, axis2=2))
    assert out.steps.tolist() == list(range(T - LAG + 1, T + 1))
    assert np.abs((out.means.numpy() - means) / sd).max() < 1e-6
    assert np.abs((out.covs.numpy() - covs) / (sd[:, :, None] * sd[:, None, :])).max() < 1e-6
    # the data make smoothing matter: the filtered estimates are far from the smoothed ones
    assert np.abs((filtered[-LAG:] - means) / sd).max() > 0.5


@pytest.mark.parametrize(("method", "seeds"), [("enkf", 8), ("smc", 3)])
def test_particle_and_ensemble_smoothers_agree_with_rts_at_their_default_n(method, seeds):
    """Every single run within 0.1 posterior sd of the RTS (means, the max over the window) and 10 % (sd) at the
    particle count a smoothing stream of the method gets by default (``smoothing_particles``: ``enkf`` 2048, ``smc``
    4096, measured by ``benchmarks/smoothing.py`` over 16 seeds: max 0.078 and 0.112). At N = 256 a single run is up to
    0.28 (``enkf``) and 0.63 (``smc``) sd off — Monte Carlo error, not bias: averaged over 16 seeds ``enkf``'s
    means are within 0.02 sd at N = 1024."""
    ys = data()
    _, means, covs = numpy_rts(ys, LAG)
    sd = np.sqrt(np.diagonal(covs, axis1=1, axis2=2))
    n = get_updater(method).smoothing_particles
    assert n in (2048, 4096)
    for seed in range(seeds):
        out = run(method, seed, ys, n=n)[2]
        assert np.abs((out.means.numpy() - means) / sd).max() < 0.1, seed
        assert np.abs(np.sqrt(np.diagonal(out.covs.numpy(), axis1=1, axis2=2)) / sd - 1).max() < 0.1, seed


def test_at_n_256_a_single_run_misses_but_the_average_does_not():
    """The error at the usual default N = 256 is Monte Carlo: ``enkf``'s single runs miss 0.1 sd, their average
    over 8 seeds does not (so the default N for smoothing, not a bias, is the fix)."""
    ys = data()
    _, means, covs = numpy_rts(ys, LAG)
    sd = np.sqrt(np.diagonal(covs, axis1=1, axis2=2))
    errs = [run("enkf", seed, ys)[2].means.numpy() for seed in range(8)]
    assert max(np.abs((e - means) / sd).max() for e in errs) > 0.1
    assert np.abs((np.mean(errs, 0) - means) / sd).max() < 0.1


def test_fewer_steps_than_the_lag_and_gaps():
    """Six steps (one predict-only) under lag 10: six rows, the newest the filter's; kalman's equal the numpy RTS
    run with the gap as a predict-only step (the reference skips the update where y is None)."""
    ys = data(6)
    ys[2] = None
    _, state, out = run("kalman", 0, ys)
    assert out.steps.tolist() == [1, 2, 3, 4, 5, 6]
    _, means, covs = numpy_rts(ys, 6)
    sd = np.sqrt(np.diagonal(covs, axis1=1, axis2=2))
    assert np.abs((out.means.numpy() - means) / sd).max() < 1e-6
    window, inner = split(state)
    assert window["mean"].shape == (1, LAG, 2)
    torch.testing.assert_close(out.means[-1], inner.extras["mean"][0])
    torch.testing.assert_close(out.covs[-1], inner.extras["cov"][0])
    _, _, particles = run("smc", 0, ys)
    assert particles.steps.tolist() == [1, 2, 3, 4, 5, 6]


def test_a_static_family_smooths_to_its_newest_posterior():
    params = {"H": [[1.0, 0.0], [0.0, 1.0]], "R": [[1.0, 0.0], [0.0, 1.0]]}
    ys = [[0.3, -0.1], [0.5, 0.2], [0.1, 0.0]]
    for method in ("kalman", "gpf"):
        _, _, out = run(method, 0, ys, n=64, lag=3, family="linear_gaussian", params=params)
        torch.testing.assert_close(out.means, out.means[-1:].expand(3, 2), atol=1e-9, rtol=0)


def test_no_window_without_a_lag_and_the_lag_is_bounded():
    model = make_model("lds", PARAMS, 2)
    updater = get_updater("kalman")
    state = updater.init(prior_from_spec(PRIOR), model, 16, 0)
    assert not split(state)[0]
    with pytest.raises(ValueError, match="smoothing_lag"):
        updater.smoothed(state)
    with pytest.raises(ValueError, match="smoothing_lag: an integer from 0 to 100"):
        updater.init(prior_from_spec(PRIOR), model, 16, 0, smoothing_lag=101)


def test_window_bytes_are_what_the_state_holds():
    for method in ("kalman", "smc", "enkf"):
        model = make_model("lds", PARAMS, 2)
        updater = get_updater(method)
        state = updater.init(prior_from_spec(PRIOR), model, 64, 0, smoothing_lag=7)
        window, _ = split(state)
        held = sum(t.numel() * t.element_size() for t in window.values())
        assert updater.smoother.window_bytes(7, 64, 2) == held


def test_ffbsm_and_genealogy_weights_against_their_formulas():
    """One backward link against the formulas written out in numpy (Doucet & Johansen 2011 eq. 49; §5.1)."""
    from mpflow.operators.smoothing.particles import backward_weights, genealogy_weights

    rng = np.random.default_rng(0)
    N, d = 7, 2
    x_s, x_next = rng.normal(size=(N, d)), rng.normal(size=(N, d))
    lw_s, lw_next = np.log(rng.dirichlet(np.ones(N))), np.log(rng.dirichlet(np.ones(N)))
    Qm = np.array([[0.5, 0.1], [0.1, 0.3]])
    fx = x_s @ A.T
    Qi = np.linalg.inv(Qm)
    diff = x_next[None, :, :] - fx[:, None, :]
    K = np.exp(-0.5 * np.einsum("ijk,kl,ijl->ij", diff, Qi, diff))  # K_ij = N(x_next_j; f(x_i), Q) up to a constant
    w_s, w_next = np.exp(lw_s), np.exp(lw_next)
    expected = w_s * (K @ (w_next / (w_s @ K)))
    t = lambda a: torch.tensor(a, dtype=torch.float64)  # noqa: E731
    got = backward_weights(t(lw_s), t(fx), t(x_next), torch.linalg.cholesky(t(Qm)), t(lw_next)).exp().numpy()
    np.testing.assert_allclose(got, expected / expected.sum(), rtol=1e-10)
    ancestors = np.array([0, 0, 3, 3, 3, 6, 1])
    expected = np.zeros(N)
    np.add.at(expected, ancestors, w_next)
    got = genealogy_weights(torch.tensor(ancestors), t(lw_next)).exp().numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-12)


def test_smc_without_a_transition_density_smooths_by_its_genealogy():
    """A static family has no transition density: every link is the genealogy's (no noise factor is kept); the
    answer is the weighted ancestors, the newest the filter's."""
    params = {"H": [[1.0, 0.0], [0.0, 1.0]], "R": [[1.0, 0.0], [0.0, 1.0]]}
    ys = [[0.3 * k, -0.1 * k] for k in range(8)]
    updater, state, out = run("smc", 0, ys, n=128, lag=5, family="linear_gaussian", params=params)
    window, inner = split(state)
    assert not window["noise_factor"].any() and window["ancestors"].ne(torch.arange(128)).any()  # it resampled
    assert torch.isfinite(out.means).all() and out.steps.tolist() == [4, 5, 6, 7, 8]
    torch.testing.assert_close(out.means[-1], updater.filtered_moments(inner)[0][0])


def test_zero_weight_particles_keep_the_window_finite():
    """``smc`` gives an impossible particle log-weight −inf; the window stores it finite (the service refuses any
    state with a non-finite number), and the smoothed answer gives it no weight."""
    model = make_model("lds", PARAMS, 2)
    updater = get_updater("smc", ess_threshold=0.0)  # never resample: the weights are carried
    state = updater.init(prior_from_spec(PRIOR), model, 32, 0, smoothing_lag=3)
    window, inner = split(state)
    inner = inner.replace(log_weights=inner.log_weights.clone().index_fill_(1, torch.tensor([0, 1]), -float("inf")))
    state = attach(inner, window)
    state, _ = updater.update(state, torch.tensor([[0.3]]), model)
    window, _ = split(state)
    assert torch.isfinite(window["log_weights"]).all() and window["log_weights"][0, -1, :2].max() <= -1e29
    assert torch.isfinite(updater.smoothed(state).means).all()


def test_smc_above_the_ffbsm_limit_smooths_by_backward_simulation(monkeypatch):
    """Above FFBSM_MAX_PARTICLES (N = 1024 here) the links are backward simulation's (O(N) per step, not N²):
    another estimate of FFBSm's marginals, within the sampling error of N draws of them (sd / 32 per number; the max
    over 20 numbers under 0.15 sd), not FFBSm's own; a read is reproducible and leaves the stream as it was."""
    from mpflow.operators.smoothing import particles

    ys = data()
    updater, state, simulated = run("smc", 0, ys, n=1024)
    before = state.rng.clone()
    again = updater.smoothed(state)
    torch.testing.assert_close(again.means, simulated.means, rtol=0, atol=0)
    assert torch.equal(state.rng, before)
    monkeypatch.setattr(particles, "FFBSM_MAX_PARTICLES", 10**6)
    reweighted = updater.smoothed(state)
    _, _, covs = numpy_rts(ys, LAG)
    sd = np.sqrt(np.diagonal(covs, axis1=1, axis2=2))
    gap = np.abs((simulated.means - reweighted.means).numpy() / sd)
    assert 0 < gap[:-1].max() < 0.15 and gap[-1].max() < 1e-12  # the newest step is the filter's in both
    monkeypatch.undo()
    model = make_model("lds", PARAMS, 2)
    flops = [updater.smoother.smooth_flops(model, LAG, n) for n in (256, 512, 2048, 4096)]
    assert flops[1] / flops[0] > 3.5 and flops[3] / flops[2] < 2.2  # N² up to the limit, N above it


def test_ffbsm_is_the_same_whatever_its_chunk(monkeypatch):
    """FFBSm's kernel is computed CHUNK columns at a time (cache-sized blocks: the time of a read at N = 512); each
    column's normaliser is its own, so the blocks change the time, not the marginals."""
    from mpflow.operators.smoothing import particles

    updater, state, blocked = run("smc", 0, data(), n=300)  # 300: blocks of 128, 128 and 44
    monkeypatch.setattr(particles, "CHUNK", 1024)
    whole = updater.smoothed(state)
    torch.testing.assert_close(blocked.means, whole.means, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(blocked.covs, whole.covs, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("method", "tol"), [("ukf", 1e-6), ("gpf", 1e-3)])
def test_gaussian_methods_on_a_linear_gaussian_model_are_the_rts_smoother(method, tol):
    """``ukf`` keeps the exact Gaussian; ``gpf``'s moment-matched cloud is exact in its moments up to float32."""
    ys = data(15)
    _, means, covs = numpy_rts(ys, LAG)
    _, _, out = run(method, 0, ys, n=64)
    sd = np.sqrt(np.diagonal(covs, axis1=1, axis2=2))
    assert np.abs((out.means.numpy() - means) / sd).max() < tol
    assert np.abs(np.sqrt(np.diagonal(out.covs.numpy(), axis1=1, axis2=2)) / sd - 1).max() < tol


def test_a_fallback_step_moves_the_window_on_as_the_streams_method():
    """A step computed by another method (the service's fall-back) enters the stream's window as its own method
    records it: a kalman stream's window after a gpf step holds that step's moments and the exact predict."""
    from mpflow.service.engine.fallback import hand_over, take_back

    model = make_model("lds", PARAMS, 2)
    kalman, gpf = get_updater("kalman"), get_updater("gpf")
    state = kalman.init(prior_from_spec(PRIOR), model, 64, 0, smoothing_lag=3)
    obs = torch.tensor([[0.7]])
    new, _ = gpf.update(hand_over(state, kalman, gpf), obs, model)
    back = take_back(new, kalman, gpf, state, obs, model)
    window, inner = split(back)
    assert int(back.step[0]) == 1 and window["mean"].shape == (1, 3, 2)
    torch.testing.assert_close(window["mean"][0, -1], inner.extras["mean"][0])
    torch.testing.assert_close(window["pred_cov"][0, -1], torch.tensor(A @ A.T + Q))  # F P Fᵀ + Q from P = I
    assert kalman.smoothed(back).steps.tolist() == [1]

"""``smc2``'s ``mh`` kernel (:mod:`mpflow.operators.updaters.smc2_mh`): resample-move with MH moves accepted by the
exact Kalman likelihood of the kept window.

* The move leaves the exact posterior invariant: on a 1-D lds with R unknown and 20 observations, a cloud drawn
  from the grid posterior keeps its mean and sd after 10 moves, within Monte Carlo error, over 3 seeds; a stream
  that rejuvenates at every step ends at the grid posterior.
* The replay's likelihood and filter are a plain Kalman filter's; a stream older than its ``history`` starts a new
  block at a checkpoint (the cloud's Gaussian in u as the block's prior, the filters' mixture moments as its start),
  and a stream moved at every step through many blocks still ends at the grid posterior of all its observations.
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
from mpflow.operators.models.priors import GaussianMixture
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


#: the checkpoint :func:`history_extras` hands a full block (its cloud's Gaussian and its state's moments)
CHECKPOINT = smc2_mh.Checkpoint(
    torch.tensor([[0.7]], dtype=torch.float64), torch.tensor([[[0.04]]], dtype=torch.float64),
    torch.tensor([[0.3]], dtype=torch.float64), torch.tensor([[[0.5]]], dtype=torch.float64),
)  # fmt: skip


def history_extras(ys: np.ndarray, H: int = 64) -> dict[str, torch.Tensor]:
    extras = smc2_mh.init_extras(1, H, 1, torch.zeros(1, 1), torch.eye(1)[None], 1)
    for y in ys:
        extras = smc2_mh.append(extras, torch.tensor([[y]]), lambda: CHECKPOINT)
    return extras


def move(theta: torch.Tensor, extras, seed: int, moves: int):
    """:func:`smc2_mh.mh_move` of the lds R θ-particles θ [1, M, 1] under the lognormal(0, 1) prior."""
    lo, hi = torch.zeros(1, 1, 1, dtype=torch.float64), torch.full((1, 1, 1), math.inf, dtype=torch.float64)
    target = smc2_mh.kalman_target(lds_model(), ["R"], {"R": ParamPrior("lognormal", 0.0, 1.0)}, lo, hi, extras)
    _, (th, m, P), acc, _ = smc2_mh.mh_move(torch.log(theta), target, [generator(seed)], moves)
    return th, m, P, acc


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_move_leaves_the_exact_posterior_invariant(seed):
    ys = simulate(seed)
    w = grid_weights(ys)
    ref_mean, ref_sd = moments(w)
    rng = np.random.default_rng(100 + seed)
    M = 2000
    draws = GRID[rng.choice(len(GRID), size=M, p=w)] * np.exp(rng.uniform(-0.5, 0.5, M) * np.log(GRID[1] / GRID[0]))
    theta = torch.tensor(draws, dtype=torch.float64)[None, :, None]
    th, m, P, acc = move(theta, history_extras(ys), seed, 10)
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


def test_the_replay_is_a_kalman_filter_and_a_new_block_starts_from_its_checkpoint():
    ys = simulate(4, 30)
    r = np.array([0.5, 2.0, 7.0])
    theta = torch.tensor(r, dtype=torch.float64)[None, :, None]
    full = history_extras(ys, H=64)
    ll, _, _ = smc2_mh.replay(
        lds_model(), ["R"], theta, full["mh_history"], full["mh_length"], full["mh_start_mean"], full["mh_start_cov"]
    )
    assert np.allclose(ll[0].numpy(), kalman_loglik(ys, r))
    assert float(full["mh_blocks"][0]) == 0 and not bool(smc2_mh.checkpointed(full)[0])
    short = history_extras(ys, H=10)  # blocks of 10: checkpoints at the 11th and the 21st observation
    assert float(short["mh_length"][0]) == 10 and float(short["mh_kept"][0]) == 10
    assert float(short["mh_blocks"][0]) == 2 and bool(smc2_mh.checkpointed(short)[0])
    assert float(short["mh_start_mean"][0, 0]) == 0.3 and float(short["mh_start_cov"][0, 0, 0]) == 0.5
    assert torch.equal(short["mh_block_mean"], CHECKPOINT.u_mean)
    ll, _, _ = smc2_mh.replay(
        lds_model(), ["R"], theta, short["mh_history"], short["mh_length"], short["mh_start_mean"],
        short["mh_start_cov"],
    )  # fmt: skip
    assert np.allclose(ll[0].numpy(), kalman_loglik(ys[20:], r, 0.3, 0.5), rtol=1e-6)
    # the block's prior replaces the stream's: log N(u; 0.7, 0.04) with u = log R
    lo, hi = torch.zeros(1, 1, 1, dtype=torch.float64), torch.full((1, 1, 1), math.inf, dtype=torch.float64)
    target = smc2_mh.kalman_target(lds_model(), ["R"], {"R": ParamPrior("lognormal", 0.0, 1.0)}, lo, hi, short)
    lp, _ = target(torch.log(theta))
    u = np.log(r)
    expected = kalman_loglik(ys[20:], r, 0.3, 0.5) - 0.5 * (u - 0.7) ** 2 / 0.04 - 0.5 * math.log(2 * math.pi * 0.04)
    assert np.allclose(lp[0].numpy(), expected, rtol=1e-6)


@pytest.mark.parametrize("seed", [0, 1])
def test_a_stream_through_many_blocks_keeps_what_the_old_ones_said(seed):
    """400 observations in blocks of 40, the cloud moved at every step: the posterior of all 400 (a window of the
    last 40 alone would be about √10 ≈ 3 times as wide)."""
    ys = simulate(10 + seed, 400)
    ref_mean, ref_sd = moments(grid_weights(ys))
    model = lds_model()
    updater = get_updater("smc2", kernel="mh", ess_threshold=1.0, mh_moves=2, theta_particles=256, history=40)
    state = updater.init(GAUSS1, model, 256, seed)
    for y in ys:
        state, _ = updater.update(state, torch.tensor([[y]], dtype=torch.float32), model)
    assert float(state.extras["mh_blocks"][0]) == 9
    mean, sd = theta_moments(state)
    assert abs(mean - ref_mean) < 0.5 * ref_sd, (mean, ref_mean, ref_sd)
    assert abs(sd / ref_sd - 1) < 0.3, (sd, ref_sd)


def test_missing_observations_are_kept_and_replayed_as_predictions():
    ys = simulate(5, 12)
    model = lds_model()
    extras = smc2_mh.init_extras(1, 16, 1, torch.zeros(1, 1), torch.eye(1)[None], 1)
    for i, y in enumerate(ys):
        obs = None if i in (3, 7) else torch.tensor([[y]])
        extras = smc2_mh.append(extras, obs, lambda: CHECKPOINT)
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
    assert float(state.extras["mh_length"][0]) == 5 and float(state.extras["mh_blocks"][0]) == 1
    assert float(state.extras["mh_kept"][0]) == 25
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


def grid_increments(ys: np.ndarray, prior: tuple[float, float]) -> np.ndarray:
    """Each step's log-evidence increment of the local level x_m = x_{m−1} + N(0, Q), o_m = x_m + N(0, R) from
    x_0 ~ N(0, 1), log Q and log R ~ N(prior) each, on a 240 × 240 log grid over [1e-9, 1e3]²."""
    g = np.exp(np.linspace(math.log(1e-9), math.log(1e3), 240))
    q, r = (a.ravel() for a in np.meshgrid(g, g, indexing="ij"))
    lw = -0.5 * ((np.log(q) - prior[0]) / prior[1]) ** 2 - 0.5 * ((np.log(r) - prior[0]) / prior[1]) ** 2
    lw -= np.logaddexp.reduce(lw)
    m, P, out = np.zeros_like(q), np.ones_like(q), []
    for y in ys:
        P = P + q
        S = P + r
        a = lw - 0.5 * (np.log(2 * np.pi * S) + (y - m) ** 2 / S)
        out.append(np.logaddexp.reduce(a))
        lw = a - out[-1]
        m, P = m + P / S * (y - m), (1 - P / S) * P
    return np.array(out)


@pytest.mark.parametrize("seed", [0, 1])
def test_defensive_particles_keep_the_tail_a_jump_after_identical_readings_needs(seed):
    """Twelve identical readings, then a jump of 3: the exact posterior of (Q, R) sat at tiny values, so the jump's
    evidence increment is π's tail — within a few nats of the grid's with the prior's draws weighted by eq. M3
    (M = 1024, 51 of them), a hundred and more below it without them."""
    prior = (math.log(0.01), 1.0)  # the posterior before the jump within the grid's range (R ≈ 3e-5)
    ln = {"prior": {"type": "lognormal", "mean": prior[0], "sd": prior[1]}}
    model = make_model("lds", {"A": [[1.0]], "B": [[1.0]], "Q": ln, "R": ln}, 1)
    ys = np.array([0.5] * 12 + [3.5, 3.4, 3.6])
    ref = grid_increments(ys, prior)
    got = {}
    for share in (0.05, 0.0):
        updater = get_updater("smc2", kernel="mh", theta_particles=1024, defensive=share)
        state = updater.init(GAUSS1, model, 1024, seed)
        got[share] = []
        for y in ys:
            state, info = updater.update(state, torch.tensor([[y]], dtype=torch.float32), model)
            got[share].append(float(info.log_evidence_increment[0]))
    assert np.allclose(got[0.05][:12], ref[:12], atol=0.2)  # before the jump the cloud holds π
    assert abs(got[0.05][12] - ref[12]) < 10.0, (got[0.05][12], ref[12])
    assert abs(sum(got[0.05]) - ref.sum()) < 15.0, (sum(got[0.05]), ref.sum())
    assert got[0.0][12] < ref[12] - 80, (got[0.0][12], ref[12])


def test_a_state_stored_before_blocks_steps_on():
    """A stream created by the version with a sliding window (no ``mh_kept``, ``mh_blocks``, ``mh_block_*``) takes
    its next step as a first block of its window, and keeps the current state's fields from then on."""
    ys = simulate(7, 30)
    model = lds_model()
    updater = get_updater("smc2", kernel="mh", history=10, ess_threshold=1.0, theta_particles=64)
    state = updater.init(GAUSS1, model, 64, 0)
    for y in ys[:10]:
        state, _ = updater.update(state, torch.tensor([[y]], dtype=torch.float32), model)
    old = {k: v for k, v in state.extras.items() if k not in {"mh_kept", "mh_blocks", "mh_block_evidence",
                                                               "mh_block_mean", "mh_block_cov"}}  # fmt: skip
    state = ParticleState.from_bytes(state.replace(extras=old).to_bytes())
    for y in ys[10:]:
        state, info = updater.update(state, torch.tensor([[y]], dtype=torch.float32), model)
        assert math.isfinite(float(info.log_evidence_increment[0]))
    assert float(state.extras["mh_blocks"][0]) == 2 and float(state.extras["mh_kept"][0]) == 10
    mean, _ = theta_moments(state)
    assert 0.2 < mean < 20


BAD_OPTIONS = {
    "history 0": ({"history": 0}, "options.history"),
    "history too long": ({"history": smc2_mh.MAX_HISTORY + 1}, "options.history"),
    "history a float": ({"history": 10.5}, "options.history"),
    "moves 0": ({"mh_moves": 0}, "options.mh_moves"),
    "moves a bool": ({"mh_moves": True}, "options.mh_moves"),
    "moves too many": ({"mh_moves": smc2_mh.MAX_MOVES + 1}, "options.mh_moves"),
    "kernel": ({"kernel": "pmmh"}, "options.kernel"),
    "defensive above a half": ({"defensive": 0.6}, "options.defensive"),
    "defensive a string": ({"defensive": "yes"}, "options.defensive"),
}


@pytest.mark.parametrize("case", sorted(BAD_OPTIONS))
def test_bad_options_are_refused_naming_the_field(case):
    options, says = BAD_OPTIONS[case]
    with pytest.raises(ValueError, match=says.replace(".", r"\.")):
        get_updater("smc2", **options)


def test_mh_needs_a_gaussian_prior_and_runs_a_particle_filter_per_theta_where_there_is_no_kalman_filter():
    sv = make_model("stochastic_volatility", {"mu": 0.0, "phi": 0.95, "sigma": LOGNORMAL}, 1)
    mixture = GaussianMixture(
        torch.tensor([[0.5, 0.5]]), torch.tensor([[[-1.0], [1.0]]]), torch.eye(1)[None, None].expand(1, 2, 1, 1)
    )
    with pytest.raises(ValueError, match=r"options\.kernel: mh replays its window from the prior's Gaussian"):
        get_updater("smc2", kernel="mh").init(mixture, sv, 64, 0)
    updater = get_updater("smc2", kernel="mh", history=20, ess_threshold=1.0, theta_particles=16)
    state = updater.init(GAUSS1, sv, 256, 0)
    for y in (0.3, -1.2, 0.8, 2.5, -0.1):
        state, info = updater.update(state, torch.tensor([[y]], dtype=torch.float32), sv)
    sigma = state.extras["param.sigma"][0]
    assert bool(torch.isfinite(sigma).all()) and len(torch.unique(sigma)) > 1  # moved, by particle-filter replays
    assert state.extras["mh_history"].shape == (1, 20, 1)


def test_the_price_holds_the_move_on_every_step_it_may_fire():
    model = lds_model()
    plain = get_updater("smc2").step_work(model, 1024)
    short = get_updater("smc2", kernel="mh", history=100, mh_moves=3).step_work(model, 1024)
    long = get_updater("smc2", kernel="mh", history=1000, mh_moves=3).step_work(model, 1024)
    move = long.flops - plain.flops
    assert short.flops > plain.flops and move > 9 * (short.flops - plain.flops)
    per_replayed_step = move / (4 * 1000)
    assert per_replayed_step >= smc2_mh.REPLAY_STEP_FLOPS[True]

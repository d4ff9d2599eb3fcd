"""The learned parameter observer (:mod:`mpflow.operators.param_observer`) and ``smc2``'s independence proposal from it
(:mod:`mpflow.operators.updaters.smc2_proposal`).

* The features are scale-free: scaling the observations by c leaves them and moves the log-variance by log c².
* The independence move leaves the exact posterior invariant (a cloud drawn from the grid posterior of R keeps its
  mean and sd) — with the shipped observer and with an untrained one, whose answer is arbitrary.
* It travels: a cloud collapsed onto R = 0.01 where the data say R ≈ 2 stays there under random walks and reaches
  the grid posterior within a few moves with the observer's.
* A parameter the stream gives as a number is conditioned on; ``observer`` options are resolved or refused naming
  the field; a stream with an observer re-seeds a degenerate cloud whatever its θ-ESS.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from mpflow.operators.models import make_model
from mpflow.operators.models.param_priors import ParamPrior
from mpflow.operators.param_observer import ParamObserver, find_observer, window_features
from mpflow.operators.rng import generator
from mpflow.operators.updaters import get_updater, smc2_mh, smc2_proposal
from mpflow.operators.updaters.smc2 import cloud_health

from tests.unit.test_smc2 import GAUSS1, LOGNORMAL, theta_moments
from tests.unit.test_smc2_mh import GRID, grid_weights, lds_model, moments, simulate

LO = torch.zeros(1, 1, 1, dtype=torch.float64)
HI = torch.full((1, 1, 1), math.inf, dtype=torch.float64)
PRIORS = {"R": ParamPrior("lognormal", 0.0, 1.0)}


def extras_of(ys: np.ndarray) -> dict[str, torch.Tensor]:
    extras = smc2_mh.init_extras(1, 128, 1, torch.zeros(1, 1), torch.eye(1)[None], 1)
    for y in ys:
        extras = smc2_mh.append(extras, torch.tensor([[y]]), lambda: None)
    return extras


def shipped(family: str = "lds"):
    record = find_observer(family, include_named_only=True)
    assert record is not None, f"no parameter observer of {family} ships in operators/pretrained"
    return smc2_proposal.resolve(
        record.name, make_model_for(family), ["R"] if family != "stochastic_volatility" else ["phi"]
    )


def make_model_for(family: str):
    if family == "lds":
        return lds_model()
    if family == "linear_gaussian":
        return make_model("linear_gaussian", {"R": LOGNORMAL}, 1)
    return make_model(
        "stochastic_volatility",
        {"mu": 0.0, "phi": {"prior": {"type": "uniform", "low": 0.5, "high": 0.995}}, "sigma": 0.3},
        1,
    )


def run_moves(theta: np.ndarray, ys: np.ndarray, seed: int, moves: int, net) -> np.ndarray:
    extras = extras_of(ys)
    target = smc2_mh.kalman_target(lds_model(), ["R"], PRIORS, LO, HI, extras)
    proposal = None
    if net is not None:
        proposal = smc2_proposal.observer_proposal(net, lds_model(), ["R"], extras, LO, HI)
        assert proposal is not None
    u = torch.log(torch.tensor(theta, dtype=torch.float64))[None, :, None]
    _, (th, _, _), _, _ = smc2_mh.mh_move(u, target, [generator(seed)], moves, proposal)
    return th[0, :, 0].numpy()


def test_the_features_are_scale_free():
    rng = np.random.default_rng(0)
    y = torch.tensor(np.cumsum(rng.standard_normal((3, 200)), 1) + rng.standard_normal((3, 200)))
    mask = torch.rand(3, 200, generator=torch.Generator().manual_seed(1)) > 0.1
    f1, v1 = window_features(y, mask)
    f2, v2 = window_features(37.0 * y, mask)
    assert torch.allclose(f1, f2, atol=1e-9)
    assert torch.allclose(v2 - v1, torch.full_like(v1, 2 * math.log(37.0)))
    flat, _ = window_features(torch.full((1, 50), 3.0), torch.ones(1, 50, dtype=torch.bool))  # identical readings
    assert bool(torch.isfinite(flat).all())


@pytest.mark.parametrize("which", ["shipped", "untrained"])
def test_the_independence_move_leaves_the_exact_posterior_invariant(which):
    ys = simulate(3, 40)
    w = grid_weights(ys)
    ref_mean, ref_sd = moments(w)
    rng = np.random.default_rng(7)
    M = 2000
    draws = GRID[rng.choice(len(GRID), size=M, p=w)]
    net = shipped() if which == "shipped" else ParamObserver(2, 2, [True, True]).eval()
    moved = run_moves(draws, ys, 5, 6, net)
    se = ref_sd / math.sqrt(M / 10)
    assert abs(moved.mean() - ref_mean) < 4 * se, (moved.mean(), ref_mean, ref_sd)
    assert abs(moved.std() / ref_sd - 1) < 0.1, (moved.std(), ref_sd)


def test_the_observer_brings_a_collapsed_cloud_to_the_data():
    ys = simulate(8, 60)
    ref_mean, ref_sd = moments(grid_weights(ys))
    stuck = np.full(512, 0.01)
    walked = run_moves(stuck, ys, 1, 6, None)
    assert walked.max() < 0.02  # a random walk scaled by a collapsed cloud's spread cannot leave it
    moved = run_moves(stuck, ys, 1, 6, shipped())
    assert abs(moved.mean() - ref_mean) < 0.3 * ref_sd, (moved.mean(), ref_mean, ref_sd)
    assert abs(moved.std() / ref_sd - 1) < 0.25, (moved.std(), ref_sd)


def test_a_known_parameter_is_conditioned_on():
    ys = simulate(2, 100)
    extras = extras_of(ys)
    net = shipped()
    q_known = lds_model()  # Q = 1 given as a number, R unknown
    proposal = smc2_proposal.observer_proposal(net, q_known, ["R"], extras, LO, HI)
    u = proposal.sample([generator(0)], 4000)
    assert u.shape == (1, 4000, 1) and bool(torch.isfinite(u).all())
    r = torch.exp(u[0, :, 0])
    assert 0.5 < float(r.median()) < 8.0  # around the truth R = 2, Q = 1 known
    lp = proposal.log_prob(u)
    assert lp.shape == (1, 4000) and bool(torch.isfinite(lp).all())
    # the density integrates to one over u (a histogram check of the t's log-density)
    grid = torch.linspace(-6, 6, 4001, dtype=torch.float64)[None, :, None]
    mass = float(torch.exp(proposal.log_prob(grid)).sum() * (12 / 4000))
    assert abs(mass - 1) < 1e-3


def test_observer_options_are_resolved_or_refused():
    model = lds_model()
    assert smc2_proposal.resolve("none", model, ["R"]) is None
    assert smc2_proposal.resolve("lds-d1-v1", model, ["R"]) is not None
    assert smc2_proposal.resolve("auto", model, ["R"]) is None  # none ships marked to serve by default
    d2 = make_model("lds", {"A": [[0.9, 0], [0, 0.9]], "B": [[1.0, 0.0]], "R": LOGNORMAL}, 2)
    assert smc2_proposal.resolve("auto", d2, ["R"]) is None  # outside every observer's domain: runs without
    with pytest.raises(ValueError, match=r"options\.observer"):
        smc2_proposal.resolve("lds-d9-v9", model, ["R"])
    with pytest.raises(ValueError, match=r"options\.observer"):
        smc2_proposal.resolve(find_observer("linear_gaussian", include_named_only=True).name, model, ["R"])
    with pytest.raises(ValueError, match=r"options\.observer"):
        get_updater("smc2", observer=3)
    with pytest.raises(ValueError, match=r"options\.observer"):
        get_updater("smc2", kernel="mh", observer="lds-d9-v9").init(GAUSS1, model, 64, 0)


def test_a_degenerate_cloud_is_reseeded_with_an_observer():
    ys = simulate(9, 80)
    model = lds_model()
    updater = get_updater("smc2", kernel="mh", observer="lds-d1-v1", theta_particles=256, history=200)
    state = updater.init(GAUSS1, model, 256, 0)
    for y in ys[:40]:
        state, _ = updater.update(state, torch.tensor([[y]], dtype=torch.float32), model)
    state = state.replace(extras={**state.extras, "param.R": torch.full_like(state.extras["param.R"], 0.01)})
    assert bool(cloud_health(state.extras).degenerate[0])
    for y in ys[40:45]:
        state, _ = updater.update(state, torch.tensor([[y]], dtype=torch.float32), model)
    assert not bool(cloud_health(state.extras).degenerate[0])
    mean, _ = theta_moments(state)
    assert mean > 0.3

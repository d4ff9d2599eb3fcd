"""``lorenz96``: the ODE and its RK4 integration, per-stream step counts, model noise, the observation operator and
ring distances, which methods run its nonlinear transition (and the refusal of the others), and a short filter run."""

from __future__ import annotations

import math

import pytest
import torch
from mpflow.operators.models import FAMILIES, make_model
from mpflow.operators.models.lorenz96 import rk4, tendency
from mpflow.operators.models.priors import prior_from_spec
from mpflow.operators.mpf.step import predict
from mpflow.operators.rng import generator
from mpflow.operators.updaters import UPDATERS, get_updater
from mpflow.service.engine.catalogue import methods_for

F64 = torch.float64


def test_tendency_is_the_lorenz96_right_hand_side():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0], dtype=F64)
    want = [(x[(i + 1) % 5] - x[i - 2]) * x[i - 1] - x[i] + 8.0 for i in range(5)]
    torch.testing.assert_close(tendency(x, torch.tensor(8.0, dtype=F64)), torch.stack(want))
    # the fixed point x_i = F
    torch.testing.assert_close(
        tendency(torch.full((6,), 8.0, dtype=F64), torch.tensor(8.0, dtype=F64)), torch.zeros(6, dtype=F64)
    )


def test_rk4_over_delta_converges_and_each_stream_takes_its_own_steps():
    x0 = 8.0 + torch.randn(1, 3, 10, generator=generator(0), dtype=F64)
    coarse = make_model("lorenz96", {"delta": 0.1, "rk4_step": 0.05}, 10, F64)
    fine = make_model("lorenz96", {"delta": 0.1, "rk4_step": 0.001}, 10, F64)
    half = make_model("lorenz96", {"delta": 0.1, "rk4_step": 0.025}, 10, F64)
    a, b = coarse.transition_mean(x0), fine.transition_mean(x0)
    err, err_half = float((a - b).abs().max()), float((half.transition_mean(x0) - b).abs().max())
    assert err < 0.02 and err_half < err / 8  # RK4: error O(h⁴)
    two = rk4(rk4(x0, torch.tensor(8.0, dtype=F64), torch.tensor(0.05, dtype=F64)), torch.tensor(8.0, dtype=F64), 0.05)
    torch.testing.assert_close(a, two)
    # a batch of streams with different Δ and steps: each as it is alone
    other = make_model("lorenz96", {"delta": 0.25, "rk4_step": 0.1, "F": 5.0}, 10, F64)
    batch = type(coarse).stack([coarse, other])
    xb = torch.cat([x0, x0 + 1])
    got = batch.transition_mean(xb)
    assert torch.equal(got[:1], a) and torch.equal(got[1:], other.transition_mean(x0 + 1))
    # at_step(k): a step of k observation intervals
    torch.testing.assert_close(
        coarse.at_step(2.0).transition_mean(x0), coarse.transition_mean(coarse.transition_mean(x0))
    )


def test_model_noise_is_added_with_variance_q():
    model = make_model("lorenz96", {"Q": 0.04}, 8, F64)
    x0 = torch.full((1, 50_000, 8), 3.0, dtype=F64)
    noise = model.transition(x0, [generator(1)]) - model.transition_mean(x0)
    assert float(noise.var()) == pytest.approx(0.04, rel=0.02)
    torch.testing.assert_close(model.transition_noise()[0], 0.04 * torch.eye(8, dtype=F64))
    with pytest.raises(TypeError, match="nonlinear"):
        model.transition_affine()


def test_observation_every_kth_variable_arctan_and_ring_distances():
    model = make_model("lorenz96", {"obs_every": 3, "arctan": True, "R": 0.25}, 8, F64)
    assert model.obs_shape == (3,)  # variables 0, 3, 6
    x = torch.arange(8, dtype=F64)[None, None]
    torch.testing.assert_close(
        model.observation_function(x)[0, 0], torch.atan(torch.tensor([0.0, 3.0, 6.0], dtype=F64))
    )
    torch.testing.assert_close(model.observation_noise()[0], 0.25 * torch.eye(3, dtype=F64))
    dist = model.localisation_distances()[0]
    assert dist.shape == (8, 3)
    assert dist[:, 0].tolist() == [0, 1, 2, 3, 4, 3, 2, 1] and dist[7, 2].tolist() == 1.0
    with pytest.raises(ValueError, match=r"^model\.params\.obs_every"):
        make_model("lorenz96", {"obs_every": 9}, 8)
    with pytest.raises(ValueError, match=r"^prior: the lorenz96 family needs at least 4"):
        make_model("lorenz96", {}, 3)


def test_only_the_methods_that_move_particles_through_the_transition_run_it():
    assert methods_for(FAMILIES["lorenz96"]) == ["enkf", "ienkf", "mpf", "smc", "ukf"]
    model = make_model("lorenz96", {}, 6)
    learning = {m for m, cls in UPDATERS.items() if cls.unknown_params}  # smc2 runs it, with priors given
    for name in sorted(set(UPDATERS) - {"enkf", "ienkf", "mpf", "smc", "ukf"} - learning):
        with pytest.raises(ValueError, match=r"^method: ") as exc:
            get_updater(name).check_compatible(model)
        assert "lorenz96" in str(exc.value)
        if name != "kalman":
            assert "nonlinear" in str(exc.value)


def twin(d: int = 10, steps: int = 40, seed: int = 0, **params):
    """A truth spun up onto the attractor and its observations (every other variable, R = 1)."""
    model = make_model("lorenz96", {"obs_every": 2, **params}, d)
    gens = [generator(seed)]
    x = 8.0 + torch.randn(1, d, generator=gens[0])
    for _ in range(200):
        x = model.transition_mean(x[:, None])[:, 0]
    xs, obs = model.simulate(steps, x, gens)
    prior = prior_from_spec({"type": "gaussian", "mean": (x[0] + 0.5).tolist(), "cov": torch.eye(d).tolist()}, d)
    return model, prior, xs, obs


def test_the_predictive_moments_of_a_nonlinear_transition_are_the_mapped_clouds_plus_q():
    """m = Σ wᵢ f(xᵢ), C = Σ wᵢ (f(xᵢ) − m)(f(xᵢ) − m)ᵀ + Q: exact noise, the cloud mapped through RK4."""
    model = make_model("lorenz96", {"Q": 0.3}, 6)
    x = 8.0 + torch.randn(1, 50, 6, dtype=torch.float64, generator=generator(3))
    lw = torch.log_softmax(torch.randn(1, 50, dtype=torch.float64, generator=generator(4)), -1)
    mean, cov = model.to(torch.float64).predicted_moments(x, lw)
    fx = model.to(torch.float64).transition_mean(x)[0]
    w = lw[0].exp()
    m = (w[:, None] * fx).sum(0)
    c = ((fx - m).T * w) @ (fx - m) + 0.3 * torch.eye(6, dtype=torch.float64)
    assert torch.allclose(mean[0], m) and torch.allclose(cov[0], c)


def test_propagate_maps_the_cloud_through_f_once_with_the_draws_and_moments_of_the_separate_calls(monkeypatch):
    """``propagate`` = (``transition``, ``predicted_moments``) from the same generator state, with f applied once."""
    model = make_model("lorenz96", {"Q": 0.3}, 6).to(torch.float64)
    x = 8.0 + torch.randn(2, 50, 6, dtype=torch.float64, generator=generator(3))
    moved = model.transition(x, [generator(9), generator(10)])
    mean, cov = model.predicted_moments(x)
    calls = []
    f = type(model).transition_mean
    monkeypatch.setattr(type(model), "transition_mean", lambda self, z: calls.append(1) or f(self, z))
    moved2, mean2, cov2 = model.propagate(x, [generator(9), generator(10)])
    assert len(calls) == 1
    assert torch.equal(moved2, moved) and torch.allclose(mean2, mean) and torch.allclose(cov2, cov)


def test_mpf_inflates_the_predictive_anomalies_by_rho():
    """``inflation`` ρ: mpf's predicted cloud has the predictive's mean and ρ² its covariance (the same draws
    uninflated give the covariance itself); ρ outside [1, 10) is refused, naming the option."""
    model = make_model("lorenz96", {"Q": 0.1}, 6).to(F64)
    x = 8.0 + torch.randn(1, 64, 6, dtype=F64, generator=generator(3))
    mean, cov = model.predicted_moments(x)
    for rho in (1.0, 1.1):
        moved, _, _ = predict(model, x, [generator(4)], density=False, inflation=rho)
        m = moved[0].mean(0)
        c = (moved[0] - m).T @ (moved[0] - m) / 64
        assert torch.allclose(m, mean[0]) and torch.allclose(c, rho**2 * cov[0])
    for bad in (0.9, 10, True, "1.1"):
        with pytest.raises(ValueError, match=r"options\.inflation"):
            get_updater("mpf", inflation=bad)


def test_mpf_reports_n_on_an_exact_step_and_computes_the_health_ess_otherwise():
    """With a linear observation the base flow is exact for the predictive's Gaussian fit: the step's ESS is N,
    not computed; with ``arctan`` it is the weights' ESS (below N)."""
    for arctan, exact in ((False, True), (True, False)):
        model, prior, _, obs = twin(arctan=arctan)
        u = get_updater("mpf")
        _, info = u.update(u.init(prior, model, 64, seed=1), obs[:, 0], model)
        assert (float(info.ess[0]) == 64.0) == exact


@pytest.mark.parametrize(
    "method,n,options",
    [
        ("enkf", 40, {"inflation": 1.05}),
        ("ukf", 1, {}),
        ("smc", 2000, {"rejuvenate": "always"}),
        ("mpf", 64, {}),
        ("mpf", 256, {"correct": True, "rejuvenate": "always", "shrinkage": 0.9}),
    ],
)
def test_filters_track_the_truth(method, n, options):
    """Every other variable observed with R = 1: the analysis RMSE stays well under the observation noise and the
    attractor's spread (~3.6)."""
    model, prior, xs, obs = twin()
    u = get_updater(method, **options)
    state = u.init(prior, model, n, seed=1)
    errs = []
    for m in range(obs.shape[1]):
        missing = m % 10 == 9  # a step without a measurement now and then: predict only
        o = torch.full_like(obs[:, m], math.nan) if missing else obs[:, m]
        state, info = u.update(state, o, model)
        if missing:
            assert float(info.log_evidence_increment[0]) == 0.0
        w = torch.softmax(state.log_weights[0].double(), -1)
        mean = (w[:, None] * state.particles[0].double()).sum(0)
        errs.append(float((mean - xs[0, m].double()).pow(2).mean().sqrt()))
    assert sum(errs[20:]) / 20 < 0.8, (method, errs)


def test_the_linear_observation_is_given_as_h_and_r():
    """Without arctan, o = H x + N(0, R I) with H picking every k-th variable: log N(o; H x, R) is the family's
    log-likelihood, also at a partial observation's gaps (H's row zero there); with arctan there is no (H, R)."""
    model = make_model("lorenz96", {"obs_every": 2, "R": 0.7}, 6).to(torch.float64)
    assert model.linear_observation()
    x = torch.randn(1, 5, 6, dtype=torch.float64, generator=generator(5))
    for obs, seen in (([0.3, -1.0, 2.0], [1.0, 1.0, 1.0]), ([0.3, math.nan, 2.0], [1.0, 0.0, 1.0])):
        part, o = model.observed_part(torch.tensor([obs], dtype=torch.float64))
        H, R = part.observation_affine()
        assert torch.equal(H[0], torch.eye(6, dtype=torch.float64)[[0, 2, 4]] * torch.tensor(seen)[:, None])
        var = R.diagonal(dim1=-2, dim2=-1)[:, None]  # [1, 1, k]
        r = o[:, None] - x @ H.transpose(-1, -2)
        log_n = (-0.5 * r**2 / var - 0.5 * torch.log(2 * math.pi * var)) * torch.tensor(seen)
        assert torch.allclose(log_n.sum(-1), part.log_likelihood(o, x))
    arctan = make_model("lorenz96", {"arctan": True}, 6)
    assert not arctan.linear_observation()
    assert not make_model("lorenz96", {"arctan": 1}, 6).linear_observation()  # the REST API sends numbers
    assert make_model("lorenz96", {"arctan": 0}, 6).linear_observation()
    with pytest.raises(ValueError, match=r"arctan: must be true or false \(1 or 0\), got 2"):
        make_model("lorenz96", {"arctan": 2}, 6)
    with pytest.raises(TypeError, match="arctan"):
        arctan.observation_affine()

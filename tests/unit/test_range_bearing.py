"""``range_bearing``: the constant-velocity transition, the wrapped bearing residual, range-only and bearing-only
observations, and a target crossing behind the sensor (its bearing passing ±π) filtered without breaking."""

from __future__ import annotations

import math

import pytest
import torch
from mpflow.operators.models import FAMILIES, make_model
from mpflow.operators.models.priors import prior_from_spec
from mpflow.operators.rng import generator
from mpflow.operators.trained_operators import outside_domain
from mpflow.operators.updaters import get_updater
from mpflow.training.task_distribution import task_distribution

F64 = torch.float64
NAN = math.nan


def test_transition_is_the_white_noise_acceleration_model_and_at_step_scales_the_interval():
    model = make_model("range_bearing", {"dt": 0.5, "q": 2.0}, 4, F64)
    F, c, Q = (t[0] for t in model.transition_affine())
    dt, q, eye = 0.5, 2.0, torch.eye(2, dtype=F64)
    torch.testing.assert_close(F, torch.cat([torch.cat([eye, dt * eye], 1), torch.cat([0 * eye, eye], 1)]))
    want_q = q * torch.cat(
        [torch.cat([dt**3 / 3 * eye, dt**2 / 2 * eye], 1), torch.cat([dt**2 / 2 * eye, dt * eye], 1)]
    )
    torch.testing.assert_close(Q, want_q)
    assert torch.equal(c, torch.zeros(4, dtype=F64))
    longer = model.at_step(3.0).transition_affine()
    same = make_model("range_bearing", {"dt": 1.5, "q": 2.0}, 4, F64).transition_affine()
    for a, b in zip(longer, same, strict=True):
        torch.testing.assert_close(a, b)
    assert model.at_step(1.0) is model
    with pytest.raises(ValueError, match=r"^observation\.u"):
        model.at_step(1.0, torch.ones(1))
    # moments of the sampled transition, within 5 standard errors
    M = 100_000
    x0 = torch.tensor([1.0, -2.0, 0.5, 0.3], dtype=F64)
    y = model.transition(x0.expand(1, M, 4).clone(), [generator(3)])[0]
    se = y.std(0) / math.sqrt(M)
    assert ((y.mean(0) - F @ x0).abs() <= 5 * se).all()
    torch.testing.assert_close(torch.cov(y.T), Q, atol=0.02, rtol=0.02)


def test_the_bearing_residual_wraps_at_pi_and_the_likelihood_is_continuous_across_it():
    model = make_model("range_bearing", {"bearing_sd": 0.05}, 4, F64)
    # a target just above and just below the sensor's back axis (bearing ≈ ±π), observed at bearing π − 0.01
    x = torch.tensor([[[-10.0, 0.1, 0, 0], [-10.0, -0.1, 0, 0]]], dtype=F64)
    obs = torch.tensor([[10.0, math.pi - 0.01]], dtype=F64)
    r = model.observation_residual(obs, model.observed_mean(x))[0, :, 1]
    assert r.abs().max() < 0.03  # not 2π − 0.02
    ll = model.log_likelihood(obs, x)[0]
    # the target below the axis (bearing −π + 0.01) is 0.02 rad from the observation (wrapped), above it 0.0
    assert float(ll[0] - ll[1]) == pytest.approx(0.5 * ((0.02 / 0.05) ** 2 - (0.0 / 0.05) ** 2), abs=5e-3)
    assert torch.isfinite(model.score(obs, x)).all()


def test_range_only_and_bearing_only_observations_condition_on_that_entry_alone():
    model = make_model("range_bearing", {"sensor": [1.0, 1.0]}, 4, F64)
    angles = torch.linspace(-3, 3, 7, dtype=F64)
    on_circle = torch.stack([1 + 5 * torch.cos(angles), 1 + 5 * torch.sin(angles)], -1)
    x = torch.cat([on_circle, torch.zeros(7, 2, dtype=F64)], -1)[None]
    ranged, o = model.observed_part(torch.tensor([[5.3, NAN]], dtype=F64))
    ll = ranged.log_likelihood(o, x)[0]
    torch.testing.assert_close(ll, ll[:1].expand(7))  # every point at range 5: the same likelihood
    assert float(ll[0]) == pytest.approx(-0.5 * 0.3**2 - 0.5 * math.log(2 * math.pi), abs=1e-9)
    along_ray = torch.tensor([[[1 + r, 1.0, 0, 0] for r in (1.0, 4.0, 20.0)]], dtype=F64)
    beared, o = model.observed_part(torch.tensor([[NAN, 0.01]], dtype=F64))
    ll = beared.log_likelihood(o, along_ray)[0]
    torch.testing.assert_close(ll, ll[:1].expand(3))
    assert float(beared.observation_log_offset()[0]) == pytest.approx(0.5 * math.log(2 * math.pi))


def crossing(seed: int = 4, steps: int = 10) -> tuple[object, object, torch.Tensor, torch.Tensor]:
    """A target passing behind a sensor at the origin: from (−10, 4) heading down across the negative x axis."""
    model = make_model("range_bearing", {"q": 0.05, "range_sd": 0.5, "bearing_sd": 0.05}, 4)
    truth0 = [-10.0, 4.0, 0.0, -1.0]
    xs, obs = model.simulate(steps, torch.tensor([truth0]), [generator(seed)])
    cov = torch.diag(torch.tensor([1.0, 1.0, 0.25, 0.25])).tolist()
    return model, prior_from_spec({"type": "gaussian", "mean": truth0, "cov": cov}, 4), xs, obs


@pytest.mark.parametrize("method,n", [("smc", 2000), ("ukf", 64), ("enkf", 256), ("mpf", 256)])
def test_a_target_crossing_behind_the_sensor_is_tracked(method, n):
    model, prior, xs, obs = crossing()
    bearings = obs[0, :, 1]
    assert bool((bearings > 3.0).any()) and bool((bearings < -3.0).any())  # the bearing does cross ±π
    u = get_updater(method)
    state = u.init(prior, model, n, seed=1)
    errors = []
    for m in range(obs.shape[1]):
        state, info = u.update(state, obs[:, m], model)
        assert torch.isfinite(info.log_evidence_increment).all()
        w = torch.softmax(state.log_weights[0].double(), -1)
        mean = (w[:, None] * state.particles[0].double()).sum(0)
        errors.append(float((mean[:2] - xs[0, m, :2].double()).norm()))
    # the measurement noise alone leaves ~0.5 of position error (0.5 in range, 0.05 rad at range ~11)
    assert max(errors) < 1.5 and sum(errors) / len(errors) < 0.9, (method, errors)


def test_training_tasks_are_tracking_geometries_inside_the_recorded_domain():
    """``sample_task_models``: per-task q and noise sds in ``TASK_RANGES``, the prior centred on a target 2–12 from
    the sensor (every direction, so some tasks pass behind it), moving at 0.2–1.5; every task, and both scenarios
    of ``benchmarks.range_bearing`` (crossing, close pass), lie inside ``task_domain``; a sensor elsewhere does not."""
    from mpflow.operators.models.range_bearing import TASK_RANGES

    cls = FAMILIES["range_bearing"]
    model, prior = task_distribution(cls).sample_task_models([generator(s) for s in range(64)], 4, torch.float64, {})
    domain = cls.task_domain({})
    means, covs = prior.means[:, 0], prior.covs[:, 0]
    ranges = torch.linalg.vector_norm(means[:, :2], dim=-1)
    assert float(ranges.min()) >= 2.0 and float(ranges.max()) <= 12.0
    assert float(ranges.max() - ranges.min()) > 5.0  # spread over the range, not one geometry
    bearings = torch.atan2(means[:, 1], means[:, 0])
    assert bool((bearings > 2.5).any()) and bool((bearings < -2.5).any())  # targets behind the sensor
    for b in range(64):
        assert outside_domain(model.select(torch.tensor([b])), domain, means[b], covs[b]) == []
    for params, mean, var in (
        ({"q": 0.05, "range_sd": 0.5, "bearing_sd": 0.05}, [-10.0, 4.0, 0.0, -1.0], [1.0, 1.0, 0.25, 0.25]),
        ({"q": 0.01, "range_sd": 0.2, "bearing_sd": 0.2}, [-5.0, 0.6, 1.0, 0.0], [0.25, 0.25, 0.01, 0.01]),
    ):
        one = make_model("range_bearing", params, 4)
        assert outside_domain(one, domain, torch.tensor(mean), torch.diag(torch.tensor(var))) == []
    moved = make_model("range_bearing", {"sensor": [3.0, 0.0], "q": 0.5}, 4)
    outside = outside_domain(moved, domain, torch.tensor([-5.0, 0.6, 1.0, 0.0]), 0.25 * torch.eye(4))
    assert [o.split()[0] for o in outside] == ["sensor", "q"], outside
    assert set(TASK_RANGES) < set(domain)

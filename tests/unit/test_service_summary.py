"""Posterior summaries and draws of a stream state (service.summary)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from mpflow.operators.models import make_model
from mpflow.operators.models.priors import prior_from_spec
from mpflow.operators.state import ParticleState
from mpflow.operators.updaters import get_updater
from mpflow.service.engine import summary as S

PRIOR = {"type": "gaussian", "mean": [1.0, -2.0, 0.5], "cov": [[2.0, 0.6, 0.0], [0.6, 1.0, 0.3], [0.0, 0.3, 0.5]]}


def state_of(method: str, n: int, seed: int = 0) -> ParticleState:
    model = make_model("linear_gaussian", None, 3)
    return get_updater(method).init(prior_from_spec(PRIOR), model, n, seed)


def test_uniform_weight_quantiles_are_numpys_inverted_cdf():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 4, generator=g, dtype=torch.float64)
    w = torch.full((37,), 1 / 37, dtype=torch.float64)
    got = S.weighted_quantiles(x, w, S.QUANTILES)
    want = np.percentile(x.numpy(), [100 * q for q in S.QUANTILES], axis=0, method="inverted_cdf")
    assert np.array_equal(got.numpy(), want)


def test_weighted_quantiles_ignore_zero_weights_and_follow_the_weights():
    x = torch.tensor([[0.0], [1.0], [2.0], [100.0]], dtype=torch.float64)
    w = torch.tensor([0.25, 0.5, 0.25, 0.0], dtype=torch.float64)
    q = S.weighted_quantiles(x, w, (0.05, 0.25, 0.5, 0.75, 0.95, 1.0))[:, 0].tolist()
    assert q == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0]  # the zero-weight 100 never appears


def test_summary_of_a_weighted_cloud():
    st = state_of("smc", 64)
    lw = torch.log_softmax(torch.linspace(-3, 3, 64, dtype=torch.float32), -1)[None]
    st = st.replace(log_weights=lw, log_evidence=torch.tensor([-1.5], dtype=torch.float64))
    s = S.summary(st)
    w = torch.softmax(lw[0].double(), -1)
    x = st.particles[0].double()
    mean = (w[:, None] * x).sum(0)
    cov = ((x - mean).T * w) @ (x - mean)
    assert torch.allclose(torch.tensor(s["mean"], dtype=torch.float64), mean, atol=1e-12)
    assert torch.allclose(torch.tensor(s["cov"], dtype=torch.float64), cov, atol=1e-12)
    assert math.isclose(s["ess"], float(1 / (w * w).sum()), rel_tol=1e-12) and s["ess"] < 64
    assert s["log_evidence"] == -1.5


def test_exact_gaussian_summary_and_draws_for_kalman():
    st = state_of("kalman", 8)
    s = S.summary(st)
    mean = torch.tensor(PRIOR["mean"], dtype=torch.float64)
    cov = torch.tensor(PRIOR["cov"], dtype=torch.float64)
    assert torch.allclose(torch.tensor(s["mean"], dtype=torch.float64), mean, atol=1e-6)  # not the 8 particles
    assert torch.allclose(torch.tensor(s["cov"], dtype=torch.float64), cov, atol=1e-6)
    z = 1.6448536269514722
    assert torch.allclose(torch.tensor(s["quantiles"]["0.05"], dtype=torch.float64), mean - z * cov.diag().sqrt())
    draws = S.draw(st, 40000, weighted=False, seed=1)
    assert draws.shape == (40000, 3)
    assert torch.allclose(draws.mean(0), mean, atol=0.04)
    assert torch.allclose(torch.cov(draws.T), cov, atol=0.06)


def test_unweighted_draws_have_the_clouds_gaussian_by_either_route():
    """N ≥ 4d: Cholesky draws; N < 4d: the Gaussian-flow resampler (GPF eq. 16). Both have the cloud's moments."""
    for n_particles in (64, 6, 3):
        st = state_of("gpf", n_particles)
        x = st.particles[0].double()
        m = x.mean(0)
        c = (x - m).T @ (x - m) / n_particles
        d = S.draw(st, 60000, weighted=False, seed=2)
        assert torch.allclose(d.mean(0), m, atol=0.05), n_particles
        assert torch.allclose(torch.cov(d.T), c, atol=0.08), n_particles
        if n_particles <= 3:  # N ≤ d: C has rank N − 1 and so do the draws (they stay in the cloud's span)
            assert torch.linalg.matrix_rank(torch.cov(d.T), rtol=1e-8) == n_particles - 1
        assert torch.equal(d, S.draw(st, 60000, weighted=False, seed=2))  # seeded


def test_weighted_draws_resample_the_particles():
    st = state_of("smc", 16)
    lw = torch.full((1, 16), -math.inf)
    lw[0, 3], lw[0, 7] = math.log(0.25), math.log(0.75)
    st = st.replace(log_weights=lw)
    d = S.draw(st, 4000, weighted=True, seed=0)
    x = st.particles[0].double()
    hit3 = (d == x[3]).all(1).double().mean().item()
    hit7 = (d == x[7]).all(1).double().mean().item()
    assert hit3 + hit7 == 1.0 and abs(hit7 - 0.75) < 0.03


def test_a_weighted_cloud_of_an_unweighted_method_is_drawn_by_its_weights():
    """mpf with flow_fraction "auto" carries weights although the method's particles are usually uniform: draws
    follow the weights whenever they are not uniform."""
    st = state_of("mpf", 16)
    lw = torch.full((1, 16), -math.inf)
    lw[0, 2], lw[0, 9] = math.log(0.4), math.log(0.6)
    d = S.draw(st.replace(log_weights=lw), 4000, weighted=False, seed=0)
    x = st.particles[0].double()
    hit2 = (d == x[2]).all(1).double().mean().item()
    assert hit2 + (d == x[9]).all(1).double().mean().item() == 1.0 and abs(hit2 - 0.4) < 0.03


def test_sample_seed_depends_on_seed_and_step():
    assert S.sample_seed(1, 2) == S.sample_seed(1, 2)
    assert len({S.sample_seed(1, 2), S.sample_seed(1, 3), S.sample_seed(2, 2)}) == 3
    assert 0 <= S.sample_seed(123, 456) < 2**63


def test_unweighted_draws_of_a_non_gaussian_model_keep_the_modes_and_the_moments():
    """A bimodal cloud (modes at x0 = ±3, as a gmm posterior): the shrunk-kernel draws keep both modes and
    almost nothing between them, with the cloud's mean and covariance; the Gaussian fit would fill the gap."""
    g = torch.Generator().manual_seed(3)
    n = 256
    centre = torch.tensor([3.0, 0.0]) * torch.where(torch.arange(n) < n // 2, 1.0, -1.0)[:, None]
    x = centre + 0.4 * torch.randn(n, 2, generator=g)
    st = state_of("gpf", n).replace(particles=x[None].float(), log_weights=torch.zeros(1, n), extras={})
    xd = st.particles[0].double()
    m = xd.mean(0)
    c = (xd - m).T @ (xd - m) / n
    kde = S.draw(st, 60000, weighted=False, seed=4, gaussian_posterior=False)
    fit = S.draw(st, 60000, weighted=False, seed=4, gaussian_posterior=True)
    between = lambda d: (d[:, 0].abs() < 1.0).double().mean().item()  # noqa: E731
    assert between(kde) < 0.01 < 0.15 < between(fit)  # the Gaussian fit puts ~25 % between the modes
    assert abs((kde[:, 0] > 0).double().mean().item() - 0.5) < 0.02  # both modes, in their proportions
    assert torch.allclose(kde.mean(0), m, atol=0.05)
    assert torch.allclose(torch.cov(kde.T), c, rtol=0.03, atol=0.03)  # Liu–West keeps C exactly in expectation
    assert torch.equal(kde, S.draw(st, 60000, weighted=False, seed=4, gaussian_posterior=False))  # seeded


@pytest.mark.parametrize("method", ["smc", "kalman", "mpf"])
def test_batched_summaries_equal_each_streams_own(method):
    """summaries() of a batch row by row = summary() of each stream alone (weighted, exact and plain clouds)."""
    model = make_model("linear_gaussian", None, 2)
    prior = prior_from_spec({"type": "gaussian", "mean": [0.5, -1.0], "cov": [[2.0, 0.3], [0.3, 1.0]]})
    updater = get_updater(method)
    states = [updater.init(prior, model, 64, seed=s) for s in range(3)]
    obs = torch.tensor([[1.0, 2.0], [0.0, 0.0], [-3.0, 1.0]])
    batch, _ = updater.update(ParticleState.stack(states), obs, model)
    rows = S.summaries(batch)
    assert len(rows) == 3
    for row, alone in zip(rows, batch.unbind(), strict=True):
        assert row == S.summary(alone)
    assert rows[0] != rows[2]

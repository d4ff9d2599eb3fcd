"""mpf's posterior moves on static families (mpflow.operators.mpf.posterior_moves): Gaussian sites that are exact where
the likelihood is Gaussian, a MALA kernel that keeps its target, an exact posterior when the window holds every
observation, a window that advances on gaps and fall-backs, batch invariance, serialisation and option checks."""

from __future__ import annotations

import pytest
import torch
from mpflow.operators import gaussian
from mpflow.operators.accuracy import mean_error_sd
from mpflow.operators.models import make_model
from mpflow.operators.models.priors import GaussianMixture
from mpflow.operators.mpf.posterior_moves import Sites, mala
from mpflow.operators.references.grid import static_grid_posterior
from mpflow.operators.rng import generator
from mpflow.operators.state import ParticleState
from mpflow.operators.updaters import get_updater
from mpflow.service.engine.fallback import hand_over, take_back

from tests.unit.test_updaters_common import model_for

F64 = torch.float64


def _logistic(d: int, S: int, T: int, seed: int = 100):
    model = make_model("logistic", {}, d)
    batch = type(model).stack([model] * S)
    gens = [generator(seed + s) for s in range(S)]
    _, obs = batch.simulate(T, torch.stack([torch.randn(d, generator=g) for g in gens]), gens)
    prior = GaussianMixture.gaussian(torch.zeros(S, d), torch.eye(d).expand(S, d, d))
    return batch, obs, prior


def _run(u, model, prior, obs, N: int, seeds):
    state = u.init(prior, model, N, seeds)
    for t in range(obs.shape[1]):
        state, info = u.update(state, obs[:, t], model)
    return state, info


def test_they_run_by_default_on_logistic_only():
    u = get_updater("mpf")
    assert u.moves(make_model("logistic", {}, 3)) > 0
    for family in ("gmm", "linear_gaussian", "stochastic_volatility", "lds"):
        assert u.moves(model_for(family)) == 0, family
    assert get_updater("mpf", correct=True).moves(make_model("logistic", {}, 3)) == 0


def test_the_sites_of_a_gaussian_likelihood_are_exact():
    """Stein's fit of a linear-Gaussian likelihood is exact at any cloud, so after T steps with a window of 1 the
    canonical Gaussian is the prior's plus Hᵀ R⁻¹ H and Hᵀ R⁻¹ o_s of every observation but the last."""
    R = [[0.5, 0.1], [0.1, 0.4]]
    model = make_model("linear_gaussian", {"R": R}, 2)
    gens = [generator(3)]
    _, obs = model.simulate(4, torch.tensor([[0.5, -1.0]]), gens)
    prior = GaussianMixture.gaussian(torch.tensor([[0.2, 0.1]]), torch.tensor([[[1.0, 0.3], [0.3, 2.0]]]))
    state, _ = _run(get_updater("mpf", moves=3, window=1), model, prior, obs, 512, 0)
    sites = Sites.read(state)
    H, Rm = (t.double() for t in model.observation_affine()[:2])
    Rinv = torch.linalg.inv(Rm)
    P0 = torch.linalg.inv(prior.covs[:, 0].double())
    precision = P0 + 3 * H.transpose(-1, -2) @ Rinv @ H
    information = P0 @ prior.means[0, 0].double() + sum(
        (H.transpose(-1, -2) @ Rinv @ obs[:, s].double()[..., None])[..., 0] for s in range(3)
    )
    torch.testing.assert_close(sites.precision, precision, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(sites.information, information, rtol=1e-4, atol=1e-4)
    assert len(sites.window) == 1 and torch.equal(sites.window[0], obs[:, 3])


def test_the_kernel_keeps_its_target():
    """From exact draws of a correlated Gaussian target, 20 moves keep its mean and covariance (a kernel without the
    Metropolis correction would inflate the variance by about ε²/4 ≈ 50 %)."""
    d, N = 4, 8192
    g = torch.Generator().manual_seed(5)
    A = torch.randn(d, d, generator=g, dtype=F64)
    cov = A @ A.T + 0.5 * torch.eye(d, dtype=F64)
    mean = torch.randn(d, generator=g, dtype=F64)
    x = (mean + torch.randn(N, d, generator=g, dtype=F64) @ torch.linalg.cholesky(cov).T)[None].float()
    precision = torch.linalg.inv(cov)
    sites = Sites(precision[None], (precision @ mean)[None], [])
    moved, acceptance = mala(sites, make_model("logistic", {}, d), torch.full((1, 1, d + 1), float("nan")), x, 20,
                             [generator(1)])  # fmt: skip
    m, c = gaussian.moments(moved.double())
    assert 0.4 < float(acceptance) < 0.9
    assert float(mean_error_sd(m, mean[None], cov[None])) < 0.04
    ratio = c.diagonal(0, -2, -1) / cov.diagonal()
    assert float((ratio - 1).abs().max()) < 0.06, ratio


def test_the_target_is_the_posterior_with_every_observation_in_the_window():
    """With a window that holds every observation π̃ is the exact posterior: 20 moves at N = 4096 bring logistic
    (d = 2, 10 minibatches) to the grid posterior, where the flow alone is off by its Gaussian fit."""
    model, obs, prior = _logistic(2, 4, 10)  # 4 streams (8 before: the same first 4, each checked the same way)
    one = make_model("logistic", {}, 2)
    means, covs = static_grid_posterior(one, torch.zeros(2, dtype=F64), torch.eye(2, dtype=F64), obs, 128)
    errors = {}
    for moves in (0, 20):
        state, info = _run(get_updater("mpf", moves=moves, window=16), model, prior, obs, 4096, list(range(4)))
        m, c = gaussian.moments(state.particles.double())
        errors[moves] = mean_error_sd(m, means[:, -1], covs[:, -1])
        if moves:
            ratio = c.diagonal(0, -2, -1) / covs[:, -1].diagonal(0, -2, -1)
            assert float((ratio - 1).abs().max()) < 0.08, ratio
            assert bool((info.extras["acceptance"] > 0.4).all())
    assert float(errors[20].max()) < 0.05 and float(errors[20].max()) < 0.5 * float(errors[0].max()), errors


def test_a_stream_does_not_depend_on_its_batch_and_its_state_round_trips():
    model, obs, prior = _logistic(3, 3, 4)
    u = get_updater("mpf")
    together, _ = _run(u, model, prior, obs, 128, [11, 12, 13])
    one = GaussianMixture.gaussian(torch.zeros(1, 3), torch.eye(3)[None])
    alone, _ = _run(u, model.select(torch.tensor([1])), one, obs[1:2], 128, [12])
    assert torch.equal(together.particles[1:2], alone.particles)
    assert set(alone.extras) == {"sites.precision", "sites.information", "window.0", "window.1", "window.0.gaps",
                                 "window.1.gaps"}  # fmt: skip
    assert all(bool(torch.isfinite(v).all()) for v in alone.extras.values())
    back = ParticleState.from_bytes(alone.to_bytes())
    for k, v in alone.extras.items():
        assert torch.equal(back.extras[k], v), k


def test_a_gap_and_a_fallback_step_advance_the_window():
    model, obs, prior = _logistic(3, 2, 3)
    u = get_updater("mpf", window=2)
    state = u.init(prior, model, 128, [1, 2])
    state, _ = u.update(state, obs[:, 0], model)
    # stream 0 has no measurement at step 2, stream 1 has one: the batch splits and joins again
    step = obs[:, 1].clone()
    step[0] = float("nan")
    mixed, _ = u.update(state, step, model)
    window = Sites.read(mixed).window
    assert torch.isnan(window[0][0]).all() and torch.equal(window[0][1], obs[1, 1])
    assert torch.equal(window[1], obs[:, 0])
    assert torch.equal(mixed.particles[0], state.particles[0])
    # a fall-back step (gpf) on the same stream: the window takes its observation in, the oldest entry retires
    gpf = get_updater("gpf")
    new, _ = gpf.update(hand_over(mixed, u, gpf), obs[:, 2], model)
    back = take_back(new, u, gpf, mixed, obs[:, 2], model)
    sites, before = Sites.read(back), Sites.read(mixed)
    assert torch.equal(sites.window[0], obs[:, 2]) and torch.equal(sites.window[1][1], obs[1, 1])
    assert not torch.equal(sites.precision[1], before.precision[1])  # obs[1, 0] retired as a site
    assert torch.equal(back.particles, new.particles)


@pytest.mark.parametrize(
    "options,family,match",
    [
        ({"moves": "many"}, "logistic", "options.moves: auto or an integer"),
        ({"moves": 65}, "logistic", "options.moves: auto or an integer"),
        ({"window": -1}, "logistic", "options.window: an integer from 0 to 16"),
        ({"moves": 3, "correct": True}, "logistic", "options.moves: the posterior moves do not run with correct"),
        ({"moves": 3}, "lds", "options.moves: posterior moves are for static families"),
    ],
)
def test_bad_options_are_refused(options, family, match):
    with pytest.raises(ValueError, match=match):
        u = get_updater("mpf", **options)
        u.check_compatible(model_for(family))


def test_a_mixture_prior_is_refused_when_moves_are_asked_for_and_skipped_by_default():
    model = make_model("logistic", {}, 2)
    mixture = GaussianMixture(
        torch.tensor([[0.5, 0.5]]), torch.tensor([[[1.0, 0.0], [-1.0, 0.0]]]), torch.eye(2).expand(1, 2, 2, 2).clone()
    )
    with pytest.raises(ValueError, match=r"options\.moves: posterior moves need the prior's density"):
        get_updater("mpf", moves=3).init(mixture, model, 64, 0)
    assert Sites.read(get_updater("mpf").init(mixture, model, 64, 0)) is None

"""``mpf``'s ``flow_fraction`` γ < 1 with ``correct``: the flow takes γ of a linear observation's likelihood and
importance weights the rest (the ensemble Kalman particle filter; mpflow.operators.mpf.kalman_particle)."""

from __future__ import annotations

import math

import pytest
import torch
from mpflow.operators.models import make_model
from mpflow.operators.models.priors import GaussianMixture
from mpflow.operators.references import kalman_filter
from mpflow.operators.rng import generator
from mpflow.operators.updaters import get_updater

N = 20000


def _one_step(prior: GaussianMixture, obs: torch.Tensor, **options) -> torch.Tensor:
    """The cloud [B, N, 1] after one step of linear_gaussian (d = 1, o = x + N(0, 1)) from ``prior``."""
    model = make_model("linear_gaussian", {"H": [[1.0]], "R": [[1.0]]}, 1)
    batch = type(model).stack([model] * prior.batch_size)
    u = get_updater("mpf", correct=True, rejuvenate="never", **options)
    state = u.init(prior, batch, N, seed=list(range(prior.batch_size)))
    state, info = u.update(state, obs, batch)
    assert float(info.ess.min()) > 0.3 * N
    return state.particles.double()


def test_a_gaussian_prior_gets_the_kalman_posterior_at_any_fraction() -> None:
    """With a Gaussian predictive every γ is exact: the mixture of step 1 is the tempered posterior, step 2 its
    exact update; the cloud's moments are Kalman's up to Monte Carlo noise."""
    prior = GaussianMixture.gaussian(torch.zeros(1, 1), 2.0 * torch.ones(1, 1, 1))
    obs = torch.tensor([[1.7]])
    # conjugate: precision 1/2 + 1, mean (1.7) / (1.5)
    exact_mean, exact_var = 1.7 / 1.5, 1 / 1.5
    for gamma in (0.2, 0.5, 0.9):
        x = _one_step(prior, obs, flow_fraction=gamma)
        assert abs(float(x.mean()) - exact_mean) < 0.03, gamma
        assert abs(float(x.var()) / exact_var - 1) < 0.05, gamma


def test_the_weights_carry_what_the_gaussian_fit_misses() -> None:
    """A bimodal prior ½ N(−2, 0.5²) + ½ N(2, 0.5²) observed at o = 1 (R = 1): the posterior mean is 1.67 (the right
    mode has 96 % of the mass). The whole likelihood by the flow (γ = 1, the exact update of the prior's Gaussian
    fit) gives 0.81; the smaller γ, the more of the likelihood the weights take and the closer the mean comes —
    slowly here, because the fit's variance (4.25) makes even a small share's Kalman move and kernel wide."""
    prior = GaussianMixture(torch.tensor([[0.5, 0.5]]), torch.tensor([[[-2.0], [2.0]]]), torch.full((1, 2, 1, 1), 0.25))
    obs = torch.tensor([[1.0]])
    right = 1.0 / (1.0 + math.exp(-3.2))  # each mode's evidence N(1; ±2, 0.25 + 1): log ratio 3.2
    exact = right * 1.8 - (1 - right) * 1.4  # the modes' posterior means (4·(±2) + 1) / 5
    errors = [abs(float(_one_step(prior, obs, flow_fraction=g).mean()) - exact) for g in (1.0, 0.25, 0.05)]
    assert errors[0] > errors[1] + 0.02 > errors[2] + 0.2, errors  # measured 0.86, 0.84, 0.55


def _bocquet_twin(steps: int):
    """Two twin experiments of Bocquet 2010's Lorenz-96 (d = 10, every other variable, R = 1.5) spun up onto the
    attractor, with a gap at step 30 → (model [2], truths [2, T, d], float32 observations, prior N(x₀, I))."""
    model = make_model("lorenz96", {"R": 1.5, "obs_every": 2}, 10)
    batch = type(model).stack([model] * 2)
    gens = [generator(b) for b in range(2)]
    x0 = 8.0 + torch.stack([torch.randn(10, generator=g, dtype=torch.float64) for g in gens])
    for _ in range(500):
        x0 = batch.transition_mean(x0[:, None])[:, 0]
    xs, obs = batch.simulate(steps, x0, gens)
    obs = obs.float()
    obs[:, 30, 1] = float("nan")
    return batch, xs, obs, GaussianMixture.gaussian(x0.float(), torch.eye(10).expand(2, 10, 10))


def test_lorenz96_partial_observation_and_inflation() -> None:
    """Bocquet 2010's Lorenz-96 (d = 10, every other variable, R = 1.5) with a gap in the observation: the step
    runs, the gap's variable moves only through its correlations, and the filter tracks the truth."""
    batch, xs, obs, prior = _bocquet_twin(60)
    u = get_updater("mpf", correct=True, flow_fraction=0.5, inflation=1.01)
    state = u.init(prior, batch.to(torch.float32), 400, seed=[0, 1])
    errors = []
    for t in range(60):
        state, info = u.update(state, obs[:, t], batch.to(torch.float32))
        assert torch.isfinite(state.particles).all() and float(info.ess.min()) > 1
        errors.append(float((state.particles.double().mean(1) - xs[:, t]).pow(2).mean().sqrt()))
    assert sum(errors[20:]) / 40 < 0.6  # Bocquet's bootstrap filter: 0.29 at N = 800; obs noise sd 1.22


def test_flow_fraction_is_checked_and_refused_where_it_cannot_run() -> None:
    assert "flow_fraction" in get_updater("mpf").stream_options
    for bad in (0, 1.5, "half", True):
        with pytest.raises(ValueError, match=r"options\.flow_fraction"):
            get_updater("mpf", correct=True, flow_fraction=bad)
    with pytest.raises(ValueError, match=r"options\.flow_fraction: .*correct"):
        get_updater("mpf", flow_fraction=0.5)
    u = get_updater("mpf", correct=True, flow_fraction=0.5)
    with pytest.raises(ValueError, match=r"options\.flow_fraction: .*linear observation"):
        u.check_compatible(make_model("range_bearing", {}, 4))
    with pytest.raises(ValueError, match=r"options\.flow_fraction"):
        u.check_compatible(make_model("lorenz96", {"arctan": True}, 10))
    u.check_compatible(make_model("lorenz96", {}, 10))


def test_kalman_filter_reference_agrees_on_a_linear_dynamic_model() -> None:
    """lds (a Gaussian predictive at every step): the split filter follows Kalman's means over a sequence."""
    lds = {"A": [[0.9, -0.2], [0.2, 0.9]], "Q": [[0.3, 0.0], [0.0, 0.3]], "B": [[1.0, 0.0]], "R": [[0.5]]}
    model = make_model("lds", lds, 2)
    batch = type(model).stack([model] * 4)
    _, obs = batch.simulate(8, torch.zeros(4, 2), [generator(10 + b) for b in range(4)])
    km, kc, _ = kalman_filter(torch.zeros(4, 2), torch.eye(2).expand(4, 2, 2), batch, obs)
    u = get_updater("mpf", correct=True, flow_fraction=0.4)
    prior = GaussianMixture.gaussian(torch.zeros(4, 2), torch.eye(2).expand(4, 2, 2))
    state = u.init(prior, batch, 4096, seed=list(range(4)))
    for t in range(8):
        state, _ = u.update(state, obs[:, t], batch)
        err = state.particles.double().mean(1) - km[:, t]
        sd = kc[:, t].diagonal(0, -2, -1).sqrt()
        assert float((err / sd).abs().max()) < 0.15, t


# ---------------------------------------------------------------- flow_fraction "auto"
AUTO = {"correct": True, "flow_fraction": "auto", "ess_threshold": 0.3}


def _scalar(R: float, B: int = 1):
    model = make_model("linear_gaussian", {"H": [[1.0]], "R": [[R]]}, 1)
    return type(model).stack([model] * B)


def test_auto_takes_no_flow_while_the_bootstrap_weights_hold() -> None:
    """A broad likelihood (R = 25 against a prior sd of 1) keeps the bootstrap weights' ESS near N: γ = 0, the
    particles stay where they are (a static family) and their weights are the likelihood's."""
    model = _scalar(25.0)
    u = get_updater("mpf", rejuvenate="never", **AUTO)
    state = u.init(GaussianMixture.gaussian(torch.zeros(1, 1), torch.ones(1, 1, 1)), model, 2000, seed=[0])
    obs = torch.tensor([[1.5]])
    new, info = u.update(state, obs, model)
    assert float(info.extras["flow_fraction"][0]) == 0.0 and not bool(info.extras["rescued"][0])
    assert torch.equal(new.particles, state.particles)
    want = torch.log_softmax(model.log_likelihood(obs, state.particles).double(), -1)
    assert torch.allclose(torch.log_softmax(new.log_weights.double(), -1), want, atol=1e-6)
    assert u.weighted and not get_updater("mpf").weighted


def test_auto_flows_where_the_weights_would_collapse_and_stays_exact_for_a_gaussian() -> None:
    """A sharp likelihood (R = 0.01 against a prior variance of 4) would leave the bootstrap filter a few
    particles: the step takes a share γ > 0, keeps the weights' ESS at the floor, and — the predictive being
    Gaussian — its weighted cloud has Kalman's mean and variance."""
    u = get_updater("mpf", rejuvenate="never", **AUTO)
    model = _scalar(0.01)
    state = u.init(GaussianMixture.gaussian(torch.zeros(1, 1), 4.0 * torch.ones(1, 1, 1)), model, N, seed=[3])
    obs = torch.tensor([[1.2]])
    new, info = u.update(state, obs, model)
    gamma = float(info.extras["flow_fraction"][0])
    bootstrap_ess = float(1 / torch.softmax(model.log_likelihood(obs, state.particles).double(), -1).square().sum())
    assert bootstrap_ess < 0.1 * N and 0 < gamma < 1 and float(info.ess[0]) >= 0.3 * N
    w = torch.softmax(new.log_weights[0].double(), -1)
    x = new.particles[0, :, 0].double()
    mean = float((w * x).sum())
    var = float((w * (x - mean) ** 2).sum())
    exact_var = 1 / (1 / 4 + 1 / 0.01)
    assert abs(mean - 1.2 * 4 / 4.01) < 0.01 and abs(var / exact_var - 1) < 0.05, (mean, var)


def test_a_cloud_that_lost_the_truth_is_inflated_and_pulled_back() -> None:
    """The consistency test (operators.mpf.consistency): a narrow cloud 6 observation sds from the truth fails it
    and is inflated so that its spread matches the innovation; the automatic flow then pulls it onto the
    observation. Clouds consistent with their observations (a thousand draws from their own predictive) pass."""
    from mpflow.operators.mpf.consistency import inflate_diverged

    gens = [generator(7)]
    model = _scalar(1.0, 1000)
    mean, cov = torch.zeros(1000, 1), torch.full((1000, 1, 1), 0.04)
    x = 0.2 * torch.randn(1000, 64, 1, generator=gens[0])
    obs = 0.2 * torch.randn(1000, 1, generator=gens[0]) + torch.randn(1000, 1, generator=gens[0])
    _, _, diverged = inflate_diverged(model, obs, x, mean, cov)
    assert not bool(diverged.any())
    model = _scalar(1.0)
    x1, cov1, diverged = inflate_diverged(model, torch.tensor([[6.0]]), x[:1], mean[:1], cov[:1])
    assert bool(diverged[0])
    assert abs(float(cov1[0, 0, 0]) - (36.0 - 1.0)) < 1e-4  # ρ² C = ν² − R
    assert torch.allclose(x1, x[:1] * (35.0 / 0.04) ** 0.5, atol=1e-4)
    u = get_updater("mpf", rejuvenate="never", **AUTO)
    state = u.init(GaussianMixture.gaussian(torch.zeros(1, 1), torch.full((1, 1, 1), 0.04)), model, 4000, seed=[1])
    new, info = u.update(state, torch.tensor([[6.0]]), model)
    w = torch.softmax(new.log_weights[0].double(), -1)
    assert bool(info.extras["rescued"][0]) and float(info.extras["flow_fraction"][0]) > 0
    assert float((w * new.particles[0, :, 0].double()).sum()) > 4.0  # without the rescue: 0.22


def test_auto_on_bocquets_lorenz96_with_a_gap_tracks_the_truth_with_weights() -> None:
    """Bocquet 2010's twin at N = 400 with Liu–West moves on resampling (a perfect model) and a gap: the filter
    tracks the truth, its weights are carried between resamplings, and most steps take no flow."""
    batch, xs, obs, prior = _bocquet_twin(80)
    u = get_updater("mpf", rejuvenate="always", shrinkage=0.85, **AUTO)
    model32 = batch.to(torch.float32)
    state = u.init(prior, model32, 400, seed=[0, 1])
    errors, shares, weighted = [], [], 0
    for t in range(80):
        state, info = u.update(state, obs[:, t], model32)
        assert torch.isfinite(state.particles).all() and float(info.ess.min()) > 1
        w = torch.softmax(state.log_weights.double(), -1)
        weighted += int((w.max(-1).values > 1.01 / 400).sum())
        shares.append(info.extras["flow_fraction"])
        errors.append(float(((w[..., None] * state.particles.double()).sum(1) - xs[:, t]).pow(2).mean().sqrt()))
    assert sum(errors[20:]) / 60 < 0.6  # Bocquet's bootstrap filter: 0.29 at N = 800; obs noise sd 1.22
    assert weighted > 80 and float((torch.stack(shares) == 0).double().mean()) > 0.5


def test_auto_is_checked_like_any_share() -> None:
    get_updater("mpf", correct=True, flow_fraction="auto")
    for bad in ("Auto", "automatic", None):
        with pytest.raises(ValueError, match=r"options\.flow_fraction"):
            get_updater("mpf", correct=True, flow_fraction=bad)
    with pytest.raises(ValueError, match=r"options\.flow_fraction: .*correct"):
        get_updater("mpf", flow_fraction="auto")
    with pytest.raises(ValueError, match=r"options\.flow_fraction: .*linear observation"):
        get_updater("mpf", correct=True, flow_fraction="auto").check_compatible(make_model("range_bearing", {}, 4))

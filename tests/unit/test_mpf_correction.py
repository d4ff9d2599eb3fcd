"""``mpf``'s importance correction (``correct``): the base flow as a proposal, weighted against the predictive's
Gaussian fit and resampled (mpflow.operators.mpf.correction)."""

from __future__ import annotations

import pytest
import torch
from mpflow.operators.accuracy import mean_error_sd
from mpflow.operators.filtering import run_filter
from mpflow.operators.models import make_model
from mpflow.operators.models.priors import GaussianMixture
from mpflow.operators.mpf.correction import from_dimensions, tempered_to_ess, to_dimensions
from mpflow.operators.references import kalman_filter
from mpflow.operators.references.grid import diagonal_grid_filter
from mpflow.operators.rng import generator
from mpflow.operators.updaters import get_updater


def _gaussian_prior(B: int, d: int) -> GaussianMixture:
    return GaussianMixture.gaussian(torch.zeros(B, d), torch.eye(d).expand(B, d, d))


def _sequences(family: str, d: int, B: int, T: int, seed: int, params: dict | None = None):
    model = make_model(family, params or {}, d)
    batch = type(model).stack([model] * B)
    _, obs = batch.simulate(T, torch.zeros(B, d), [generator(seed + i) for i in range(B)])
    return model, batch, obs


def test_dimensions_round_trip() -> None:
    x = torch.randn(3, 7, 4)
    rows = to_dimensions(x)
    assert rows.shape == (12, 7, 1)
    assert torch.equal(rows[1 * 4 + 2, :, 0], x[1, :, 2])  # row b·d + j is dimension j of stream b
    assert torch.equal(from_dimensions(rows, 4), x)
    assert torch.equal(to_dimensions(torch.arange(6.0).reshape(2, 3))[:, 0], torch.arange(6.0))


def test_degenerate_weights_are_tempered_to_the_ess_floor() -> None:
    log_w = torch.log_softmax(torch.stack([torch.linspace(0, 40, 100), torch.zeros(100)]).double(), -1)
    out = tempered_to_ess(log_w, 50.0)
    ess = 1.0 / torch.exp(2 * out).sum(-1)
    assert 49.0 < float(ess[0]) < 52.0  # tempered down to the floor, not below it and not flattened
    assert torch.equal(out[1], log_w[1])  # uniform weights pass as they are
    assert torch.equal(tempered_to_ess(log_w[1:], 50.0), log_w[1:])


def test_per_dimension_model_matches_the_joint_one() -> None:
    model = make_model("stochastic_volatility", {"mu": [0.1, -0.2, 0.3], "phi": [0.9, 0.95, 0.97]}, 3)
    split = model.per_dimension(2)
    assert split.state_dim == 1 and split.batch_size == 6
    obs, x = torch.randn(2, 3), torch.randn(2, 5, 3)
    joint = model.log_likelihood(obs, x)
    per_dim = split.log_likelihood(to_dimensions(obs), to_dimensions(x)).reshape(2, 3, 5).sum(1)
    assert torch.allclose(joint, per_dim, atol=1e-5)
    assert make_model("linear_gaussian", {}, 2).per_dimension(1) is None


def test_weights_are_uniform_where_the_flow_is_exact() -> None:
    """lds: a Gaussian predictive and a linear-Gaussian likelihood, so the flow is the exact Bayes map and every
    weight p(o | x₁) N(x₁; m, C) / N(x₀; m, C) is the same: ESS = N, and the mean is Kalman's."""
    lds = {"A": [[0.9, -0.2], [0.2, 0.9]], "Q": [[0.3, 0.0], [0.0, 0.3]], "B": [[1.0, 0.0]], "R": [[0.5]]}
    _, batch, obs = _sequences("lds", 2, 4, 6, 10, lds)
    km, kc, _ = kalman_filter(torch.zeros(4, 2), torch.eye(2).expand(4, 2, 2), batch, obs)
    run = run_filter(get_updater("mpf", correct=True), batch, _gaussian_prior(4, 2), obs, 512, list(range(4)))
    assert float(run.ess.min()) > 0.999 * 512
    for t, mean in enumerate(run.means):
        assert float(mean_error_sd(mean, km[:, t], kc[:, t]).max()) < 0.15  # resampling noise only


def test_correction_removes_the_flows_bias_on_stochastic_volatility() -> None:
    model, batch, obs = _sequences("stochastic_volatility", 3, 8, 12, 300)
    gm, gc = diagonal_grid_filter(model, torch.zeros(3), torch.ones(3), obs, points=400)
    prior = _gaussian_prior(8, 3)

    def error(**options) -> tuple[float, torch.Tensor]:  # the flow with Stein's fit at the prior: biased
        up = get_updater("mpf", linearisation="stein", marginal=False, **options)  # the flow's own step
        run = run_filter(up, batch, prior, obs, 512, list(range(8)))
        errs = [float(mean_error_sd(m, gm[:, t], gc[:, t]).mean()) for t, m in enumerate(run.means)]
        return sum(errs) / len(errs), run.ess

    plain, _ = error()
    corrected, ess = error(correct=True)
    assert corrected < 0.85 * plain, (plain, corrected)  # measured 0.116 against 0.154
    assert float(ess.median()) > 0.75 * 512  # per-dimension weights: no collapse with d


def test_correction_on_a_static_family_keeps_the_conjugate_posterior() -> None:
    """linear_gaussian (static): the exact flow, uniform weights, then Liu–West moves that keep mean and
    covariance; the posterior stays Kalman's up to Monte Carlo noise."""
    _, batch, obs = _sequences("linear_gaussian", 2, 4, 8, 20)
    km, kc, _ = kalman_filter(torch.zeros(4, 2), torch.eye(2).expand(4, 2, 2), batch, obs)
    run = run_filter(get_updater("mpf", correct=True), batch, _gaussian_prior(4, 2), obs, 1024, list(range(4)))
    for t, mean in enumerate(run.means):
        assert float(mean_error_sd(mean, km[:, t], kc[:, t]).max()) < 0.2


def test_correct_is_a_stream_option_and_refuses_what_it_cannot_weight() -> None:
    assert "correct" in get_updater("mpf").stream_options
    with pytest.raises(ValueError, match=r"options\.correct"):
        get_updater("mpf", correct="yes")
    with pytest.raises(ValueError, match=r"options\.correct"):
        get_updater("mpf", correct=True, track_density=True)
    with pytest.raises(ValueError, match=r"options\.correct"):
        get_updater("mpf", correct=True, operator="stochastic_volatility-d2-v1")


def test_scalar_flow_is_the_general_base_flow_in_one_dimension() -> None:
    from mpflow.operators.models.tempered import tempered
    from mpflow.operators.mpf.network import MPFVelocity
    from mpflow.operators.mpf.scalar_flow import scalar_base_flow
    from mpflow.operators.mpf.step import flow_step

    model = type(make_model("stochastic_volatility", {}, 1)).stack([make_model("stochastic_volatility", {}, 1)] * 4)
    x, obs = torch.randn(4, 256, 1, generator=generator(1)), 2 * torch.randn(4, 1, generator=generator(2))
    net = MPFVelocity(1).eval()
    for stages in (1, 4):
        general = x
        with torch.no_grad():
            for _ in range(stages):
                general, _ = flow_step(
                    net, tempered(model, stages), obs, general, None, divergence="none", residual=False
                )
        assert float((general - scalar_base_flow(model, obs, x, stages)[0]).abs().max()) < 1e-5


def test_a_corrected_step_with_low_ess_runs_again_in_more_stages() -> None:
    """range_bearing, a target 0.9 from the sensor with a predictive of sd 1 and a precise sensor: one stage's
    Gaussian fit of the arc-shaped likelihood leaves few particles with weight. By default (``max_substeps``
    4 × ``substeps`` with ``correct``) that stream runs the step again in 2, then 4 stages and its weights' ESS
    rises; a stream far from the sensor keeps its one-stage step, whichever batch it is in."""
    model = make_model("range_bearing", {"range_sd": 0.02, "bearing_sd": 0.02, "q": 0.01}, 4)
    batch = type(model).stack([model] * 2)
    means = torch.tensor([[0.9, 0.0, 0.0, 0.0], [8.0, 0.0, 0.0, 0.0]])
    prior = GaussianMixture.gaussian(means, torch.diag(torch.tensor([1.0, 1.0, 0.1, 0.1])).expand(2, 4, 4))
    obs = torch.tensor([[[0.7, 0.9]], [[8.1, 0.02]]])

    def step(**options):
        return run_filter(get_updater("mpf", correct=True, **options), batch, prior, obs, 512, [5, 6], keep_states=True)

    assert get_updater("mpf", correct=True).options["max_substeps"] == 4
    assert get_updater("mpf", correct=True, substeps=2).options["max_substeps"] == 8
    assert get_updater("mpf").options["max_substeps"] == 1  # the uncorrected base flow: no re-staging by default
    one, default = step(max_substeps=1), step()
    assert float(one.ess[0, 0]) < 0.5 * 512 <= float(default.ess[0, 0]), (one.ess, default.ess)
    assert float(one.ess[0, 1]) > 0.5 * 512  # far from the sensor: healthy in one stage
    assert torch.equal(one.states[0].particles[1], default.states[0].particles[1])
    alone = run_filter(get_updater("mpf", correct=True), model, GaussianMixture.gaussian(means[:1], prior.covs[:1, 0]),
                       obs[:1], 512, [5], keep_states=True)  # fmt: skip
    assert torch.allclose(alone.states[0].particles[0], default.states[0].particles[0], atol=1e-5)

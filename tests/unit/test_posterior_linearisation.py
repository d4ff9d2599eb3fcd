"""The posterior linearisation of a non-Gaussian likelihood (mpflow.operators.mpf.daum_huang): Stein's fit re-fitted
at the Gaussian posterior it gives — exact where the likelihood is Gaussian, at the Gaussian variational fixed point
otherwise, the same in the element-wise one-dimensional flow as in the general one, and the base flow's default."""

from __future__ import annotations

import pytest
import torch
from mpflow.operators import gaussian, state
from mpflow.operators.accuracy import mean_error_sd
from mpflow.operators.filtering import run_filter
from mpflow.operators.models import make_model
from mpflow.operators.models.priors import GaussianMixture
from mpflow.operators.mpf import correction
from mpflow.operators.mpf.daum_huang import (
    gaussian_posterior_points,
    linear_gaussian_likelihood,
    posterior_linearisation,
    statistical_linearisation,
)
from mpflow.operators.mpf.health import flow_ess
from mpflow.operators.mpf.network import MPFVelocity
from mpflow.operators.mpf.scalar_flow import scalar_base_flow
from mpflow.operators.mpf.step import flow_step
from mpflow.operators.references.grid import diagonal_grid_filter
from mpflow.operators.rng import generator
from mpflow.operators.updaters import get_updater

F64 = torch.float64


def _cloud(B: int, N: int, d: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, N, d, generator=g, dtype=F64)
    return gaussian.moment_matched(x, torch.zeros(B, d, dtype=F64), torch.eye(d, dtype=F64).expand(B, d, d))


def _logistic_step(d: int = 3, B: int = 2, rows: int = 24):
    model = make_model("logistic", {}, d)
    batch = type(model).stack([model] * B)
    gens = [generator(7 + b) for b in range(B)]
    _, obs = batch.simulate(1, torch.stack([1.5 * torch.randn(d, generator=g) for g in gens]), gens)
    return batch, obs[:, 0].to(F64)


def test_it_is_exact_for_a_linear_gaussian_likelihood() -> None:
    model = make_model("linear_gaussian", {"R": (0.5 * torch.eye(2)).tolist()}, 2)
    batch = type(model).stack([model] * 2).to(F64)
    x = _cloud(2, 500, 2)
    obs = torch.tensor([[0.7, -1.2], [2.0, 0.3]], dtype=F64)
    fit = posterior_linearisation(batch, obs, x, gaussian.whiten(x), batch.score(obs, x), iterations=3)
    exact = linear_gaussian_likelihood(*(t.double() for t in batch.observation_affine()), obs)
    assert torch.allclose(fit.precision, exact.precision, atol=1e-8)
    assert torch.allclose(fit.information, exact.information, atol=1e-8)


def test_its_fixed_point_is_the_gaussian_variational_posterior() -> None:
    """At the fixed point q = N(m_q, P_q) = N(0, I) · N-lik(Λ, η) with Λ, η Stein's fit at q: P_q⁻¹ = I + E_q[−∇²ℓ]
    and m_q = E_q[∇ℓ] (prior mean 0, covariance I) — the stationarity conditions of KL(q ‖ posterior)."""
    model, obs = _logistic_step()
    x = _cloud(2, 4000, 3)
    white = gaussian.whiten(x)
    fit = statistical_linearisation(x, model.score(obs, x))
    for _ in range(40):  # the re-fit of posterior_linearisation, without its choice of the best-scored fit
        q = gaussian_posterior_points(white, fit)
        fit = statistical_linearisation(q, model.score(obs, q))
    q = gaussian_posterior_points(white, fit)
    again = statistical_linearisation(q, model.score(obs, q))
    assert torch.allclose(again.precision, fit.precision, atol=1e-6)  # a fixed point
    m_q, P_q = gaussian.moments(q)
    assert torch.allclose(m_q, model.score(obs, q).mean(1), atol=1e-6)
    a = obs[..., :-1]
    p = torch.sigmoid(q @ a.transpose(-1, -2))
    hessian = torch.einsum("bnm,bmi,bmj->bij", p * (1 - p), a, a) / q.shape[1]  # E_q[−∇²ℓ] over the cloud
    eye = torch.eye(3, dtype=F64)
    gap = torch.linalg.matrix_norm(torch.linalg.inv(P_q) - eye - hessian) / torch.linalg.matrix_norm(eye + hessian)
    assert float(gap.max()) < 0.05  # Stein's estimate of E_q[−∇²ℓ] against its plain average: Monte Carlo error


def test_each_stream_keeps_its_best_scored_fit() -> None:
    """A target passing close to a range-bearing sensor: the re-fit runs away on some streams; the fit kept scores
    at least as well as Stein's (the ESS of the weights that would correct its Gaussian posterior)."""
    model = make_model("range_bearing", {}, 4)
    B = 16
    batch = type(model).stack([model] * B)
    g = torch.Generator().manual_seed(3)
    mean = torch.tensor([-1.0, 0.4, 1.0, 0.0], dtype=F64) + 0.3 * torch.randn(B, 4, generator=g, dtype=F64)
    x = gaussian.moment_matched(
        torch.randn(B, 256, 4, generator=g, dtype=F64), mean, (0.5 * torch.eye(4, dtype=F64)).expand(B, 4, 4)
    ).float()
    _, obs = batch.simulate(1, mean.float(), [generator(b) for b in range(B)])
    obs = obs[:, 0]
    white = gaussian.whiten(x.double())

    def score(fit) -> torch.Tensor:
        x1 = gaussian_posterior_points(white, fit).float()
        return state.ess(correction.log_weights(batch, obs, white, x1))

    stein = statistical_linearisation(x, batch.score(obs, x), whitened=white)
    kept = posterior_linearisation(batch, obs, x, white, batch.score(obs, x), iterations=3)
    assert bool((score(kept) >= score(stein) - 1e-6).all())
    assert bool((score(kept) > score(stein) + 1).any())  # and the re-fit does improve some streams


def test_the_element_wise_flow_is_the_general_one_in_one_dimension() -> None:
    model = make_model("stochastic_volatility", {}, 1)
    batch = type(model).stack([model] * 3)
    x = _cloud(3, 256, 1).float() * 0.8 + 0.3
    obs = torch.tensor([[2.5], [-0.1], [0.05]])
    general, _ = flow_step(
        MPFVelocity(1, linearisation="posterior"), batch, obs, x, None, divergence="none", residual=False
    )
    fast, n_eff = scalar_base_flow(batch, obs, x, 1, iterations=3)
    assert torch.allclose(general, fast, atol=1e-5)
    # the ESS it returns is the step's health ESS (the affine map's Jacobian cancels in the weights)
    assert torch.allclose(n_eff, flow_ess(batch, obs, gaussian.whiten(x.double()), fast), rtol=1e-4)
    assert scalar_base_flow(batch, obs, x, 2, iterations=3)[1] is None  # tempered stages: not the step's weights


@pytest.mark.parametrize("d", [1, 3])
def test_the_default_flow_beats_steins_fit_on_stochastic_volatility(d: int) -> None:
    """Against the grid filter (exact per dimension); d = 3 runs the per-dimension flow. Measured (d = 1 and 3):
    0.03 against Stein's 0.13–0.15 posterior sd."""
    model = make_model("stochastic_volatility", {}, d)
    batch = type(model).stack([model] * 8)
    gens = [generator(500 + i) for i in range(8)]
    _, obs = batch.simulate(15, torch.zeros(8, d), gens)
    prior = GaussianMixture.gaussian(torch.zeros(8, d), torch.eye(d).expand(8, d, d))
    gm, gc = diagonal_grid_filter(model, torch.zeros(d), torch.ones(d), obs, points=400)

    def error(**options) -> float:
        run = run_filter(get_updater("mpf", marginal=False, **options), batch, prior, obs, 256, list(range(8)))
        return sum(float(mean_error_sd(m, gm[:, t], gc[:, t]).mean()) for t, m in enumerate(run.means)) / len(run.means)

    default, stein = error(), error(linearisation="stein")
    assert default < 0.06 and default < 0.5 * stein, (default, stein)


def test_linearisation_is_a_checked_stream_option() -> None:
    assert "linearisation" in get_updater("mpf").stream_options
    assert get_updater("mpf").options["linearisation"] == "posterior"
    with pytest.raises(ValueError, match=r"options\.linearisation"):
        get_updater("mpf", linearisation="laplace")


def test_the_fit_gives_the_base_flows_points_and_the_corrected_flows_weights() -> None:
    """The corrected step takes its one-stage points and weights from ``posterior_fit`` (it computes both to choose
    the fit): they are the base flow's map of the cloud and the correction's weights at it, to float32 rounding."""
    from mpflow.operators.mpf.daum_huang import POSTERIOR_ITERATIONS, posterior_fit

    model = make_model("range_bearing", {"range_sd": 0.2, "bearing_sd": 0.2}, 4)
    batch = type(model).stack([model] * 3)
    x = (_cloud(3, 400, 4) * 0.5 + torch.tensor([1.0, 0.4, 1.0, 0.0], dtype=F64)).float()
    obs = torch.tensor([[1.1, 0.3], [0.9, 0.6], [1.3, -2.9]])
    white = gaussian.whiten(x.double())
    fit = posterior_fit(batch, obs, x, white, batch.score(obs, x), POSTERIOR_ITERATIONS)
    with torch.no_grad():
        base = MPFVelocity(4, linearisation="posterior").eval()
        x1, _ = flow_step(base, batch, obs, x, None, divergence="none", whitened=white, residual=False)
    assert float((fit.points - x1).abs().max()) < 1e-4
    assert float((fit.log_weights - correction.log_weights(batch, obs, white, x1)).exp().sub(1).abs().max()) < 1e-2
    assert torch.equal(
        fit.likelihood.precision, posterior_linearisation(batch, obs, x, white, batch.score(obs, x), 3).precision
    )

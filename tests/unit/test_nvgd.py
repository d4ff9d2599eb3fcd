"""NVGD (operators.updaters.nvgd): the witness divergence against autograd, the plain solver on a 2-D
Gaussian target, the assumed-density filter against the Kalman filter, and per-stream reproducibility.

Tolerances come from measurements with the default options (N = 256, float32):
- solver, target N(μ, Σ) from N(0, I), 20 seeds: mean error ≤ 0.09 target sd (Mahalanobis), variance
  ratios in [0.92, 1.14] (iid samples of 256 have ±9 % variance noise). Asserted: < 0.2 sd, [0.8, 1.25].
  Checked by breaking the code: without the div f term the cloud collapses onto the mode (ratios < 0.003);
  with the step x − ε f it runs away (mean error 9–14 sd, ratios 4.5–140).
- filter, linear_gaussian d = 2 (R = 3I) from N(0, I), 10 observations, 10 seeds: mean error 0.22 posterior
  sd on average, 0.44 at most; variance ratios in [0.86, 1.56] (mean |log ratio| ≈ 0.15). That is the Monte
  Carlo floor of an assumed-density filter refitted from 256 particles at every step: with iid posterior
  draws at every step instead (200 seeds) the mean error is 0.28 on average, 0.51 at the 95th percentile,
  0.90 at most, the variance ratios 0.60–1.42 for 95 % (0.53–1.61 at the extremes). Asserted per stream
  (3 streams): < 0.8 sd and [0.55, 1.8]; over the streams: mean error < 0.5 sd, mean |log ratio| < 0.3.
  Broken: particles left unmoved give mean errors ≈ 2 sd and ratios 4–6, the step x − ε f errors of 60–415
  sd, and without div f the collapsed cloud stops the run (singular covariance in the whitening).
"""

from __future__ import annotations

import pytest
import torch
from mpflow.operators import gaussian, rng
from mpflow.operators.models import make_model
from mpflow.operators.models.priors import GaussianMixture, prior_from_spec
from mpflow.operators.references import kalman_filter
from mpflow.operators.updaters import UPDATERS, get_updater
from mpflow.operators.updaters.nvgd import NVGDUpdater, init_witness, nvgd, unpack, witness, witness_and_divergence

MU = torch.tensor([1.0, -0.5])
SIGMA = torch.tensor([[2.0, 0.6], [0.6, 0.5]])


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread: these tensors are tiny, and on a shared CPU torch's thread pool only adds
    (sometimes 10-50x) overhead. Restored afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def gaussian_score(x: torch.Tensor) -> torch.Tensor:
    return -(x - MU) @ torch.linalg.inv(SIGMA)


def mahalanobis_error(mean: torch.Tensor, ref_mean: torch.Tensor, ref_cov: torch.Tensor) -> torch.Tensor:
    """‖L⁻¹ (m − m_ref)‖ per stream, LLᵀ = ref_cov: the mean error in reference standard deviations."""
    L = torch.linalg.cholesky(ref_cov.to(torch.float64))
    diff = (mean.to(torch.float64) - ref_mean.to(torch.float64))[..., None]
    return torch.linalg.solve_triangular(L, diff, upper=False).squeeze(-1).norm(dim=-1)


def variance_ratio(cov: torch.Tensor, ref_cov: torch.Tensor) -> torch.Tensor:
    return torch.diagonal(cov.to(torch.float64), dim1=-2, dim2=-1) / torch.diagonal(
        ref_cov.to(torch.float64), dim1=-2, dim2=-1
    )


def test_divergence_matches_autograd_jacobian_trace():
    torch.manual_seed(0)
    gens = [rng.generator(1), rng.generator(2)]
    d, hidden = 3, (8, 5)
    theta = init_witness(gens, d, hidden, torch.float64)
    theta = theta + 0.5 * torch.randn_like(theta)  # non-zero output layer
    params = unpack(theta, d, hidden)
    z = torch.randn(2, 4, d, dtype=torch.float64)
    J = torch.autograd.functional.jacobian(lambda zz: witness(params, zz), z)  # [B, N, d, B, N, d]
    jac = torch.stack([torch.stack([J[b, n, :, b, n, :] for n in range(4)]) for b in range(2)])
    f, div = witness_and_divergence(params, z, None)
    torch.testing.assert_close(f, witness(params, z))
    torch.testing.assert_close(div, torch.diagonal(jac, dim1=-2, dim2=-1).sum(-1))
    v = torch.randn(2, 4, 3, d, dtype=torch.float64)  # 3 probes
    _, hutch = witness_and_divergence(params, z, v)
    torch.testing.assert_close(hutch, torch.einsum("bnpi,bnij,bnpj->bn", v, jac, v) / 3)


@pytest.mark.parametrize("divergence", ["exact", "hutchinson"])
def test_solver_reaches_gaussian_target(divergence):
    seeds = [0, 1, 2]
    gens = [rng.generator(s) for s in seeds]
    x0 = rng.randn(gens, (256, 2))  # N(0, I), float32
    x, trace = nvgd(x0, gaussian_score, gens, divergence=divergence)
    assert x.dtype == torch.float32 and x.shape == x0.shape
    mean, cov = gaussian.moments(x.to(torch.float64))
    err = mahalanobis_error(mean, MU.expand(3, 2), SIGMA.expand(3, 2, 2))
    ratio = variance_ratio(cov, SIGMA.expand(3, 2, 2))
    assert (err < 0.2).all(), err
    assert ((ratio > 0.8) & (ratio < 1.25)).all(), ratio
    assert (trace.iterations > 0).all() and (trace.iterations <= 60).all()


def test_filter_linear_gaussian_matches_kalman():
    T, N, B = 10, 256, 3  # three independent streams in one batch
    model = make_model("linear_gaussian", {}, 2)
    one = prior_from_spec({"type": "gaussian", "mean": [0.0, 0.0], "cov": [[1.0, 0.0], [0.0, 1.0]]}, 2)
    prior = GaussianMixture.stack([one] * B)
    g = [rng.generator(1000 + b) for b in range(B)]
    x_true = prior.sample(1, g)[:, 0]
    _, obs = model.simulate(T, x_true, g)
    km, kc, _ = kalman_filter(prior.means[:, 0], prior.covs[:, 0], model, obs)
    updater = get_updater("nvgd")
    state = updater.init(prior, model, N, seed=list(range(B)))
    for t in range(T):
        state, info = updater.update(state, obs[:, t], model)
        assert torch.isfinite(info.log_evidence_increment).all()
    mean, cov = gaussian.moments(state.particles.to(torch.float64))
    err = mahalanobis_error(mean, km[:, -1], kc[:, -1])
    ratio = variance_ratio(cov, kc[:, -1])
    assert (err < 0.8).all() and err.mean() < 0.5, err
    assert ((ratio > 0.55) & (ratio < 1.8)).all() and ratio.log().abs().mean() < 0.3, ratio


def test_reproducible_and_independent_of_batch():
    model = make_model("linear_gaussian", {}, 2)
    p0 = prior_from_spec({"type": "gaussian", "mean": [0.0, 0.0], "cov": [[1.0, 0.0], [0.0, 1.0]]}, 2)
    p1 = prior_from_spec({"type": "gaussian", "mean": [2.0, -1.0], "cov": [[4.0, 1.0], [1.0, 2.0]]}, 2)
    both = GaussianMixture.stack([p0, p1])
    obs = torch.tensor([[[1.0, 0.5], [0.7, -0.2]], [[3.0, -2.0], [2.5, -1.5]]])  # [B, T, k]
    # Hutchinson draws probes from the stream generators; 10 × 5 network steps instead of 60 × 20 (a test of what
    # is drawn and in which order, not of convergence: the same for any count)
    updater = NVGDUpdater(divergence="hutchinson", max_iters=10, inner_steps=5)

    def run(prior, seeds, o):
        state = updater.init(prior, model, 64, seed=seeds)
        for t in range(o.shape[1]):
            state, _ = updater.update(state, o[:, t], model)
        return state

    alone = run(p0, [7], obs[:1])
    again = run(p0, [7], obs[:1])
    batch = run(both, [7, 8], obs)
    assert torch.equal(alone.particles, again.particles)
    torch.testing.assert_close(batch.particles[:1], alone.particles, atol=1e-5, rtol=0)
    assert torch.equal(batch.rng[:1], alone.rng)  # the generator advanced by the same draws
    other_seed = run(p0, [9], obs[:1])
    assert not torch.allclose(other_seed.particles, alone.particles)


def test_registry_and_option_validation():
    assert UPDATERS["nvgd"] is NVGDUpdater
    with pytest.raises(ValueError, match=r"^options\.evidence"):
        NVGDUpdater(evidence="kl")
    with pytest.raises(ValueError, match=r"^options\.divergence"):
        nvgd(torch.zeros(1, 8, 2), gaussian_score, [rng.generator(0)], divergence="trace")
    with pytest.raises(ValueError, match=r"^options\.inner_steps"):
        nvgd(torch.zeros(1, 8, 2), gaussian_score, [rng.generator(0)], inner_steps=0)
    with pytest.raises(ValueError, match=r"^gens"):
        nvgd(torch.zeros(2, 8, 2), gaussian_score, [rng.generator(0)])

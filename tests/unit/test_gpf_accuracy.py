"""Gaussian particle flow: Theorem 1 (D + 1 particles reach a D-dim Gaussian target exactly) and GPF as
an assumed-density filter on linear-Gaussian models (equal to Kalman up to the solver tolerance)."""

import torch
from mpflow.operators import gaussian
from mpflow.operators.models import make_model
from mpflow.operators.models.priors import prior_from_spec
from mpflow.operators.references import kalman_filter
from mpflow.operators.rng import generator
from mpflow.operators.updaters import get_updater
from mpflow.operators.updaters.gpf import gaussian_particle_flow


def gaussian_target(D, cond, seed):
    g = torch.Generator().manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(D, D, generator=g, dtype=torch.float64))
    Sigma = Q @ torch.diag(torch.logspace(0, torch.log10(torch.tensor(cond)).item(), D, dtype=torch.float64)) @ Q.T
    mu = 2 * torch.randn(D, generator=g, dtype=torch.float64)
    L = torch.linalg.cholesky(Sigma)[None]
    return (
        mu,
        Sigma,
        (lambda x: gaussian.log_prob(x, mu[None], L)),
        (lambda x: -gaussian.precision_times(x - mu, L)),
    )


def test_theorem1_d_plus_one_particles_converge_on_20d_gaussian():
    D = 20
    mu, Sigma, log_prob, score = gaussian_target(D, cond=10.0, seed=0)
    x0 = torch.randn(1, D + 1, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for optimizer in ("plain", "rmsprop"):
        x, trace = gaussian_particle_flow(x0, log_prob, score, tol=1e-12, max_iters=3000, optimizer=optimizer)
        m, C = gaussian.moments(x)
        assert float((m[0] - mu).abs().max()) < 1e-3, optimizer
        assert float((C[0] - Sigma).abs().max()) < 1e-3, optimizer
        # the empirical free energy decreased to its minimum: −½log|Σ| + D/2 + ½ log|2πΣ|... (up to constants)
        assert float(trace.kl_decrease[0]) < 0


def test_too_few_particles_do_not_reach_the_covariance():
    """The bound is tight: with N = D particles C has rank D − 1 (Theorem 3), so the test above can fail."""
    D = 20
    mu, Sigma, log_prob, score = gaussian_target(D, cond=10.0, seed=0)
    x0 = torch.randn(1, D, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    x, _ = gaussian_particle_flow(x0, log_prob, score, tol=1e-12, max_iters=3000)
    _, C = gaussian.moments(x)
    assert float((C[0] - Sigma).abs().max()) > 1e-2


def test_gpf_filter_matches_kalman_on_lds():
    d, T = 3, 12
    g = torch.Generator().manual_seed(4)
    A = (0.9 * torch.linalg.qr(torch.randn(d, d, generator=g))[0]).tolist()
    B = torch.randn(d, d, generator=g).tolist()
    model = make_model("lds", {"A": A, "B": B}, d)
    _, obs = model.simulate(T, torch.ones(1, d), [generator(7)])
    means, covs, logz = kalman_filter(torch.zeros(1, d), torch.eye(d)[None], model, obs)
    gpf = get_updater("gpf")
    state = gpf.init(
        prior_from_spec({"type": "gaussian", "mean": [0.0] * d, "cov": torch.eye(d).tolist()}, d),
        model,
        16,
        0,
    )
    for t in range(T):
        state, info = gpf.update(state, obs[:, t], model)
        assert abs(float(info.log_evidence_increment[0] - logz[0, t])) < 1e-3
        m, C = gaussian.moments(state.particles.double())
        sd = covs[0, t].diagonal().sqrt()
        assert float(((m[0] - means[0, t]) / sd).abs().max()) < 1e-3
        assert float((C[0].diagonal() / covs[0, t].diagonal() - 1).abs().max()) < 1e-3

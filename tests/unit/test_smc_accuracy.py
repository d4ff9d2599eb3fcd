"""The bootstrap particle filter against the exact Kalman filter on ``lds`` d = 2."""

import torch
from mpflow.operators import gaussian
from mpflow.operators.models import make_model
from mpflow.operators.models.priors import prior_from_spec
from mpflow.operators.references import kalman_filter
from mpflow.operators.rng import generator
from mpflow.operators.state import systematic_resample
from mpflow.operators.updaters import get_updater

A = [[0.9, 0.2], [-0.15, 0.85]]
B = [[1.0, 0.0], [0.4, 1.0]]
PRIOR = {"type": "gaussian", "mean": [0.0, 0.0], "cov": [[1.0, 0.0], [0.0, 1.0]]}


def run_smc(T, N, seed):
    model = make_model("lds", {"A": A, "B": B}, 2)
    _, obs = model.simulate(T, torch.tensor([[1.0, -1.0]]), [generator(100 + seed)])
    means, covs, logz = kalman_filter(torch.zeros(1, 2), torch.eye(2)[None], model, obs)
    smc = get_updater("smc")
    state = smc.init(prior_from_spec(PRIOR, 2), model, N, seed=seed)
    errs = []
    for t in range(T):
        state, _ = smc.update(state, obs[:, t], model)
        m, C = gaussian.moments(state.particles.double(), state.log_weights)
        sd = covs[0, t].diagonal().sqrt()
        errs.append(((m[0] - means[0, t]) / sd).abs().max())
        errs.append((C[0].diagonal() / covs[0, t].diagonal() - 1).abs().max())
    return torch.stack(errs), float(state.log_evidence[0] - logz.sum())


def test_smc_4096_tracks_kalman_on_lds():
    errs, _ = run_smc(T=50, N=4096, seed=0)
    # Monte Carlo error of N = 4096 (ESS ≥ N/2): mean ~ 1/√2048 ≈ 0.02 sd; variance ratio ~ ±5 %
    assert float(errs[0::2].max()) < 0.15, errs[0::2].max()
    assert float(errs[1::2].max()) < 0.25, errs[1::2].max()
    assert float(errs[0::2].mean()) < 0.05


def test_smc_log_evidence_within_one_nat_of_kalman_over_50_steps():
    for seed in range(3):
        _, gap = run_smc(T=50, N=4096, seed=seed)
        assert abs(gap) < 1.0, (seed, gap)


def test_systematic_resampling_gives_each_particle_floor_or_ceil_of_n_w():
    """Systematic resampling's defining property: particle i is copied ⌊N w_i⌋ or ⌈N w_i⌉ times."""
    g = torch.Generator().manual_seed(0)
    N = 1000
    lw = 3 * torch.randn(2, N, generator=g, dtype=torch.float64)
    idx = systematic_resample(lw, torch.rand(2, generator=g, dtype=torch.float64))
    for b in range(2):
        counts = torch.bincount(idx[b], minlength=N).double()
        nw = N * torch.softmax(lw[b], -1)
        assert bool(((counts >= torch.floor(nw) - 1e-9) & (counts <= torch.ceil(nw) + 1e-9)).all())

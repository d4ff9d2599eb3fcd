"""The non-Gaussian references of benchmarks/equal_compute.py, checked where the exact answer is known:
each reduces to the Kalman filter / conjugate posterior on a linear-Gaussian model, and each refuses to be a
reference when its own diagnostics fail."""

from __future__ import annotations

import pytest
import torch
from mpflow.operators.models import make_model
from mpflow.operators.references import kalman_filter
from mpflow.operators.references.grid import diagonal_grid_filter, grid_error, static_grid_posterior
from mpflow.operators.references.hmc import (
    ReferenceRejectedError,
    effective_sample_size,
    hmc_reference,
    split_rhat,
)
from mpflow.operators.rng import generator


def _sd_error(means, covs, exact_means, exact_covs) -> float:
    sd = exact_covs.diagonal(dim1=-2, dim2=-1).sqrt()
    return float(((means - exact_means).abs() / sd).max())


def test_diagonal_grid_filter_is_the_kalman_filter_on_a_diagonal_lds() -> None:
    lds = make_model("lds", {"A": [[0.9, 0], [0, -0.5]], "B": [[1, 0], [0, 1]], "Q": [[0.5, 0], [0, 0.2]]}, 2)
    _, obs = lds.simulate(8, torch.zeros(3, 2), [generator(i) for i in range(3)])
    km, kc, _ = kalman_filter(torch.zeros(3, 2), 2 * torch.eye(2).expand(3, 2, 2), lds, obs)
    gm, gc = diagonal_grid_filter(lds, torch.zeros(2), 2 * torch.ones(2), obs, points=400)
    assert _sd_error(gm, gc, km, kc) < 1e-8
    assert torch.allclose(gc, kc, rtol=1e-8, atol=1e-10)


def test_diagonal_grid_filter_refuses_a_coupled_transition() -> None:
    lds = make_model("lds", {"A": [[0.9, 0.1], [0, 0.5]], "B": [[1, 0], [0, 1]]}, 2)
    _, obs = lds.simulate(2, torch.zeros(1, 2), [generator(0)])
    with pytest.raises(ValueError, match="diagonal"):
        diagonal_grid_filter(lds, torch.zeros(2), torch.ones(2), obs)


def test_static_grid_is_the_conjugate_posterior_and_reports_its_error() -> None:
    lg = make_model("linear_gaussian", {"R": [[0.05, 0], [0, 0.05]]}, 2)  # a posterior 40x narrower than the prior
    _, obs = lg.simulate(4, torch.ones(2, 2), [generator(i) for i in range(2)])
    km, kc, _ = kalman_filter(torch.zeros(2, 2), 4 * torch.eye(2).expand(2, 2, 2), lg, obs)
    (gm, gc), err = grid_error(lambda g: static_grid_posterior(lg, torch.zeros(2), 4 * torch.eye(2), obs, g), 128)
    assert _sd_error(gm, gc, km, kc) < 1e-6  # the adaptive box resolves it
    assert err < 1e-3


def test_hmc_matches_the_conjugate_posterior_within_its_monte_carlo_error() -> None:
    lg = make_model("linear_gaussian", {}, 3)
    _, obs = lg.simulate(3, torch.zeros(2, 3), [generator(i) for i in range(2)])
    km, kc, _ = kalman_filter(torch.zeros(2, 3), torch.eye(3).expand(2, 3, 3), lg, obs)
    ref = hmc_reference(lg, torch.zeros(3), torch.eye(3), obs, chains=8, draws=300, warmup=100, min_ess=500)
    tolerance = 5 / float(ref.ess.min()) ** 0.5  # 5 Monte Carlo standard errors
    assert _sd_error(ref.means, ref.covs, km, kc) < tolerance
    ratio = ref.covs.diagonal(dim1=-2, dim2=-1) / kc.diagonal(dim1=-2, dim2=-1)
    assert float((ratio - 1).abs().max()) < 0.15
    assert float(ref.rhat.max()) <= 1.01


def test_hmc_refuses_to_be_a_reference_when_its_diagnostics_fail() -> None:
    lg = make_model("linear_gaussian", {}, 2)
    _, obs = lg.simulate(1, torch.zeros(1, 2), [generator(0)])
    with pytest.raises(ReferenceRejectedError, match="ESS"):
        hmc_reference(lg, torch.zeros(2), torch.eye(2), obs, chains=2, draws=20, warmup=20, min_ess=1000)


def test_diagnostics_of_iid_and_of_stuck_chains() -> None:
    iid = torch.randn(1, 8, 500, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    assert float(split_rhat(iid).max()) < 1.01
    assert float(effective_sample_size(iid).min()) > 2000  # 4000 draws, no autocorrelation
    stuck = iid + torch.arange(8, dtype=torch.float64)[None, :, None, None]  # chains around different means
    assert float(split_rhat(stuck).min()) > 1.5
    sticky = iid.repeat_interleave(10, dim=2)  # every draw repeated ten times
    assert float(effective_sample_size(sticky).max()) < 0.3 * 8 * 5000

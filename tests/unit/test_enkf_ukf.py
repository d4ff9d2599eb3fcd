"""``enkf`` and ``ukf``: exact where they should be, consistent where they approximate, and explicit about what they
cannot run.

* ``ukf`` on a linear-Gaussian model is the Kalman filter: the float64 reference of test_missing_observations (gaps,
  a predict-only step and partial observations included), means, covariances and evidence to 1e-6;
* the ETKF's analysis ensemble has exactly the Kalman analysis mean and covariance of its forecast ensemble's
  Gaussian (deterministic square-root filter); the perturbed-observation EnKF has them in expectation;
* both follow the exact filter with gaps within Monte Carlo tolerances;
* the LETKF with an infinite radius is the global ETKF; localisation is refused where the family has no distance;
* families without o = h(x) + N(0, R) are refused with a message naming what is missing.
"""

from __future__ import annotations

import math

import pytest
import torch
from mpflow.operators.models import make_model
from mpflow.operators.models.priors import prior_from_spec
from mpflow.operators.rng import generator
from mpflow.operators.updaters import get_updater

from tests.unit.test_lorenz96 import twin
from tests.unit.test_missing_observations import OBS, reference
from tests.unit.test_missing_observations import run as run_with_gaps
from tests.unit.test_updaters_common import model_for, prior_for

F64 = torch.float64


def test_ukf_is_the_kalman_filter_on_a_linear_gaussian_model_with_gaps():
    rows, ref = run_with_gaps("ukf", 64), reference()
    total = 0.0
    for (state, info), (m, P, inc) in zip(rows, ref, strict=True):
        torch.testing.assert_close(state.extras["mean"][0], m, atol=1e-6, rtol=0)
        torch.testing.assert_close(state.extras["cov"][0], P, atol=1e-6, rtol=0)
        assert float(info.log_evidence_increment[0]) == pytest.approx(inc, abs=1e-6)
        total += inc
    assert float(rows[-1][0].log_evidence[0]) == pytest.approx(total, abs=1e-6)


@pytest.mark.parametrize("variant,n,tol", [("etkf", 600, 0.1), ("perturbed", 4000, 0.12)])
def test_enkf_follows_the_exact_filter_with_gaps(variant, n, tol):
    ref = reference()
    rows = run_with_gaps("enkf", n, variant=variant)
    for (state, _), (m, P, _) in zip(rows, ref, strict=True):
        x = state.particles[0].double()
        assert ((x.mean(0) - m).abs() / P.diagonal().sqrt()).max() < tol
        assert (torch.cov(x.T).diagonal() / P.diagonal() - 1).abs().max() < 3 * tol
    assert float(rows[-1][0].log_evidence[0]) == pytest.approx(sum(r[2] for r in ref), abs=0.15)
    for (_, info), o in zip(rows, OBS, strict=True):
        if all(math.isnan(v) for v in o):
            assert float(info.log_evidence_increment[0]) == 0.0


def test_the_etkf_analysis_is_the_kalman_analysis_of_its_ensemble():
    """Static H = I model: the forecast ensemble is the initial one, P_f its sample covariance (N − 1); the ETKF's
    analysis mean is x̄ + K (o − x̄) and its sample covariance (I − K) P_f, K = P_f (P_f + R)⁻¹, to float32 precision."""
    model = make_model("linear_gaussian", {"R": [[0.5, 0.1], [0.1, 0.8]]}, 2)
    prior = prior_from_spec({"type": "gaussian", "mean": [0.3, -0.2], "cov": [[1.0, 0.4], [0.4, 2.0]]}, 2)
    u = get_updater("enkf")
    state = u.init(prior, model, 20, seed=4)
    x = state.particles[0].double()
    Pf, R = torch.cov(x.T), torch.tensor([[0.5, 0.1], [0.1, 0.8]], dtype=F64)
    o = torch.tensor([1.0, -1.5], dtype=F64)
    K = Pf @ torch.linalg.inv(Pf + R)
    new, _ = u.update(state, o[None].float(), model)
    xa = new.particles[0].double()
    torch.testing.assert_close(xa.mean(0), x.mean(0) + K @ (o - x.mean(0)), atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.cov(xa.T), (torch.eye(2, dtype=F64) - K) @ Pf, atol=1e-5, rtol=0)


def test_the_letkf_with_an_unbounded_radius_is_the_global_etkf_and_a_short_one_differs():
    model, prior, _, obs = twin(d=12, steps=3)
    outs = {}
    for radius in (None, 1e6, 2.0):
        u = get_updater("enkf", localisation=radius, inflation=1.02)
        state = u.init(prior, model, 16, seed=2)
        for m in range(3):
            state, _ = u.update(state, obs[:, m], model)
        outs[radius] = state.particles
    torch.testing.assert_close(outs[1e6], outs[None], atol=1e-4, rtol=1e-4)
    assert float((outs[2.0] - outs[None]).abs().max()) > 1e-2


def test_options_are_validated_and_localisation_needs_a_distance():
    for bad, field in (
        ({"variant": "square"}, "variant"),
        ({"inflation": 0.9}, "inflation"),
        ({"localisation": -1.0}, "localisation"),
        ({"localisation": 2.0, "variant": "perturbed"}, "localisation"),
    ):
        with pytest.raises(ValueError, match=rf"^options\.{field}"):
            get_updater("enkf", **bad)
    with pytest.raises(ValueError, match=r"^options\.localisation: the lds family defines no distance"):
        get_updater("enkf", localisation=3.0).check_compatible(model_for("lds"), prior_for("lds"))
    with pytest.raises(ValueError, match=r"^options\.alpha"):
        get_updater("ukf", alpha=0.0)


@pytest.mark.parametrize("method", ["enkf", "ukf"])
@pytest.mark.parametrize("family", ["gmm", "logistic", "stochastic_volatility"])
def test_families_without_an_explicit_observation_function_are_refused(method, family):
    with pytest.raises(ValueError, match=r"^method: .* o = h\(x\) \+ N\(0, R\)") as exc:
        get_updater(method).init(prior_for(family), model_for(family), 16, seed=0)
    assert family in str(exc.value)


def test_ukf_starts_from_any_priors_moments():
    model = model_for("range_bearing")
    mixture = prior_from_spec(
        {
            "type": "mixture",
            "weights": [0.5, 0.5],
            "means": [[0, 0, 0, 0], [1, 1, 0, 0]],
            "covs": [torch.eye(4).tolist()] * 2,
        }
    )
    u = get_updater("ukf")
    state = u.init(mixture, model, 32, seed=0)
    torch.testing.assert_close(state.extras["mean"][0], torch.tensor([0.5, 0.5, 0, 0], dtype=F64))
    _, obs = model.simulate(1, torch.zeros(1, 4), [generator(0)])
    new, info = u.update(state, obs[:, 0], model)
    assert torch.isfinite(new.particles).all() and torch.isfinite(info.log_evidence_increment).all()

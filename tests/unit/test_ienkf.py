"""``ienkf``, the iterative ensemble Kalman filter: the ETKF where the model and the observation are linear (one
Gauss–Newton step lands on the minimum, the next finds nothing to change), its iterations priced and reported, a
stream's result independent of its batch, its options checked with the field named, and the families it cannot
serve refused.
"""

from __future__ import annotations

import pytest
import torch
from mpflow.operators.models import make_model
from mpflow.operators.models.priors import GaussianMixture, prior_from_spec
from mpflow.operators.updaters import get_updater
from mpflow.operators.updaters.base import CAPABILITIES

from tests.unit.test_lorenz96 import twin
from tests.unit.test_updaters_common import model_for, prior_for

LDS = {
    "A": [[0.9, 0.3], [-0.2, 0.8]],
    "Q": [[1e-10, 0.0], [0.0, 1e-10]],
    "B": [[1.0, 0.0], [0.0, 1.0]],
    "R": [[0.5, 0.1], [0.1, 0.8]],
}
PRIOR = {"type": "gaussian", "mean": [0.3, -0.2], "cov": [[1.0, 0.4], [0.4, 2.0]]}


@pytest.mark.parametrize("family,params", [("linear_gaussian", {"R": LDS["R"]}), ("lds", LDS)])
def test_on_a_linear_model_it_is_the_etkf_after_one_gauss_newton_step(family, params):
    """Linear f and h: the IEnKF's analysis is the ETKF's of the forecast ensemble (to float32 precision), its
    evidence the same Gaussian predictive, and it stops at its second iteration (Δw = 0 there)."""
    model = make_model(family, params, 2)
    prior = prior_from_spec(PRIOR, 2)
    obs = torch.tensor([[1.0, -1.5]])
    out = {}
    for method in ("ienkf", "enkf"):
        u = get_updater(method, inflation=1.05)
        state = u.init(prior, model, 20, seed=4)
        out[method] = u.update(state, obs, model)
    (xi, ii), (xe, ie) = out["ienkf"], out["enkf"]
    torch.testing.assert_close(xi.particles, xe.particles, atol=1e-4, rtol=0)
    torch.testing.assert_close(ii.log_evidence_increment, ie.log_evidence_increment, atol=1e-4, rtol=0)
    assert ii.iterations.tolist() == [2]


def test_on_lorenz96_it_iterates_and_a_stream_does_not_depend_on_its_batch():
    """A nonlinear forecast (Lorenz-96, Δ = 0.4): more than two iterations; each stream of a batch of two gets what it
    gets alone (a stream that has converged stops while the other goes on)."""
    params = {"delta": 0.4, "rk4_step": 0.05}
    runs = [twin(d=12, steps=1, seed=s, **params) for s in (0, 1)]
    model = runs[0][0]
    means = torch.stack([r[1].means[0, 0] for r in runs])
    prior = GaussianMixture.gaussian(means, torch.eye(12).expand(2, 12, 12))
    obs = torch.cat([r[3][:, 0] for r in runs])
    u = get_updater("ienkf", inflation=1.1)
    both, info = u.update(u.init(prior, model, 16, seed=[3, 4]), obs, model)
    assert int(info.iterations.max()) > 2
    for b in range(2):
        one = GaussianMixture.gaussian(means[b : b + 1], torch.eye(12)[None])
        alone, _ = u.update(u.init(one, model, 16, seed=3 + b), obs[b : b + 1], model)
        torch.testing.assert_close(alone.particles[0], both.particles[b], atol=1e-5, rtol=0)


def test_its_work_grows_with_its_iterations():
    model = make_model("lorenz96", {"delta": 0.4, "rk4_step": 0.02, "obs_every": 2}, 40)
    few, many = (get_updater("ienkf", iterations=n).step_work(model, 40).flops for n in (3, 10))
    letkf = get_updater("enkf", localisation=4).step_work(model, 40).flops
    assert many > 2 * few > 0 and few > 0.5 * letkf


def test_options_are_validated_naming_the_field():
    for bad, field in (
        ({"iterations": 0}, "iterations"),
        ({"iterations": 21}, "iterations"),
        ({"iterations": 2.5}, "iterations"),
        ({"iterations": True}, "iterations"),
        ({"tolerance": -0.1}, "tolerance"),
        ({"tolerance": 1.0}, "tolerance"),
        ({"inflation": 0.9}, "inflation"),
    ):
        with pytest.raises(ValueError, match=rf"^options\.{field}"):
            get_updater("ienkf", **bad)
    with pytest.raises(ValueError, match=r"^options: unknown option\(s\) \['localisation'\]"):
        get_updater("ienkf", localisation=4)


@pytest.mark.parametrize("family", ["gmm", "logistic", "stochastic_volatility"])
def test_families_without_an_explicit_observation_function_are_refused(family):
    with pytest.raises(ValueError, match=r"^method: ienkf needs an observation o = h\(x\) \+ N\(0, R\)"):
        get_updater("ienkf").init(prior_for(family), model_for(family), 16, seed=0)


def test_capabilities_are_an_unweighted_approximate_filter():
    caps = get_updater("ienkf").capabilities_with({})
    assert set(caps) == set(CAPABILITIES)
    assert caps["weighted"] is False and caps["exact"] is False and caps["forecasts"] is True


@pytest.mark.parametrize("q", [0.0, 0.1])
def test_a_step_forecasts_its_ensemble_once_for_its_p_values_too(monkeypatch, q):
    """The p-values read the first iterate's forecast plus the step's own model noise: a step runs the forecast
    its Gauss–Newton iterations and its analysis need and no more (the former extra transition draw for the
    p-values is gone), and at ρ = 1 the p-values are those of that former draw — f(E0) + the same noise — to
    rounding. One entry left unobserved keeps its NaN."""
    from mpflow.operators.updaters.base import Updater

    params = {"delta": 0.4, "rk4_step": 0.05, "Q": q}
    model, prior, _, observations = twin(d=12, steps=1, seed=0, **params)
    obs = observations[:, 0].clone()
    obs[0, 3] = float("nan")
    u = get_updater("ienkf", iterations=3, tolerance=0.0)
    state = u.init(prior, model, 16, seed=2)
    calls = []
    original = type(model).transition_mean

    def counted(self, x):
        calls.append(x.shape)
        return original(self, x)

    monkeypatch.setattr(type(model), "transition_mean", counted)
    new, info = u.update(state, obs, model)
    assert len(calls) == int(info.iterations[0]) + 1  # the iterations' forecasts and the analysis's
    expected = Updater.pit(u, state, obs.to(u.model_dtype), model)  # the former way: a transition draw of its own
    assert len(calls) == int(info.iterations[0]) + 2
    assert torch.isnan(info.extras["pit"][0, 3]) and torch.isnan(expected[0, 3])
    # Q > 0: the same law, other draws (the analysis draws its noise in float64, the former predict in float32)
    atol = 1e-5 if q == 0 else 0.1
    torch.testing.assert_close(info.extras["pit"], expected, atol=atol, rtol=0, equal_nan=True)
    assert u.pit_work(model, 16).flops < u.step_work(model, 16).flops / 4  # no second forecast priced

"""The MPF updater pipeline with the untrained (zero-residual) network: the exact Daum–Huang filter, which
must track the Kalman posterior — particles and their tracked log-density — on linear-Gaussian models."""

import pytest
import torch
from mpflow.operators import gaussian
from mpflow.operators.models import make_model
from mpflow.operators.models.priors import prior_from_spec
from mpflow.operators.mpf.network import MPFVelocity
from mpflow.operators.references import kalman_filter
from mpflow.operators.rng import generator
from mpflow.operators.updaters.mpf import MPFUpdater

PRIOR2 = {"type": "gaussian", "mean": [0.0, 0.0], "cov": [[1.0, 0.0], [0.0, 1.0]]}


@pytest.mark.parametrize(
    ("family", "params"),
    [("linear_gaussian", {}), ("lds", {"A": [[0.9, 0.2], [-0.1, 0.9]], "B": [[1.0, 0.0], [0.5, 1.0]]})],
)
def test_untrained_mpf_is_the_exact_daum_huang_filter(family, params):
    model = make_model(family, params, 2)
    _, obs = model.simulate(20, torch.tensor([[1.0, -1.0]]), [generator(3)])
    means, covs, logz = kalman_filter(torch.zeros(1, 2), torch.eye(2)[None], model, obs)
    up = MPFUpdater(steps=4, track_density=True)
    state = up.init(prior_from_spec(PRIOR2, 2), model, 256, 0)
    for t in range(20):
        state, info = up.update(state, obs[:, t], model)
        m, C = gaussian.moments(state.particles.double())
        sd = covs[0, t].diagonal().sqrt()
        assert float(((m[0] - means[0, t]) / sd).abs().max()) < 0.02, t
        assert float((C[0].diagonal() / covs[0, t].diagonal() - 1).abs().max()) < 0.03, t
    if family == "linear_gaussian":  # static: the tracked log q (eq. 8) is the exact posterior density
        exact = gaussian.log_prob(state.particles.double(), means[:, -1], torch.linalg.cholesky(covs[:, -1]))
        assert float((state.log_density.double() - exact).abs().max()) < 0.05
    assert abs(float(state.log_evidence[0] - logz.sum())) < 1.0


def test_non_gaussian_likelihood_runs_and_stays_finite():
    model = make_model("stochastic_volatility", {}, 2)
    _, obs = model.simulate(10, torch.zeros(1, 2), [generator(5)])
    up = MPFUpdater(track_density=True)
    state = up.init(prior_from_spec(PRIOR2, 2), model, 128, 0)
    for t in range(10):
        state, _ = up.update(state, obs[:, t], model)
    assert bool(torch.isfinite(state.particles).all()) and bool(torch.isfinite(state.log_density).all())


def test_network_option_is_validated():
    with pytest.raises(ValueError, match=r"^options\.network"):
        MPFUpdater(network="lds-d2-v1")


def _save_operator(root, family="linear_gaussian", dim=2, seed=0):
    from mpflow.operators.registry import save_operator

    torch.manual_seed(seed)
    net = MPFVelocity(dim, hidden=8, layers=2, embed=8)
    with torch.no_grad():
        net.layers[-1].linear.weight.normal_(0, 0.05)  # a non-zero residual
    config = {
        "family": family,
        "state_dim": dim,
        "obs_dim": dim,
        "architecture": {"hidden": 8, "layers": 2, "embed": 8, "use_base": True},
        "solver": {"method": "rk4", "steps": 2},
    }
    return save_operator(root, None, config, net.state_dict(), {"note": "test"}, "made by a test"), net


def test_an_operator_marked_not_auto_select_serves_only_when_named(tmp_path):
    """``"auto_select": false`` in config.json: the newest operator for (family, d) is then the one before it (or
    none); named, it still loads; the shipped ``lorenz96-d40-v1`` is such an operator."""
    import json

    from mpflow.operators.trained_operators import find_operator
    from mpflow.operators.updaters import get_updater

    first, _ = _save_operator(tmp_path)
    second, _ = _save_operator(tmp_path, seed=1)
    config = second.path / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "auto_select": False}))
    assert find_operator("linear_gaussian", 2, [tmp_path]).name == first.name
    assert find_operator("linear_gaussian", 2, [tmp_path], include_named_only=True).name == second.name
    assert get_updater("mpf", operator=str(second.path)).record.name == second.name
    assert find_operator("lorenz96", 40) is None
    assert find_operator("lorenz96", 40, include_named_only=True).name == "lorenz96-d40-v1"


def test_a_trained_operator_restages_low_ess_steps_by_default(tmp_path):
    """``max_substeps``: ``substeps`` for the base flow, 4 × ``substeps`` with an operator (its config's solver or
    the stream's own option override it)."""
    from mpflow.operators.updaters import get_updater
    from mpflow.operators.updaters.mpf import ON_DEMAND_STAGES

    record, _ = _save_operator(tmp_path)
    assert get_updater("mpf").options["max_substeps"] == 1
    assert get_updater("mpf", substeps=2).options["max_substeps"] == 2
    assert get_updater("mpf", operator=str(record.path)).options["max_substeps"] == ON_DEMAND_STAGES == 4
    assert get_updater("mpf", operator=str(record.path), substeps=2).options["max_substeps"] == 8
    assert get_updater("mpf", operator=str(record.path), max_substeps=1).options["max_substeps"] == 1


def test_registered_operator_is_found_loaded_and_checked(tmp_path):
    from mpflow.operators.trained_operators import find_operator
    from mpflow.operators.updaters import get_updater

    first, _ = _save_operator(tmp_path)
    second, net = _save_operator(tmp_path, seed=1)
    assert find_operator("linear_gaussian", 2, [tmp_path]).name == second.name == "linear_gaussian-d2-v2"
    assert find_operator("gmm", 2, [tmp_path]) is None
    up = get_updater("mpf", operator=str(second.path))
    assert up.options["steps"] == 2 and up.options["solver"] == "rk4"  # the operator's own solver settings
    for a, b in zip(up.network(2).parameters(), net.parameters(), strict=True):
        assert torch.equal(a, b)
    model = make_model("linear_gaussian", {}, 2)
    state = up.init(prior_from_spec(PRIOR2, 2), model, 32, 0)
    state, _ = up.update(state, torch.tensor([[0.5, -0.5]]), model)
    assert bool(torch.isfinite(state.particles).all())
    with pytest.raises(ValueError, match="method: operator linear_gaussian-d2-v2 is for linear_gaussian"):
        up.init(prior_from_spec(PRIOR2, 2), make_model("gmm", {}, 2), 32, 0)
    with pytest.raises(ValueError, match="operator: unknown operator"):
        get_updater("mpf", operator="nope-d2-v1")


def test_a_one_dimensional_operator_serves_a_factorised_family_one_dimension_at_a_time(tmp_path):
    """``stochastic_volatility`` factorises over its dimensions, so its d = 1 operator serves every d: found for d = 3
    when there is no operator of that d (not for a family that does not factorise), run on the 3·B one-dimensional
    streams — so an observation moves only its own dimension, which a joint flow would not keep — and refused with
    a tracked density, which the split flow does not carry."""
    from mpflow.operators.trained_operators import find_operator
    from mpflow.operators.updaters import get_updater

    record, _ = _save_operator(tmp_path, family="stochastic_volatility", dim=1)
    assert find_operator("stochastic_volatility", 3, [tmp_path]).name == record.name
    _save_operator(tmp_path, family="linear_gaussian", dim=1)
    assert find_operator("linear_gaussian", 3, [tmp_path]) is None
    model = make_model("stochastic_volatility", {"mu": [0.0, -1.0, 0.5], "phi": 0.9, "sigma": 0.4}, 3)
    prior = prior_from_spec({"type": "gaussian", "mean": [0.0, 0.0, 0.0], "cov": torch.eye(3).tolist()}, 3)
    up = get_updater("mpf", operator=str(record.path))
    base = get_updater("mpf")
    obs = torch.tensor([[0.3, -2.0, 1.1]])
    moved = obs.clone()
    moved[0, 0] = 4.0
    start = up.init(prior, model, 128, 7)
    a, info = up.update(start, obs, model)
    b, _ = up.update(start, moved, model)
    flowed, _ = base.update(start, obs, model)
    assert torch.equal(a.particles[..., 1:], b.particles[..., 1:])
    assert not torch.allclose(a.particles[..., 0], b.particles[..., 0])
    assert not torch.allclose(a.particles, flowed.particles, atol=1e-4)  # the residual acts
    assert float(info.ess[0]) > 0 and bool(torch.isfinite(a.particles).all())
    with pytest.raises(ValueError, match=r"options\.track_density: the operator \(d = 1\) serves d = 3"):
        get_updater("mpf", operator=str(record.path), track_density=True).init(prior, model, 32, 0)
    with pytest.raises(ValueError, match="is for stochastic_volatility with d = 1, not linear_gaussian"):
        up.init(prior, make_model("linear_gaussian", {}, 3), 32, 0)

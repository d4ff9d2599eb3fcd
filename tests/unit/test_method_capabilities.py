"""What a method says it can do (``Updater.capabilities_with``, published in the stream document and
``GET /v1/models``) is what it does: a method that declares an unweighted cloud keeps its weights uniform, one that
declares a weighted cloud (smc; mpf with ``flow_fraction: "auto"``) carries unequal weights after a step, and the
one that declares itself exact (kalman) matches the Kalman filter."""

from __future__ import annotations

import pytest
import torch
from mpflow.operators.models import make_model
from mpflow.operators.models.priors import prior_from_spec
from mpflow.operators.references import kalman_filter
from mpflow.operators.state import ess
from mpflow.operators.updaters import CAPABILITIES, UPDATERS, get_updater

N = 128
STEPS = 4
AUTO = {"flow_fraction": "auto", "correct": True}
#: options that cap the iterative methods (only keys a method declares are passed)
FAST = {"max_iters": 20, "inner_steps": 5}


def _run(method: str, options: dict) -> tuple[list[torch.Tensor], torch.Tensor | None, torch.Tensor]:
    """(log-weights after each step, the mean of the density the method keeps (None: it keeps none), the exact
    Kalman mean) of a 2-d lds stream after its last step."""
    params = {"A": [[0.9, 0.1], [0.0, 0.9]], "B": [[1.0, 0.0], [0.0, 1.0]], "R": [[0.5, 0.0], [0.0, 0.5]]}
    if UPDATERS[method].unknown_params:  # a method that learns parameters runs a model with one given as a prior
        params["R"] = {"prior": {"type": "lognormal", "mean": -0.7, "sd": 0.5}}
    model = make_model("lds", params, 2)
    prior = prior_from_spec({"type": "gaussian", "mean": [0.0, 0.0], "cov": [[1.0, 0.0], [0.0, 1.0]]}, 2)
    obs = torch.tensor([[[0.8, -0.4]], [[1.1, -0.2]], [[0.9, 0.3]], [[1.4, 0.1]]])
    updater = get_updater(method, **options)
    state = updater.init(prior, model, N, seed=3)
    weights = []
    for m in range(STEPS):
        state, _ = updater.update(state, obs[m], model)
        weights.append(state.log_weights[0])
    eye = torch.eye(2, dtype=torch.float64)
    if UPDATERS[method].unknown_params:
        return weights, None, torch.zeros(2)
    means, _, _ = kalman_filter(torch.zeros(1, 2, dtype=torch.float64), eye[None], model, obs.transpose(0, 1))
    density = updater.density(state)
    return weights, None if density is None else density.moments()[0][0], means[0, -1]


def test_every_method_publishes_every_capability_as_a_bool() -> None:
    for name, cls in UPDATERS.items():
        caps = cls.capabilities_with()
        assert list(caps) == list(CAPABILITIES) and all(isinstance(v, bool) for v in caps.values()), name
        assert cls.catalogue_entry() == {**cls.capabilities_with(cls.defaults), "weighted_with": cls.weighted_options}
        assert get_updater(name).weighted == caps["weighted"], name


@pytest.mark.parametrize(
    ("method", "options"),
    [(m, {k: v for k, v in FAST.items() if k in UPDATERS[m].defaults}) for m in sorted(UPDATERS)] + [("mpf", AUTO)],
)
def test_a_method_does_what_it_declares(method: str, options: dict) -> None:
    caps = UPDATERS[method].capabilities_with(options)
    assert get_updater(method, **options).weighted == caps["weighted"]
    weights, mean, exact_mean = _run(method, options)
    sizes = [float(ess(lw[None])[0]) for lw in weights]
    if caps["weighted"]:
        assert min(sizes) < N - 1, f"{method} {options} declares a weighted cloud, yet every ESS is N: {sizes}"
    else:
        assert all(abs(s - N) < 1e-3 for s in sizes), f"{method} declares uniform weights, ESS {sizes}"
    if caps["exact"]:  # the belief it keeps is the exact posterior, not particles
        assert mean is not None and torch.allclose(mean, exact_mean, atol=1e-6), (mean, exact_mean)


def test_the_service_reads_a_streams_weighting_off_its_own_options() -> None:
    """The service's draws and fall-backs (``engine.methods.weighted``) follow the stream's options, as its
    document's ``capabilities`` does: an ``mpf`` stream with ``flow_fraction: "auto"`` is weighted, one without is
    not, ``smc`` always is, and a method this server does not know is taken as weighted."""
    from mpflow.service.engine.methods import capabilities, weighted

    auto = {"method": "mpf", "method_options": AUTO}
    plain = {"method": "mpf", "method_options": {"correct": True}}
    assert weighted(auto) and capabilities(auto)["weighted"]
    assert not weighted(plain) and not capabilities(plain)["weighted"]
    assert weighted({"method": "smc", "method_options": None})
    assert weighted({"method": "not-a-method"}) and capabilities({"method": "not-a-method"}) is None

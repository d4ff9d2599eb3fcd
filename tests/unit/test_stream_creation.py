"""A new stream's preparation (:func:`mpflow.service.streams.creation.prepare`): its model is built once, in its
method's dtype, and the particle count a smoothing stream gets by default fits every request of that stream —
not only its window and ``/smoothed``, but its creation and its steps too (else the server would refuse, naming
``num_particles``, a count the client never sent)."""

from __future__ import annotations

import pytest
from mpflow.operators.models import make_model
from mpflow.operators.models.priors import prior_from_spec
from mpflow.operators.updaters import get_updater
from mpflow.service.engine import methods as methods_module
from mpflow.service.engine.catalogue import OperatorCatalogue
from mpflow.service.engine.methods import Methods
from mpflow.service.schemas import CreateStreamRequest
from mpflow.service.settings import Settings
from mpflow.service.streams import costs
from mpflow.service.streams.creation import prepare, smoothing_default

from tests.harness.rts import PARAMS, PRIOR

#: Lorenz-96 in its usual d = 40 with 500 RK4 sub-steps a step (Δ = 0.5, h = 0.001): one particle's step, about
#: 7.6e5 operations, costs more than five steps of its ``/smoothed`` window (about 1.4e5 each at backward
#: simulation's measured price), so that the stream's creation binds before its read
L96 = {"family": "lorenz96", "params": {"delta": 0.5, "rk4_step": 0.001, "Q": 0.1}}
L96_D, L96_LAG = 40, 5
L96_PRIOR = {
    "type": "gaussian",
    "mean": [8.0] * L96_D,
    "cov": [[float(i == j) for j in range(L96_D)] for i in range(L96_D)],
}


def setup(**extra) -> tuple[Settings, Methods]:
    settings = Settings(redis_url="redis://unused", **extra)
    return settings, Methods(settings, OperatorCatalogue([]))


@pytest.mark.parametrize("method", ["kalman", "smc", "ukf"])
def test_prepare_builds_the_model_once(monkeypatch, method):
    built = []
    make = methods_module.make_model
    monkeypatch.setattr(methods_module, "make_model", lambda *a, **k: built.append(a) or make(*a, **k))
    settings, methods = setup()
    req = CreateStreamRequest(model={"family": "lds", "params": PARAMS}, prior=PRIOR, method=method, num_particles=64)
    meta, state, _ = prepare(settings, methods, req)
    assert len(built) == 1, built
    assert meta["method"] == method and int(state.step[0]) == 0


def test_the_smoothing_default_fits_the_streams_creation_and_steps():
    """A Lorenz-96 stream (:data:`L96`) keeping 5 steps: at N = 4096 its creation (its first step included) is over
    a budget of 6.5e9 operations while its window and ``/smoothed`` are not; the default N is lowered to fit all of
    them, so the stream is created."""
    settings, methods = setup(max_request_flops=6.5e9)
    model = make_model("lorenz96", L96["params"], L96_D)
    updater, prior = get_updater("smc"), prior_from_spec(L96_PRIOR)
    assert costs.share(settings, costs.creation_cost(model, updater, prior, 4096)) > 1
    assert costs.share(settings, costs.smoothing_cost(model, updater, 4096, L96_LAG)) <= 1
    req = CreateStreamRequest(model=L96, prior=L96_PRIOR, method="smc", smoothing_lag=L96_LAG)
    meta, _, _ = prepare(settings, methods, req)
    n = meta["num_particles"]
    assert 256 < n < 4096
    for cost in (
        costs.creation_cost(model, updater, prior, n),
        costs.observations_cost(model, updater, n, [(1.0, None)], 0, L96_LAG),
        costs.smoothing_cost(model, updater, n, L96_LAG),
    ):
        assert costs.share(settings, cost) <= 1
    # the largest
    assert costs.share(settings, costs.smoothing_stream_cost(model, updater, prior, n + 1, L96_LAG)) > 1


def test_a_static_familys_smoothing_stream_gets_more_particles_than_a_dynamic_ones():
    """At L = 100 (the defaults' budgets) an ``smc`` stream of the 2-D ``lds`` gets fewer than ``smoothing_particles``
    by default (its read is backward simulation's), while a static family's — whose read walks the genealogy, N
    links a step — gets them all."""
    settings, _ = setup()
    updater, prior = get_updater("smc"), prior_from_spec(PRIOR)
    static, dynamic = make_model("linear_gaussian", {}, 2), make_model("lds", PARAMS, 2)
    n_static = smoothing_default(settings, static, updater, prior, 256, 100)
    n_dynamic = smoothing_default(settings, dynamic, updater, prior, 256, 100)
    assert n_dynamic < n_static == updater.smoothing_particles

"""The hand-over of a state between methods (``to_particles`` / ``density`` / ``from_particles`` of every updater in
``UPDATERS``), as the service's fall-back uses it (:func:`mpflow.service.engine.fallback.hand_over` and ``take_back``).

* the shared form carries no extras, and a method's density is what it knows exactly beyond its particles;
* a fall-back reads the stream's exact Gaussian or step-0 prior where the stream's method has one;
* after a fall-back step the state has the form a step of the stream's own method leaves (the same fields, extras,
  shapes and dtypes), so the next step runs the stream's method — and batches with its other streams — as usual;
* an unweighted stream's weighted fall-back returns uniform weights (``uniform_weight_options``).
"""

from __future__ import annotations

import pytest
import torch
from mpflow.operators.models import FAMILIES
from mpflow.operators.state import ParticleState
from mpflow.operators.updaters import UPDATERS, Updater, get_updater
from mpflow.service.engine.fallback import hand_over, take_back
from mpflow.service.engine.numerics import FALLBACK_ORDER, fallback_methods

from tests.unit.test_updaters_common import (
    FAST,
    FAST_PER_METHOD,
    N,
    compatible_or_skip,
    model_for,
    observations,
    prior_for,
)

# a stream of each method (mpf also tracking its density, and as the marginal filter where it applies), at step 0
# and after one step of its own
STREAMS = [(m, {}) for m in sorted(UPDATERS)] + [("mpf", {"track_density": True}), ("mpf", {"marginal": "auto"})]
CASES = [(m, o, f) for m, o in STREAMS for f in sorted(FAMILIES)]
IDS = [f"{m}{''.join('-' + k for k in o)}-{f}" for m, o, f in CASES]


def make(name: str, **extra) -> Updater:
    cls = UPDATERS[name]
    opts = {k: v for k, v in {**FAST, **FAST_PER_METHOD.get(name, {})}.items() if k in cls.defaults}
    return get_updater(name, **opts, **extra)


def form(state: ParticleState) -> tuple:
    """What a state's form is: its fields' and extras' shapes and dtypes."""

    def shape(t: torch.Tensor | None) -> tuple | None:
        return None if t is None else (tuple(t.shape), t.dtype)

    fields = [shape(t) for t in (state.particles, state.log_weights, state.step, state.log_evidence, state.rng)]
    extras = sorted((k, shape(v)) for k, v in state.extras.items())
    return (*fields, shape(state.log_density), tuple(extras))


def streams(method: str, options: dict, family: str) -> tuple[Updater, object, list[ParticleState], torch.Tensor]:
    u, model, prior = make(method, **options), model_for(family), prior_for(family)
    compatible_or_skip(u, model, prior)
    obs = observations(model, 3, seed=2)
    s0 = u.init(prior, model, N, seed=1)
    s1, _ = u.update(s0, obs[:, 0], model)
    return u, model, [s0, s1], obs


@pytest.mark.parametrize("method,options,family", CASES, ids=IDS)
def test_shared_form_and_density(method, options, family):
    u, _, states, _ = streams(method, options, family)
    for state in states:
        shared = u.to_particles(state)
        assert shared.extras == {}
        for field in ("particles", "log_weights", "step", "log_evidence", "rng", "log_density"):
            assert getattr(shared, field) is getattr(state, field)
        density = u.density(state)
        if method in ("kalman", "ukf"):  # its Gaussian, in float64
            mean, cov = density.moments()
            assert density.means.dtype == torch.float64
            torch.testing.assert_close(mean, state.extras["mean"], rtol=0, atol=0)
            torch.testing.assert_close(cov, state.extras["cov"], rtol=0, atol=1e-15)
        elif method in ("gpf", "svgd", "nvgd") and int(state.step[0]) == 0:  # the step-0 prior
            assert torch.equal(density.means, state.extras["prior_means"])
        else:  # the particles are all there is
            assert density is None


@pytest.mark.parametrize("method,options,family", CASES, ids=IDS)
def test_a_fallback_step_leaves_the_form_of_the_streams_own_step(method, options, family):
    u, model, states, obs = streams(method, options, family)
    for state in states:
        own, _ = u.update(state, obs[:, 1], model)
        for name in fallback_methods(method, model):
            fallback = make(name, **({} if u.weighted else UPDATERS[name].uniform_weight_options))
            start = hand_over(state, u, fallback)
            new, _ = fallback.update(start, obs[:, 1], model)
            back = take_back(new, u, fallback, state, obs[:, 1], model)
            assert form(back) == form(own), (name, int(state.step[0]))
            assert torch.equal(back.particles, new.particles) and torch.equal(back.step, own.step)
            if not u.weighted:  # an unweighted stream is never handed weighted particles
                assert float(back.log_weights.max() - back.log_weights.min()) < 1e-6, name
            # the next step runs the stream's own method on it
            after, _ = u.update(back, obs[:, 2], model)
            assert torch.isfinite(after.particles).all()


@pytest.mark.parametrize("family", ["linear_gaussian", "lds"])
def test_a_kalman_streams_gaussian_is_the_flows_prior_and_comes_back_as_moments(family):
    kalman, model, states, obs = streams("kalman", {}, family)
    gpf = make("gpf")
    state = states[1]
    start = hand_over(state, kalman, gpf)
    assert set(start.extras) == {"prior_weights", "prior_means", "prior_covs"}
    assert start.extras["prior_means"].dtype == state.particles.dtype
    torch.testing.assert_close(start.extras["prior_means"][:, 0], state.extras["mean"].float())
    torch.testing.assert_close(start.extras["prior_covs"][:, 0], state.extras["cov"].float())
    new, _ = gpf.update(start, obs[:, 1], model)
    back = take_back(new, kalman, gpf, state, obs[:, 1], model)
    x = new.particles.double()
    mean = x.mean(1)
    cov = torch.einsum("bni,bnj->bij", x - mean[:, None], x - mean[:, None]) / x.shape[1]
    torch.testing.assert_close(back.extras["mean"], mean)
    torch.testing.assert_close(back.extras["cov"], cov)


@pytest.mark.parametrize("method", ["gpf", "svgd", "nvgd", "smc", "mpf"])
def test_kalman_as_a_fallback_starts_from_the_streams_gaussian(method):
    u, _, states, _ = streams(method, {}, "linear_gaussian")
    kalman = make("kalman")
    for state in states:
        start = hand_over(state, u, kalman)
        assert set(start.extras) == {"mean", "cov"} and start.extras["mean"].dtype == torch.float64
        density = u.density(state)
        if density is not None:  # a flow method's step-0 prior: its exact moments
            mean, cov = density.to(torch.float64).moments()
        else:  # else the particles' weighted moments
            w = torch.softmax(state.log_weights.double(), -1)
            x = state.particles.double()
            mean = torch.einsum("bn,bnd->bd", w, x)
            cov = torch.einsum("bn,bni,bnj->bij", w, x - mean[:, None], x - mean[:, None])
        torch.testing.assert_close(start.extras["mean"], mean)
        torch.testing.assert_close(start.extras["cov"], cov)


def test_a_tracked_density_is_refitted_after_a_fallback():
    mpf, model, states, obs = streams("mpf", {"track_density": True}, "linear_gaussian")
    gpf = make("gpf")
    new, _ = gpf.update(hand_over(states[1], mpf, gpf), obs[:, 1], model)
    assert torch.equal(new.log_density, states[1].log_density)  # gpf does not move it
    back = take_back(new, mpf, gpf, states[1], obs[:, 1], model)
    assert not torch.equal(back.log_density, new.log_density) and torch.isfinite(back.log_density).all()


def test_the_defaults_fit_a_method_that_keeps_only_particles():
    class Plain(Updater):
        name = "plain"

    u, state = Plain(), make("svgd").init(prior_for("linear_gaussian"), model_for("linear_gaussian"), N, seed=0)
    assert state.extras  # svgd's step-0 prior
    assert u.to_particles(state).extras == {} and u.density(state) is None
    assert u.from_particles(state) is state
    assert Plain.uniform_weight_options == {}


def test_every_weighted_fallback_can_return_uniform_weights():
    for name in FALLBACK_ORDER:
        cls = UPDATERS[name]
        assert not cls.weighted or cls.uniform_weight_options, name

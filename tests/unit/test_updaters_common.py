"""Properties every updater in ``mpflow.operators.updaters.UPDATERS`` must have, on every family it supports.

* a few updates stay finite, ``step`` counts them and ``log_evidence`` is the sum of the increments;
* the same seed gives identical particles (every draw goes through the stream's generator);
* batch independence: a stream's result does not depend on the batch it runs in (allclose 1e-5) — the
  service micro-batches streams and relies on this;
* bad observations (wrong batch, ±inf) raise ValueError (NaN marks an entry not observed:
  test_missing_observations); extreme observations (±1e6) never give a silent NaN: the state stays finite or the
  update raises NonFiniteError (SMC must stay finite).

Tiny clouds (N = 64) and capped iteration counts keep this quick; accuracy is tested elsewhere.
"""

from __future__ import annotations

import math

import pytest
import torch
from mpflow.operators.models import FAMILIES, ModelFamily, make_model
from mpflow.operators.models.priors import GaussianMixture, Prior, prior_from_spec
from mpflow.operators.rng import generator, randn
from mpflow.operators.state import ParticleState, StepInfo
from mpflow.operators.updaters import UPDATERS, NonFiniteError, Updater, get_updater

N = 64
#: options that cap the iterative methods (only keys a method declares are passed)
FAST = {"max_iters": 40, "inner_steps": 10}
FAST_PER_METHOD = {"nvgd": {"max_iters": 5, "inner_steps": 10}}


def make_updater(name: str) -> Updater:
    cls = UPDATERS[name]
    opts = {k: v for k, v in {**FAST, **FAST_PER_METHOD.get(name, {})}.items() if k in cls.defaults}
    return get_updater(name, **opts)


# ------------------------------------------------------------------------------------------ the cases
def model_for(family: str, informative: bool = True) -> ModelFamily:
    """A d = 2 model (the others of ``DIMS``); ``informative=False`` gives a much flatter likelihood where the family
    has a noise parameter, so batched streams can differ in whether SMC resamples."""
    noise = 0.3 if informative else 30.0
    if family == "linear_gaussian":
        return make_model(family, {"R": [[noise, 0.0], [0.0, noise]]}, 2)
    if family == "lds":
        A = [[0.9, 0.2], [-0.1, 0.8]]
        return make_model(family, {"A": A, "Q": [[0.2, 0.0], [0.0, 0.2]], "B": [[1.0, 0.0]], "R": [[noise]]}, 2)
    if family == "gmm":
        return make_model(family, {"s": math.sqrt(noise)}, 2)
    if family == "logistic":
        return make_model(family, {}, 3)
    if family == "stochastic_volatility":
        return make_model(family, {"sigma": 0.3 if informative else 0.1}, 2)
    if family == "range_bearing":
        sd = {"range_sd": noise, "bearing_sd": 0.05 if informative else 3.0}
        return make_model(family, {"sensor": [-5.0, 0.0], **sd}, DIMS[family])
    if family == "lorenz96":
        return make_model(family, {"R": noise, "obs_every": 2}, DIMS[family])
    if family == "structural":  # a local linear trend in continuous time (d = 2)
        return make_model(family, {"level_sd": 0.5, "trend_sd": 0.2, "R": noise}, 2)
    raise AssertionError(f"no test case for family {family}")


#: the state dimension of each family's case (2 where not named)
DIMS = {"logistic": 3, "range_bearing": 4, "lorenz96": 5}


def prior_for(family: str, shift: float = 0.0) -> GaussianMixture:
    d = DIMS.get(family, 2)
    mean = [shift] * d
    cov = [[1.0 if i == j else 0.2 for j in range(d)] for i in range(d)]
    return prior_from_spec({"type": "gaussian", "mean": mean, "cov": cov}, d)


def observations(model: ModelFamily, T: int, seed: int, informative: bool = True) -> torch.Tensor:
    """T observations [1, T, *obs_shape] simulated from the model; for logistic, ``informative=False``
    shrinks the features (a flatter likelihood)."""
    gens = [generator(seed)]
    truth = 1.5 * randn(gens, [model.state_dim])
    _, obs = model.simulate(T, truth, gens)
    if model.name == "logistic" and not informative:
        obs = torch.cat([0.05 * obs[..., :-1], obs[..., -1:]], -1)
    return obs


def test_cases_cover_every_family():
    for family in FAMILIES:
        model_for(family)


COMBOS = [(m, f) for m in sorted(UPDATERS) for f in sorted(FAMILIES)]


def compatible_or_skip(u: Updater, model: ModelFamily, prior: Prior) -> None:
    try:
        u.check_compatible(model, prior)
    except ValueError as exc:
        pytest.skip(f"{u.name} does not support {model.name}: {exc}")


def run(u: Updater, state: ParticleState, obs: torch.Tensor, model: ModelFamily, steps: int):
    infos: list[StepInfo] = []
    states = [state]
    for m in range(steps):
        state, info = u.update(state, obs[:, m], model)
        states.append(state)
        infos.append(info)
    return states, infos


def assert_finite_state(state: ParticleState) -> None:
    assert torch.isfinite(state.particles).all()
    assert torch.isfinite(state.log_weights).all()
    assert torch.isfinite(state.log_evidence).all()
    if state.log_density is not None:
        assert torch.isfinite(state.log_density).all()


# ------------------------------------------------------------------------------------------ compatibility
@pytest.mark.parametrize("family", ["gmm", "logistic", "stochastic_volatility", "range_bearing", "lorenz96"])
def test_kalman_rejects_nonlinear_families(family):
    u = make_updater("kalman")
    model, prior = model_for(family), prior_for(family)
    with pytest.raises(ValueError, match=r"^method") as exc:
        u.check_compatible(model, prior)
    assert family in str(exc.value)
    with pytest.raises(ValueError, match=r"^method"):
        u.init(prior, model, N, seed=0)


@pytest.mark.parametrize("family", ["linear_gaussian", "lds"])
def test_kalman_rejects_non_gaussian_priors(family):
    u = make_updater("kalman")
    model = model_for(family)
    mixture = prior_from_spec(
        {"type": "mixture", "weights": [0.5, 0.5], "means": [[0, 0], [1, 1]], "covs": [[[1, 0], [0, 1]]] * 2}
    )
    particles = prior_from_spec({"type": "particles", "particles": [[0, 0], [1, 1], [2, 0]]})
    for prior in (mixture, particles):
        with pytest.raises(ValueError, match=r"^prior"):
            u.check_compatible(model, prior)
        with pytest.raises(ValueError, match=r"^prior"):
            u.init(prior, model, 3, seed=0)
    u.check_compatible(model, prior_for(family))  # a Gaussian prior is fine


# ------------------------------------------------------------------------------------------ properties
@pytest.mark.parametrize("method,family", COMBOS)
def test_updates_finite_step_and_evidence(method, family):
    u, model, prior = make_updater(method), model_for(family), prior_for(family)
    compatible_or_skip(u, model, prior)
    state = u.init(prior, model, N, seed=1)
    assert state.particles.shape == (1, N, model.state_dim) and state.particles.dtype == torch.float32
    assert int(state.step[0]) == 0 and float(state.log_evidence[0]) == 0.0
    obs = observations(model, 3, seed=2)
    states, infos = run(u, state, obs, model, 3)
    total = torch.zeros(1, dtype=torch.float64)
    for m, (s, info) in enumerate(zip(states[1:], infos, strict=True), start=1):
        assert_finite_state(s)
        assert s.particles.shape == (1, N, model.state_dim)
        assert s.step.tolist() == [m]
        # normalised (float32) weights
        lse = torch.logsumexp(s.log_weights.double(), -1)
        torch.testing.assert_close(lse, torch.zeros(1, dtype=torch.float64), rtol=0, atol=1e-5)
        assert info.log_evidence_increment.shape == (1,) and torch.isfinite(info.log_evidence_increment).all()
        assert info.ess.shape == (1,) and 1.0 - 1e-6 <= float(info.ess[0]) <= N * (1 + 1e-6)
        total = total + info.log_evidence_increment.to(torch.float64)
        assert s.log_evidence.dtype == torch.float64
        torch.testing.assert_close(s.log_evidence, total, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("method,family", COMBOS)
def test_same_seed_same_particles(method, family):
    u, model, prior = make_updater(method), model_for(family), prior_for(family)
    compatible_or_skip(u, model, prior)
    obs = observations(model, 2, seed=5)
    a, _ = run(u, u.init(prior, model, N, seed=7), obs, model, 2)
    b, _ = run(make_updater(method), u.init(prior, model, N, seed=7), obs, model, 2)
    for sa, sb in zip(a, b, strict=True):
        assert torch.equal(sa.particles, sb.particles)
        assert torch.equal(sa.log_weights, sb.log_weights)
        assert torch.equal(sa.log_evidence, sb.log_evidence)
        assert torch.equal(sa.rng, sb.rng)
    c, _ = run(u, u.init(prior, model, N, seed=8), obs, model, 2)
    assert not torch.equal(a[0].particles, c[0].particles)  # the seed matters


@pytest.mark.parametrize("method,family", COMBOS)
def test_batch_independence(method, family):
    """Stream 0 batched with a different stream 1 (other prior, parameters and observations; a much more
    informative likelihood) gives the same result as stream 0 run alone."""
    u = make_updater(method)
    m0, m1 = model_for(family, informative=False), model_for(family, informative=True)
    p0, p1 = prior_for(family), prior_for(family, shift=-1.0)
    compatible_or_skip(u, m0, p0)
    o0, o1 = observations(m0, 2, seed=11, informative=False), observations(m1, 2, seed=12)
    batch_model = type(m0).stack([m0, m1])
    batch_prior = GaussianMixture.stack([p0, p1])
    batched, binfo = run(u, u.init(batch_prior, batch_model, N, seed=[3, 4]), torch.cat([o0, o1]), batch_model, 2)
    alone, ainfo = run(u, u.init(p0, m0, N, seed=3), o0, m0, 2)
    for sb, sa in zip(batched, alone, strict=True):
        torch.testing.assert_close(sb.particles[:1], sa.particles, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(sb.log_weights[:1], sa.log_weights, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(sb.log_evidence[:1], sa.log_evidence, rtol=1e-5, atol=1e-5)
    for ib, ia in zip(binfo, ainfo, strict=True):
        torch.testing.assert_close(ib.log_evidence_increment[:1], ia.log_evidence_increment, rtol=1e-5, atol=1e-5)
    # the second stream is a stream of its own too
    alone1, _ = run(u, u.init(p1, m1, N, seed=4), o1, m1, 2)
    torch.testing.assert_close(batched[-1].particles[1:], alone1[-1].particles, rtol=1e-5, atol=1e-5)


def test_smc_batch_where_only_one_stream_resamples():
    """The case batch independence must survive in SMC: stream 1 resamples at step 1, stream 0 does not (so
    stream 0 must not draw resampling noise because stream 1 does)."""
    u = make_updater("smc")
    m0, m1 = model_for("linear_gaussian", informative=False), model_for("linear_gaussian", informative=True)
    p0, p1 = prior_for("linear_gaussian"), prior_for("linear_gaussian", shift=-1.0)
    o0, o1 = observations(m0, 2, seed=11, informative=False), observations(m1, 2, seed=12)
    bm = type(m0).stack([m0, m1])
    batched, binfo = run(u, u.init(GaussianMixture.stack([p0, p1]), bm, N, seed=[3, 4]), torch.cat([o0, o1]), bm, 2)
    alone, _ = run(u, u.init(p0, m0, N, seed=3), o0, m0, 2)
    thr = u.options["ess_threshold"] * N
    assert float(binfo[0].ess[0]) >= thr > float(binfo[0].ess[1])  # the precondition of this test
    for sb, sa in zip(batched, alone, strict=True):
        torch.testing.assert_close(sb.particles[:1], sa.particles, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(sb.log_weights[:1], sa.log_weights, rtol=1e-5, atol=1e-5)
        assert torch.equal(sb.rng[:1], sa.rng)  # the same draws were taken from stream 0's generator


# ------------------------------------------------------------------------------------------ bad input
def _bad_obs_setup(method, family):
    u, model, prior = make_updater(method), model_for(family), prior_for(family)
    compatible_or_skip(u, model, prior)
    state = u.init(prior, model, N, seed=0)
    obs = observations(model, 1, seed=1)[:, 0]
    return u, model, state, obs


@pytest.mark.parametrize("method,family", COMBOS)
def test_wrong_observation_batch_raises(method, family):
    u, model, state, obs = _bad_obs_setup(method, family)
    with pytest.raises(ValueError, match=r"^observations"):
        u.update(state, torch.cat([obs, obs]), model)
    with pytest.raises(ValueError, match=r"^observations"):
        u.update(state, obs[:0], model)


@pytest.mark.parametrize("method,family", COMBOS)
def test_nan_observation_raises(method, family):
    u, model, state, obs = _bad_obs_setup(method, family)
    for bad in (math.inf, -math.inf):
        o = obs.clone()
        o.view(-1)[0] = bad
        with pytest.raises(ValueError, match=r"^observations"):
            u.update(state, o, model)
    u.update(state, obs, model)  # the state is still usable


EXTREME = [
    (m, f, v) for m in sorted(UPDATERS) for f in ("linear_gaussian", "stochastic_volatility") for v in (1e6, -1e6)
]


@pytest.mark.parametrize("method,family,value", EXTREME)
def test_extreme_observations_never_give_silent_nan(method, family, value):
    u, model, prior = make_updater(method), model_for(family), prior_for(family)
    compatible_or_skip(u, model, prior)
    state = u.init(prior, model, N, seed=0)
    extreme = torch.full((1, *model.obs_shape), value)
    normal = observations(model, 1, seed=1)[:, 0]
    try:
        for obs in (extreme, normal):
            state, info = u.update(state, obs, model)
            assert_finite_state(state)
            assert torch.isfinite(info.log_evidence_increment).all()
            assert torch.isfinite(info.ess).all()
    except NonFiniteError:
        if method == "smc":
            raise  # the bootstrap filter works in the log domain: it must cope

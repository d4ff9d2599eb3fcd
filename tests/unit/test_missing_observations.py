"""Missing and partial observations through every updater (issue 19).

* A step without a measurement (NaN everywhere) predicts only: its evidence increment is 0, ``step`` counts it,
  a static family's state is left as it was.
* A partial observation (NaN at some entries) conditions on the observed entries: for ``kalman`` exactly the
  float64 Kalman filter on the rows S of H and the block S×S of R (computed here independently); the particle
  methods within their usual tolerances of it.
* A micro-batch mixing missing, partial and full observations gives each stream what it gets alone.
* A family where partial observations have no meaning refuses them with a ValueError naming the field.
"""

from __future__ import annotations

import math

import pytest
import torch
from mpflow.operators.models import FAMILIES, make_model
from mpflow.operators.models.priors import prior_from_spec
from mpflow.operators.updaters import UPDATERS, get_updater

from tests.unit.test_updaters_common import make_updater, model_for, prior_for

NAN = math.nan
LDS = {
    "A": [[0.95, 0.1], [-0.1, 0.9]],
    "Q": [[0.1, 0.02], [0.02, 0.1]],
    "B": [[1.0, 0.0], [0.3, 1.0]],
    "R": [[0.5, 0.1], [0.1, 0.4]],
}
PRIOR = {"type": "gaussian", "mean": [0.5, -0.5], "cov": [[1.0, 0.2], [0.2, 1.0]]}
# full, missing, partial (second entry), partial (first entry), full ...
OBS = [[0.3, -0.2], [NAN, NAN], [0.8, NAN], [NAN, -0.4], [1.1, 0.2], [NAN, NAN], [0.9, 0.5], [0.2, NAN]]


def kalman_with_gaps(mean, cov, A, Q, H, R, observations):
    """Float64 Kalman filter dropping the unobserved rows of H and R: the means, covariances and increments."""
    m, P = mean.double(), cov.double()
    A, Q, H, R = (t.double() for t in (A, Q, H, R))
    out = []
    for o in observations:
        o = torch.as_tensor(o, dtype=torch.float64)
        m, P = A @ m, A @ P @ A.T + Q
        seen = ~torch.isnan(o)
        inc = 0.0
        if seen.any():
            Hs, Rs, os_ = H[seen], R[seen][:, seen], o[seen]
            S = Hs @ P @ Hs.T + Rs
            inc = float(torch.distributions.MultivariateNormal(Hs @ m, S).log_prob(os_))
            K = P @ Hs.T @ torch.linalg.inv(S)
            m = m + K @ (os_ - Hs @ m)
            P = (torch.eye(2, dtype=torch.float64) - K @ Hs) @ P
        out.append((m.clone(), 0.5 * (P + P.T), inc))
    return out


def run(method: str, n: int, seed: int = 0, **options):
    model = make_model("lds", LDS, 2)
    prior = prior_from_spec(PRIOR, 2)
    u = get_updater(method, **options)
    state = u.init(prior, model, n, seed)
    rows = []
    for o in OBS:
        state, info = u.update(state, torch.tensor([o]), model)
        rows.append((state, info))
    return rows


def reference():
    p = {k: torch.tensor(v) for k, v in LDS.items()}
    return kalman_with_gaps(
        torch.tensor(PRIOR["mean"]), torch.tensor(PRIOR["cov"]), p["A"], p["Q"], p["B"], p["R"], OBS
    )


def test_kalman_matches_the_float64_filter_on_the_observed_rows():
    ref = reference()
    total = 0.0
    for t, ((state, info), (m, P, inc)) in enumerate(zip(run("kalman", 64), ref, strict=True)):
        assert int(state.step[0]) == t + 1
        torch.testing.assert_close(state.extras["mean"][0], m, atol=1e-6, rtol=0)
        torch.testing.assert_close(state.extras["cov"][0], P, atol=1e-6, rtol=0)
        assert float(info.log_evidence_increment[0]) == pytest.approx(inc, abs=1e-6)
        if math.isnan(OBS[t][0]) and math.isnan(OBS[t][1]):
            assert float(info.log_evidence_increment[0]) == 0.0
        total += inc
    assert float(state.log_evidence[0]) == pytest.approx(total, abs=1e-6)


@pytest.mark.parametrize(
    "method,n,options,mean_tol,logz_tol",
    [
        ("smc", 4096, {}, 0.08, 0.15),
        ("gpf", 256, {}, 0.02, 0.1),
        ("mpf", 256, {}, 0.02, 0.1),
        ("svgd", 256, {"max_iters": 60}, 0.15, 0.3),
        ("nvgd", 256, {"max_iters": 10}, 0.3, 0.5),
    ],
)
def test_particle_methods_follow_the_exact_filter(method, n, options, mean_tol, logz_tol):
    ref = reference()
    rows = run(method, n, **options)
    for (state, _), (m, P, _) in zip(rows, ref, strict=True):
        w = torch.softmax(state.log_weights[0].double(), -1)
        mean = (w[:, None] * state.particles[0].double()).sum(0)
        sd = P.diagonal().sqrt()
        assert ((mean - m).abs() / sd).max() < mean_tol, method
    assert float(rows[-1][0].log_evidence[0]) == pytest.approx(sum(r[2] for r in ref), abs=logz_tol)
    for (_, info), o in zip(rows, OBS, strict=True):
        if all(math.isnan(v) for v in o):
            assert float(info.log_evidence_increment[0]) == 0.0


def skip_unless_it_runs(u, family: str) -> None:
    if u.refusal(FAMILIES[family]) is not None:
        pytest.skip(u.refusal(FAMILIES[family]))


@pytest.mark.parametrize("method", sorted(UPDATERS))
@pytest.mark.parametrize("family", ["linear_gaussian", "gmm", "logistic"])
def test_static_family_keeps_its_state_on_a_missing_step(method, family):
    u = make_updater(method)
    skip_unless_it_runs(u, family)
    model = model_for(family)
    state = u.init(prior_for(family), model, 64, 3)
    missing = model.missing_observation()[None]
    new, info = u.update(state, missing, model)
    assert int(new.step[0]) == 1 and float(info.log_evidence_increment[0]) == 0.0
    assert torch.equal(new.particles, state.particles) and torch.equal(new.log_weights, state.log_weights)
    assert new.extras.keys() == state.extras.keys()
    for k, v in state.extras.items():  # mpf's window of past observations holds NaN (none yet)
        torch.testing.assert_close(new.extras[k], v, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("method", sorted(UPDATERS))
@pytest.mark.parametrize("family", ["lds", "stochastic_volatility", "linear_gaussian"])
def test_a_batch_mixing_missing_partial_and_full_steps_gives_each_stream_its_own_result(method, family):
    u = make_updater(method)
    skip_unless_it_runs(u, family)
    model = model_for(family) if family != "lds" else make_model("lds", LDS, 2)
    prior = prior_for(family)
    observations = [[0.4, -0.3], [NAN, NAN], [0.7, NAN]]
    # two steps so the batched step starts after a full one (the flow methods' step-0 prior is gone)
    states = [u.init(prior, model, 64, 10 + b) for b in range(3)]
    first = torch.tensor([[0.1, 0.2]])
    states = [u.update(s, first, model)[0] for s in states]
    alone = [u.update(s, torch.tensor([o]), model) for s, o in zip(states, observations, strict=True)]
    stacked = type(states[0]).stack(states)
    batched, info = u.update(stacked, torch.tensor(observations), model)
    for b, (state, inf) in enumerate(alone):
        torch.testing.assert_close(batched.particles[b], state.particles[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(batched.log_evidence[b], state.log_evidence[0], atol=1e-5, rtol=1e-5)
        assert float(info.log_evidence_increment[b]) == pytest.approx(float(inf.log_evidence_increment[0]), abs=1e-5)
    assert float(info.log_evidence_increment[1]) == 0.0


def test_read_observation_gaps():
    lds = make_model("lds", LDS, 2)
    assert torch.isnan(lds.read_observation(None, "observations[0]")).all()
    part = lds.read_observation([1.5, None], "observations[0]")
    assert part[0] == 1.5 and torch.isnan(part[1])
    assert torch.isnan(lds.read_observation([None, None])).all()
    gmm = make_model("gmm", {}, 2)
    assert torch.isnan(gmm.read_observation([None])).all()
    logistic = make_model("logistic", {}, 2)
    assert torch.isnan(logistic.read_observation(None)).all()
    with pytest.raises(ValueError, match=r"^observations\[3\]: the logistic family cannot condition on part"):
        logistic.read_observation({"x": [[1.0, None]], "y": [1]}, "observations[3]")
    with pytest.raises(ValueError, match=r"^observations\[1\]"):
        lds.read_observation([1.0, None, 2.0], "observations[1]")


def test_partial_observation_of_a_family_without_meaning_is_refused():
    u = get_updater("smc")
    model = make_model("logistic", {}, 2)
    state = u.init(_prior(2), model, 16, 0)
    obs = torch.tensor([[[1.0, NAN, 1.0]]])
    with pytest.raises(ValueError, match=r"^observations: the logistic family cannot condition on part"):
        u.update(state, obs, model)


def _prior(d: int):
    return prior_from_spec({"type": "gaussian", "mean": [0.0] * d, "cov": torch.eye(d).tolist()}, d)

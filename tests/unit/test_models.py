"""Unit tests of the model families (operators.models) and the priors (operators.models.priors).

Closed forms are evaluated independently in float64 (scipy / explicit formulas); Monte-Carlo checks use
explicit generators (deterministic) and a tolerance of 5 standard errors estimated from the samples.
"""

from __future__ import annotations

import math
import re
from dataclasses import replace

import numpy as np
import pytest
import torch
from mpflow.operators.models import FAMILIES, ModelFamily, make_model
from mpflow.operators.models.priors import GaussianMixture, ParticlePrior, prior_from_spec
from mpflow.operators.models.spec import catalogue_entry
from mpflow.operators.rng import generator, randn
from mpflow.training.task_distribution import task_distribution
from scipy import stats
from scipy.special import logsumexp

F64 = torch.float64
#: Monte-Carlo tolerance, in standard errors
MC_SIGMAS = 5.0


# ----------------------------------------------------------------------------------------- fixtures
#: per family: (state_dim, params) — the defaults except where a family requires or we want non-trivial ones
FAMILY_CASES: dict[str, tuple[int, dict]] = {
    "linear_gaussian": (2, {}),
    "lds": (2, {"A": [[0.9, 0.1], [-0.2, 0.8]], "B": [[1.0, 0.0], [0.5, 1.0], [0.0, 2.0]]}),
    "gmm": (2, {}),
    "logistic": (3, {}),
    "stochastic_volatility": (2, {}),
    "range_bearing": (4, {"sensor": [1.0, -0.5], "range_sd": 0.5, "bearing_sd": 0.1}),
    "lorenz96": (6, {"obs_every": 2, "R": 0.5, "arctan": True}),
    "structural": (4, {"trend_sd": 0.1, "seasonal": [{"period": 24.0, "harmonics": 1, "sd": 0.2}], "R": 0.5}),
}

#: the API's JSON form of one observation for the FAMILY_CASES models
JSON_OBS: dict[str, object] = {
    "linear_gaussian": [0.3, -1.2],
    "lds": [0.3, -1.2, 2.0],
    "gmm": 0.7,
    "logistic": {"x": [[0.1, -0.2, 0.3], [1.0, 0.0, -1.0]], "y": [0, 1]},
    "stochastic_volatility": [0.5, -0.25],
    "range_bearing": [3.0, -3.1],
    "lorenz96": [0.1, 0.5, -0.2],
    "structural": [0.3],
}


def test_cases_cover_every_family():
    assert set(FAMILY_CASES) == set(FAMILIES)


def build(name: str, dtype: torch.dtype = torch.float32, **overrides) -> ModelFamily:
    d, params = FAMILY_CASES[name]
    return make_model(name, {**params, **overrides}, d, dtype)


def sim_obs(
    model: ModelFamily, T: int, seed: int = 0, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Simulate one stream (B = 1) from a standard-normal true x0."""
    gens = [generator(seed)]
    return model.simulate(T, randn(gens, [model.state_dim], dtype), gens)


# ----------------------------------------------------------------------------------------- basics
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_simulate_and_likelihood_shapes(name):
    d = FAMILY_CASES[name][0]
    one = build(name)
    model = type(one).stack([one, build(name)])  # B = 2
    assert model.batch_size == 2 and model.state_dim == d
    T = 4
    gens = [generator(1), generator(2)]
    xs, obs = model.simulate(T, torch.zeros(2, d), gens)
    assert xs.shape == (2, T, d)
    want = tuple(s if s != -1 else obs.shape[2] for s in model.obs_shape)
    assert obs.shape == (2, T, *want)
    assert torch.isfinite(xs).all() and torch.isfinite(obs).all()
    if not model.dynamic:  # a static state never moves
        assert torch.equal(xs, torch.zeros_like(xs))
    N = 7
    x = randn(gens, [N, d])
    ll = model.log_likelihood(obs[:, 0], x)
    assert ll.shape == (2, N) and torch.isfinite(ll).all()
    sc = model.score(obs[:, 0], x)
    assert sc.shape == (2, N, d) and torch.isfinite(sc).all()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (F64, 1e-10)])
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_score_matches_autograd(name, dtype, tol):
    """The family's score (closed form where overridden) equals autograd of log_likelihood (the base
    implementation ModelFamily.score), relative to the gradient's scale."""
    model = build(name, dtype)
    _, obs = sim_obs(model, 1, seed=3, dtype=dtype)
    x = randn([generator(5)], [50, model.state_dim], dtype)
    got = model.score(obs[:, 0].to(dtype), x)
    ref = ModelFamily.score(model, obs[:, 0].to(dtype), x)
    scale = ref.abs().max().clamp_min(1.0)
    assert got.dtype == dtype
    torch.testing.assert_close(got / scale, ref / scale, atol=tol, rtol=0)


def _closed_form_loglik(name: str, model: ModelFamily, obs: np.ndarray, x: np.ndarray) -> np.ndarray:
    """log p(o | x) for one stream, obs [*obs_shape], x [N, d], evaluated independently in float64."""
    p = {k: v[0].double().numpy() for k, v in model.params.items()}
    if name == "linear_gaussian":
        return stats.multivariate_normal(mean=None, cov=p["R"]).logpdf(obs[None] - x @ p["H"].T)
    if name == "lds":
        return stats.multivariate_normal(mean=None, cov=p["R"]).logpdf(obs[None] - x @ p["B"].T)
    if name == "gmm":
        s = float(p["s"])
        l1 = stats.norm(x[:, 0], s).logpdf(obs[0])
        l2 = stats.norm(x[:, 0] + x[:, 1], s).logpdf(obs[0])
        return np.logaddexp(l1, l2) + math.log(0.5)
    if name == "logistic":
        a, y = obs[:, :-1], obs[:, -1]
        prob = 1.0 / (1.0 + np.exp(-(x @ a.T)))
        return (y * np.log(prob) + (1 - y) * np.log1p(-prob)).sum(-1)
    if name == "stochastic_volatility":
        return stats.norm(0.0, np.exp(0.5 * x)).logpdf(obs[None]).sum(-1)
    if name == "range_bearing":
        rel = x[:, :2] - p["sensor"]
        bearing_residual = (obs[1] - np.arctan2(rel[:, 1], rel[:, 0]) + math.pi) % (2 * math.pi) - math.pi
        return stats.norm(np.hypot(rel[:, 0], rel[:, 1]), p["range_sd"]).logpdf(obs[0]) + stats.norm(
            0.0, p["bearing_sd"]
        ).logpdf(bearing_residual)
    if name == "lorenz96":
        return stats.norm(np.arctan(x[:, ::2]), math.sqrt(p["R"])).logpdf(obs[None]).sum(-1)
    if name == "structural":  # o = level + the first coordinate of each harmonic pair + N(0, R)
        return stats.norm(x[:, 0] + x[:, 2::2].sum(-1), 0.5**0.5).logpdf(obs[0])  # the case has a trend
    raise AssertionError(name)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_log_likelihood_closed_form(name):
    model = build(name, F64)
    _, obs = sim_obs(model, 1, seed=11, dtype=F64)
    x = randn([generator(12)], [40, model.state_dim], F64)
    got = model.log_likelihood(obs[:, 0], x)[0].numpy()
    ref = _closed_form_loglik(name, model, obs[0, 0].numpy(), x[0].numpy())
    np.testing.assert_allclose(got, ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_parse_observation_json_form(name):
    model = build(name)
    value = JSON_OBS[name]
    t = model.parse_observation(value)
    assert t.dtype == torch.float32
    if name == "logistic":
        assert t.shape == (2, model.state_dim + 1)
        torch.testing.assert_close(t[:, :-1], torch.tensor(value["x"]))
        torch.testing.assert_close(t[:, -1], torch.tensor([0.0, 1.0]))
    elif name == "gmm":
        assert t.shape == (1,) and float(t[0]) == pytest.approx(0.7)
        assert torch.equal(model.parse_observation([0.7]), t)  # a one-element list is accepted too
    else:
        assert tuple(t.shape) == model.obs_shape
        torch.testing.assert_close(t, torch.tensor(value))
    # the parsed observation batches into log_likelihood
    ll = model.log_likelihood(t[None], torch.zeros(1, 3, model.state_dim))
    assert ll.shape == (1, 3) and torch.isfinite(ll).all()


def test_defaults_are_the_api_table():
    lg = make_model("linear_gaussian", None, 3)
    torch.testing.assert_close(lg.params["H"][0], torch.eye(3))
    torch.testing.assert_close(lg.params["R"][0], 3 * torch.eye(3))
    lds = make_model("lds", {"A": np.eye(2).tolist(), "B": [[1.0, 0.0]]}, 2)
    torch.testing.assert_close(lds.params["Q"][0], torch.eye(2))
    torch.testing.assert_close(lds.params["R"][0], torch.eye(1))
    assert lds.obs_shape == (1,)
    sv = make_model("stochastic_volatility", {}, 2)
    for k, v in {"mu": 0.0, "phi": 0.95, "sigma": 0.3}.items():
        torch.testing.assert_close(sv.params[k][0], torch.full((2,), v))
    assert float(make_model("gmm", {}, 2).params["s"][0]) == 1.0


def test_default_noise_covariance_takes_the_observation_dimension():
    """R's default (3I for linear_gaussian, I for lds) is k×k, k the rows of H / B — not d×d."""
    lg = make_model("linear_gaussian", {"H": [[1.0, 2.0]]}, 2)
    torch.testing.assert_close(lg.params["R"][0], 3 * torch.eye(1))
    lds = make_model("lds", {"A": np.eye(2).tolist(), "B": [[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]}, 2)
    torch.testing.assert_close(lds.params["R"][0], torch.eye(3))


# ----------------------------------------------------------------------------------------- transitions
DYNAMIC_CASES = {
    "lds": (2, {"A": [[0.9, 0.3], [-0.2, 0.7]], "Q": [[0.5, 0.2], [0.2, 0.3]], "B": [[1.0, 0.0]]}),
    "stochastic_volatility": (2, {"mu": [0.5, -1.0], "phi": [0.9, 0.5], "sigma": [0.3, 1.2]}),
}


#: dynamic families whose transitions are tested in a file of their own
OWN_TRANSITION_TESTS = {
    "range_bearing": "test_range_bearing.py",
    "lorenz96": "test_lorenz96.py",
    "structural": "test_structural.py",
}


def test_dynamic_cases_cover_every_dynamic_family():
    assert set(DYNAMIC_CASES) == {n for n, c in FAMILIES.items() if c.dynamic} - set(OWN_TRANSITION_TESTS)


@pytest.mark.parametrize("name", sorted(DYNAMIC_CASES))
def test_transition_moments_match_affine(name):
    """x' = F x + c + N(0, Q): with every particle at the same x, the sample mean is F x + c and the sample
    covariance Q, within 5 standard errors (estimated from the samples)."""
    d, params = DYNAMIC_CASES[name]
    model = make_model(name, params, d, F64)
    F, c, Q = model.transition_affine()
    assert F.shape == (1, d, d) and c.shape == (1, d) and Q.shape == (1, d, d)
    if name == "stochastic_volatility":  # the affine form is the model's μ + φ (x − μ) + σ ε
        p = {k: torch.tensor(v, dtype=F64) for k, v in params.items()}
        torch.testing.assert_close(F[0], torch.diag(p["phi"]))
        torch.testing.assert_close(c[0], (1 - p["phi"]) * p["mu"])
        torch.testing.assert_close(Q[0], torch.diag(p["sigma"] ** 2))
    else:
        torch.testing.assert_close(F[0], torch.tensor(params["A"], dtype=F64))
        torch.testing.assert_close(c[0], torch.zeros(d, dtype=F64))
        torch.testing.assert_close(Q[0], torch.tensor(params["Q"], dtype=F64))
    M = 200_000
    x0 = torch.tensor([1.5, -0.5], dtype=F64)
    y = model.transition(x0.expand(1, M, d).clone(), [generator(7)])[0]
    want_mean = F[0] @ x0 + c[0]
    mean = y.mean(0)
    se_mean = y.std(0) / math.sqrt(M)
    assert ((mean - want_mean).abs() <= MC_SIGMAS * se_mean).all(), (mean, want_mean)
    yc = y - want_mean
    prods = yc[:, :, None] * yc[:, None, :]  # [M, d, d], E = Q
    se_cov = prods.std(0) / math.sqrt(M)
    assert ((prods.mean(0) - Q[0]).abs() <= MC_SIGMAS * se_cov).all(), (prods.mean(0), Q[0])


@pytest.mark.parametrize("name", sorted(n for n, c in FAMILIES.items() if not c.dynamic))
def test_static_families_have_no_transition(name):
    model = build(name)
    x = torch.randn(1, 5, model.state_dim, generator=generator(0))
    assert torch.equal(model.transition(x, [generator(1)]), x)
    with pytest.raises(TypeError):
        model.transition_affine()


# ----------------------------------------------------------------------------------------- bad input
def raises_field(field: str):
    """ValueError whose message starts with the field name."""
    return pytest.raises(ValueError, match="^" + re.escape(field))


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    "name,d,params,field",
    [
        ("linear_gaussian", 2, {"R": [[1, 2], [2, 1]]}, "model.params.R"),  # indefinite
        ("linear_gaussian", 2, {"R": [[1, 0.5], [0.0, 1]]}, "model.params.R"),  # not symmetric
        ("linear_gaussian", 2, {"R": [[1, 0, 0], [0, 1, 0]]}, "model.params.R"),  # not square
        ("linear_gaussian", 2, {"H": [[1, 0, 0], [0, 1, 0]]}, "model.params.H"),  # 3 columns for d = 2
        ("linear_gaussian", 2, {"H": [[1, 0]], "R": [[1, 0], [0, 1]]}, "model.params.R"),  # R not k×k
        ("linear_gaussian", 2, {"H": [1, 0]}, "model.params.H"),  # not a matrix
        ("linear_gaussian", 2, {"H": [[1, NAN], [0, 1]]}, "model.params.H"),
        ("linear_gaussian", 2, {"R": [[INF, 0], [0, 1]]}, "model.params.R"),
        ("linear_gaussian", 2, {"H": [[1, 0], [0]]}, "model.params.H"),  # ragged
        ("linear_gaussian", 2, {"G": [[1, 0], [0, 1]]}, "model.params"),  # unknown name
        ("lds", 2, {"B": [[1, 0]]}, "model.params.A"),  # A required
        ("lds", 2, {"A": [[1, 0]]}, "model.params.B"),  # B required (A checked first only when present)
        ("lds", 2, {"A": [[1, 0, 0], [0, 1, 0], [0, 0, 1]], "B": [[1, 0]]}, "model.params.A"),
        ("lds", 2, {"A": [[1, 0], [0, 1]], "B": [[1, 0, 0]]}, "model.params.B"),
        ("lds", 2, {"A": [[1, 0], [0, 1]], "B": [[1, 0]], "Q": np.eye(3).tolist()}, "model.params.Q"),
        ("lds", 2, {"A": [[1, 0], [0, 1]], "B": [[1, 0]], "Q": [[1, 2], [2, 1]]}, "model.params.Q"),
        ("lds", 2, {"A": [[1, 0], [0, NAN]], "B": [[1, 0]]}, "model.params.A"),
        ("gmm", 2, {"s": 0.0}, "model.params.s"),
        ("gmm", 2, {"s": -1.0}, "model.params.s"),
        ("gmm", 2, {"s": [1.0, 2.0]}, "model.params.s"),
        ("gmm", 2, {"s": NAN}, "model.params.s"),
        ("gmm", 3, {}, "prior"),  # the gmm state is 2-dimensional
        ("logistic", 2, {"w": 1.0}, "model.params"),
        ("stochastic_volatility", 2, {"sigma": 0.0}, "model.params.sigma"),
        ("stochastic_volatility", 2, {"sigma": [0.3, -0.1]}, "model.params.sigma"),
        ("stochastic_volatility", 2, {"sigma": [0.3, 0.3, 0.3]}, "model.params.sigma"),
        ("stochastic_volatility", 2, {"phi": [0.3, INF]}, "model.params.phi"),
        ("stochastic_volatility", 2, {"mu": NAN}, "model.params.mu"),
    ],
)
def test_bad_params_name_the_field(name, d, params, field):
    with raises_field(field):
        make_model(name, params, d)


def test_unknown_family_and_bad_state_dim():
    with raises_field("model.family"):
        make_model("kalman_net", {}, 2)
    with raises_field("state_dim"):
        make_model("linear_gaussian", {}, 0)


@pytest.mark.parametrize(
    "name,value,field",
    [
        ("linear_gaussian", [0.3], "observation"),  # wrong length
        ("linear_gaussian", [0.3, 1.0, 2.0], "observation"),
        ("linear_gaussian", [[0.3, 1.0]], "observation"),  # wrong rank
        ("linear_gaussian", [0.3, NAN], "observation"),
        ("linear_gaussian", [INF, 0.0], "observation"),
        ("linear_gaussian", "abc", "observation"),
        ("lds", [0.3, -1.2], "observation"),  # k = 3 rows of B
        ("lds", [0.3, -INF, 2.0], "observation"),
        ("gmm", [0.1, 0.2], "observation"),
        ("gmm", NAN, "observation"),
        ("stochastic_volatility", [0.5], "observation"),
        ("stochastic_volatility", [0.5, NAN], "observation"),
        ("logistic", [[0.1, 0.2, 0.3]], "observation"),  # not a {"x", "y"} object
        ("logistic", {"x": [[0.1, 0.2, 0.3]]}, "observation"),
        ("logistic", {"x": [[0.1, 0.2, 0.3]], "y": [2]}, "observation.y"),
        ("logistic", {"x": [[0.1, 0.2, 0.3]], "y": [0.5]}, "observation.y"),
        ("logistic", {"x": [[0.1, 0.2, 0.3]], "y": [-1]}, "observation.y"),
        ("logistic", {"x": [[0.1, 0.2, 0.3]], "y": [0, 1]}, "observation.y"),  # length mismatch
        ("logistic", {"x": [[0.1, 0.2]], "y": [1]}, "observation.x"),  # d = 3 features
        ("logistic", {"x": [[0.1, NAN, 0.3]], "y": [1]}, "observation.x"),
        ("logistic", {"x": [[0.1, 0.2, 0.3]], "y": [NAN]}, "observation.y"),
        ("logistic", {"x": [], "y": []}, "observation.x"),
    ],
)
def test_bad_observations_name_the_field(name, value, field):
    with raises_field(field):
        build(name).parse_observation(value)


def test_observation_field_name_is_passed_through():
    with raises_field("observations[3]"):
        build("linear_gaussian").parse_observation([1.0], field="observations[3]")


# ----------------------------------------------------------------------------------------- priors
def test_prior_specs_parse():
    g = prior_from_spec({"type": "gaussian", "mean": [1.0, -1.0], "cov": [[2.0, 0.5], [0.5, 1.0]]}, dim=2)
    assert isinstance(g, GaussianMixture) and g.batch_size == 1 and g.dim == 2
    assert g.weights.shape == (1, 1) and g.means.shape == (1, 1, 2) and g.covs.shape == (1, 1, 2, 2)
    torch.testing.assert_close(g.means[0, 0], torch.tensor([1.0, -1.0]))
    m = prior_from_spec(
        {"type": "mixture", "weights": [1, 3], "means": [[0, 0], [2, 2]], "covs": [np.eye(2).tolist()] * 2}
    )
    assert isinstance(m, GaussianMixture) and m.weights.shape == (1, 2) and m.covs.shape == (1, 2, 2, 2)
    torch.testing.assert_close(m.weights[0], torch.tensor([0.25, 0.75]))  # normalised
    p = prior_from_spec({"type": "particles", "particles": [[0, 1], [2, 3], [4, 5]]}, dim=2)
    assert isinstance(p, ParticlePrior) and p.particles.shape == (1, 3, 2) and p.dim == 2
    mean, cov = p.moments()
    torch.testing.assert_close(mean[0], torch.tensor([2.0, 3.0]))
    torch.testing.assert_close(cov[0], torch.full((2, 2), 8.0 / 3.0))


@pytest.mark.parametrize(
    "spec,dim,field",
    [
        ({"type": "gaussian", "mean": [0, 0], "cov": [[1, 2], [2, 1]]}, 2, "prior.cov"),
        ({"type": "gaussian", "mean": [0, 0], "cov": [[1, 0.5], [0, 1]]}, 2, "prior.cov"),
        ({"type": "gaussian", "mean": [0, 0], "cov": [[1, 0, 0], [0, 1, 0], [0, 0, 1]]}, 2, "prior.cov"),
        ({"type": "gaussian", "mean": [0, 0, 0], "cov": [[1, 0], [0, 1]]}, 2, "prior.mean"),
        ({"type": "gaussian", "mean": [0, NAN], "cov": [[1, 0], [0, 1]]}, 2, "prior.mean"),
        ({"type": "gaussian", "mean": [0, 0], "cov": [[1, 0], [0, INF]]}, 2, "prior.cov"),
        ({"type": "gaussian", "mean": [0, 0]}, 2, "prior.cov"),
        ({"type": "gaussian", "mean": [0, 0], "cov": [[1, 0], [0, 1]], "std": 1}, 2, "prior"),
        (
            {"type": "mixture", "weights": [1, 1], "means": [[0, 0], [1, 1]], "covs": [[[1, 0], [0, 1]]]},
            2,
            "prior.covs",
        ),
        (
            {
                "type": "mixture",
                "weights": [1, 1],
                "means": [[0, 0], [1, 1]],
                "covs": [[[1, 0], [0, 1]], [[1, 2], [2, 1]]],
            },
            2,
            "prior.covs[1]",
        ),
        ({"type": "mixture", "weights": [1, 1], "means": [[0, 0]], "covs": [[[1, 0], [0, 1]]] * 2}, 2, "prior.means"),
        (
            {"type": "mixture", "weights": [1, -1], "means": [[0, 0], [1, 1]], "covs": [np.eye(2).tolist()] * 2},
            2,
            "prior.weights",
        ),
        ({"type": "mixture", "weights": [], "means": [], "covs": []}, 2, "prior.weights"),
        ({"type": "particles", "particles": [[0, 1]]}, 2, "prior.particles"),
        ({"type": "particles", "particles": [[0, 1, 2], [1, 2, 3]]}, 2, "prior.particles"),
        ({"type": "particles", "particles": [[0, NAN], [1, 2]]}, 2, "prior.particles"),
        ({"type": "dirichlet"}, 2, "prior.type"),
        ({"mean": [0, 0]}, 2, "prior"),
        ([0, 0], 2, "prior"),
    ],
)
def test_bad_priors_name_the_field(spec, dim, field):
    with raises_field(field):
        prior_from_spec(spec, dim)


def _mixtures() -> GaussianMixture:
    """A batch of two 2-component mixtures in float64 (B = 2, K = 2, d = 2)."""
    a = prior_from_spec(
        {
            "type": "mixture",
            "weights": [0.3, 0.7],
            "means": [[-1.0, 0.5], [1.5, -0.5]],
            "covs": [[[1.0, 0.3], [0.3, 0.5]], [[0.4, -0.1], [-0.1, 0.9]]],
        },
        dtype=F64,
    )
    b = prior_from_spec(
        {
            "type": "mixture",
            "weights": [0.5, 0.5],
            "means": [[0.0, 2.0], [3.0, 0.0]],
            "covs": [[[2.0, 0.0], [0.0, 2.0]], [[0.2, 0.1], [0.1, 0.3]]],
        },
        dtype=F64,
    )
    return GaussianMixture.stack([a, b])


def _np_mixture_logpdf(mix: GaussianMixture, b: int, x: np.ndarray) -> np.ndarray:
    comps = [
        math.log(float(mix.weights[b, k]))
        + stats.multivariate_normal(mix.means[b, k].numpy(), mix.covs[b, k].numpy()).logpdf(x)
        for k in range(mix.weights.shape[1])
    ]
    return logsumexp(np.stack(comps), axis=0)


def _np_mixture_score(mix: GaussianMixture, b: int, x: np.ndarray) -> np.ndarray:
    """Σ_k r_k(x) Σ_k⁻¹ (μ_k − x)."""
    K = mix.weights.shape[1]
    logc = np.stack(
        [
            math.log(float(mix.weights[b, k]))
            + stats.multivariate_normal(mix.means[b, k].numpy(), mix.covs[b, k].numpy()).logpdf(x)
            for k in range(K)
        ]
    )
    r = np.exp(logc - logsumexp(logc, axis=0))
    return sum(
        r[k][:, None] * np.linalg.solve(mix.covs[b, k].numpy(), (mix.means[b, k].numpy() - x).T).T for k in range(K)
    )


def test_mixture_log_prob_and_score_closed_form():
    mix = _mixtures()
    x = randn([generator(0), generator(1)], [30, 2], F64) * 2
    lp = mix.log_prob(x)
    sc = mix.score(x)
    assert lp.shape == (2, 30) and sc.shape == (2, 30, 2)
    for b in range(2):
        xb = x[b].numpy()
        np.testing.assert_allclose(lp[b].numpy(), _np_mixture_logpdf(mix, b, xb), rtol=1e-10, atol=1e-10)
        np.testing.assert_allclose(sc[b].numpy(), _np_mixture_score(mix, b, xb), rtol=1e-8, atol=1e-10)
    xg = x.clone().requires_grad_(True)
    (auto,) = torch.autograd.grad(mix.log_prob(xg).sum(), xg)
    torch.testing.assert_close(sc, auto, atol=1e-10, rtol=1e-8)
    # a one-component mixture is the Gaussian it wraps
    g = GaussianMixture.gaussian(mix.means[:, 0], mix.covs[:, 0])
    ref = np.stack(
        [
            stats.multivariate_normal(mix.means[b, 0].numpy(), mix.covs[b, 0].numpy()).logpdf(x[b].numpy())
            for b in range(2)
        ]
    )
    np.testing.assert_allclose(g.log_prob(x).numpy(), ref, rtol=1e-10)
    want = torch.linalg.solve(mix.covs[:, 0][:, None], (mix.means[:, 0][:, None] - x)[..., None])[..., 0]
    torch.testing.assert_close(g.score(x), want, rtol=1e-10, atol=1e-10)  # Σ⁻¹ (μ − x)


def test_mixture_moments_closed_form():
    mix = _mixtures()
    mean, cov = mix.moments()
    for b in range(2):
        w, mu, S = mix.weights[b].numpy(), mix.means[b].numpy(), mix.covs[b].numpy()
        m = (w[:, None] * mu).sum(0)
        C = sum(w[k] * (S[k] + np.outer(mu[k], mu[k])) for k in range(len(w))) - np.outer(m, m)
        np.testing.assert_allclose(mean[b].numpy(), m, rtol=1e-12)
        np.testing.assert_allclose(cov[b].numpy(), C, rtol=1e-12)


def _assert_moments_mc(y: torch.Tensor, mean: torch.Tensor, cov: torch.Tensor) -> None:
    """Sample moments of y [M, d] match (mean, cov) within MC_SIGMAS standard errors (from the samples)."""
    M = y.shape[0]
    se_mean = y.std(0) / math.sqrt(M)
    assert ((y.mean(0) - mean).abs() <= MC_SIGMAS * se_mean).all(), (y.mean(0), mean)
    yc = y - mean
    prods = yc[:, :, None] * yc[:, None, :]
    se_cov = prods.std(0) / math.sqrt(M)
    assert ((prods.mean(0) - cov).abs() <= MC_SIGMAS * se_cov).all(), (prods.mean(0), cov)


def test_mixture_sample_moments():
    mix = _mixtures()
    M = 100_000
    x = mix.sample(M, [generator(3), generator(4)])
    assert x.shape == (2, M, 2) and x.dtype == F64
    mean, cov = mix.moments()
    for b in range(2):
        _assert_moments_mc(x[b], mean[b], cov[b])
    # the same generators give the same draws; stream b's draws depend only on its own generator
    again = mix.sample(M, [generator(3), generator(4)])
    assert torch.equal(again, x)
    alone = GaussianMixture(mix.weights[1:], mix.means[1:], mix.covs[1:]).sample(M, [generator(4)])
    assert torch.equal(alone[0], x[1])


def test_mixture_push_closed_form_and_monte_carlo():
    mix = _mixtures()
    F = torch.tensor([[[0.9, 0.2], [-0.3, 0.6]], [[1.1, 0.0], [0.4, 0.5]]], dtype=F64)
    c = torch.tensor([[0.5, -1.0], [0.0, 2.0]], dtype=F64)
    Q = torch.tensor([[[0.3, 0.1], [0.1, 0.2]], [[0.05, 0.0], [0.0, 0.5]]], dtype=F64)
    pushed = mix.push(F, c, Q)
    torch.testing.assert_close(pushed.weights, mix.weights)
    for b in range(2):
        for k in range(2):
            want_mean = F[b] @ mix.means[b, k] + c[b]
            want_cov = F[b] @ mix.covs[b, k] @ F[b].T + Q[b]
            torch.testing.assert_close(pushed.means[b, k], want_mean, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(pushed.covs[b, k], want_cov, rtol=1e-12, atol=1e-12)
    # Monte Carlo: x ~ mix, y = F x + c + N(0, Q)
    M = 100_000
    gens = [generator(8), generator(9)]
    x = mix.sample(M, gens)
    noise = randn(gens, [M, 2], F64) @ torch.linalg.cholesky(Q).transpose(-1, -2)
    y = x @ F.transpose(-1, -2) + c[:, None] + noise
    mean, cov = pushed.moments()
    for b in range(2):
        _assert_moments_mc(y[b], mean[b], cov[b])


def test_mixture_stack_rejects_different_component_counts():
    g = prior_from_spec({"type": "gaussian", "mean": [0, 0], "cov": [[1, 0], [0, 1]]})
    with raises_field("prior"):
        GaussianMixture.stack([g, _mixtures()])


def test_autograd_score_keeps_the_graph_when_x_is_part_of_one():
    """MPF's divergence differentiates the velocity, which contains the score: for families without a
    closed-form score (gmm) the autograd score must stay differentiable in x, as the closed forms are."""
    model = make_model("gmm", {}, 2, dtype=F64)
    obs = torch.tensor([[0.7]], dtype=F64)
    x = torch.randn(1, 5, 2, dtype=F64, requires_grad=True)
    s = model.score(obs, x)
    assert s.requires_grad
    (hess_diag_sum,) = torch.autograd.grad(s[..., 0].sum(), x)
    # finite differences of the score's first component along x₁
    eps = 1e-6
    e = torch.zeros_like(x)
    e[..., 0] = eps
    with torch.no_grad():
        fd = (model.score(obs, x + e)[..., 0] - model.score(obs, x - e)[..., 0]) / (2 * eps)
    assert torch.allclose(hess_diag_sum[..., 0], fd, atol=1e-5)
    assert not model.score(obs, x.detach()).requires_grad


# ----------------------------------------------------------------------------------------- what a family knows
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_family_describes_itself(name):
    """Catalogue text and parameter kinds are the family's spec; evaluation defaults and a task distribution are on
    the family class."""
    cls = FAMILIES[name]
    assert cls.spec.description and cls.spec.observation
    entry = catalogue_entry(cls, 16)
    assert entry["family"] == name and entry["description"] == cls.spec.description
    assert all(p["kind"] != "value" for p in entry["parameters"])  # every shipped parser says what it accepts
    tasks = task_distribution(name)
    assert tasks.eval_steps >= 1 and all(n >= 1 for n in tasks.eval_particles)
    d = cls.fixed_state_dim or max(3, cls.min_state_dim)
    model, prior = tasks.sample_task_models([generator(0), generator(1)], d, torch.float32, {})
    assert isinstance(model, cls) and model.batch_size == 2 and prior.batch_size == 2 and prior.dim == d
    benchmark = make_model(name, tasks.benchmark_params(d, generator(2)), d)
    example = make_model(name, cls.example_params(d), d)
    assert benchmark.state_dim == example.state_dim == d


def test_gmm_posterior_modes_are_the_likelihood_symmetry():
    gmm = FAMILIES["gmm"]
    modes = gmm.posterior_modes(torch.tensor([[1.0, -2.0]]))
    assert torch.equal(modes, torch.tensor([[[1.0, -2.0], [-1.0, 2.0]]], dtype=F64))
    model = make_model("gmm", {}, 2, F64)
    o = torch.tensor([[0.3]], dtype=F64)
    torch.testing.assert_close(model.log_likelihood(o, modes[:, :1]), model.log_likelihood(o, modes[:, 1:]))
    assert FAMILIES["linear_gaussian"].posterior_modes(torch.zeros(1, 2)) is None


def test_a_new_family_is_one_class(monkeypatch, capsys):
    """A family registered in FAMILIES is served by the catalogue, sampled as meta-training tasks and run by
    ``mpflow filter`` with no other edit (the generic code reads the class)."""
    from mpflow.operators.models.linear_gaussian import LinearGaussian
    from mpflow.service.engine import catalogue
    from mpflow.training.tasks import sample_tasks

    from mpflow.cli.main import main

    class Toy(LinearGaussian):
        name = "toy"
        spec = replace(LinearGaussian.spec, description="o ~ N(x, 3I), a test family", observation="vector of length d")
        eval_steps = 7

    monkeypatch.setitem(FAMILIES, "toy", Toy)
    entry = next(f for f in catalogue.models(8) if f["family"] == "toy")
    assert entry["description"] == Toy.spec.description and "kalman" in entry["methods"]
    tasks = sample_tasks("toy", 2, 3, 4, generator(0))
    assert type(tasks.model) is Toy and tasks.obs.shape == (3, 4, 2)
    assert main(["filter", "--family", "toy", "--method", "kalman", "--steps", "2"]) == 0
    assert "log-evidence error vs Kalman" in capsys.readouterr().out


def test_select_keeps_the_chosen_streams_of_a_batched_model():
    """``ModelFamily.select``: the rows of a batch, as the stack of those streams' own models; a shared model (batch 1)
    is itself."""
    params = [{"phi": 0.9, "sigma": 0.2}, {"phi": 0.5, "sigma": 0.3}, {"phi": 0.7, "sigma": 0.4}]
    models = [make_model("stochastic_volatility", p, 2) for p in params]
    batch = type(models[0]).stack(models)
    picked = batch.select(torch.tensor([0, 2]))
    expected = type(models[0]).stack([models[0], models[2]])
    assert picked.batch_size == 2
    for k in expected.params:
        assert torch.equal(picked.params[k], expected.params[k])
    assert models[1].select(torch.tensor([0])) is models[1]
    logistic = type(make_model("logistic", {}, 3)).stack([make_model("logistic", {}, 3)] * 4)
    assert logistic.select(torch.tensor([1, 3])).batch_size == 2

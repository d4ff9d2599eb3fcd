"""Unknown model parameters through the real app and real Redis (docs/API.md "Unknown parameters"): a parameter given
as a prior makes a ``smc2`` stream whose every answer carries ``summary.params`` and the health of its parameter
cloud (``params_ess``, ``params_distinct``, ``params_degenerate``), per step only when asked (``per_step_params``);
its p-values are its own θ-mixture's predictive; a cloud's θ-ESS is in /metrics; the stream survives export and
import byte for byte; bad priors, methods that cannot learn and steps of another duration are refused with the field
named and nothing created; the particle count θ × x is bounded by the cost model (413 naming the limit); the client
reads the parameters as numpy arrays and pandas tables; the forecast carries the observation predictive, each
(θ, x) pair observed under its own R."""

from __future__ import annotations

import math

import numpy as np
import pytest
from mpflow.service.client import Client
from mpflow.service.results import StepTable
from scipy.stats import norm

from tests.integration.test_api_streams import run
from tests.integration.test_client import server  # noqa: F401  (fixture)

LOGNORMAL = {"prior": {"type": "lognormal", "mean": 0.0, "sd": 1.0}}
GAUSS1 = {"type": "gaussian", "mean": [0.0], "cov": [[1.0]]}
OBS = [[0.8], [1.9], [-0.4], [2.5], [0.3], [-1.7], [0.9], [1.2]]


def lds_request(**extra):
    params = {"A": [[0.9]], "B": [[1.0]], "Q": [[1.0]], "R": LOGNORMAL}
    return {"model": {"family": "lds", "params": params}, "prior": GAUSS1, "seed": 3, **extra}


def test_a_prior_makes_a_learning_stream_with_params_in_every_answer(redis_url):
    async def body(app, c):
        created = await c.post("/v1/streams", json=lds_request(stream_id="learn"))
        answer = await c.post("/v1/streams/learn/observations", json={"observations": OBS})
        got = await c.get("/v1/streams/learn")
        forecast = await c.get("/v1/streams/learn/forecast", params={"steps": 2})
        return created, answer, got, forecast

    created, answer, got, forecast = run(redis_url, body)
    assert created.status_code == 201, created.text
    doc = created.json()
    assert doc["method"] == "smc2" and "R" in doc["method_reason"]
    assert doc["num_particles"] == 1024 and doc["state_bytes"] > 0
    r0 = doc["summary"]["params"]["R"]
    # at step 0 the θ-particles are the lognormal(0, 1) prior: median 1, sd √((e−1)e) ≈ 2.16 (sampled)
    assert r0["q05"] < 1.0 < r0["q95"] and 0.5 < r0["mean"] < 3.0
    ans = answer.json()
    assert answer.status_code == 200 and ans["step"] == len(OBS)
    assert [s["step"] for s in ans["per_step"]] == list(range(1, len(OBS) + 1))
    assert all("params" not in s for s in ans["per_step"])  # once per answer, in its summary
    r = ans["summary"]["params"]["R"]
    assert r["q05"] <= r["mean"] <= r["q95"] and r["sd"] > 0
    assert got.json()["summary"]["params"] == ans["summary"]["params"]
    assert got.json()["state_bytes"] == doc["state_bytes"]  # the state does not grow with its steps
    assert forecast.status_code == 200 and len(forecast.json()["forecast"]) == 2


def test_the_forecast_observes_each_pair_under_its_own_r(redis_url):
    """o = x + N(0, R_j): at every horizon the observation predictive's mean is the state's and its variance the
    state's plus the posterior mean of R (the answer's ``summary.params.R.mean``), within Monte Carlo error; the same
    request gives the same answer, samples included."""
    n, query = 4096, {"steps": 3, "samples": 20}

    async def body(app, c):
        await c.post("/v1/streams", json=lds_request(stream_id="fc", num_particles=n))
        answer = (await c.post("/v1/streams/fc/observations", json={"observations": OBS})).json()
        forecast = await c.get("/v1/streams/fc/forecast", params=query)
        again = await c.get("/v1/streams/fc/forecast", params=query)
        return answer, forecast, again

    answer, forecast, again = run(redis_url, body)
    assert forecast.status_code == 200, forecast.text
    doc = forecast.json()
    assert doc == again.json() and len(doc["forecast"]) == 3
    r_mean = answer["summary"]["params"]["R"]["mean"]
    for h in doc["forecast"]:
        state, obs = h["state"], h["observation"]
        assert obs is not None and len(obs["samples"]) == 20 and len(obs["samples"][0]) == 1
        assert set(obs["quantiles"]) == {"0.025", "0.05", "0.5", "0.95", "0.975"}
        var, expected = obs["cov"][0][0], state["cov"][0][0] + r_mean
        # a weighted cloud of effective size ≥ N/4 (the θ-ESS is kept above M/2): a few sd/√(N/4) and var √(2/(N/4))
        assert abs(obs["mean"][0] - state["mean"][0]) < 6 * math.sqrt(var / (n / 4))
        assert abs(var - expected) < 6 * expected * math.sqrt(2 / (n / 4)), (h["step"], var, expected)


def test_export_import_continues_byte_identically(redis_url):
    async def body(app, c):
        await c.post("/v1/streams", json=lds_request(stream_id="a", num_particles=256))
        await c.post("/v1/streams/a/observations", json={"observations": OBS[:4]})
        snapshot = (await c.get("/v1/streams/a/export")).content
        headers = {"content-type": "application/octet-stream"}
        imported = await c.post("/v1/streams:import", content=snapshot, params={"stream_id": "b"}, headers=headers)
        answers = [
            (await c.post(f"/v1/streams/{sid}/observations", json={"observations": OBS[4:]})).json() for sid in "ab"
        ]
        exported = [(await c.get(f"/v1/streams/{sid}/export")).content for sid in "ab"]
        return imported, answers, exported

    imported, answers, exported = run(redis_url, body)
    assert imported.status_code == 201, imported.text
    assert imported.json()["state_bytes"] > 0
    assert answers[0]["summary"] == answers[1]["summary"]
    from mpflow.operators.state import ParticleState

    a, b = (ParticleState.from_bytes(blob) for blob in exported)
    for name, t in a.fields().items():
        assert t.equal(b.fields()[name]), name


REFUSED = {
    "unknown type": ({"R": {"prior": {"type": "gamma", "mean": 1, "sd": 1}}}, None, "model.params.R.prior.type"),
    "normal for a variance": (
        {"R": {"prior": {"type": "normal", "mean": 1, "sd": 1}}},
        None,
        "use a lognormal prior",
    ),
    "uniform upside down": ({"R": {"prior": {"type": "uniform", "low": 2, "high": 1}}}, None, "low < high"),
    "negative sd": ({"R": {"prior": {"type": "lognormal", "mean": 0, "sd": -1}}}, None, "model.params.R.prior.sd"),
    "a matrix": ({"A": {"prior": {"type": "normal", "mean": 0, "sd": 1}}}, None, "model.params.A"),
    "kalman cannot learn": ({}, "kalman", "use smc2"),
    "smc2 without a prior": ({"R": [[1.0]]}, "smc2", "give at least one of model.params as a prior"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_bad_priors_and_methods_are_refused_naming_the_field(redis_url, case):
    params, method, says = REFUSED[case]
    req = lds_request(stream_id="bad")
    req["model"]["params"].update(params)
    if method is not None:
        req["method"] = method
    assert_refused(redis_url, req, says)


def assert_refused(redis_url, req, says: str) -> None:
    """Creating the stream ``req`` is 422 with ``says`` in its message, and no stream is left behind."""

    async def body(app, c):
        return await c.post("/v1/streams", json=req), await c.get(f"/v1/streams/{req['stream_id']}")

    r, after = run(redis_url, body)
    assert r.status_code == 422, r.text
    assert says in r.json()["error"]["message"]
    assert after.status_code == 404


def test_a_step_of_another_duration_is_refused_and_nothing_applied(redis_url):
    async def body(app, c):
        await c.post("/v1/streams", json=lds_request(stream_id="dt", num_particles=64))
        r = await c.post("/v1/streams/dt/observations", json={"observations": [[0.1], {"value": [0.2], "dt": 0.5}]})
        return r, (await c.get("/v1/streams/dt")).json()

    r, doc = run(redis_url, body)
    assert r.status_code == 422 and "observations[1].dt" in r.json()["error"]["message"]
    assert doc["step"] == 0


def test_the_particle_count_theta_times_x_is_bounded_by_the_cost_model(redis_url):
    sv = {
        "family": "stochastic_volatility",
        "params": {"phi": {"prior": {"type": "uniform", "low": 0.5, "high": 0.99}}, "sigma": LOGNORMAL},
    }
    req = {"model": sv, "prior": GAUSS1, "num_particles": 65536, "stream_id": "big"}

    async def body(app, c):
        return await c.post("/v1/streams", json=req), await c.get("/v1/streams/big")

    r, after = run(redis_url, body, max_request_flops=1e6)
    assert r.status_code == 413, r.text
    message = r.json()["error"]["message"]
    assert "num_particles" in message and "MPFLOW_MAX_REQUEST_FLOPS" in message
    assert after.status_code == 404


def test_a_stochastic_volatility_stream_learns_phi_and_sigma(redis_url):
    sv = {
        "family": "stochastic_volatility",
        "params": {"phi": {"prior": {"type": "uniform", "low": 0.5, "high": 0.99}}, "sigma": LOGNORMAL},
    }
    req = {"model": sv, "prior": GAUSS1, "num_particles": 256, "stream_id": "sv", "seed": 1}

    async def body(app, c):
        created = await c.post("/v1/streams", json=req)
        answer = await c.post("/v1/streams/sv/observations", json={"observations": OBS})
        return created, answer

    created, answer = run(redis_url, body)
    assert created.status_code == 201, created.text
    assert created.json()["method"] == "smc2"
    params = answer.json()["summary"]["params"]
    assert set(params) == {"phi", "sigma"}
    assert 0.5 <= params["phi"]["q05"] <= params["phi"]["q95"] <= 0.99
    assert math.isfinite(params["sigma"]["mean"]) and params["sigma"]["mean"] > 0


def test_the_client_reads_params_as_numpy_and_pandas(server):  # noqa: F811
    with Client(server) as client:
        stream = client.create_stream(model=lds_request()["model"], prior=GAUSS1, num_particles=128, seed=2)
        answers = list(stream.filter(OBS, batch=3))
        stream.delete()
        stream = client.create_stream(model=lds_request()["model"], prior=GAUSS1, num_particles=128, seed=2)
        asked = list(stream.filter(OBS, batch=3, per_step_params=True))
        stream.delete()
    last = answers[-1]
    # per step only where asked: else each answer's last step (its summary's) and NaN between
    every = StepTable.of(asked).params["R"]["mean"]
    assert np.isfinite(every).all() and every[-1] == asked[-1].params["R"]["mean"]
    sparse = StepTable.of(answers).params["R"]["mean"]
    np.testing.assert_array_equal(np.isfinite(sparse), [False, False, True, False, False, True, False, True])
    np.testing.assert_array_equal(sparse[[2, 5, 7]], every[[2, 5, 7]])  # the same stream, the same numbers
    assert set(last.params) == {"R"} and set(last.params["R"]) == {"mean", "sd", "q025", "q05", "q95", "q975"}
    frame = last.params_to_pandas()
    assert list(frame.index) == ["R"] and frame.loc["R", "mean"] == last.params["R"]["mean"]
    table = StepTable.of(answers)
    assert table.params["R"]["mean"].shape == (len(OBS),)
    assert table.params["R"]["mean"][-1] == last.params["R"]["mean"]
    columns = table.to_pandas().columns
    assert {"param_R_mean", "param_R_sd", "param_R_q05", "param_R_q95"} <= set(columns)


def test_the_p_value_is_the_theta_mixture_of_the_learned_r(redis_url):
    """o under R ≈ 0.01 (log R ~ N(log 0.01, 0.1²)), A = B = 1, Q = 0.01, x_0 ~ N(0, 0.01): the step's p-value is
    ∫ Φ(o / √(0.01 + 0.01 + R)) p(R) dR (Gauss–Hermite over log R; the M = 1024 θ-particles are draws of that prior),
    0.9987 at o 3 predictive sd up, where the family's R = 1 gave 0.70; the stream's summary reports it too."""
    prior_r = {"prior": {"type": "lognormal", "mean": math.log(0.01), "sd": 0.1}}
    model = {"family": "lds", "params": {"A": [[1.0]], "B": [[1.0]], "Q": [[0.01]], "R": prior_r}}
    req = {"model": model, "prior": {"type": "gaussian", "mean": [0.0], "cov": [[0.01]]}, "stream_id": "pit"}
    o = 3 * math.sqrt(0.03)

    async def body(app, c):
        await c.post("/v1/streams", json={**req, "method": "smc2", "seed": 4})
        return await c.post("/v1/streams/pit/observations", json={"observations": [[o]]})

    answer = run(redis_url, body)
    assert answer.status_code == 200, answer.text
    z, w = np.polynomial.hermite_e.hermegauss(40)
    r = np.exp(math.log(0.01) + 0.1 * z)
    exact = float((w / w.sum() * norm.cdf(np.float32(o) / np.sqrt(0.02 + r))).sum())
    pit = answer.json()["per_step"][0]["pit"][0]
    assert abs(pit - exact) < 2e-4, (pit, exact)
    assert exact > 0.998 and answer.json()["summary"]["pit"] == [pit]


def test_a_collapsing_cloud_reports_its_ess_and_distinct_values(redis_url):
    """The collapse scenario: ``lds`` A = B = 1 with Q and R learned (lognormal(0, 1) each), seven identical
    readings then a jump. Every answer's summary carries the θ-cloud's ESS (at most M) and distinct count beside
    ``params``, and whether it is degenerate; per step only with ``per_step_params``, each step's there; /metrics has
    a θ-ESS fraction per stream-step; an unknown request field is still refused."""
    model = {"family": "lds", "params": {"A": [[1.0]], "B": [[1.0]], "Q": LOGNORMAL, "R": LOGNORMAL}}
    req = {"model": model, "prior": GAUSS1, "stream_id": "jump", "num_particles": 256, "seed": 5}
    url = "/v1/streams/jump/observations"

    async def body(app, c):
        created = (await c.post("/v1/streams", json=req)).json()
        same = (await c.post(url, json={"observations": [[1.0]] * 7})).json()
        jump = (await c.post(url, json={"observations": [[6.0]], "per_step_params": True})).json()
        refused = await c.post(url, json={"observations": [[1.0]], "per_step_param": True})
        return created, same, jump, refused, (await c.get("/metrics")).text, (await c.get("/v1/streams/jump")).json()

    created, same, jump, refused, metrics, got = run(redis_url, body)
    m = 256
    for doc in (created, same, jump, got):
        s = doc["summary"]
        assert set(s["params"]) == {"Q", "R"}
        assert 1 <= s["params_ess"] <= m + 1e-6 and 1 <= s["params_distinct"] <= m, s
        assert s["params_degenerate"] is False  # a prior of sd 1 in log θ: 8 steps leave a wide cloud
    assert created["summary"]["params_distinct"] == m and abs(created["summary"]["params_ess"] - m) < 1e-6
    assert all(not {"params", "params_ess", "params_distinct"} & set(e) for e in same["per_step"])
    (entry,) = jump["per_step"]
    assert {k: entry[k] for k in ("params", "params_ess", "params_distinct", "params_degenerate")} == {
        k: jump["summary"][k] for k in ("params", "params_ess", "params_distinct", "params_degenerate")
    }
    assert got["summary"]["params_ess"] == jump["summary"]["params_ess"]
    assert refused.status_code == 422 and "per_step_param" in refused.text
    assert 'mpflow_update_theta_ess_fraction_count{method="smc2"} 8.0' in metrics, metrics


MH_REFUSED = {
    "history 0": ({"kernel": "mh", "history": 0}, None, "options.history"),
    "too many moves": ({"kernel": "mh", "mh_moves": 1000}, None, "options.mh_moves"),
    "not a kernel": ({"kernel": "pmmh"}, None, "options.kernel"),
    "an observer that is not registered": ({"kernel": "mh", "observer": "lds-d9-v9"}, None, "options.observer"),
    "an observer of another family": (
        {"kernel": "mh", "observer": "linear_gaussian-d1-v1"},
        None,
        "options.observer: linear_gaussian-d1-v1 is a parameter observer of linear_gaussian",
    ),
    "an observer that is not a string": ({"kernel": "mh", "observer": 3}, None, "options.observer"),
}


@pytest.mark.parametrize("observer", ["stochastic_volatility-d1-v2", "none"])
def test_an_sv_stream_rejuvenates_by_particle_replays_with_or_without_its_observer(redis_url, observer):
    """``kernel: "mh"`` on a family without a Kalman filter: a particle filter per θ-particle replays the block;
    with ``observer: "stochastic_volatility-d1-v2"`` the shipped SV observer proposes too. The stream goes through the
    store between requests, learns φ and σ inside their supports, and says its rejuvenation is exact."""
    sv = {
        "family": "stochastic_volatility",
        "params": {"mu": 0.0, "phi": {"prior": {"type": "uniform", "low": 0.5, "high": 0.99}}, "sigma": LOGNORMAL},
    }
    opts = {"kernel": "mh", "history": 50, "ess_threshold": 0.8, "observer": observer, "theta_particles": 16}
    req = {"model": sv, "prior": GAUSS1, "num_particles": 256, "stream_id": "svmh", "seed": 1, "method_options": opts}
    rng = np.random.default_rng(4)
    ys = [[float(np.exp(0.5 * x) * rng.standard_normal())] for x in 0.5 * rng.standard_normal(24)]

    async def body(app, c):  # four observations a request: each step is priced with a move over the block
        created = await c.post("/v1/streams", json=req)
        answers = [await c.post("/v1/streams/svmh/observations", json={"observations": ys[i : i + 4]}) for i in
                   range(0, 24, 4)]  # fmt: skip
        too_many = await c.post("/v1/streams/svmh/observations", json={"observations": ys})
        return created, answers, too_many

    created, answers, too_many = run(redis_url, body)
    assert created.status_code == 201, created.text
    assert all(a.status_code == 200 for a in answers), answers[-1].text
    assert too_many.status_code == 413 and "observations" in too_many.text
    summary = answers[-1].json()["summary"]
    assert 0.5 <= summary["params"]["phi"]["q05"] <= summary["params"]["phi"]["q95"] <= 0.99
    assert summary["params"]["sigma"]["sd"] > 0 and summary["params_rejuvenation"] == "exact"
    assert summary["params_distinct"] > 1


@pytest.mark.parametrize("case", sorted(MH_REFUSED))
def test_bad_mh_options_are_refused_naming_the_field(redis_url, case):
    options, model, says = MH_REFUSED[case]
    req = lds_request(stream_id="mhbad", method="smc2", method_options=options, num_particles=64)
    if model is not None:
        req["model"] = model
    assert_refused(redis_url, req, says)


def test_an_mh_stream_keeps_its_history_through_the_store(redis_url):
    """``kernel: "mh"`` with a window of 5 observations: the state (its history included) goes through the store
    between requests, keeps its size, and learns R."""
    opts = {"kernel": "mh", "history": 5, "mh_moves": 2, "ess_threshold": 0.9}
    req = lds_request(stream_id="mh", method="smc2", method_options=opts, num_particles=128)

    async def body(app, c):
        created = await c.post("/v1/streams", json=req)
        first = await c.post("/v1/streams/mh/observations", json={"observations": OBS[:4]})
        second = await c.post("/v1/streams/mh/observations", json={"observations": [*OBS[4:], None]})
        return created, first, second, await c.get("/v1/streams/mh")

    created, first, second, got = run(redis_url, body)
    assert created.status_code == 201, created.text
    assert first.status_code == 200 and second.status_code == 200, second.text
    assert second.json()["step"] == len(OBS) + 1
    assert got.json()["state_bytes"] == created.json()["state_bytes"]
    r = got.json()["summary"]["params"]["R"]
    assert r["q05"] <= r["mean"] <= r["q95"] and r["sd"] > 0
    # the moves target the exact posterior while the 5-step block holds every step, a checkpoint's after
    assert first.json()["summary"]["params_rejuvenation"] == "exact"
    assert got.json()["summary"]["params_rejuvenation"] == "checkpointed"

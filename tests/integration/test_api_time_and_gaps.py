"""Missing observations, partial observations, irregular time steps and control inputs through the HTTP API
(issue 19), against a real Redis.

The model is a continuous-time constant-velocity target, dx = (F x + C u) dt + dW, observed in position and
velocity; the reference is a float64 Kalman filter written here, with the step's A = e^{FΔ}, Q and the input gain
computed by numerical quadrature (scipy's ``quad_vec``) — independently of the service's Van Loan discretisation —
and the unobserved rows of H and R dropped.
"""

from __future__ import annotations

import math
from typing import Any

import httpx
import numpy as np
import pytest
import scipy.integrate
import scipy.linalg
import scipy.stats

from tests.harness.specs import SHORT_SOLVERS
from tests.integration.test_api_streams import run

F = [[0.0, 1.0], [0.0, -0.2]]
QC = [[0.0, 0.0], [0.0, 0.6]]
H = [[1.0, 0.0], [0.0, 1.0]]
R = [[0.3, 0.05], [0.05, 0.2]]
C = [[0.0], [1.0]]
MODEL = {"family": "lds", "params": {"F": F, "Qc": QC, "B": H, "R": R, "C": C}}
PRIOR = {"type": "gaussian", "mean": [0.0, 1.0], "cov": [[1.0, 0.0], [0.0, 0.5]]}
STEPS: list[Any] = [
    {"value": [0.9, 1.1], "dt": 1.0},
    {"value": None, "dt": 0.5, "u": [0.4]},
    {"value": [1.8, None], "dt": 0.25},
    None,
    [2.9, 0.7],
    {"value": [None, 0.5], "dt": 2.0, "u": [-0.3]},
    {"value": [5.0, 0.6], "dt": 0.1, "u": [1.0]},
    {"value": [None, None], "dt": 0.7},
    {"value": [6.1, 0.4], "dt": 1.3},
]


def discretise(dt: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A = e^{FΔ}, Q = ∫₀^Δ e^{Fs} Qc e^{Fᵀs} ds, Γ = ∫₀^Δ e^{Fs} ds, by quadrature."""
    Fm, Qc = np.array(F), np.array(QC)
    Q, _ = scipy.integrate.quad_vec(lambda s: scipy.linalg.expm(Fm * s) @ Qc @ scipy.linalg.expm(Fm * s).T, 0, dt)
    G, _ = scipy.integrate.quad_vec(lambda s: scipy.linalg.expm(Fm * s), 0, dt)
    return scipy.linalg.expm(Fm * dt), Q, G


def item(step: Any) -> tuple[Any, float, np.ndarray]:
    if isinstance(step, dict):
        return step["value"], step.get("dt", 1.0), np.array(step.get("u", [0.0]))
    return step, 1.0, np.zeros(1)


def nothing_observed(value: Any) -> bool:
    """A value with no entry observed: null, or null everywhere."""
    return value is None or (isinstance(value, list) and all(v is None for v in value))


def reference() -> list[tuple[np.ndarray, np.ndarray, float]]:
    """The float64 Kalman filter's (mean, cov, log-evidence increment) after each step."""
    m, P = np.array(PRIOR["mean"]), np.array(PRIOR["cov"])
    Hm, Rm, Cm = np.array(H), np.array(R), np.array(C)
    out = []
    for step in STEPS:
        value, dt, u = item(step)
        A, Q, G = discretise(dt)
        m, P = A @ m + G @ Cm @ u, A @ P @ A.T + Q
        inc = 0.0
        o = np.array([math.nan, math.nan] if value is None else [math.nan if v is None else v for v in value])
        seen = ~np.isnan(o)
        if seen.any():
            Hs, Rs = Hm[seen], Rm[np.ix_(seen, seen)]
            S = Hs @ P @ Hs.T + Rs
            inc = float(scipy.stats.multivariate_normal(Hs @ m, S).logpdf(o[seen]))
            K = P @ Hs.T @ np.linalg.inv(S)
            m = m + K @ (o[seen] - Hs @ m)
            P = (np.eye(2) - K @ Hs) @ P
        out.append((m, 0.5 * (P + P.T), inc))
    return out


#: steps per request: a default ``gpf`` step is priced at its 500 iterations' fixed cost, 2 steps a request at most
#: (docs/API.md "Limits"); the others take up to three (:func:`filtered`) or five (:func:`forecast_after_filtering`)
STEPS_PER_REQUEST = {"gpf": 2}


async def observe(client: httpx.AsyncClient, stream_id: str, steps: list[Any], per_request: int) -> list[dict]:
    """``steps`` posted ``per_request`` a request; every step's ``per_step`` entry."""
    per_step = []
    for i in range(0, len(steps), per_request):
        r = await client.post(
            f"/v1/streams/{stream_id}/observations", json={"observations": steps[i : i + per_request]}
        )
        assert r.status_code == 200, r.text
        per_step += r.json()["per_step"]
    return per_step


async def filtered(client: httpx.AsyncClient, method: str, n: int, stream_id: str) -> list[dict[str, Any]]:
    body = {"stream_id": stream_id, "model": MODEL, "prior": PRIOR, "method": method, "num_particles": n, "seed": 3}
    assert (await client.post("/v1/streams", json=body)).status_code == 201
    per_step = await observe(client, stream_id, STEPS, STEPS_PER_REQUEST.get(method, 3))
    doc = (await client.get(f"/v1/streams/{stream_id}")).json()
    return per_step, doc


def test_kalman_matches_the_float64_filter_with_gaps_irregular_time_and_inputs(redis_url):
    ref = reference()

    async def body(app, client):
        return await filtered(client, "kalman", 64, "kf")

    per_step, doc = run(redis_url, body)
    assert [p["step"] for p in per_step] == list(range(1, len(STEPS) + 1)) and doc["step"] == len(STEPS)
    for p, (m, _, inc), step in zip(per_step, ref, STEPS, strict=True):
        np.testing.assert_allclose(p["mean"], m, atol=1e-6)
        if not nothing_observed(item(step)[0]):
            assert p["log_evidence_increment"] == pytest.approx(inc, abs=1e-6)
    np.testing.assert_allclose(doc["summary"]["cov"], ref[-1][1], atol=1e-6)
    assert doc["summary"]["log_evidence"] == pytest.approx(sum(r[2] for r in ref), abs=1e-6)
    for p, step in zip(per_step, STEPS, strict=True):
        if nothing_observed(item(step)[0]):
            assert p["log_evidence_increment"] is None  # nothing observed: no score


@pytest.mark.parametrize(
    "method,n,sd_tol,logz_tol", [("smc", 2048, 0.25, 0.3), ("gpf", 256, 0.1, 0.2), ("mpf", 256, 0.1, 0.2)]
)
def test_particle_methods_are_close_to_the_exact_filter(redis_url, method, n, sd_tol, logz_tol):
    ref = reference()

    async def body(app, client):
        return await filtered(client, method, n, method)

    per_step, doc = run(redis_url, body)
    for p, (m, P, _) in zip(per_step, ref, strict=True):
        assert np.max(np.abs(np.array(p["mean"]) - m) / np.sqrt(np.diag(P))) < sd_tol
    assert doc["summary"]["log_evidence"] == pytest.approx(sum(r[2] for r in ref), abs=logz_tol)


def test_a_batch_mixing_missing_and_present_steps_matches_the_streams_alone(redis_url):
    """Streams updated concurrently (micro-batched) with one missing and one present step each time give the
    answers each gets alone."""

    async def body(app, client):
        ids = ["a", "b", "c", "d"]
        for sid in ids:
            req = {"stream_id": sid, "model": MODEL, "prior": PRIOR, "method": "gpf", "num_particles": 64, "seed": 5}
            assert (await client.post("/v1/streams", json=req)).status_code == 201
        first = [[0.5, 1.0], None, [0.4, None], {"value": None, "dt": 0.5}]
        second = [None, {"value": [1.0, 1.2], "dt": 0.5, "u": [0.1]}, [None, 1.0], [1.3, 0.9]]
        for steps in (first, second):
            updates = [{"stream_id": sid, "observations": [o]} for sid, o in zip(ids, steps, strict=True)]
            r = await client.post("/v1/observations:batch", json={"updates": updates})
            assert all(res["status"] == 200 for res in r.json()["results"]), r.text
        batched = {sid: (await client.get(f"/v1/streams/{sid}")).json()["summary"] for sid in ids}
        alone = {}
        for sid, o1, o2 in zip(ids, first, second, strict=True):
            req = {"stream_id": f"{sid}-alone", "model": MODEL, "prior": PRIOR, "method": "gpf", "num_particles": 64}
            assert (await client.post("/v1/streams", json={**req, "seed": 5})).status_code == 201
            for o in (o1, o2):
                r = await client.post(f"/v1/streams/{sid}-alone/observations", json={"observations": [o]})
                assert r.status_code == 200, r.text
            alone[sid] = r.json()["summary"]
        return batched, alone

    batched, alone = run(redis_url, body, method_options=SHORT_SOLVERS)  # 4 default gpf steps: 160% of a budget
    for sid, summary in batched.items():
        np.testing.assert_allclose(summary["mean"], alone[sid]["mean"], atol=1e-5)
        assert summary["log_evidence"] == pytest.approx(alone[sid]["log_evidence"], abs=1e-5)


@pytest.mark.parametrize(
    "model,observation,field",
    [
        (MODEL, {"value": [1.0, 1.0], "dt": 0}, "observations[0].dt"),
        (MODEL, {"value": [1.0, 1.0], "dt": -0.5}, "observations[0].dt"),
        (MODEL, {"value": [1.0, 1.0], "u": [1.0, 2.0]}, "observations[0].u"),
        (
            {"family": "lds", "params": {"F": F, "Qc": QC, "B": H}},
            {"value": [1.0, 1.0], "u": [1.0]},
            "observations[0].u",
        ),
        (
            {"family": "lds", "params": {"A": [[1, 0], [0, 1]], "B": H}},
            {"value": [1.0, 1.0], "dt": 2},
            "observations[0].dt",
        ),
        ({"family": "logistic", "params": {}}, {"x": [[1.0, None]], "y": [1]}, "observations[0]"),
        ({"family": "gmm", "params": {}}, {"value": 1.0, "u": [1.0]}, "observations[0].u"),
        (MODEL, [1.0, None, 2.0], "observations[0]"),
    ],
)
def test_bad_steps_are_422_naming_the_field_and_nothing_is_applied(redis_url, model, observation, field):
    async def body(app, client):
        req = {"stream_id": "s", "model": model, "prior": PRIOR, "method": "smc", "num_particles": 16, "seed": 1}
        assert (await client.post("/v1/streams", json=req)).status_code == 201, req
        r = await client.post("/v1/streams/s/observations", json={"observations": [observation]})
        return r, (await client.get("/v1/streams/s")).json()["step"]

    r, step = run(redis_url, body)
    assert r.status_code == 422, r.text
    assert r.json()["error"]["message"].startswith(field), r.json()
    assert step == 0


def test_missing_step_of_a_static_family_keeps_the_posterior(redis_url):
    async def body(app, client):
        req = {"stream_id": "s", "model": {"family": "linear_gaussian", "params": {}}, "prior": PRIOR}
        assert (await client.post("/v1/streams", json={**req, "method": "gpf", "num_particles": 32})).status_code == 201
        before = (await client.get("/v1/streams/s/particles")).json()
        r = await client.post("/v1/streams/s/observations", json={"observations": [None, {"value": None, "dt": 3}]})
        after = (await client.get("/v1/streams/s/particles")).json()
        return r.json(), before, after

    doc, before, after = run(redis_url, body)
    assert doc["step"] == 2 and [p["log_evidence_increment"] for p in doc["per_step"]] == [None, None]
    assert before == after


# ---------------------------------------------------------------------------------------------- forecasts
def closed_form_forecast(m: np.ndarray, P: np.ndarray, steps: int, dt: float):
    """The k-step predictive of N(m, P): state and observation means and covariances per horizon."""
    A, Q, _ = discretise(dt)
    Hm, Rm = np.array(H), np.array(R)
    out = []
    for _ in range(steps):
        m, P = A @ m, A @ P @ A.T + Q
        out.append((m, P, Hm @ m, Hm @ P @ Hm.T + Rm))
    return out


async def forecast_after_filtering(client, method: str, n: int, query: str):
    body = {"stream_id": method, "model": MODEL, "prior": PRIOR, "method": method, "num_particles": n, "seed": 9}
    assert (await client.post("/v1/streams", json=body)).status_code == 201
    await observe(client, method, STEPS[:5], STEPS_PER_REQUEST.get(method, 5))
    r = await client.get(f"/v1/streams/{method}/forecast?{query}")
    assert r.status_code == 200, r.text
    return r.json()


def test_kalman_forecast_is_the_closed_form_and_leaves_the_stream_unchanged(redis_url):
    async def body(app, client):
        store = app.state.streams.store
        doc = await forecast_after_filtering(client, "kalman", 64, "steps=4&dt=0.5&samples=50")
        before = await store.get("default", "kalman")
        again = (await client.get("/v1/streams/kalman/forecast?steps=4&dt=0.5&samples=50")).json()
        after = await store.get("default", "kalman")
        state = (await client.get("/v1/streams/kalman")).json()
        return doc, again, before, after, state

    doc, again, before, after, state = run(redis_url, body)
    assert before == after and doc == again  # reads only, and reproducible
    assert doc["stream_id"] == "kalman" and doc["step"] == 5 == state["step"]
    expected = closed_form_forecast(np.array(state["summary"]["mean"]), np.array(state["summary"]["cov"]), 4, 0.5)
    for j, (h, (m, P, om, oc)) in enumerate(zip(doc["forecast"], expected, strict=True)):
        assert h["step"] == 6 + j and h["t"] == pytest.approx(0.5 * (j + 1))
        np.testing.assert_allclose(h["state"]["mean"], m, atol=1e-6)
        np.testing.assert_allclose(h["state"]["cov"], P, atol=1e-6)
        np.testing.assert_allclose(h["observation"]["mean"], om, atol=1e-6)
        np.testing.assert_allclose(h["observation"]["cov"], oc, atol=1e-6)
        z = scipy.stats.norm.ppf(0.95)
        np.testing.assert_allclose(h["state"]["quantiles"]["0.95"], m + z * np.sqrt(np.diag(P)), atol=1e-6)
        assert np.array(h["state"]["samples"]).shape == (50, 2) and np.array(h["observation"]["samples"]).shape == (
            50,
            2,
        )


@pytest.mark.parametrize("method,n", [("smc", 4096), ("gpf", 1024), ("mpf", 1024)])
def test_particle_forecasts_are_within_monte_carlo_error_of_the_closed_form(redis_url, method, n):
    async def body(app, client):
        doc = await forecast_after_filtering(client, method, n, "steps=3&dt=0.7")
        state = (await client.get(f"/v1/streams/{method}")).json()
        return doc, state

    doc, state = run(redis_url, body)
    m0, P0 = np.array(state["summary"]["mean"]), np.array(state["summary"]["cov"])
    for h, (m, P, om, oc) in zip(doc["forecast"], closed_form_forecast(m0, P0, 3, 0.7), strict=True):
        sd = np.sqrt(np.diag(P))
        # a weighted cloud of effective size ≥ N/4: the mean's error is a few sd/√(N/4), the covariance's a few /√N
        assert np.max(np.abs(np.array(h["state"]["mean"]) - m) / sd) < 6 / math.sqrt(n / 4)
        np.testing.assert_allclose(h["state"]["cov"], P, rtol=0.3, atol=0.05)
        np.testing.assert_allclose(h["observation"]["mean"], om, atol=6 * math.sqrt(np.max(np.diag(oc)) / (n / 4)))
        np.testing.assert_allclose(h["observation"]["cov"], oc, rtol=0.3, atol=0.05)
        assert "samples" not in h["state"]


@pytest.mark.parametrize(
    "model,query,status,field",
    [
        (MODEL, "steps=0", 422, "steps"),
        (MODEL, "steps=3&dt=0", 422, "dt"),
        (MODEL, "steps=3&dt=-1", 422, "dt"),
        (MODEL, "steps=11", 413, "steps"),
        (MODEL, "steps=2&samples=201", 413, "samples"),
        ({"family": "lds", "params": {"A": [[1, 0], [0, 1]], "B": H}}, "steps=2&dt=0.5", 422, "dt"),
    ],
)
def test_bad_forecasts_are_refused_naming_the_parameter(redis_url, model, query, status, field):
    async def body(app, client):
        req = {"stream_id": "s", "model": model, "prior": PRIOR, "method": "kalman"}
        assert (await client.post("/v1/streams", json=req)).status_code == 201
        return await client.get(f"/v1/streams/s/forecast?{query}")

    r = run(redis_url, body, max_forecast_steps=10, max_samples_per_request=200)
    assert r.status_code == status, r.text
    assert field in r.json()["error"]["message"].split(":")[0] or r.json()["error"]["message"].startswith(field)


def test_forecast_of_a_static_family_and_of_logistic(redis_url):
    async def body(app, client):
        out = {}
        for family, obs in (("gmm", [1.0]), ("logistic", {"x": [[1.0, 0.5]], "y": [1]})):
            req = {"stream_id": family, "model": {"family": family, "params": {}}, "prior": PRIOR, "method": "smc"}
            assert (await client.post("/v1/streams", json={**req, "num_particles": 64})).status_code == 201
            await client.post(f"/v1/streams/{family}/observations", json={"observations": [obs]})
            out[family] = (await client.get(f"/v1/streams/{family}/forecast?steps=2")).json()
            out[family + "-doc"] = (await client.get(f"/v1/streams/{family}")).json()
        return out

    out = run(redis_url, body)
    for family in ("gmm", "logistic"):
        for h in out[family]["forecast"]:  # a static state does not move
            np.testing.assert_allclose(h["state"]["mean"], out[family + "-doc"]["summary"]["mean"], atol=1e-9)
    assert out["logistic"]["forecast"][0]["observation"] is None
    assert len(out["gmm"]["forecast"][0]["observation"]["mean"]) == 1

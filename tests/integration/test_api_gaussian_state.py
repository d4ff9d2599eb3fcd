"""Streams whose posterior is a Gaussian kept as moments (``kalman``, ``ukf``: ``Updater.gaussian_state``), against
a real server and Redis (issue 38): every answer — summary, per_step, history, forecasts — gives the Gaussian's
float64 moments, computed from the request's numbers in float64 (0.3 stays 0.3, not float32's 0.30000001192), and
no effective sample size (null: the particles are draws from the Gaussian, not a cloud); the client reads the null
as NaN. A particle method still reports its ESS."""

from __future__ import annotations

import httpx
import numpy as np
from mpflow.service.client import Client

from tests.integration.test_client import MODEL, OBS, server  # noqa: F401  (fixture)

TOUR_MODEL = {"family": "linear_gaussian", "params": {}}
PRIOR = {"type": "gaussian", "mean": [0.0, 0.0], "cov": [[1.0, 0.0], [0.0, 1.0]]}
Z95 = 1.6448536269514722  # Φ⁻¹(0.95)


def kalman(A: np.ndarray, B: np.ndarray, obs: list[list[float]]) -> tuple[list, list, list]:
    """The Kalman filter in float64 (Q = R = I, prior N(0, I)): means, covariances and log p(o_m | o_<m)."""
    d = A.shape[0]
    m, P = np.zeros(d), np.eye(d)
    means, covs, logs = [], [], []
    for o in np.asarray(obs, dtype=np.float64):
        m, P = A @ m, A @ P @ A.T + np.eye(d)
        S = B @ P @ B.T + np.eye(len(o))
        r = o - B @ m
        logs.append(-0.5 * (r @ np.linalg.solve(S, r) + np.linalg.slogdet(2 * np.pi * S)[1]))
        K = P @ B.T @ np.linalg.inv(S)
        m, P = m + K @ r, P - K @ S @ K.T
        means.append(m)
        covs.append(P)
    return means, covs, logs


def _create(http: httpx.Client, model: dict, method: str) -> str:
    r = http.post("/v1/streams", json={"model": model, "prior": PRIOR, "method": method, "seed": 0})
    assert r.status_code == 201, r.text
    return r.json()["stream_id"]


def test_the_tour_answers_the_exact_float64_moments_and_no_ess(server):  # noqa: F811
    """The README's tour: mean [0.08, −0.42] and variances 0.6 to the last bit, log p(o₁, o₂) = −6.623…"""
    obs = [[0.3, -1.2], [0.1, -0.9]]
    with httpx.Client(base_url=server, timeout=30) as http:
        sid = _create(http, TOUR_MODEL, "kalman")
        answer = http.post(f"/v1/streams/{sid}/observations", json={"seq": 1, "observations": obs}).json()
        s = answer["summary"]
        np.testing.assert_allclose(s["mean"], [0.08, -0.42], rtol=0, atol=1e-15)
        np.testing.assert_allclose(s["cov"], 0.6 * np.eye(2), rtol=0, atol=1e-15)
        # o_1, o_2 per dimension: N(0, [[4, 1], [1, 4]]) (x ~ N(0, 1), o = x + N(0, 3))
        S = np.array([[4.0, 1.0], [1.0, 4.0]])
        exact = sum(
            -0.5 * (o @ np.linalg.solve(S, o) + np.linalg.slogdet(2 * np.pi * S)[1])
            for o in np.array(obs, dtype=np.float64).T
        )
        assert abs(s["log_evidence"] - exact) < 1e-12
        np.testing.assert_allclose(s["quantiles"]["0.95"], np.array(s["mean"]) + Z95 * np.sqrt(0.6), atol=1e-15)
        assert s["ess"] is None and [p["ess"] for p in answer["per_step"]] == [None, None]
        assert answer["per_step"][0]["mean"] == [0.075, -0.3]  # 0.3/4, −1.2/4 exactly, not 0.07500000298
        history = http.get(f"/v1/streams/{sid}/history").json()["steps"]
        assert [h["ess"] for h in history] == [None, None] and history[-1]["mean"] == s["mean"]
        assert http.get(f"/v1/streams/{sid}").json()["summary"]["ess"] is None


def test_kalman_and_ukf_streams_match_a_float64_kalman_filter(server):  # noqa: F811
    """An lds with A = [[0.9, 0.1], [−0.1, 0.9]] (0.9 is not a float32 number): ``kalman`` and ``ukf`` (exact on a
    linear model) agree with the float64 Kalman filter to 1e-12 at every step, and so do their forecasts."""
    A, B = (np.array(MODEL["params"][k], dtype=np.float64) for k in ("A", "B"))
    means, covs, logs = kalman(A, B, OBS)
    with httpx.Client(base_url=server, timeout=30) as http:
        for method in ("kalman", "ukf"):
            sid = _create(http, MODEL, method)
            answer = http.post(f"/v1/streams/{sid}/observations", json={"seq": 1, "observations": OBS}).json()
            for step, m, P, lp in zip(answer["per_step"], means, covs, logs, strict=True):
                np.testing.assert_allclose(step["mean"], m, rtol=0, atol=1e-12, err_msg=method)
                np.testing.assert_allclose(step["std"], np.sqrt(np.diag(P)), rtol=0, atol=1e-12, err_msg=method)
                assert abs(step["log_evidence_increment"] - lp) < 1e-12 and step["ess"] is None, method
            np.testing.assert_allclose(answer["summary"]["cov"], covs[-1], rtol=0, atol=1e-12, err_msg=method)
            forecast = http.get(f"/v1/streams/{sid}/forecast", params={"steps": 2}).json()["forecast"]
            m, P = means[-1], covs[-1]
            for horizon in forecast:  # the exact predictive: no particle in it
                m, P = A @ m, A @ P @ A.T + np.eye(2)
                np.testing.assert_allclose(horizon["state"]["mean"], m, rtol=0, atol=1e-12, err_msg=method)
                np.testing.assert_allclose(horizon["state"]["cov"], P, rtol=0, atol=1e-12, err_msg=method)
                obs_cov = B @ P @ B.T + np.eye(2)
                np.testing.assert_allclose(horizon["observation"]["cov"], obs_cov, rtol=0, atol=1e-12, err_msg=method)
                upper = m + Z95 * np.sqrt(np.diag(P))
                np.testing.assert_allclose(horizon["state"]["quantiles"]["0.95"], upper, atol=1e-12, err_msg=method)


def test_the_client_reads_a_null_ess_as_nan_and_a_cloud_keeps_its_ess(server):  # noqa: F811
    with Client(server) as client:
        exact = client.create_stream(model=MODEL, prior=PRIOR, method="kalman", seed=0)
        posterior = exact.update(OBS[:3])
        assert np.isnan(posterior.ess) and np.isnan(posterior.steps.ess).all() and len(posterior.steps.ess) == 3
        assert np.isnan(exact.history().ess).all()
        cloud = client.create_stream(model=MODEL, prior=PRIOR, method="smc", num_particles=64, seed=0)
        answer = cloud.update(OBS[:3])
        assert 1 <= answer.ess <= 64 and np.isfinite(answer.steps.ess).all()

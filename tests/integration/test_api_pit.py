"""Predictive p-values through the HTTP API against a real Redis: every ``per_step`` entry carries ``pit`` — for a
``kalman`` stream exactly Φ((o − H m⁻)/√(H P⁻ Hᵀ + R)) of a float64 Kalman filter written here —, null where an
entry was not observed, and the stream's summary shows the latest values and flags them at the stream's
``pit_alert``; a ``pit_alert`` outside (0, 1) is refused."""

from __future__ import annotations

import math

import numpy as np

from tests.integration.test_api_streams import run

A = [[0.9, 0.1], [0.0, 0.8]]
Q = [[0.3, 0.0], [0.0, 0.2]]
R = [[0.5, 0.0], [0.0, 0.4]]
MODEL = {"family": "lds", "params": {"A": A, "Q": Q, "B": [[1.0, 0.0], [0.0, 1.0]], "R": R}}
PRIOR = {"type": "gaussian", "mean": [0.0, 0.5], "cov": [[1.0, 0.2], [0.2, 0.8]]}
#: the third reading is a 6-sd surprise in its first entry; the second misses its second entry
OBS = [[0.4, 0.3], [0.1, None], [6.0, 0.2]]


def kalman_pit() -> list[list[float]]:
    """Φ((o_j − (H m⁻)_j)/√S_jj) per step, from a float64 Kalman filter (H = I) conditioning on observed entries."""
    m, P = np.array(PRIOR["mean"]), np.array(PRIOR["cov"])
    F, Qm, Rm = np.array(A), np.array(Q), np.array(R)
    out = []
    for o in OBS:
        m, P = F @ m, F @ P @ F.T + Qm
        S = P + Rm
        out.append(
            [math.nan if o[j] is None else 0.5 * math.erfc(-(o[j] - m[j]) / math.sqrt(2 * S[j, j])) for j in range(2)]
        )
        seen = [j for j in range(2) if o[j] is not None]
        H = np.eye(2)[seen]
        S_seen = H @ P @ H.T + Rm[np.ix_(seen, seen)]
        K = P @ H.T @ np.linalg.inv(S_seen)
        m = m + K @ (np.array([o[j] for j in seen]) - H @ m)
        P = P - K @ H @ P
    return out


def test_per_step_pit_matches_kalman_and_the_summary_flags(redis_url):
    async def body(app, client):
        created = await client.post(
            "/v1/streams", json={"model": MODEL, "prior": PRIOR, "method": "kalman", "seed": 3, "pit_alert": 0.02}
        )
        assert created.status_code == 201, created.text
        sid = created.json()["stream_id"]
        assert created.json()["summary"]["pit_alert"] == 0.02 and "pit" not in created.json()["summary"]
        answers = []
        for o in OBS:
            r = await client.post(f"/v1/streams/{sid}/observations", json={"observations": [o]})
            assert r.status_code == 200, r.text
            answers.append(r.json())
        refused = await client.post("/v1/streams", json={"model": MODEL, "prior": PRIOR, "pit_alert": 1.5})
        doc = (await client.get(f"/v1/streams/{sid}")).json()
        return answers, refused, doc

    answers, refused, doc = run(redis_url, body)
    expected = kalman_pit()
    for t, answer in enumerate(answers):
        pit = answer["per_step"][0]["pit"]
        for j in range(2):
            if OBS[t][j] is None:
                assert pit[j] is None
            else:
                assert abs(pit[j] - expected[t][j]) < 1e-5, (t, j, pit, expected[t])
    first, second, third = (a["summary"] for a in answers)
    assert first["pit_flagged"] is False and first["pit_step"] == 1
    assert second["pit"][1] is None and second["pit_flags"] == [False, False]
    assert third["pit_flagged"] is True and third["pit_flags"] == [True, False] and third["pit"][0] > 0.99
    assert doc["summary"]["pit"] == third["pit"] and doc["summary"]["pit_flagged"] is True
    assert refused.status_code == 422 and "pit_alert" in refused.text


def test_particle_methods_report_pit_for_every_family(redis_url):
    sv = {"family": "stochastic_volatility", "params": {"phi": 0.9}}
    gauss = {"type": "gaussian", "mean": [0.0, 0.0], "cov": [[0.5, 0.0], [0.0, 0.5]]}

    async def body(app, client):
        out = {}
        for method in ("smc", "mpf", "gpf"):
            r = await client.post(
                "/v1/streams", json={"model": sv, "prior": gauss, "method": method, "num_particles": 64, "seed": 1}
            )
            sid = r.json()["stream_id"]
            r = await client.post(f"/v1/streams/{sid}/observations", json={"observations": [[0.1, 25.0]]})
            out[method] = r.json()
        return out

    for method, answer in run(redis_url, body).items():
        pit = answer["per_step"][0]["pit"]
        assert 0.2 < pit[0] < 0.8 and pit[1] > 0.999, (method, pit)  # 25 is ~ 30 sd of exp(x/2) above 0
        assert answer["summary"]["pit_flagged"] is True


def test_the_summary_keeps_the_latest_observed_steps_values_past_steps_without_a_measurement(redis_url):
    """A request whose last step has no measurement (``null``), and one of such steps alone, leave the summary's
    ``pit`` at the latest observed step (docs/API.md), for an exact and a Monte Carlo method (the summary once took
    the request's last step: none after one request, an older request's values after several)."""

    async def body(app, client):
        out = {}
        for method in ("kalman", "smc"):
            spec = {"model": MODEL, "prior": PRIOR, "method": method, "num_particles": 64, "seed": 3}
            sid = (await client.post("/v1/streams", json=spec)).json()["stream_id"]
            r = await client.post(f"/v1/streams/{sid}/observations", json={"observations": [*OBS, None]})
            assert r.status_code == 200, r.text
            r2 = await client.post(f"/v1/streams/{sid}/observations", json={"observations": [None, None]})
            assert r2.status_code == 200, r2.text
            doc = (await client.get(f"/v1/streams/{sid}")).json()
            out[method] = r.json(), r2.json()["summary"], doc["summary"]
        return out

    for method, (answer, later, now) in run(redis_url, body).items():
        third = answer["per_step"][2]["pit"]
        assert answer["summary"]["pit_step"] == 3 and answer["summary"]["pit"] == third, (method, answer["summary"])
        assert answer["summary"]["pit_flagged"] is True and third[0] > 0.99, method
        for summary in (later, now):
            assert (summary["pit_step"], summary["pit"], summary["pit_flagged"]) == (3, third, True), (method, summary)

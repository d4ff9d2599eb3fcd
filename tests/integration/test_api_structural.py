"""The ``structural`` family over HTTP against a real Redis (issue 56): a stream of level + trend + a daily season
with timestamps in seconds, created without a method (``kalman``, the default) and fed irregular ``dt``; its answers
equal the float64 reference filter of tests/unit/test_structural.py; bad components are 422 naming the field."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tests.integration.test_api_streams import run
from tests.unit.test_structural import discretise, reference_filter, simulate

DAY = 86400.0
PARAMS = {
    "level_sd": 0.5 / math.sqrt(DAY),
    "trend_sd": 0.01 / DAY,
    "seasonal": [{"period": DAY, "harmonics": 2, "sd": 0.05 / math.sqrt(DAY)}],
    "R": 0.09,
}
D = 6
PRIOR = {"type": "gaussian", "mean": [0.0] * D, "cov": np.diag([25.0, 1e-10, 4.0, 4.0, 4.0, 4.0]).tolist()}


def test_a_structural_stream_filters_irregular_steps_exactly_with_kalman_by_default(redis_url):
    rng = np.random.default_rng(3)
    dts = rng.exponential(1800.0, 30) + 1.0
    _, obs = simulate(PARAMS, np.array([5.0, 0.0, 1.5, 0.5, 0.2, -0.1]), dts, seed=6)
    steps = [{"value": float(o), "dt": float(dt)} for o, dt in zip(obs, dts, strict=True)]
    steps[7] = {"value": None, "dt": steps[7]["dt"]}  # a step without a measurement: the transition only
    m0, P0 = np.array(PRIOR["mean"]), np.array(PRIOR["cov"])

    async def body(app, client):
        req = {"stream_id": "st", "model": {"family": "structural", "params": PARAMS}, "prior": PRIOR, "seed": 1}
        r = await client.post("/v1/streams", json=req)
        assert r.status_code == 201, r.text
        per_step = []
        for i in range(0, len(steps), 5):
            r = await client.post("/v1/streams/st/observations", json={"observations": steps[i : i + 5]})
            assert r.status_code == 200, r.text
            per_step += r.json()["per_step"]
        doc = (await client.get("/v1/streams/st")).json()
        models = (await client.get("/v1/models")).json()
        return per_step, doc, models

    per_step, doc, models = run(redis_url, body)
    assert doc["method"] == "kalman" and doc["step"] == len(steps)
    assert doc["state_names"] == ["level", "slope", "harmonic[0]", "harmonic[0]*", "harmonic[1]", "harmonic[1]*"]
    entry = next(f for f in models["families"] if f["family"] == "structural")
    assert [p["name"] for p in entry["parameters"]] == ["level_sd", "trend_sd", "seasonal", "R"]
    assert "kalman" in entry["methods"]
    # the reference, with step 7 a prediction only
    means, incs = [], []
    m, P = m0, P0
    for i, (o, dt) in enumerate(zip(obs, dts, strict=True)):
        if i == 7:
            A, Q = discretise(PARAMS, dt)
            m, P = A @ m, A @ P @ A.T + Q
            means.append(m)
            incs.append(None)
            continue
        ms, Ps, inc = reference_filter(PARAMS, m, P, [o], [dt])
        m, P = ms[0], Ps[0]
        means.append(m)
        incs.append(float(inc[0]))
    for p, want, inc in zip(per_step, means, incs, strict=True):
        np.testing.assert_allclose(p["mean"], want, rtol=1e-5, atol=1e-5 * max(1.0, np.abs(want).max()))
        if inc is None:
            assert p["log_evidence_increment"] is None
        else:
            assert p["log_evidence_increment"] == pytest.approx(inc, abs=1e-5)
    np.testing.assert_allclose(doc["summary"]["mean"], means[-1], rtol=1e-5, atol=1e-5)
    assert doc["summary"]["log_evidence"] == pytest.approx(sum(i for i in incs if i is not None), abs=1e-4)


@pytest.mark.parametrize(
    "params,d,field",
    [
        ({"seasonal": [{"period": 0, "harmonics": 1}]}, 3, "model.params.seasonal[0].period"),
        ({"seasonal": [{"period": 24, "harmonics": 20}]}, 41, "model.params.seasonal[0].harmonics"),
        ({"level_sd": -1}, 1, "model.params.level_sd"),
        ({"trend_sd": 0.1}, 3, "prior: the structural model of model.params has a 2-dimensional state"),
    ],
)
def test_bad_components_are_422_naming_the_field(redis_url, params, d, field):
    prior = {"type": "gaussian", "mean": [0.0] * d, "cov": np.eye(d).tolist()}

    async def body(app, client):
        req = {"model": {"family": "structural", "params": params}, "prior": prior, "method": "kalman"}
        return await client.post("/v1/streams", json=req)

    r = run(redis_url, body)
    assert r.status_code == 422, r.text
    assert r.json()["error"]["message"].startswith(field), r.json()

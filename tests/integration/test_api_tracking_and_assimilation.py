"""``range_bearing`` and ``lorenz96`` through the REST API with the methods that run them: created, observed (a full
step, a range-only step, a step without a detection), read back, and the methods that cannot run them refused with 422
naming the method."""

from __future__ import annotations

import httpx
from fastapi import FastAPI

from tests.integration.test_api_streams import run

TRACK = {
    "model": {"family": "range_bearing", "params": {"sensor": [0.0, 0.0], "range_sd": 0.5, "bearing_sd": 0.05}},
    "prior": {
        "type": "gaussian",
        "mean": [-10.0, 0.5, 0.0, -1.0],
        "cov": [[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 0.25, 0], [0, 0, 0, 0.25]],
    },
    "num_particles": 128,
    "seed": 5,
}
# across the sensor's back axis: bearing 3.1 then −3.1; then a range alone; then no detection
TRACK_OBS = [[10.0, 3.1], [10.1, -3.1], [10.2, None], None]

L96_PRIOR = {
    "type": "gaussian",
    "mean": [8.0, 1.0, 2.0, 3.0, 4.0, 5.0],
    "cov": [[float(i == j) for j in range(6)] for i in range(6)],
}
L96 = {"model": {"family": "lorenz96", "params": {"obs_every": 2}}, "prior": L96_PRIOR, "num_particles": 32, "seed": 1}


def test_range_bearing_and_lorenz96_streams_run_through_the_api(redis_url):
    async def body(app: FastAPI, c: httpx.AsyncClient):
        models = {f["family"]: f for f in (await c.get("/v1/models")).json()["families"]}
        assert {"ukf", "enkf", "smc", "mpf", "gpf"} <= set(models["range_bearing"]["methods"])
        assert models["range_bearing"]["state_dim"] == {"fixed": 4, "min": 4, "max": 4}
        assert models["lorenz96"]["state_dim"]["min"] == 4
        for family, spec, obs in (("range_bearing", TRACK, TRACK_OBS), ("lorenz96", L96, [[1.0, None, 2.0], None])):
            for method in models[family]["methods"]:
                label = f"{family}/{method}"
                r = await c.post("/v1/streams", json={**spec, "method": method})
                assert r.status_code == 201, (label, r.text)
                sid = r.json()["stream_id"]
                r = await c.post(f"/v1/streams/{sid}/observations", json={"observations": obs})
                assert r.status_code == 200, (label, r.text)
                doc = r.json()
                assert doc["step"] == len(obs), label
                assert doc["per_step"][-1]["log_evidence_increment"] == 0.0, label  # the step without a measurement
        for method in ("gpf", "kalman"):
            r = await c.post("/v1/streams", json={**L96, "method": method})
            assert r.status_code == 422 and "lorenz96" in r.text and method in r.text, r.text
        r = await c.post("/v1/streams", json={**L96, "method": "enkf", "method_options": {"localisation": 2.0}})
        assert r.status_code == 201, r.text

    run(redis_url, body)

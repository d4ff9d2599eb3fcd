"""``range_bearing`` and ``lorenz96`` through the REST API with the methods that run them: created, observed (a full
step, a range-only step, a step without a detection), read back, and the methods that cannot run them refused with 422
naming the method."""

from __future__ import annotations

import httpx
from fastapi import FastAPI

from tests.harness.specs import SHORT_SOLVERS
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
                assert doc["per_step"][-1]["log_evidence_increment"] is None, label  # the step without a measurement
        for method in ("gpf", "kalman"):
            r = await c.post("/v1/streams", json={**L96, "method": method})
            assert r.status_code == 422 and "lorenz96" in r.text and method in r.text, r.text
        r = await c.post("/v1/streams", json={**L96, "method": "enkf", "method_options": {"localisation": 2.0}})
        assert r.status_code == 201, r.text
        # the corrected flow with a share of the likelihood weighted (a linear observation): a partial observation
        # and a gap; where the observation is nonlinear (arctan, range-bearing) a 422 names the option
        split = {"correct": True, "flow_fraction": 0.5}
        r = await c.post("/v1/streams", json={**L96, "method": "mpf", "method_options": split})
        assert r.status_code == 201 and r.json()["method_options"] == split, r.text
        r = await c.post(
            f"/v1/streams/{r.json()['stream_id']}/observations", json={"observations": [[1.0, None, 2.0], None]}
        )
        assert r.status_code == 200 and 1 <= r.json()["per_step"][0]["ess"] <= 32, r.text
        arctan = {**L96, "model": {"family": "lorenz96", "params": {"obs_every": 2, "arctan": 1}}}
        for spec in (arctan, TRACK):
            r = await c.post("/v1/streams", json={**spec, "method": "mpf", "method_options": split})
            assert r.status_code == 422 and "method_options.flow_fraction" in r.text, r.text
        r = await c.post("/v1/streams", json={**L96, "method": "mpf", "method_options": {"flow_fraction": 0.5}})
        assert r.status_code == 422 and "set correct to true" in r.text, r.text
        # the automatic share: weights carried, each step says which share it took and whether it rescued the cloud
        auto = {"correct": True, "flow_fraction": "auto", "ess_threshold": 0.3, "rejuvenate": "always"}
        r = await c.post("/v1/streams", json={**L96, "method": "mpf", "method_options": auto})
        assert r.status_code == 201 and r.json()["method_options"] == auto, r.text
        sid = r.json()["stream_id"]
        r = await c.post(f"/v1/streams/{sid}/observations", json={"observations": [[8.5, 2.0, 4.0], [1.0, None, 2.0]]})
        assert r.status_code == 200, r.text
        for entry in r.json()["per_step"]:
            assert 0 <= entry["flow_fraction"] < 1 and isinstance(entry["rescued"], bool), entry
        particles = (await c.get(f"/v1/streams/{sid}/particles")).json()
        samples = (await c.get(f"/v1/streams/{sid}/samples", params={"n": 50})).json()["samples"]
        assert len(particles["log_weights"]) == 32 and len(samples) == 50
        assert all(s in particles["particles"] for s in samples)  # weighted clouds are drawn by resampling
        for bad in ("Auto", "yes"):
            r = await c.post(
                "/v1/streams", json={**L96, "method": "mpf", "method_options": {**auto, "flow_fraction": bad}}
            )
            assert r.status_code == 422 and "method_options.flow_fraction" in r.text, r.text

    run(redis_url, body, method_options=SHORT_SOLVERS)  # 4 steps a request: gpf at its default takes 2


def test_a_range_bearing_stream_without_a_method_gets_the_corrected_flow(redis_url):
    """The measured default (service/engine/default_methods.json, benchmarks.range_bearing): mpf with correct at N =
    512,
    the base flow (the trained range_bearing-d4-v1 serves only when named), through a crossing of the back axis, a
    range alone and a step without a detection."""

    async def body(app: FastAPI, c: httpx.AsyncClient):
        spec = {k: v for k, v in TRACK.items() if k != "num_particles"}
        r = await c.post("/v1/streams", json=spec)
        assert r.status_code == 201, r.text
        doc = r.json()
        assert (doc["method"], doc["num_particles"], doc.get("operator")) == ("mpf", 512, None), doc
        assert doc["method_options"] == {"correct": True}, doc
        r = await c.post(f"/v1/streams/{doc['stream_id']}/observations", json={"observations": TRACK_OBS})
        assert r.status_code == 200, r.text
        steps = r.json()["per_step"]
        assert all(0 < s["ess"] <= 512 for s in steps[:3]), steps
        named = await c.post("/v1/streams", json={**TRACK, "operator": "range_bearing-d4-v1"})
        assert named.status_code == 201 and named.json()["operator"] == "range_bearing-d4-v1", named.text

    run(redis_url, body)


def test_a_corrected_mpf_stream_runs_the_base_flow_where_an_operator_would_fit(redis_url):
    """gmm d = 2 has an operator the server picks for a plain mpf stream (gmm-d2-v4); a stream asking for the
    corrected flow gets the base flow instead of a 422 about an operator it never named; naming both is refused."""

    async def body(app: FastAPI, c: httpx.AsyncClient):
        spec = {"model": {"family": "gmm"}, "prior": {"type": "gaussian", "mean": [0.0, 0.0], "cov": [[1, 0], [0, 1]]}}
        plain = await c.post("/v1/streams", json={**spec, "method": "mpf"})
        assert plain.status_code == 201 and plain.json()["operator"] == "gmm-d2-v4", plain.text
        r = await c.post("/v1/streams", json={**spec, "method": "mpf", "method_options": {"correct": True}})
        assert r.status_code == 201, r.text
        assert r.json()["operator"] is None and r.json()["method_options"] == {"correct": True}, r.json()
        r = await c.post(f"/v1/streams/{r.json()['stream_id']}/observations", json={"observations": [0.5, 1.0]})
        assert r.status_code == 200, r.text
        named = {**spec, "operator": "gmm-d2-v4", "method_options": {"correct": True}}
        r = await c.post("/v1/streams", json=named)
        assert r.status_code == 422 and "method_options.correct" in r.text, r.text

    run(redis_url, body)


def test_a_lorenz96_stream_without_a_method_gets_the_measured_default_where_it_runs(redis_url):
    """The measured default for Lorenz-96 at d = 10 (benchmarks.lorenz96 on Bocquet 2010) is the corrected flow with
    its share chosen per step, which needs a linear observation: with ``arctan`` the stream gets smc instead, and
    its method_reason says why."""
    eye = [[float(i == j) for j in range(10)] for i in range(10)]
    prior = {"type": "gaussian", "mean": [8.0] + [1.0] * 9, "cov": eye}

    async def body(app: FastAPI, c: httpx.AsyncClient):
        linear = {"model": {"family": "lorenz96", "params": {"obs_every": 2, "R": 1.5}}, "prior": prior, "seed": 3}
        r = await c.post("/v1/streams", json=linear)
        assert r.status_code == 201, r.text
        doc = r.json()
        assert doc["method"] == "mpf" and doc["method_options"]["flow_fraction"] == "auto", doc
        r = await c.post(f"/v1/streams/{doc['stream_id']}/observations", json={"observations": [[8.0] * 5, None]})
        assert r.status_code == 200 and "rescued" in r.json()["per_step"][0], r.text
        arctan = {**linear, "model": {"family": "lorenz96", "params": {"obs_every": 2, "arctan": 1}}}
        r = await c.post("/v1/streams", json=arctan)
        assert r.status_code == 201, r.text
        doc = r.json()
        assert doc["method"] == "smc" and "does not run these parameters" in doc["method_reason"], doc
        assert "options.flow_fraction" in doc["method_reason"], doc
        # the request's own options count: a share the model can run keeps the default; others go to smc
        r = await c.post("/v1/streams", json={**arctan, "method_options": {"flow_fraction": 1}})
        assert r.status_code == 201 and r.json()["method"] == "mpf", r.text
        assert r.json()["method_options"]["flow_fraction"] == 1, r.text
        r = await c.post("/v1/streams", json={**arctan, "method_options": {"ess_threshold": 0.4}})
        assert r.status_code == 201 and r.json()["method"] == "smc", r.text
        r = await c.post("/v1/streams", json={**arctan, "method_options": {"flow_fraction": "x"}})
        assert r.status_code == 422 and "method_options.flow_fraction" in r.text, r.text

    run(redis_url, body)

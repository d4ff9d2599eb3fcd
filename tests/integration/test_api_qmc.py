"""Sequential quasi-Monte Carlo through the HTTP API against a real Redis (``smc``'s ``method_options.qmc``, ``mpf``'s
``method_options.marginal``):

* an ``smc`` stream on the one-dimensional stochastic-volatility model with ``qmc: true`` and a smoothing window
  takes observations (per-step increments and pit values), answers ``GET .../smoothed``, and its snapshot, imported
  under another id, answers the next observations exactly as the original does (the points are drawn from the
  stream's own generator: nothing else carries over);
* an ``mpf`` stream with ``marginal: true`` on SV d = 5 (five one-dimensional problems) steps, and its snapshot,
  imported under another id, answers the next observations exactly as the original does (the weighted cloud it
  carries between steps travels in the snapshot);
* an ``smc`` stream on SV d = 3 runs one filter per dimension (``factorise``), carries its weighted cloud in its
  stored state and snapshot, and follows the grid filter's increments;
* a value that is not ``"auto"``, true or false, and ``true`` where the scheme does not apply (a two-dimensional
  ``lds``), are refused with a 422 naming the field.
"""

from __future__ import annotations

import math

import torch
from mpflow.operators.models import make_model
from mpflow.operators.references.grid import diagonal_grid_evidence
from mpflow.service.streams.snapshots import MEDIA_TYPE

from tests.integration.test_api_streams import GAUSS2, run

SV = {"family": "stochastic_volatility", "params": {"mu": -1.0, "phi": 0.95, "sigma": 0.3}}
SV_PRIOR = {"type": "gaussian", "mean": [-1.0], "cov": [[0.9]]}
RETURNS = [[0.3], [-0.8], [1.9], [0.1], [-0.2], [0.6], [-2.4], [0.05]]
LDS2 = {"family": "lds", "params": {"A": [[0.9, 0.1], [0.0, 0.9]], "B": [[1.0, 0.0], [0.0, 1.0]]}}


def test_qmc_stream_steps_smooths_and_resumes_from_its_snapshot(redis_url):
    async def body(app, client):
        create = {"model": SV, "prior": SV_PRIOR, "method": "smc", "num_particles": 512, "seed": 4}
        r = await client.post(
            "/v1/streams", json={**create, "stream_id": "q", "method_options": {"qmc": True}, "smoothing_lag": 4}
        )
        assert r.status_code == 201, r.text
        first = await client.post("/v1/streams/q/observations", json={"observations": RETURNS[:6]})
        assert first.status_code == 200, first.text
        smoothed = await client.get("/v1/streams/q/smoothed")
        assert smoothed.status_code == 200, smoothed.text
        snapshot = (await client.get("/v1/streams/q/export")).content
        r = await client.post("/v1/streams:import?stream_id=q2", content=snapshot, headers={"content-type": MEDIA_TYPE})
        assert r.status_code == 201, r.text
        later = []
        for sid in ("q", "q2"):
            r = await client.post(f"/v1/streams/{sid}/observations", json={"observations": RETURNS[6:]})
            assert r.status_code == 200, r.text
            later.append(r.json())
        return first.json(), smoothed.json(), later

    first, smoothed, (original, copy) = run(redis_url, body)
    steps = first["per_step"]
    assert len(steps) == 6
    assert all(math.isfinite(s["log_evidence_increment"]) and 0 < s["pit"][0] < 1 for s in steps)
    assert [s["step"] for s in smoothed["steps"]] == [3, 4, 5, 6]
    assert all(math.isfinite(s["mean"][0]) and s["cov"][0][0] > 0 for s in smoothed["steps"])
    assert [s["log_evidence_increment"] for s in original["per_step"]] == [
        s["log_evidence_increment"] for s in copy["per_step"]
    ]
    assert original["summary"]["mean"] == copy["summary"]["mean"]


def test_marginal_mpf_steps_and_resumes_its_weighted_cloud_from_a_snapshot(redis_url):
    """The marginal filter carries its weighted cloud between steps in the stream's stored state: a stream stepped
    in two requests answers exactly as one given all four observations in one (a store that lost the carried cloud
    would start the third step's mixture predictive from the resampled particles and differ), and a snapshot taken
    between the requests, imported under another id, answers the next observations — and their standard errors
    ``log_evidence_sd`` — as the original does."""

    async def body(app, client):
        prior = {
            "type": "gaussian",
            "mean": [-1.0] * 5,
            "cov": [[0.9 if i == j else 0.0 for j in range(5)] for i in range(5)],
        }
        for sid in ("m", "whole"):
            r = await client.post(
                "/v1/streams",
                json={
                    "stream_id": sid,
                    "model": SV,
                    "prior": prior,
                    "method": "mpf",
                    "num_particles": 128,
                    "seed": 1,
                    "method_options": {"marginal": True},
                },
            )
            assert r.status_code == 201, r.text
        obs = [[0.2, -0.5, 1.4, 0.0, -0.9], [2.5, 0.1, -0.3, 0.4, 0.2]]
        first = (await client.post("/v1/streams/m/observations", json={"observations": obs})).json()
        snapshot = (await client.get("/v1/streams/m/export")).content
        r = await client.post("/v1/streams:import?stream_id=m2", content=snapshot, headers={"content-type": MEDIA_TYPE})
        assert r.status_code == 201, r.text
        later = [[-1.9, 0.3, 0.0, 2.2, -0.1], [0.4, -0.2, 0.7, -0.6, 3.0]]
        answers = []
        for sid in ("m", "m2"):
            r = await client.post(f"/v1/streams/{sid}/observations", json={"observations": later})
            assert r.status_code == 200, r.text
            answers.append(r.json())
        whole = (await client.post("/v1/streams/whole/observations", json={"observations": obs + later})).json()
        return first, answers, whole

    first, (original, copy), whole = run(redis_url, body)
    assert [math.isfinite(s["log_evidence_increment"]) for s in first["per_step"]] == [True, True]
    increments = [s["log_evidence_increment"] for s in original["per_step"]]
    assert all(math.isfinite(v) for v in increments)
    assert increments == [s["log_evidence_increment"] for s in copy["per_step"]]
    assert increments == [s["log_evidence_increment"] for s in whole["per_step"][2:]]
    assert original["summary"]["mean"] == copy["summary"]["mean"]
    # each step's standard error, the carried cloud's share included, answers with it (and resumes with the cloud)
    sds = [s["log_evidence_sd"] for s in original["per_step"]]
    assert all(0 < v < 1 for v in sds), sds
    assert sds == [s["log_evidence_sd"] for s in copy["per_step"]]


def test_factorised_smc_carries_its_weighted_cloud_and_follows_the_grid(redis_url):
    """An ``smc`` stream on SV d = 3 runs one filter per dimension by default (``factorise: "auto"``): stepped in two
    requests — a partly observed step and one with nothing observed among them — it answers as a stream given
    everything in one (the weighted cloud it carries is in the stored state: resampled particles would differ), a
    snapshot of it imported under another id answers the next observations as it does, it smooths, and on fully observed
    returns with a 5-sd one its increments are within 0.05 nat of the per-dimension grid filter's at every step."""
    prior = {
        "type": "gaussian",
        "mean": [-1.0] * 3,
        "cov": [[0.9 if i == j else 0.0 for j in range(3)] for i in range(3)],
    }
    obs = [[0.2, -0.5, 1.4], [None, 0.1, -0.3], None, [2.5, 0.1, -0.3]]
    later = [[-1.9, 0.3, 0.0], [0.4, None, 0.7]]
    returns = [
        [0.3, -0.8, 0.1],
        [-0.2, 0.6, 0.05],
        [0.5, 0.2, -0.4],
        [3.0, -0.1, 0.3],
        [0.7, 0.4, -0.2],
        [-1.2, 0.1, 0.2],
    ]

    async def body(app, client):
        create = {"model": SV, "prior": prior, "method": "smc", "seed": 2}
        for sid, n, lag in (("f", 1024, 3), ("whole", 1024, 3), ("grid", 4096, 0)):
            r = await client.post(
                "/v1/streams", json={**create, "stream_id": sid, "num_particles": n, "smoothing_lag": lag}
            )
            assert r.status_code == 201, r.text
        first = (await client.post("/v1/streams/f/observations", json={"observations": obs})).json()
        snapshot = (await client.get("/v1/streams/f/export")).content
        r = await client.post("/v1/streams:import?stream_id=f2", content=snapshot, headers={"content-type": MEDIA_TYPE})
        assert r.status_code == 201, r.text
        answers = []
        for sid in ("f", "f2"):
            r = await client.post(f"/v1/streams/{sid}/observations", json={"observations": later})
            assert r.status_code == 200, r.text
            answers.append(r.json())
        whole = (await client.post("/v1/streams/whole/observations", json={"observations": obs + later})).json()
        graded = (await client.post("/v1/streams/grid/observations", json={"observations": returns})).json()
        smoothed = await client.get("/v1/streams/f/smoothed")
        assert smoothed.status_code == 200, smoothed.text
        return first, answers, whole, graded, smoothed.json()

    first, (original, copy), whole, graded, smoothed = run(redis_url, body)
    assert [s["step"] for s in smoothed["steps"]] == [4, 5, 6]
    assert all(math.isfinite(m) for s in smoothed["steps"] for m in s["mean"])
    assert all(math.isfinite(s["log_evidence_increment"]) for k, s in enumerate(first["per_step"]) if k != 2)
    assert first["per_step"][2]["log_evidence_increment"] is None  # nothing observed: no score
    increments = [s["log_evidence_increment"] for s in original["per_step"]]
    assert increments == [s["log_evidence_increment"] for s in copy["per_step"]]
    assert increments == [s["log_evidence_increment"] for s in whole["per_step"][4:]]
    assert original["summary"]["mean"] == copy["summary"]["mean"] == whole["summary"]["mean"]
    model = make_model("stochastic_volatility", SV["params"], 3, torch.float64)
    exact = diagonal_grid_evidence(
        model, torch.full((3,), -1.0, dtype=torch.float64), torch.full((3,), 0.9, dtype=torch.float64),
        torch.tensor([returns], dtype=torch.float64),
    )[2][0]  # fmt: skip
    got = torch.tensor([s["log_evidence_increment"] for s in graded["per_step"]], dtype=torch.float64)
    assert float((got - exact).abs().max()) < 0.05, (got - exact).tolist()


def test_bad_values_and_inapplicable_requests_are_refused_naming_the_field(redis_url):
    async def body(app, client):
        sv = {"model": SV, "prior": SV_PRIOR}
        lds = {"model": LDS2, "prior": GAUSS2}
        return [
            await client.post("/v1/streams", json={**sv, "method": "smc", "method_options": {"qmc": "yes"}}),
            await client.post("/v1/streams", json={**lds, "method": "smc", "method_options": {"qmc": True}}),
            await client.post("/v1/streams", json={**sv, "method": "mpf", "method_options": {"marginal": 2}}),
            await client.post("/v1/streams", json={**lds, "method": "mpf", "method_options": {"marginal": True}}),
            await client.post("/v1/streams", json={**sv, "method": "smc", "method_options": {"factorise": "yes"}}),
            await client.post("/v1/streams", json={**lds, "method": "smc", "method_options": {"factorise": True}}),
            await client.post("/v1/streams", json={**lds, "method": "smc", "method_options": {"qmc": "auto"}}),
        ]

    *refused, auto_on_2d = run(redis_url, body)
    fields = ["qmc", "qmc", "marginal", "marginal", "factorise", "factorise"]
    for r, field in zip(refused, fields, strict=True):
        assert r.status_code == 422, r.text
        assert f"method_options.{field}" in r.text, r.text
    assert auto_on_2d.status_code == 201, auto_on_2d.text  # "auto": the bootstrap filter where SQMC does not apply

"""``kalman``'s ``outlier_clip`` through the HTTP API against a real Redis (issue 56): a stream created with
``method_options.outlier_clip`` keeps its level through a 30-sd spike (an exact stream's jumps most of the way to
it) while reporting the same evidence and surprise for the spike, and the next ordinary reading is not anomalous; a
bad value is a 422 naming the option, and nothing is created."""

from __future__ import annotations

from tests.integration.test_api_streams import run

MODEL = {"family": "lds", "params": {"A": [[1.0]], "Q": [[0.01]], "B": [[1.0]], "R": [[1.0]]}}
PRIOR = {"type": "gaussian", "mean": [0.0], "cov": [[1.0]]}
READINGS = [0.2, -0.4, 0.1, 0.5, -0.3, 0.0, 0.3, -0.2, 30.0, 0.1]


def test_a_clipped_stream_keeps_its_level_through_a_spike(redis_url):
    async def body(app, client):
        out = {}
        for name, options in (("exact", {}), ("clipped", {"outlier_clip": 3})):
            created = await client.post(
                "/v1/streams",
                json={"model": MODEL, "prior": PRIOR, "method": "kalman", "method_options": options, "seed": 0},
            )
            assert created.status_code == 201, created.text
            sid = created.json()["stream_id"]
            answer = await client.post(f"/v1/streams/{sid}/observations", json={"observations": READINGS})
            assert answer.status_code == 200, answer.text
            out[name] = answer.json()["per_step"]
        bad = await client.post(
            "/v1/streams",
            json={"model": MODEL, "prior": PRIOR, "method": "kalman", "method_options": {"outlier_clip": 0}},
        )
        listed = (await client.get("/v1/streams")).json()
        return out, bad, listed

    out, bad, listed = run(redis_url, body)
    exact, clipped = out["exact"], out["clipped"]
    spike = READINGS.index(30.0)
    assert exact[spike]["mean"][0] > 3.0 and abs(clipped[spike]["mean"][0]) < 0.5
    assert clipped[spike]["log_evidence_increment"] == exact[spike]["log_evidence_increment"]
    assert clipped[spike]["surprise"] == exact[spike]["surprise"] > 100
    after = spike + 1
    assert clipped[after]["surprise"] < 3.0 < exact[after]["surprise"]  # the exact stream now mistrusts 0.1
    assert bad.status_code == 422 and "outlier_clip" in bad.text
    assert len(listed["streams"]) == 2  # the refused stream was not created

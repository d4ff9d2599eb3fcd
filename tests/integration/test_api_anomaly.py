"""Log tails, surprise and the anomaly score through the HTTP API against a real Redis (issue 56): on a ``kalman``
stream of N(0, 1)-like readings with one 20-sd spike, the spike's surprise is far beyond what a saturated p-value
could say (> 100 nats, pit exactly 1.0) and its anomaly score is the stream's highest (> 0.99); scores are null
during the warm-up and rank each step against the earlier steps of its own request too; the summary, the history
and the dashboard's feed carry the fields; a bad ``anomaly_memory``/``anomaly_warmup`` is a 422 naming the field;
and a snapshot round trip keeps the stream's surprise history (the copy scores the next step exactly as the
original)."""

from __future__ import annotations

import json

import numpy as np
from mpflow.operators.state import read_metadata
from mpflow.service.streams.snapshots import MEDIA_TYPE

from tests.integration.test_api_streams import run

#: x' = 0.5 x + N(0, 0.1), o = x + N(0, 1): the predictive sd settles near 1.05
MODEL = {"family": "lds", "params": {"A": [[0.5]], "Q": [[0.1]], "B": [[1.0]], "R": [[1.0]]}}
PRIOR = {"type": "gaussian", "mean": [0.0], "cov": [[1.0]]}
SPIKE_AT = 45  # 0-based index of the spike among the readings


def readings() -> list[float]:
    rng = np.random.default_rng(11)
    values = rng.normal(0.0, 1.0, 60).tolist()
    values[SPIKE_AT] = 22.0  # about 20 predictive sd
    return values


def test_a_spike_has_the_highest_score_and_every_view_carries_it(redis_url):
    values = readings()

    async def body(app, client):
        created = await client.post("/v1/streams", json={"model": MODEL, "prior": PRIOR, "method": "kalman", "seed": 1})
        assert created.status_code == 201, created.text
        sid = created.json()["stream_id"]
        answers = [await client.post(f"/v1/streams/{sid}/observations", json={"observations": values[:30]})]
        for v in values[30:]:
            answers.append(await client.post(f"/v1/streams/{sid}/observations", json={"observations": [v]}))
        assert all(a.status_code == 200 for a in answers), [a.text for a in answers if a.status_code != 200]
        gap = await client.post(f"/v1/streams/{sid}/observations", json={"observations": [None]})
        doc = (await client.get(f"/v1/streams/{sid}")).json()
        history = (await client.get(f"/v1/streams/{sid}/history")).json()
        bad = {
            field: [
                await client.post("/v1/streams", json={"model": MODEL, "prior": PRIOR, field: value})
                for value in (-1, 10**9, "x", 1.5)
            ]
            for field in ("anomaly_memory", "anomaly_warmup")
        }
        forgetting = await client.post(
            "/v1/streams", json={"model": MODEL, "prior": PRIOR, "anomaly_memory": 10, "anomaly_warmup": 0}
        )
        fsid = forgetting.json()["stream_id"]
        fanswer = await client.post(f"/v1/streams/{fsid}/observations", json={"observations": values[:50]})
        return [a.json() for a in answers], gap.json(), doc, history, bad, fanswer.json()

    answers, gap, doc, history, bad, fanswer = run(redis_url, body)
    steps = [e for a in answers for e in a["per_step"]]
    assert len(steps) == 60
    for e in steps:
        assert {"log_tail_lower", "log_tail_upper", "surprise", "anomaly_score"} <= set(e)
        assert e["surprise"] >= 0 and all(v <= 0 for v in e["log_tail_lower"] + e["log_tail_upper"])
    # warm-up: the first 20 steps unscored, the 21st — within the first request — ranked against the 20 before it
    assert [e["anomaly_score"] for e in steps[:20]] == [None] * 20
    assert all(e["anomaly_score"] is not None for e in steps[20:])
    spike = steps[SPIKE_AT]
    assert spike["pit"] == [1.0]  # saturated; the log tails and the surprise are not
    assert spike["log_tail_upper"][0] < -150 and spike["surprise"] > 100
    assert spike["anomaly_score"] > 0.99
    assert spike["anomaly_score"] == max(e["anomaly_score"] for e in steps[20:])
    assert spike["surprise"] > max(e["surprise"] for i, e in enumerate(steps) if i != SPIKE_AT)
    # a step with nothing observed: no surprise, no score, and the summary keeps the latest observed step's
    assert gap["per_step"][0]["surprise"] is None and gap["per_step"][0]["anomaly_score"] is None
    last = steps[-1]
    for field in ("log_tail_lower", "log_tail_upper", "surprise", "anomaly_score"):
        assert doc["summary"][field] == last[field], field
    assert doc["summary"]["pit_step"] == 60
    kept = {e["step"]: e for e in history["steps"]}
    assert kept[SPIKE_AT + 1]["surprise"] == spike["surprise"]
    assert kept[SPIKE_AT + 1]["anomaly_score"] == spike["anomaly_score"]
    assert kept[61]["surprise"] is None
    for field, answers_ in bad.items():
        for r in answers_:
            assert r.status_code == 422 and field in r.text, (field, r.status_code, r.text)
    fscores = [e["anomaly_score"] for e in fanswer["per_step"]]
    assert fscores[0] is None and all(0.0 <= s <= 1.0 for s in fscores[1:])


def test_a_snapshot_keeps_the_surprise_history(redis_url):
    values = readings()[:40]

    async def body(app, client):
        created = await client.post(
            "/v1/streams",
            json={"model": MODEL, "prior": PRIOR, "method": "kalman", "seed": 4, "anomaly_memory": 500},
        )
        sid = created.json()["stream_id"]
        r = await client.post(f"/v1/streams/{sid}/observations", json={"observations": values})
        assert r.status_code == 200, r.text
        snapshot = (await client.get(f"/v1/streams/{sid}/export")).content
        imported = await client.post(
            f"/v1/streams:import?stream_id={sid}-copy", content=snapshot, headers={"content-type": MEDIA_TYPE}
        )
        assert imported.status_code == 201, imported.text
        original = (await client.get(f"/v1/streams/{sid}")).json()
        nexts = [
            (await client.post(f"/v1/streams/{target}/observations", json={"observations": [3.5]})).json()
            for target in (sid, f"{sid}-copy")
        ]
        again = (await client.get(f"/v1/streams/{sid}-copy/export")).content
        return snapshot, imported.json(), original, nexts, again

    snapshot, imported, original, nexts, again = run(redis_url, body)
    stream = json.loads(read_metadata(snapshot)["stream"])
    assert stream["anomaly_memory"] == 500 and stream["anomaly_warmup"] == 20
    assert stream["anomaly_state"]["surprise"]["n"] == 40
    assert imported["summary"] == original["summary"]
    a, b = (n["per_step"][0] for n in nexts)
    assert a["anomaly_score"] is not None
    assert a["anomaly_score"] == b["anomaly_score"] and a["surprise"] == b["surprise"]
    assert json.loads(read_metadata(again)["stream"])["anomaly_state"]["surprise"]["n"] == 41

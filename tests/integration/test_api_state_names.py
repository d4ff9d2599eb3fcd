"""``state_names`` set at creation and ``untrained`` in the stream document, end to end (in process, real Redis, as
``test_api_streams``): the names in the stream document, the observation answer and the forecast; a request's bad
names refused with nothing created; the names carried by a snapshot (and an older snapshot without them still
imported, with ``trust=foreign``: older servers did not sign); ``untrained`` true exactly for an ``mpf`` stream
without a trained operator."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from mpflow.operators.state import ParticleState, read_metadata
from mpflow.service.streams.snapshots import MEDIA_TYPE, checksum

from tests.harness.snapshots import unsigned
from tests.integration.test_api_streams import FAMILIES, new_stream, run

NAMES = ["position", "velocity"]
EYE3 = [[float(i == j) for j in range(3)] for i in range(3)]


def test_state_names_in_the_document_the_answer_and_the_forecast(redis_url):
    async def body(app, c):
        create = new_stream("lds", "smc", stream_id="named", state_names=NAMES)
        created = (await c.post("/v1/streams", json=create)).json()
        got = (await c.get("/v1/streams/named")).json()
        answer = (await c.post("/v1/streams/named/observations", json={"observations": FAMILIES["lds"][2]})).json()
        forecast = (await c.get("/v1/streams/named/forecast", params={"steps": 2})).json()
        plain = (await c.post("/v1/streams", json=new_stream("lds", "smc"))).json()
        plain_forecast = (await c.get(f"/v1/streams/{plain['stream_id']}/forecast", params={"steps": 1})).json()
        return created, got, answer, forecast, plain, plain_forecast

    created, got, answer, forecast, plain, plain_forecast = run(redis_url, body)
    assert created["state_names"] == got["state_names"] == answer["state_names"] == NAMES
    assert forecast["state_names"] == NAMES and len(forecast["forecast"]) == 2
    assert plain["state_names"] is None and plain_forecast["state_names"] is None  # lds names none


BAD_NAMES = {
    "too few": (["x"], "give 2 names (got 1)"),
    "too many": (["x", "y", "z"], "give 2 names (got 3)"),
    "repeated": (["x", "x"], "'x' is given more than once"),
    "empty": (["x", ""], "state_names"),
    "too long": (["x", "y" * 65], "state_names"),
    "not strings": (["x", 1], "state_names"),
    "not a list": ("xy", "state_names"),
}


@pytest.mark.parametrize("case", sorted(BAD_NAMES))
def test_bad_state_names_are_refused_and_nothing_is_created(redis_url, case):
    names, says = BAD_NAMES[case]

    async def body(app, c):
        r = await c.post("/v1/streams", json=new_stream("lds", "smc", stream_id="bad", state_names=names))
        return r, await c.get("/v1/streams/bad"), (await c.get("/v1/streams")).json()

    r, after, listed = run(redis_url, body)
    assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_request"
    message = r.json()["error"]["message"]
    assert "state_names" in message and says in message
    assert after.status_code == 404 and listed["streams"] == []


def test_untrained_names_the_mpf_stream_without_an_operator(redis_url):
    async def body(app, c):
        three = {"type": "gaussian", "mean": [0.0, 0.0, 0.0], "cov": EYE3}  # no operator for linear_gaussian d=3
        bare = {"model": {"family": "linear_gaussian"}, "prior": three, "method": "mpf", "num_particles": 16}
        docs = {
            "mpf, no operator": (await c.post("/v1/streams", json=bare)).json(),
            "mpf, operator": (await c.post("/v1/streams", json=new_stream("linear_gaussian", "mpf"))).json(),
            "kalman": (await c.post("/v1/streams", json=new_stream("linear_gaussian", "kalman"))).json(),
        }
        sid = docs["mpf, no operator"]["stream_id"]
        answer = (await c.post(f"/v1/streams/{sid}/observations", json={"observations": [[0.1, 0.2, 0.3]]})).json()
        return docs, answer, (await c.get(f"/v1/streams/{sid}")).json()

    docs, answer, got = run(redis_url, body)
    assert docs["mpf, no operator"]["operator"] is None and docs["mpf, no operator"]["untrained"] is True
    assert answer["untrained"] is True and got["untrained"] is True
    assert docs["mpf, operator"]["operator"] is not None and docs["mpf, operator"]["untrained"] is False
    assert docs["kalman"]["untrained"] is False


def _rewritten(snapshot: bytes, edit: Callable[[dict], dict]) -> bytes:
    """The snapshot with its stream description ``edit``-ed, a valid checksum and no signature (as an older server
    wrote it: imported with ``trust=foreign``)."""
    meta = read_metadata(unsigned(snapshot))
    text = json.dumps(edit(json.loads(meta["stream"])), sort_keys=True, separators=(",", ":"))
    state = ParticleState.from_bytes(snapshot)
    return state.to_bytes({**meta, "stream": text, "sha256": checksum(text, state.to_bytes())})


def _older(stream: dict) -> dict:
    """The description as a server before ``state_names`` wrote it (no such field)."""
    return {k: v for k, v in stream.items() if k != "state_names"}


def test_a_snapshot_carries_the_state_names_and_an_older_one_imports_without(redis_url):
    headers = {"content-type": MEDIA_TYPE}

    async def body(app, c):
        await c.post("/v1/streams", json=new_stream("lds", "smc", stream_id="orig", state_names=NAMES))
        snapshot = (await c.get("/v1/streams/orig/export")).content
        copy = await c.post("/v1/streams:import?stream_id=copy", content=snapshot, headers=headers)
        older = _rewritten(snapshot, _older)
        unsigned = await c.post("/v1/streams:import?stream_id=old", content=older, headers=headers)
        old = await c.post("/v1/streams:import?stream_id=old&trust=foreign", content=older, headers=headers)
        bad = _rewritten(snapshot, lambda stream: {**stream, "state_names": ["x", "x"]})
        refused = await c.post("/v1/streams:import?stream_id=bad&trust=foreign", content=bad, headers=headers)
        return snapshot, copy, unsigned, old, refused, await c.get("/v1/streams/bad")

    snapshot, copy, unsigned, old, refused, after = run(redis_url, body)
    assert unsigned.status_code == 422 and unsigned.json()["error"]["code"] == "untrusted_snapshot"
    assert json.loads(read_metadata(snapshot)["stream"])["state_names"] == NAMES
    assert copy.status_code == 201 and copy.json()["state_names"] == NAMES
    assert old.status_code == 201 and old.json()["state_names"] is None  # lds names none
    assert refused.status_code == 422 and "state_names" in refused.json()["error"]["message"]
    assert after.status_code == 404

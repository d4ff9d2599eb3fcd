"""Rough edges a newcomer met (issue 58), through the real app and real Redis (docs/API.md):

* item 2 — a stream that learns parameters takes steps of duration 1 only: an ``lds`` in continuous time (``F``,
  ``Qc``: a model for steps of any ``dt``) with a prior is refused at creation naming ``model.params.F``; a step of
  another ``dt`` is refused naming the parameters and saying what to do;
* item 3 — a JSON body sent with another ``Content-Type`` (curl's default form encoding) or none is 415
  ``unsupported_media_type`` naming the header and ``application/json``, on every route that takes a JSON body;
* item 7 — unknown query parameters are 422 naming them and the accepted ones, on every ``/v1`` route;
* item 10 — NaN/inf in an observation is refused naming the entry and saying to send null for a missing entry; a bare
  number is the observation of a family whose observation is one number, and the cost model counts it.
"""

from __future__ import annotations

import httpx
from mpflow.service.streams.costs import requested_steps

from tests.integration.test_api_params import LOGNORMAL, lds_request
from tests.integration.test_api_streams import run

GAUSS1 = {"type": "gaussian", "mean": [0.0], "cov": [[1.0]]}
LDS1 = {"model": {"family": "lds", "params": {"A": [[0.9]], "B": [[1.0]]}}, "prior": GAUSS1, "seed": 1}
LG2 = {
    "model": {"family": "linear_gaussian", "params": {}},
    "prior": {"type": "gaussian", "mean": [0.0, 0.0], "cov": [[1.0, 0.0], [0.0, 1.0]]},
    "method": "kalman",
}


def _error(r: httpx.Response) -> tuple[int, str, str]:
    err = r.json()["error"]
    return r.status_code, err["code"], err["message"]


# ---------------------------------------------------------------------------------------------- item 2
def test_a_continuous_time_model_that_learns_is_refused_at_creation(redis_url):
    continuous = {"F": [[-0.5]], "B": [[1.0]], "Qc": [[1.0]], "R": LOGNORMAL}

    async def body(app, c):
        req = {"stream_id": "ct", "model": {"family": "lds", "params": continuous}, "prior": GAUSS1}
        named = {**req, "stream_id": "ct2", "method": "smc2"}
        learned_qc = {**req, "stream_id": "ct3", "model": {"family": "lds", "params": {**continuous, "R": [[1.0]]}}}
        learned_qc["model"]["params"]["Qc"] = LOGNORMAL
        answers = [await c.post("/v1/streams", json=r) for r in (req, named, learned_qc)]
        listed = (await c.get("/v1/streams")).json()["streams"]
        # the same model with its parameters as values takes steps of any dt
        values = {**req, "stream_id": "ct-values", "model": {"family": "lds", "params": {**continuous, "R": [[1.0]]}}}
        created = await c.post("/v1/streams", json=values)
        step = await c.post("/v1/streams/ct-values/observations", json={"observations": [{"value": [0.3], "dt": 0.25}]})
        return answers, listed, created, step

    answers, listed, created, step = run(redis_url, body)
    for r in answers:
        status, code, message = _error(r)
        assert (status, code) == (422, "invalid_request"), r.text
        assert message.startswith("model.params.F:"), message
        assert "duration 1" in message and "A and Q" in message and "as values" in message, message
    assert listed == []  # nothing created
    assert created.status_code == 201 and step.status_code == 200, step.text


def test_a_step_of_another_duration_says_which_parameters_and_what_to_do(redis_url):
    async def body(app, c):
        await c.post("/v1/streams", json=lds_request(stream_id="dt", num_particles=64))
        r = await c.post("/v1/streams/dt/observations", json={"observations": [[0.1], {"value": [0.2], "dt": 0.5}]})
        return r, (await c.get("/v1/streams/dt")).json()

    r, doc = run(redis_url, body)
    status, code, message = _error(r)
    assert (status, code) == (422, "invalid_request")
    assert message.startswith("observations[1].dt: a stream with unknown parameters (model.params.R given as priors)")
    assert "send dt = 1" in message and "given as values" in message, message
    assert doc["step"] == 0


# ---------------------------------------------------------------------------------------------- item 3
def test_a_json_body_without_its_content_type_is_415_naming_the_header(redis_url):
    form = {"Content-Type": "application/x-www-form-urlencoded"}  # curl -d's default

    async def body(app, c):
        created = await c.post("/v1/streams", json={**LDS1, "stream_id": "s"})
        obs = b'{"observations": [[0.5]]}'
        batch = b'{"updates": [{"stream_id": "s", "observations": [[0.5]]}]}'
        create = (
            b'{"model": {"family": "lds", "params": {"A": [[0.9]], "B": [[1.0]]}}, "prior": {"type": "gaussian", '
            b'"mean": [0.0], "cov": [[1.0]]}}'
        )
        refused = [
            await c.post("/v1/streams", content=create, headers=form),
            await c.post("/v1/streams", content=create, headers={"Content-Type": "text/plain"}),
            await c.post("/v1/streams/s/observations", content=obs, headers=form),
            await c.post("/v1/streams/s/observations", content=obs),  # no Content-Type at all
            await c.post("/v1/observations:batch", content=batch, headers=form),
            await c.post("/v1/observations:batch", content=b"", headers=form),
        ]
        after = (await c.get("/v1/streams/s")).json()
        accepted = [
            await c.post("/v1/streams/s/observations", content=obs, headers={"Content-Type": "application/json"}),
            await c.post(
                "/v1/streams/s/observations", content=obs, headers={"Content-Type": "application/json; charset=utf-8"}
            ),
        ]
        empty = await c.post("/v1/streams/s/observations", content=b"")  # no header, no body: the body's own 422
        return created, refused, after, accepted, empty

    created, refused, after, accepted, empty = run(redis_url, body)
    assert created.status_code == 201, created.text
    for r in refused:
        status, code, message = _error(r)
        assert (status, code) == (415, "unsupported_media_type"), r.text
        assert message.startswith("content-type: the Content-Type header"), message
        assert "'Content-Type: application/json'" in message, message
    assert "'application/x-www-form-urlencoded'" in _error(refused[0])[2]
    assert "is missing" in _error(refused[3])[2]
    assert after["step"] == 0  # nothing applied
    assert [r.status_code for r in accepted] == [200, 200]
    assert _error(empty)[:2] == (422, "invalid_request")


# ---------------------------------------------------------------------------------------------- item 7
def test_unknown_query_parameters_are_refused_naming_them_and_the_accepted_ones(redis_url):
    async def body(app, c):
        await c.post("/v1/streams", json={**LDS1, "stream_id": "q"})
        bad = {
            "samples": await c.get("/v1/streams/q/samples", params={"nn": 3}),
            "document": await c.get("/v1/streams/q", params={"verbose": 1}),
            "forecast": await c.get("/v1/streams/q/forecast", params={"steps": 2, "step": 1, "horizon": 3}),
            "list": await c.get("/v1/streams", params={"limit": 5, "page": 2}),
            "observe": await c.post("/v1/streams/q/observations", params={"seq": 1}, json={"observations": [[0.1]]}),
            "models": await c.get("/v1/models", params={"family": "lds"}),
            "key": await c.get("/v1/streams/q", params={"api_key": "k"}),
            "events": await c.get("/v1/streams/q/events", params={"since": 3}),
            "import": await c.post(
                "/v1/streams:import",
                params={"stream_id": "q2", "force": 1},
                content=b"",
                headers={"Content-Type": "application/octet-stream"},
            ),
        }
        after = (await c.get("/v1/streams/q")).json()
        good = [
            await c.get("/v1/streams/q/samples", params={"n": 3}),
            await c.get("/v1/streams/q/forecast", params={"steps": 2, "dt": 1.0, "samples": 1}),
            await c.get("/v1/streams", params={"limit": 5}),
            await c.get("/v1/streams/q/history", params={"limit": 1}),
            await c.get("/healthz", params={"x": 1}),  # outside /v1: its own
        ]
        return bad, after, good

    bad, after, good = run(redis_url, body)
    expected = {
        "samples": "nn: unknown query parameter; accepted: n",
        "document": "verbose: unknown query parameter; accepted: levels",
        "forecast": "step, horizon: unknown query parameters; accepted: steps, dt, samples",
        "list": "page: unknown query parameter; accepted: limit, cursor",
        "observe": "seq: unknown query parameter; this route takes none",
        "models": "family: unknown query parameter; this route takes none",
        "key": "api_key: unknown query parameter; accepted: levels; send the API key as 'Authorization: Bearer <key>'",
        "events": "since: unknown query parameter; this route takes none",
        "import": "force: unknown query parameter; accepted: stream_id, trust",
    }
    for name, r in bad.items():
        assert _error(r) == (422, "invalid_request", expected[name]), (name, r.text)
    assert after["step"] == 0
    assert [r.status_code for r in good] == [200] * len(good), [r.text for r in good]
    assert len(good[0].json()["samples"]) == 3


# ---------------------------------------------------------------------------------------------- item 10
def test_nan_and_inf_name_the_entry_and_say_to_send_null(redis_url):
    async def body(app, c):
        await c.post("/v1/streams", json={**LG2, "stream_id": "n"})
        headers = {"Content-Type": "application/json"}
        sent = [
            b'{"observations": [[0.1, 0.2], [0.3, 0.4], [0.5, 0.6], [0.7, NaN]]}',
            b'{"observations": [[0.1, 0.2], {"value": [-Infinity, 0.2], "dt": 1}]}',
            b'{"observations": [[1e400, 0.0]]}',
            b'{"updates": [{"stream_id": "n", "observations": [[0.1, 0.2], [NaN, 0.0]]}]}',
        ]
        answers = [await c.post("/v1/streams/n/observations", content=b, headers=headers) for b in sent[:3]]
        batch = await c.post("/v1/observations:batch", content=sent[3], headers=headers)
        gap = await c.post("/v1/streams/n/observations", json={"observations": [[0.7, None]]})
        return answers, batch, gap

    answers, batch, gap = run(redis_url, body)
    starts = [
        "observations[3][1]: NaN is not a number; send null for a missing entry",
        "observations[1].value[0]: -Infinity is not a number; send null for a missing entry",
        "observations[0][0]: Infinity is not a number; send null for a missing entry",
    ]
    for r, start in zip(answers, starts, strict=True):
        assert _error(r) == (422, "invalid_request", start), r.text
    assert batch.status_code == 422, batch.text
    assert _error(batch)[2] == "updates[0].observations[1][0]: NaN is not a number; send null for a missing entry"
    assert gap.status_code == 200 and gap.json()["step"] == 1  # what the message says to send works


def test_a_bare_number_is_a_one_number_observation(redis_url):
    async def body(app, c):
        await c.post("/v1/streams", json={**LDS1, "stream_id": "bare", "method": "kalman"})
        await c.post("/v1/streams", json={**LDS1, "stream_id": "list", "method": "kalman"})
        await c.post("/v1/streams", json={**LG2, "stream_id": "two"})
        bare = await c.post("/v1/streams/bare/observations", json={"observations": [0.5, {"value": -0.25}, None, 2]})
        listed = await c.post("/v1/streams/list/observations", json={"observations": [[0.5], [-0.25], None, [2]]})
        ws_like = await c.post("/v1/observations:batch", json={"updates": [{"stream_id": "bare", "observations": [1]}]})
        two = await c.post("/v1/streams/two/observations", json={"observations": [0.5]})
        history = (await c.get("/v1/streams/bare/history")).json()
        return bare, listed, ws_like, two, history

    bare, listed, ws_like, two, history = run(redis_url, body)
    assert bare.status_code == 200, bare.text
    assert bare.json()["per_step"] == listed.json()["per_step"]  # the same steps as [x]
    assert ws_like.json()["results"][0]["status"] == 200, ws_like.text
    status, code, message = _error(two)  # a family whose observation is two numbers still wants both
    assert (status, code) == (422, "invalid_request") and message.startswith("observations[0]"), message
    assert "[2]" in message, message
    assert [s["observation"] for s in history["steps"]][:2] == [0.5, -0.25]  # kept as posted
    # the cost model counts a bare number as one entry, as [x]
    assert requested_steps([0.5, {"value": 2, "dt": 0.5}]) == requested_steps([[0.5], {"value": [2], "dt": 0.5}])
    assert requested_steps([0.5]) == [(1.0, 1)]

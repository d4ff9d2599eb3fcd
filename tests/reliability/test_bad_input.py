"""Bad input: whatever a client sends, the answer is a 4xx with the API's error body (never a 5xx), fast.

* every operation of ``/openapi.json`` fuzzed by schemathesis (:func:`tests.harness.hostile.fuzz`:
  ``EXAMPLES`` valid and ``EXAMPLES`` invalid requests each; the positive ones address existing streams of every
  family), checked for no 5xx and the documented status and body schema, against uvicorn over real TCP;
* hostile bodies (:data:`tests.harness.hostile.HOSTILE`: 100 000-deep arrays, 7 MiB of numbers in the
  wrong shape, 400 000 unknown keys, ``NaN``/``Infinity``/``1e400``/``1e39`` literals, 4000-digit integers,
  9 MiB bodies declared and chunked, ...) each answered with its status, naming the field, in under
  ``MAX_SECONDS``; the same over the WebSocket, whose connection survives them;
* wrong shapes for every family, and non-finite numbers in every numeric field of every request, are 422 with a
  message that starts with the offending field.

The counts and times of a larger run are in ``benchmarks/results/reliability_input.json``
(``python -m benchmarks.reliability_input``).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import httpx
import pytest
from mpflow.service.settings import Settings

from tests.harness.hostile import fuzz, fuzz_targets, hostile_bodies
from tests.harness.server import drop_prefix, serve_as_user, serve_in_process
from tests.harness.specs import LINEAR_STREAM, SERVER_ENV
from tests.integration import conftest as integration

redis_url = integration.redis_url  # the real-Redis fixture of the integration tests

#: per operation and generation mode (derandomized: the same cases every run); ~1000 requests over the contract's
#: operations. The larger run, 150 each, is benchmarks/reliability_input.py's
EXAMPLES = 30
MAX_SECONDS = 2.5  # to answer any hostile body (measured ≤ 1.1 s on 2 cores at load average 3.5)


def server_settings(url: str, prefix: str, **overrides: Any) -> Settings:
    """The benchmark's server settings (small limits, short iterative methods) on ``prefix``."""
    env = {k.removeprefix("MPFLOW_").lower(): json.loads(v) for k, v in SERVER_ENV.items()}
    return Settings(redis_url=url, redis_prefix=prefix, **{**env, **overrides})


@pytest.fixture(scope="module")
def server(redis_url, tmp_path_factory):
    """``python -m mpflow serve`` on a free port, as a user runs it (its timings are its own, not this process's),
    its streams under a fresh prefix deleted afterwards: (url, a stream id)."""
    prefix = f"mpflowtest-{uuid.uuid4().hex}"
    env = {**SERVER_ENV, "MPFLOW_REDIS_URL": redis_url, "MPFLOW_REDIS_PREFIX": prefix}
    try:
        with serve_as_user(env, tmp_path_factory.mktemp("bad-input") / "service.log") as service:
            sid = httpx.post(f"{service.url}/v1/streams", json=LINEAR_STREAM, timeout=30).json()["stream_id"]
            yield service.url, sid
    finally:
        asyncio.run(drop_prefix(redis_url, prefix))


def test_fuzzing_every_operation_finds_no_5xx_and_no_undocumented_answer(server):
    url, _ = server
    targets = fuzz_targets(url)
    stats = fuzz(url, EXAMPLES, raise_on_failure=True, stream_ids=targets)
    assert len(stats) >= 13, sorted(stats)  # every operation of the contract was fuzzed
    for label, s in stats.items():
        assert s.server_errors == 0 and not s.failures, (label, s.to_json())
        assert s.requests >= 1, label
    body_ops = [k for k in stats if k.startswith("POST")]
    assert all(stats[k].requests >= 2 * EXAMPLES for k in body_ops), {k: stats[k].requests for k in body_ops}
    # the fuzzed observations met real streams, and what they left stored is finite
    assert sum(s.statuses[200] for k, s in stats.items() if "observations" in k) > 0
    for sid in targets:
        r = httpx.get(f"{url}/v1/streams/{sid}/particles", timeout=30)
        assert r.status_code == 200 and all(_finite(x) for row in r.json()["particles"] for x in row), sid
    assert httpx.get(f"{url}/healthz").status_code == 200


def _finite(x: float) -> bool:
    return x == x and abs(x) != float("inf")


def test_hostile_bodies_are_refused_fast_naming_the_field(server):
    url, sid = server
    rows = hostile_bodies(url, sid)
    assert len(rows) >= 25
    for row in rows:
        assert row["ok"], row  # the expected 4xx, and the message starts with the field where one is named
        assert 400 <= row["status"] < 500 and row["code"], row
        assert row["seconds"] < MAX_SECONDS, row
    big = [r for r in rows if r["bytes"] >= 6 * 1024 * 1024]
    assert len(big) >= 5, [r["case"] for r in rows]  # the 7 and 9 MiB bodies were really sent
    # the stream the bodies were aimed at is untouched and the server still serves
    doc = httpx.get(f"{url}/v1/streams/{sid}", timeout=30).json()
    assert doc["step"] == 0


def test_hostile_websocket_frames_get_error_frames_and_the_socket_survives(server):
    from websockets.sync.client import connect

    url, _ = server
    sid = httpx.post(f"{url}/v1/streams", json=LINEAR_STREAM, timeout=30).json()["stream_id"]
    frames = {
        '{"observations": ' + "[" * 100_000 + "]" * 100_000 + "}": (400, "frame"),
        '{"observations": [[NaN, 0]]}': (422, "observations[0]"),
        '{"observations": [[0, Infinity]]}': (422, "observations[0]"),
        '{"observations": [[1e400, 0]]}': (422, "observations[0]"),
        '{"observations": [[1e39, 0]]}': (422, "observations[0]"),
        '{"observations": [[' + "9" * 4000 + ", 0]]}": (422, "observations[0]"),
        '{"observations": [[0, 0, 0]]}': (422, "observations[0]"),
        '{"observations": [[0, 0]], "extra": 1}': (422, "body"),
        "not json": (400, "frame"),
    }
    with connect(url.replace("http://", "ws://") + f"/v1/streams/{sid}/ws", max_size=None) as ws:
        for frame, (status, field) in frames.items():
            ws.send(frame)
            answer = json.loads(ws.recv(timeout=MAX_SECONDS))
            assert answer.get("status") == status, (frame[:60], answer)
            assert answer["error"]["message"].startswith(field), (frame[:60], answer)
        ws.send(json.dumps({"seq": 1, "observations": [[0.5, -0.5]]}))
        answer = json.loads(ws.recv(timeout=30))
        assert answer["step"] == 1 and "error" not in answer


# ---------------------------------------------------------------------------------------------- wrong shapes
GAUSS2 = {"type": "gaussian", "mean": [0.0, 0.5], "cov": [[1.0, 0.2], [0.2, 0.8]]}
LDS = {"A": [[0.9, 0.1], [0.0, 0.8]], "B": [[1.0, 0.0]], "R": [[0.5]]}
# family -> (params, [(observations, the field the 422 must name)])
WRONG_OBSERVATIONS: dict[str, tuple[dict[str, Any], list[tuple[list[Any], str]]]] = {
    "linear_gaussian": ({}, [([[1, 2, 3]], "observations[0]"), ([[0, 0], [[1, 2]]], "observations[1]")]),
    "lds": (LDS, [([[1, 2]], "observations[0]"), ([[0], [0], {"x": [[1]], "y": [1]}], "observations[2]")]),
    "gmm": ({"s": 1.0}, [([[1, 2]], "observations[0]"), ([0.5, "x"], "observations[1]")]),
    "logistic": (
        {},
        [
            ([[1, 2]], "observations[0]"),
            ([{"x": [[1, 2, 3]], "y": [1]}], "observations[0].x"),
            ([{"x": [[1, 2]], "y": [2]}], "observations[0].y"),
            ([{"x": [[1, 2]], "y": [1, 0]}], "observations[0].y"),
            ([{"x": [[1, 2]], "y": [1], "z": 0}], "observations[0]"),
        ],
    ),
    "stochastic_volatility": (
        {"phi": 0.9},
        [([[1, 2, 3]], "observations[0]"), ([[0, 0], [0, 0], [1]], "observations[2]")],
    ),
}
WRONG_PARAMS: dict[str, list[tuple[dict[str, Any], str]]] = {
    "linear_gaussian": [
        ({"H": [[1, 0, 0], [0, 1, 0], [0, 0, 1]]}, "model.params.H"),
        ({"H": [1, 2]}, "model.params.H"),
        ({"R": [[1]]}, "model.params.R"),
        ({"R": [[1, 2], [2, 1]]}, "model.params.R"),
        ({"G": 1}, "model.params"),
    ],
    "lds": [
        ({**LDS, "A": [[1, 0, 0]]}, "model.params.A"),
        ({**LDS, "B": [[1, 0, 0]]}, "model.params.B"),
        ({**LDS, "Q": [[1]]}, "model.params.Q"),
        ({"B": [[1, 0]]}, "model.params.A"),
    ],
    "gmm": [({"s": -1}, "model.params.s"), ({"s": [1, 2]}, "model.params.s")],
    "logistic": [({"w": 1}, "model.params")],
    "stochastic_volatility": [
        ({"phi": [1, 2, 3]}, "model.params.phi"),
        ({"sigma": -1}, "model.params.sigma"),
        ({"mu": [1, 2, 3]}, "model.params.mu"),
    ],
}
WRONG_PRIORS: list[tuple[dict[str, Any], str]] = [
    ({"type": "gaussian", "mean": [0, 0, 0], "cov": [[1, 0], [0, 1]]}, "prior.cov"),
    ({"type": "gaussian", "mean": [0, 0], "cov": [[1, 0]]}, "prior.cov"),
    ({"type": "particles", "particles": [[0, 0], [1]]}, "prior.particles"),
    ({"type": "mixture", "weights": [1], "means": [[0, 0], [1, 1]], "covs": [[[1, 0], [0, 1]]]}, "prior.means"),
    ({"type": "gaussian", "mean": [0, 0]}, "prior.gaussian.cov"),
    ({"type": "cloud", "mean": [0, 0]}, "prior"),
]


def run_in_process(url: str, body: Any) -> Any:
    prefix = f"mpflowtest-{uuid.uuid4().hex}"

    async def main() -> Any:
        try:
            async with serve_in_process(server_settings(url, prefix)) as (_, client):
                return await body(client)
        finally:
            await drop_prefix(url, prefix)

    return asyncio.run(main())


@pytest.mark.parametrize("family", sorted(WRONG_OBSERVATIONS))
def test_wrong_shapes_are_422_naming_the_field(redis_url, family):
    params, wrong_obs = WRONG_OBSERVATIONS[family]

    async def body(c: httpx.AsyncClient) -> None:
        spec = {"model": {"family": family, "params": params}, "prior": GAUSS2, "method": "smc", "num_particles": 8}
        r = await c.post("/v1/streams", json=spec)
        assert r.status_code == 201, r.text
        sid = r.json()["stream_id"]
        for observations, field in wrong_obs:
            for path, payload in (
                (f"/v1/streams/{sid}/observations", {"observations": observations}),
                ("/v1/observations:batch", {"updates": [{"stream_id": sid, "observations": observations}]}),
            ):
                r = await c.post(path, json=payload)
                if path.endswith(":batch") and r.status_code == 200:  # validated per stream: inside the result
                    r_status, error = r.json()["results"][0]["status"], r.json()["results"][0]["error"]
                    field_here = field
                else:
                    r_status, error = r.status_code, r.json()["error"]
                    field_here = field if "batch" not in path else f"updates[0].{field}"
                assert r_status == 422, (family, observations, r.text)
                assert error["message"].startswith(field_here), (family, path, observations, error)
        for params_, field in WRONG_PARAMS[family]:
            r = await c.post("/v1/streams", json={**spec, "model": {"family": family, "params": params_}})
            assert r.status_code == 422 and r.json()["error"]["message"].startswith(field), (family, params_, r.text)
        for prior, field in WRONG_PRIORS:
            r = await c.post("/v1/streams", json={**spec, "prior": prior})
            assert r.status_code == 422 and r.json()["error"]["message"].startswith(field), (family, prior, r.text)
        assert (await c.get(f"/v1/streams/{sid}")).json()["step"] == 0  # nothing of it was applied

    run_in_process(redis_url, body)


# ---------------------------------------------------------------------------------------------- non-finite numbers
NON_FINITE = ["NaN", "Infinity", "-Infinity", "1e400", "-1e400", "1e39"]
CREATE_FIELDS = {  # a create body with one number replaced by {x}, and the field the 422 must name
    "prior.mean": ('{"type": "gaussian", "mean": [{x}, 0], "cov": [[1, 0], [0, 1]]}', None, "prior.gaussian.mean[0]"),
    "prior.cov": ('{"type": "gaussian", "mean": [0, 0], "cov": [[1, 0], [0, {x}]]}', None, "prior.gaussian.cov[1][1]"),
    "prior.particles": (
        '{"type": "particles", "particles": [[0, 0], [{x}, 1]]}',
        None,
        "prior.particles.particles[1][0]",
    ),
    "prior.weights": (
        '{"type": "mixture", "weights": [{x}, 1], "means": [[0, 0], [1, 1]], "covs": [[[1, 0], [0, 1]]] }',
        None,
        "prior.mixture.weights[0]",
    ),
    "model.params.R": (None, '{"family": "linear_gaussian", "params": {"R": [[1, 0], [0, {x}]]}}', "model.params.R"),
    "model.params.s": (None, '{"family": "gmm", "params": {"s": {x}}}', "model.params.s"),
}


def test_non_finite_numbers_are_422_in_every_field(redis_url):
    async def body(c: httpx.AsyncClient) -> None:
        sid = (await c.post("/v1/streams", json=LINEAR_STREAM)).json()["stream_id"]
        headers = {"content-type": "application/json"}
        for x in NON_FINITE:
            for name, (prior, model, field) in CREATE_FIELDS.items():
                prior = (prior or json.dumps(LINEAR_STREAM["prior"])).replace("{x}", x)
                model = (model or '{"family": "linear_gaussian"}').replace("{x}", x)
                raw = '{"model": ' + model + ', "prior": ' + prior + ', "method": "smc", "num_particles": 8}'
                r = await c.post("/v1/streams", content=raw, headers=headers)
                assert r.status_code == 422, (name, x, r.text)
                assert r.json()["error"]["message"].startswith(field), (name, x, r.text)
            for path, raw, field in (
                (f"/v1/streams/{sid}/observations", '{"observations": [[0, 0], [0, {x}]]}', "observations[1]"),
                (f"/v1/streams/{sid}/observations", '{"observations": [[0, 0]], "seq": {x}}', "seq"),
                (
                    "/v1/observations:batch",
                    '{"updates": [{"stream_id": "s", "observations": [[{x}, 0]]}]}',
                    "updates[0]",
                ),
            ):
                r = await c.post(path, content=raw.replace("{x}", x), headers=headers)
                assert r.status_code == 422, (path, x, r.text)
                assert r.json()["error"]["message"].startswith(field), (path, x, r.text)
        for query in ("n=NaN", "n=Infinity", "n=1e400"):
            r = await c.get(f"/v1/streams/{sid}/samples?{query}")
            assert r.status_code == 422 and r.json()["error"]["message"].startswith("n"), (query, r.text)
        assert (await c.get(f"/v1/streams/{sid}")).json()["step"] == 0

    run_in_process(redis_url, body)

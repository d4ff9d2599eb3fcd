"""The updater cache through the API (issue 34 item 7; in process, real Redis, as ``test_api_streams``): streams
created with ever new ``method_options`` keep at most ``MPFLOW_UPDATER_CACHE_SIZE`` updaters in the server, and a
stream whose updater was evicted is served by a rebuilt one, continuing exactly as a stream that never lost it."""

from __future__ import annotations

from fastapi import FastAPI
from httpx import AsyncClient

from tests.integration.test_api_streams import run

SIZE = 8
STREAMS = 60
MODEL = {"family": "linear_gaussian"}
PRIOR = {"type": "gaussian", "mean": [0.0, 0.0], "cov": [[1.0, 0.0], [0.0, 1.0]]}
OBS = {"observations": [[0.4, -0.1], [0.2, 0.3]]}


def _stream(sid: str, i: int) -> dict:
    options = {"ess_threshold": 0.2 + i / 1000}  # one distinct option set per stream
    return {"stream_id": sid, "model": MODEL, "prior": PRIOR, "method": "smc", "num_particles": 32, "seed": 3,
            "method_options": options}  # fmt: skip


def test_distinct_option_sets_keep_a_bounded_cache(redis_url):
    async def body(app: FastAPI, c: AsyncClient) -> tuple[int, dict, dict]:
        for i in range(STREAMS):
            r = await c.post("/v1/streams", json=_stream(f"s{i}", i))
            assert r.status_code == 201, r.text
            assert (await c.post(f"/v1/streams/s{i}/observations", json=OBS)).status_code == 200
        kept = len(app.state.streams.methods._updaters)
        # s0's updater was evicted long ago: its next update rebuilds it; a fresh twin never lost it
        assert (await c.post("/v1/streams", json=_stream("twin", 0))).status_code == 201
        assert (await c.post("/v1/streams/twin/observations", json=OBS)).status_code == 200
        again = {"observations": [[1.0, 1.0]]}
        first = (await c.post("/v1/streams/s0/observations", json=again)).json()
        twin = (await c.post("/v1/streams/twin/observations", json=again)).json()
        return kept, first, twin

    kept, first, twin = run(redis_url, body, updater_cache_size=SIZE)
    assert kept <= SIZE, kept
    assert first["summary"] == twin["summary"] and first["step"] == twin["step"] == 3

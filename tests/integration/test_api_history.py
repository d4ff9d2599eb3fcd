"""``GET /v1/streams/{stream_id}/history`` end to end (in process, real Redis, as ``test_api_streams``): the steps of
the stored updates with their observations, capped by ``MPFLOW_HISTORY_STEPS``, a duplicate ``seq`` recorded once,
scoped by tenant, gone with the stream; the families' ``state_names`` in the stream document; and all of it again on
a Redis Cluster."""

from __future__ import annotations

import asyncio
import uuid

from tests.harness.cluster import LocalCluster
from tests.harness.server import TENANT_KEYS, drop_prefix, serve_tenants
from tests.integration import test_store_history as store_history
from tests.integration.test_api_documented import _undocumented
from tests.integration.test_api_streams import GAUSS2, new_stream, run, settings

EYE4 = [[float(i == j) for j in range(4)] for i in range(4)]


def test_history_holds_each_stored_step_with_its_observation(redis_url):
    async def body(app, client):
        create = {**new_stream("lds", "smc"), "stream_id": "h-1"}
        assert (await client.post("/v1/streams", json=create)).status_code == 201
        empty = (await client.get("/v1/streams/h-1/history")).json()
        first = [[0.5], {"value": [-0.25], "dt": 1.0}, None]  # lds (A, Q) takes steps of 1 only
        a = (await client.post("/v1/streams/h-1/observations", json={"seq": 1, "observations": first})).json()
        again = await client.post("/v1/streams/h-1/observations", json={"seq": 1, "observations": first})
        assert again.json()["duplicate"] is True  # nothing applied: nothing recorded
        b = (await client.post("/v1/streams/h-1/observations", json={"seq": 4, "observations": [[0.1], [0.2]]})).json()
        full = await client.get("/v1/streams/h-1/history")
        latest = (await client.get("/v1/streams/h-1/history", params={"limit": 2})).json()
        spec = (await client.get("/openapi.json")).json()
        return empty, a["per_step"] + b["per_step"], full, latest, spec

    empty, per_step, full, latest, spec = run(redis_url, body)
    assert empty == {"stream_id": "h-1", "step": 0, "history_steps": 500, "steps": []}
    assert full.status_code == 200 and full.headers["content-type"] == "application/json"
    history = full.json()
    assert (history["stream_id"], history["step"], history["history_steps"]) == ("h-1", 5, 500)
    steps = history["steps"]
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5]
    assert [s["observation"] for s in steps] == [[0.5], [-0.25], None, [0.1], [0.2]]
    assert [s.get("dt") for s in steps] == [None, 1.0, None, None, None]  # dt only where the request gave it
    for s, answered in zip(steps, per_step, strict=True):  # the answers' per_step entries, verbatim but quantiles
        assert {k: v for k, v in s.items() if k not in ("observation", "dt")} == {
            k: v for k, v in answered.items() if k != "quantiles"
        }
        assert "quantiles" in answered
    assert latest["steps"] == steps[-2:] and latest["step"] == 5
    components = spec["components"]["schemas"]
    assert _undocumented(history, components["HistoryResponse"], components, "HistoryResponse") == []
    assert "/v1/streams/{stream_id}/history" in spec["paths"]


def test_history_keeps_the_configured_number_of_steps_and_refuses_a_limit_beyond(redis_url):
    async def body(app, client):
        sid = (await client.post("/v1/streams", json=new_stream("linear_gaussian", "smc"))).json()["stream_id"]
        for m in range(1, 6):
            r = await client.post(f"/v1/streams/{sid}/observations", json={"seq": m, "observations": [[m, 0.0]]})
            assert r.status_code == 200
        kept = (await client.get(f"/v1/streams/{sid}/history")).json()
        refused = [await client.get(f"/v1/streams/{sid}/history", params={"limit": n}) for n in (0, 4, "x")]
        unknown = await client.get("/v1/streams/nope/history")
        return kept, refused, unknown

    kept, refused, unknown = run(redis_url, body, history_steps=3)
    assert kept["history_steps"] == 3 and [s["step"] for s in kept["steps"]] == [3, 4, 5]
    assert [s["observation"] for s in kept["steps"]] == [[3, 0.0], [4, 0.0], [5, 0.0]]
    for r in refused:
        assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_request"
        assert "limit" in r.json()["error"]["message"], r.json()
    assert "MPFLOW_HISTORY_STEPS" in refused[1].json()["error"]["message"]
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "stream_not_found"


def test_history_is_scoped_by_tenant_and_goes_with_the_stream(redis_url):
    prefix = f"mpflowtest-{uuid.uuid4().hex}"
    s = settings(redis_url, prefix, api_keys=TENANT_KEYS)

    async def main():
        try:
            async with serve_tenants(s) as (a, b, anon):
                body = {**new_stream("linear_gaussian", "smc"), "stream_id": "shared-id"}
                assert (await a.post("/v1/streams", json=body)).status_code == 201
                await a.post("/v1/streams/shared-id/observations", json={"observations": [[1.0, 2.0]]})
                path = "/v1/streams/shared-id/history"
                assert len((await a.get(path)).json()["steps"]) == 1
                r = await b.get(path)
                assert r.status_code == 404 and r.json()["error"]["code"] == "stream_not_found"
                assert (await anon.get(path)).status_code == 401
                assert (await b.post("/v1/streams", json=body)).status_code == 201  # b's own stream of that id
                assert (await b.get(path)).json()["steps"] == []
                assert (await a.delete("/v1/streams/shared-id")).status_code == 204
                assert (await a.get(path)).status_code == 404
                assert (await a.post("/v1/streams", json=body)).status_code == 201  # the id again: no old steps
                assert (await a.get(path)).json()["steps"] == []
        finally:
            await drop_prefix(redis_url, prefix)

    asyncio.run(main())


def test_large_observations_are_left_out_and_state_names_come_from_the_family(redis_url):
    rows = [[0.1 * i, -0.2] for i in range(400)]  # one minibatch of ~6 kB of JSON

    async def body(app, client):
        docs = {}
        for family, params, prior in (
            ("logistic", {}, GAUSS2),
            ("stochastic_volatility", {}, GAUSS2),
            ("linear_gaussian", {}, GAUSS2),
            ("range_bearing", {}, {"type": "gaussian", "mean": [5.0, 5.0, 0.0, 0.0], "cov": EYE4}),
        ):
            create = {"stream_id": family, "model": {"family": family, "params": params}, "prior": prior}
            r = await client.post("/v1/streams", json={**create, "method": "smc", "num_particles": 16})
            assert r.status_code == 201, r.text
            docs[family] = (await client.get(f"/v1/streams/{family}")).json()
        minibatch = {"x": rows, "y": [i % 2 for i in range(400)]}
        small = {"x": [[1.0, 0.0]], "y": [1]}
        r = await client.post("/v1/streams/logistic/observations", json={"observations": [minibatch, small]})
        assert r.status_code == 200, r.text
        history = (await client.get("/v1/streams/logistic/history")).json()
        return docs, history

    docs, history = run(redis_url, body)
    assert docs["logistic"]["state_names"] == ["w[0]", "w[1]"]
    assert docs["stochastic_volatility"]["state_names"] == ["log-vol[0]", "log-vol[1]"]
    assert docs["range_bearing"]["state_names"] == ["px", "py", "vx", "vy"]
    assert docs["linear_gaussian"]["state_names"] is None
    big, kept = history["steps"]
    assert big["observation"] is None and big["observation_omitted"] is True
    assert kept["observation"] == {"x": [[1.0, 0.0]], "y": [1]} and "observation_omitted" not in kept


def test_history_on_a_cluster(redis_cluster: LocalCluster) -> None:
    """The history key lives in the stream's slot: the scripts that write, read and delete it run on a cluster."""
    store_history.test_history_is_appended_by_each_write_and_capped(redis_cluster.url)
    store_history.test_history_is_deleted_with_the_stream_and_not_inherited(redis_cluster.url)
    test_history_holds_each_stored_step_with_its_observation(redis_cluster.url)
    test_history_is_scoped_by_tenant_and_goes_with_the_stream(redis_cluster.url)

"""The Python client with numpy, against a real server and Redis (the fixtures of ``test_client``): numpy arrays
and scalars accepted in every call, results as numpy arrays (and pandas tables where pandas is installed), the
batch endpoint, the WebSocket, and the client's own error for a server it cannot reach."""

from __future__ import annotations

import asyncio
import importlib.util
import uuid

import numpy as np
import pytest
from mpflow.service.client import AsyncClient, Client, MpflowConnectionError, MpflowError, Retry
from mpflow.service.results import Posterior, StepTable, jsonable
from mpflow.service.settings import Settings

from tests.harness.server import drop_prefix, free_port, serve_in_process
from tests.integration.test_client import FAST_RETRY, MODEL, OBS, PRIOR, server  # noqa: F401  (fixture)

NP_MODEL = {"family": "lds", "params": {k: np.array(v) for k, v in MODEL["params"].items()}}
NP_PRIOR = {"type": "gaussian", "mean": np.zeros(2), "cov": np.eye(2)}
NP_OBS = np.array(OBS)
HAS_PANDAS = importlib.util.find_spec("pandas") is not None


def _np_stream(client: Client, **extra) -> Posterior:
    return client.create_stream(
        model=NP_MODEL, prior=NP_PRIOR, method="smc", num_particles=np.int64(64), seed=np.uint32(11), **extra
    )


def test_jsonable_turns_numpy_anywhere_into_json_values():
    value = {"a": np.float32(0.5), "b": [np.arange(2), (np.int64(3), {"c": np.eye(2)})], "d": "text", "e": None}
    assert jsonable(value) == {"a": 0.5, "b": [[0, 1], [3, {"c": [[1.0, 0.0], [0.0, 1.0]]}]], "d": "text", "e": None}
    assert type(jsonable(np.int64(3))) is int and type(jsonable(np.float64(0.25))) is float


def test_create_stream_with_numpy_model_prior_and_scalars(server):  # noqa: F811
    with Client(server) as client:
        stream = _np_stream(client, stream_id=f"np-{uuid.uuid4().hex[:8]}", ttl_seconds=np.int64(600))
        doc = stream.document
        assert isinstance(doc, Posterior) and doc.step == 0 and doc["num_particles"] == 64
        assert doc["model"]["params"]["A"] == MODEL["params"]["A"] and doc["ttl_seconds"] == 600
        assert doc.mean.shape == (2,) and (np.abs(doc.mean) < 0.5).all()  # 64 draws of N(0, I)
        assert doc.cov.shape == (2, 2) and doc.std.shape == (2,)


def test_update_with_numpy_observations_seq_and_samples(server):  # noqa: F811
    with Client(server) as client:
        stream = _np_stream(client)
        answer = stream.update(NP_OBS[:2], seq=np.int64(1), return_samples=np.int64(4))
        assert answer.step == 2 and [p["step"] for p in answer["per_step"]] == [1, 2]
        assert answer.samples.shape == (4, 2) and answer.mean.dtype == np.float64
        steps = answer.steps
        assert isinstance(steps, StepTable) and steps.step.tolist() == [1, 2] and steps.mean.shape == (2, 2)
        np.testing.assert_array_equal(steps.mean[-1], answer.mean)  # the last step is the posterior now
        assert np.isfinite(steps.log_evidence_increment).all() and answer.log_evidence < 0
        assert set(answer.quantiles) == {0.05, 0.5, 0.95} and answer.quantiles[0.5].shape == (2,)
        single = stream.update([np.array([0.1, 0.2])])  # a list of arrays, without seq
        assert single.step == 3


def test_filter_with_a_numpy_array_and_the_steps_of_its_answers(server):  # noqa: F811
    with Client(server) as client:
        stream = _np_stream(client)
        answers = list(stream.filter(NP_OBS, batch=np.int64(4)))
        assert [a.step for a in answers] == [4, 6]
        table = StepTable.of(answers)
        assert table.step.tolist() == [1, 2, 3, 4, 5, 6] and table.names == ["x0", "x1"]
        assert table.std.shape == (6, 2) and (table.std > 0).all()


def test_samples_particles_and_listing_with_numpy_arguments(server):  # noqa: F811
    with Client(server) as client:
        stream = _np_stream(client)
        assert len(stream.samples(np.int64(5))) == 5
        assert len(stream.particles()["particles"]) == 64
        assert stream.stream_id in {s["stream_id"] for s in client.list_streams(limit=np.int64(2))}


def test_batch_with_numpy_updates(server):  # noqa: F811
    with Client(server) as client:
        a, b = _np_stream(client), _np_stream(client)
        updates = [
            {"stream_id": a.stream_id, "seq": np.int64(1), "observations": NP_OBS[:2]},
            {"stream_id": b.stream_id, "seq": np.int64(1), "observations": NP_OBS[2:3], "return_samples": np.int8(2)},
            {"stream_id": "no-such-stream", "observations": NP_OBS[:1]},
        ]
        results = client.batch(updates)
        assert [(r["stream_id"], r["status"]) for r in results] == [
            (a.stream_id, 200),
            (b.stream_id, 200),
            ("no-such-stream", 404),
        ]
        assert isinstance(results[0]["stream"], Posterior) and results[0]["stream"].step == 2
        assert results[1]["stream"].samples.shape == (2, 2)
        assert results[2]["error"]["code"] == "stream_not_found"
        again = client.batch(updates[:2])  # every update carries seq: applied once, answered as duplicates
        assert [r["stream"]["duplicate"] for r in again] == [True, True]


def test_websocket_updates_with_numpy(server):  # noqa: F811
    with Client(server) as client:
        stream = _np_stream(client)
        with stream.socket() as ws:
            first = ws.update(NP_OBS[:2], seq=np.int64(1))
            second = ws.update(NP_OBS[2:3], seq=np.int64(3), return_samples=np.int64(3))
            duplicate = ws.update(NP_OBS[2:3], seq=3)
            with pytest.raises(MpflowError) as err:
                ws.update(NP_OBS[:1], seq=9)  # a gap: the error frame, raised with its status
            assert (err.value.status, err.value.code) == (409, "seq_conflict")
        assert (first.step, second.step, duplicate["duplicate"]) == (2, 3, True)
        assert second.samples.shape == (3, 2) and stream.get().step == 3
        with pytest.raises(MpflowError) as err, client.stream("no-such-stream").socket() as ws:
            ws.update(NP_OBS[:1])
        assert (err.value.status, err.value.code) == (404, "stream_not_found")


def test_pandas_views_where_pandas_is_installed(server):  # noqa: F811
    with Client(server) as client:
        answer = _np_stream(client).update(NP_OBS[:3], seq=1)
    if not HAS_PANDAS:
        with pytest.raises(ImportError, match="pip install pandas"):
            answer.to_pandas()
        with pytest.raises(ImportError, match="pip install pandas"):
            answer.steps.to_pandas()
        return
    frame = answer.to_pandas()
    assert list(frame.index) == ["x0", "x1"] and list(frame.columns) == ["mean", "std", "q0.05", "q0.5", "q0.95"]
    steps = answer.steps.to_pandas()
    assert list(steps.index) == [1, 2, 3] and "mean_x0" in steps.columns and "log_evidence_increment" in steps


def test_a_server_that_cannot_be_reached_raises_the_clients_error():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with Client(url, retry=Retry(attempts=2, base_delay=0.001)) as client, pytest.raises(MpflowConnectionError) as err:
        client.models()
    assert isinstance(err.value, MpflowError) and err.value.status is None and err.value.code == "connection_failed"
    assert url in err.value.message

    async def main() -> None:
        async with AsyncClient(url, retry=Retry(attempts=1)) as client:
            with pytest.raises(MpflowConnectionError):
                await client.stream("s").get()

    asyncio.run(main())
    with Client(url) as client, pytest.raises(MpflowConnectionError):
        client.stream("s").socket()


def test_async_client_with_numpy(redis_url: str) -> None:
    prefix = f"mpflowtest-{uuid.uuid4().hex}"
    settings = Settings(redis_url=redis_url, redis_prefix=prefix, log_level="WARNING")

    async def main() -> None:
        try:
            async with serve_in_process(settings) as (app, _):
                import httpx

                transport = httpx.ASGITransport(app=app)
                async with AsyncClient("http://mpflow", retry=FAST_RETRY, transport=transport) as client:
                    stream = await client.create_stream(model=NP_MODEL, prior=NP_PRIOR, method="smc", seed=np.int64(1))
                    answer = await stream.update(NP_OBS[:2], seq=np.int64(1))
                    assert isinstance(answer, Posterior) and answer.step == 2
                    answers = [a async for a in stream.filter(NP_OBS[2:], batch=np.int64(2))]
                    assert [a.step for a in answers] == [4, 6]
                    assert len(await stream.samples(np.int64(3))) == 3
                    results = await client.batch([{"stream_id": stream.stream_id, "observations": NP_OBS[:1]}])
                    assert results[0]["status"] == 200 and results[0]["stream"].step == 7
        finally:
            await drop_prefix(redis_url, prefix)

    asyncio.run(main())


def test_async_websocket_updates_with_numpy(server):  # noqa: F811
    async def main() -> None:
        async with AsyncClient(server) as client:
            stream = await client.create_stream(model=NP_MODEL, prior=NP_PRIOR, method="smc", seed=np.int64(2))
            async with stream.socket() as ws:
                first = await ws.update(NP_OBS[:2], seq=np.int64(1))
                with pytest.raises(MpflowError) as err:
                    await ws.update(NP_OBS[:1], seq=7)
                assert err.value.status == 409
            assert first.step == 2 and (await stream.get()).step == 2
            with pytest.raises(MpflowError) as err:
                async with client.stream("no-such-stream").socket() as ws:
                    await ws.update(NP_OBS[:1])
            assert err.value.status == 404

    asyncio.run(main())

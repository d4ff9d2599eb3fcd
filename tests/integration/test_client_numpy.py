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
        assert set(answer.quantiles) == {"0.025", "0.05", "0.5", "0.95", "0.975"}  # the API's keys
        quantiles = answer.quantiles
        assert quantiles[0.5].shape == (2,) and quantiles[0.5] is quantiles["0.5"] and 0.975 in quantiles
        single = stream.update([np.array([0.1, 0.2])])  # a list of arrays, without seq
        assert single.step == 3


def test_steps_carry_the_increments_standard_error_where_the_method_reports_one(server):  # noqa: F811
    """``mpf``'s marginal filter (its default on SV) reports each increment's standard error; ``smc`` does not."""
    sv = {"family": "stochastic_volatility", "params": {}}
    prior = {"type": "gaussian", "mean": [-1.0], "cov": [[0.5]]}
    with Client(server) as client:
        mpf = client.create_stream(model=sv, prior=prior, method="mpf", num_particles=128, seed=3)
        steps = mpf.update(np.array([[0.2], [-0.4], [2.5]])).steps
        assert steps.log_evidence_sd.shape == (3,) and ((steps.log_evidence_sd > 0) & (steps.log_evidence_sd < 1)).all()
        assert np.isnan(_np_stream(client).update(NP_OBS[:2]).steps.log_evidence_sd).all()
    if HAS_PANDAS:
        assert "log_evidence_sd" in steps.to_pandas()


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
        gappy = client.batch([{"stream_id": b.stream_id, "observations": np.array([[np.nan, 0.3]])}])
        assert gappy[0]["status"] == 200 and b.history().observations[-1] == [None, 0.3]  # NaN: a missing entry
        with pytest.raises(MpflowError, match=r"updates\[1\]\.observations\[0\]\[0\]: -inf is not a number"):
            client.batch([updates[0], {"stream_id": b.stream_id, "observations": np.array([[-np.inf, 0.3]])}])
        assert (a.get().step, b.get().step) == (2, 2)  # nothing was sent


def test_websocket_updates_with_numpy(server):  # noqa: F811
    with Client(server) as client:
        stream = _np_stream(client)
        with stream.socket() as ws:
            first = ws.update(NP_OBS[:2], seq=np.int64(1))
            second = ws.update(NP_OBS[2:3], seq=np.int64(3), return_samples=np.int64(3))
            duplicate = ws.update(NP_OBS[2:3], seq=3)
            gappy = ws.update(np.array([[np.nan, 0.2]]), seq=4)  # NaN: a missing entry
            with pytest.raises(MpflowError, match=r"observations\[0\]\[1\]: \+inf is not a number"):
                ws.update(np.array([[0.1, np.inf]]), seq=5)
            with pytest.raises(MpflowError) as err:
                ws.update(NP_OBS[:1], seq=9)  # a gap: the error frame, raised with its status
            assert (err.value.status, err.value.code) == (409, "seq_conflict")
        assert (first.step, second.step, duplicate["duplicate"]) == (2, 3, True)
        assert second.samples.shape == (3, 2) and gappy.step == 4 and stream.get().step == 4
        assert stream.history().observations[-1] == [None, 0.2]
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
    assert list(frame.index) == ["x0", "x1"] and list(frame.columns) == [
        "mean",
        "std",
        "q0.025",
        "q0.05",
        "q0.5",
        "q0.95",
        "q0.975",
    ]
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


# ------------------------------------------------------------------ missing values, pandas tables, numpy reads
CT_MODEL = {  # continuous time, one observed dimension: steps of any dt, and a Series of scalars
    "family": "lds",
    "params": {"F": [[0.0, 1.0], [0.0, 0.0]], "Qc": [[0.0, 0.0], [0.0, 0.5]], "B": [[1.0, 0.0]]},
}


def _kalman(client: Client, model: dict = NP_MODEL):
    return client.create_stream(model=model, prior=NP_PRIOR, method="kalman")


def test_nan_and_none_entries_are_sent_as_missing_entries(server):  # noqa: F811
    with Client(server) as client:
        gappy, plain, filtered = _kalman(client), _kalman(client), _kalman(client)
        sent = gappy.update(np.array([[0.5, np.nan], [np.nan, np.nan], [0.2, np.float32(0.4)]]), seq=1)
        # np.float32(0.4) is 0.4000000059604645, and kalman computes in float64 from the numbers sent
        expected = plain.update([[0.5, None], None, [0.2, float(np.float32(0.4))]], seq=1)
        assert sent.step == 3 and sent["summary"] == expected["summary"]
        assert np.isnan(sent.steps.log_evidence_increment[1])  # NaN everywhere: a step without a measurement
        answers = list(filtered.filter(np.array([[0.5, np.nan], [np.nan, np.nan], [0.2, np.float32(0.4)]]), batch=2))
        assert answers[-1]["summary"] == expected["summary"]
        assert gappy.history().observations[:2] == [[0.5, None], [None, None]]  # posted as null


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (np.array([[0.5, 0.1], [0.2, np.inf]]), "observations[1][1]: +inf is not a number; send NaN/None"),
        ([[0.5, 0.1], [-np.inf, 0.2]], "observations[1][0]: -inf is not a number; send NaN/None"),
        ([[0.5, "0.1"]], "observations[0][1]: a string ('0.1') is not a number"),
        ([[0.5, np.True_]], "observations[0][1]: a boolean (True) is not a number"),
        ([[0.5, object()]], "observations[0][1]: a value of type 'object' is not a number"),
    ],
)
def test_what_cannot_be_sent_raises_the_clients_error_before_sending(server, bad, message):  # noqa: F811
    with Client(server) as client:
        stream = _kalman(client)
        stream.update(NP_OBS[:1])
        with pytest.raises(MpflowError) as err:
            stream.update(bad)
        assert (err.value.status, err.value.code) == (None, "invalid_request")
        assert err.value.message.startswith(message)
        with pytest.raises(MpflowError, match=r"observations\[4\]\[1\]: \+inf"):  # checked before the first request
            list(stream.filter(np.vstack([NP_OBS[:4], [[0.1, np.inf]]]), batch=1))
        with pytest.raises(MpflowError, match=r"observations\[0\]\.dt: NaN is not a number"):
            stream.update([0.1, 0.2], dt=np.nan)
        assert stream.get().step == 1  # nothing was sent


@pytest.mark.skipif(not HAS_PANDAS, reason="pandas is not installed")
def test_dataframes_by_name_and_by_position(server):  # noqa: F811
    import pandas as pd

    frame = pd.DataFrame({"y1": NP_OBS[:, 1], "note": np.arange(6) * 100.0, "y0": NP_OBS[:, 0]})
    with Client(server) as client:
        expected = _kalman(client).update(NP_OBS)
        by_name = _kalman(client).update(frame, columns=["y0", "y1"])
        assert by_name.step == 6 and by_name["summary"] == expected["summary"]
        by_position = _kalman(client).filter(frame, columns=[2, 0], batch=4)  # a DataFrame in, its estimates out
        assert list(by_position.index) == [1, 2, 3, 4, 5, 6]
        assert by_position[["mean_x0", "mean_x1"]].iloc[-1].tolist() == expected["summary"]["mean"]
        in_order = _kalman(client).update(frame[["y0", "y1"]])  # no columns=: every column, in order
        assert in_order["summary"] == expected["summary"]
        gappy = frame[["y0", "y1"]].copy()
        gappy.iloc[2, 1] = np.nan  # pandas' missing value: a missing entry
        obs = NP_OBS.tolist()
        obs[2][1] = None
        assert _kalman(client).update(gappy)["summary"] == _kalman(client).update(obs)["summary"]
        stream = _kalman(client)
        with pytest.raises(MpflowError, match=r"columns: 'y2' is not a column of the DataFrame"):
            stream.update(frame, columns=["y0", "y2"])
        with pytest.raises(MpflowError, match=r"columns: position 3 is outside the DataFrame's 3 columns"):
            stream.update(frame, columns=[0, 3])
        with pytest.raises(MpflowError, match=r"observations\[1\]\[0\]: \+inf"):
            stream.update(frame.replace(NP_OBS[1, 0], np.inf), columns=["y0", "y1"])
        assert stream.get().step == 0


@pytest.mark.skipif(not HAS_PANDAS, reason="pandas is not installed")
def test_a_dt_column_gives_each_steps_dt_and_a_series_is_one_entry_per_step(server):  # noqa: F811
    import pandas as pd

    values, dts = [0.3, 0.9, np.nan, 1.4], [0.5, 2.0, 1.0, 0.25]
    with Client(server) as client:
        timed = _kalman(client, CT_MODEL)
        answer = timed.update(pd.DataFrame({"position": values, "dt": dts}))
        items = [{"value": [v], "dt": d} for v, d in zip([0.3, 0.9, None, 1.4], dts, strict=True)]
        assert answer["summary"] == _kalman(client, CT_MODEL).update(items)["summary"]
        assert timed.history().dt.tolist() == dts
        filtered = _kalman(client, CT_MODEL).filter(pd.DataFrame({"dt": dts, "position": values}), batch=3)
        assert filtered["mean_x0"].tolist() == [s["mean"][0] for s in answer["per_step"]]
        with pytest.raises(MpflowError, match="dt: a DataFrame gives each step's dt in its 'dt' column"):
            timed.update(pd.DataFrame({"position": values}), dt=0.5)

        series = _kalman(client, CT_MODEL).update(pd.Series(values, name="position"))
        expected = _kalman(client, CT_MODEL).update([[0.3], [0.9], None, [1.4]])
        assert series.step == 4 and series["summary"] == expected["summary"]
        streamed = _kalman(client, CT_MODEL).filter(pd.Series(values))
        assert list(streamed.index) == [1, 2, 3, 4] and streamed["mean_x0"].iloc[-1] == expected["summary"]["mean"][0]


def test_every_read_returns_numpy(server):  # noqa: F811
    with Client(server) as client:
        stream = _np_stream(client)
        stream.update(NP_OBS[:2])
        samples = stream.samples(5)
        assert isinstance(samples, np.ndarray) and samples.shape == (5, 2) and samples.dtype == np.float64
        particles = stream.particles()
        assert particles["particles"].shape == (64, 2) and particles["log_weights"].shape == (64,)
        forecast = stream.forecast(3, samples=4)
        assert forecast["step"] == 2 and [h["step"] for h in forecast["forecast"]] == [3, 4, 5]
        for horizon in forecast["forecast"]:
            for part in (horizon["state"], horizon["observation"]):
                assert part["mean"].shape == (2,) and part["cov"].shape == (2, 2) and part["samples"].shape == (4, 2)
                assert set(part["quantiles"]) == {"0.025", "0.05", "0.5", "0.95", "0.975"}
                assert part["quantiles"]["0.5"].shape == (2,) and part["quantiles"][0.5] is part["quantiles"]["0.5"]
        assert (
            np.diag(forecast["forecast"][2]["state"]["cov"]) > np.diag(forecast["forecast"][0]["state"]["cov"])
        ).all()

    async def main() -> None:
        async with AsyncClient(server) as client:
            stream = await client.create_stream(model=NP_MODEL, prior=NP_PRIOR, method="kalman")
            samples = await stream.samples(3)
            assert isinstance(samples, np.ndarray) and samples.shape == (3, 2)
            assert (await stream.forecast(2))["forecast"][1]["state"]["cov"].shape == (2, 2)
            assert isinstance((await stream.particles())["log_weights"], np.ndarray)

    asyncio.run(main())

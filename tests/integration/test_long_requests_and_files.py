"""Long observation requests and whole data files against a real server and a real Redis: a 400-observation POST
(applied as run jobs on the update engine, at most ``RUN_STEPS`` = 128 steps each: several here) gives the same
``per_step`` answers as 400 single POSTs; ``mpflow
filter --data --server`` gives the same estimates as in-process; ``stream.filter(DataFrame)`` returns the per-step
estimates as a DataFrame."""

from __future__ import annotations

import asyncio
import json
import math
import uuid
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
from mpflow.service.client import Client
from mpflow.service.settings import Settings

from mpflow.cli.main import main
from tests.harness.server import drop_prefix, serve_in_process, serve_in_thread

pd = pytest.importorskip("pandas")

MODEL_1D = {"family": "lds", "params": {"A": [[0.9]], "B": [[1.0]], "R": [[0.5]]}}
PRIOR_1D = {"type": "gaussian", "mean": [0.0], "cov": [[1.0]]}


def _settings(redis_url: str, prefix: str) -> Settings:
    return Settings(redis_url=redis_url, redis_prefix=prefix, log_level="WARNING")


@pytest.fixture(scope="module")
def server(redis_url: str) -> Iterator[str]:
    prefix = f"mpflowtest-{uuid.uuid4().hex}"
    try:
        with serve_in_thread(_settings(redis_url, prefix)) as url:
            yield url
    finally:
        asyncio.run(drop_prefix(redis_url, prefix))


#: kalman 400 steps (at least four run jobs, the last partial), smc 300 (three); more steps add only single POSTs
@pytest.mark.parametrize(("method", "steps"), [("kalman", 400), ("smc", 300)])
def test_one_long_post_answers_as_many_single_posts(redis_url, method, steps):
    """The same seeded stream fed ``steps`` observations in one POST and one per POST: every per_step entry (mean,
    std, quantiles, log-evidence increment, ESS) and the final state agree; ``seq`` and ``step`` count every one;
    a repeat of the long POST is a duplicate that applies nothing."""
    obs = np.random.default_rng(7).normal(size=(steps, 1)).tolist()
    obs[3] = [None]  # a step without a measurement inside the runs
    body = {"model": MODEL_1D, "prior": PRIOR_1D, "method": method, "num_particles": 64, "seed": 11}

    async def scenario() -> tuple[dict, list[dict], dict, list[dict]]:
        prefix = f"mpflowtest-{uuid.uuid4().hex}"
        try:
            async with serve_in_process(_settings(redis_url, prefix)) as (_, http):
                one = (await http.post("/v1/streams", json=body)).json()["stream_id"]
                many = (await http.post("/v1/streams", json=body)).json()["stream_id"]
                long = await http.post(f"/v1/streams/{one}/observations", json={"observations": obs, "seq": 1})
                assert long.status_code == 200, long.text
                again = await http.post(f"/v1/streams/{one}/observations", json={"observations": obs, "seq": 1})
                singles = []
                for i, o in enumerate(obs):
                    r = await http.post(f"/v1/streams/{many}/observations", json={"observations": [o], "seq": i + 1})
                    assert r.status_code == 200, r.text
                    singles += r.json()["per_step"]
                last = (await http.get(f"/v1/streams/{many}")).json()
                return long.json(), singles, last, again.json()
        finally:
            await drop_prefix(redis_url, prefix)

    long, singles, last, again = asyncio.run(scenario())
    assert long["step"] == last["step"] == steps and len(long["per_step"]) == steps
    assert [s["step"] for s in long["per_step"]] == list(range(1, steps + 1))
    assert again["duplicate"] is True and again["per_step"] == [] and again["step"] == steps
    for got, want in zip(long["per_step"], singles, strict=True):
        assert got.keys() == want.keys()
        for key in ("mean", "std", "log_evidence_increment", "ess"):
            if want[key] is None:  # a Gaussian state (kalman) has no particle ESS
                assert got[key] is None, (got["step"], key)
                continue
            assert got[key] == pytest.approx(want[key], rel=1e-9, abs=1e-12), (got["step"], key)
        for q, row in want["quantiles"].items():
            assert got["quantiles"][q] == pytest.approx(row, rel=1e-9, abs=1e-12)
    assert long["summary"]["mean"] == pytest.approx(last["summary"]["mean"], rel=1e-9)
    assert long["per_step"][3]["log_evidence_increment"] is None  # no measurement: no score


def _write_model(path, **extra):
    path.write_text(json.dumps({"model": MODEL_1D, "prior": PRIOR_1D, **extra}))
    return path


def test_a_file_through_a_server_gives_the_in_process_estimates(server, tmp_path, capsys):
    """``mpflow filter --data`` of a CSV with a gap, in-process and through the server, with a seeded ``smc``
    stream: the same numbers (the same creation and stepping code, the same seed), sent in several requests."""
    values = np.random.default_rng(3).normal(size=40)
    values[5] = math.nan
    data = tmp_path / "readings.csv"
    pd.DataFrame({"y": values}).to_csv(data, index=False)
    model = _write_model(tmp_path / "model.json", method="smc", num_particles=128, seed=5)
    local, remote = tmp_path / "local.csv", tmp_path / "remote.csv"
    common = ["filter", "--quiet", "--data", str(data), "--model", str(model), "--batch", "15"]
    assert main([*common, "--out", str(local)]) == 0, capsys.readouterr().err
    assert main([*common, "--out", str(remote), "--server", server]) == 0, capsys.readouterr().err
    a, b = pd.read_csv(local, index_col="step"), pd.read_csv(remote, index_col="step")
    assert list(a.columns) == list(b.columns) and len(a) == 40
    np.testing.assert_allclose(a.to_numpy(), b.to_numpy(), rtol=1e-9, atol=1e-12)
    assert math.isnan(a["log_evidence_increment"].iloc[5])  # no measurement: no score


def test_a_bad_row_through_a_server_is_named_by_its_row(server, tmp_path, capsys):
    data = tmp_path / "readings.csv"
    data.write_text("y,z\n0.5,1.0\n")
    model = _write_model(tmp_path / "model.json", method="kalman")
    code = main(["filter", "--quiet", "--data", str(data), "--model", str(model), "--server", server])
    assert code == 2
    assert "row 1: expected shape [1], got [2]" in capsys.readouterr().err


def test_stream_filter_takes_a_dataframe_and_returns_the_estimates(server):
    """Columns by name and by position, a dt column, NaN as a missing entry; the rows sent in batches (``batch``)
    within the server's limit; the estimates equal the per_step answers of the same observations posted as
    lists."""
    ct_model = {"family": "lds", "params": {"F": [[-0.3]], "B": [[1.0]]}}
    values, dts = [0.3, 0.9, np.nan, 1.4, 0.2, -0.5, 0.8], [0.5, 2.0, 1.0, 0.25, 1.0, 1.0, 0.5]
    frame = pd.DataFrame({"dt": dts, "note": range(7), "position": values})
    with Client(server) as client:
        stream = client.create_stream(ct_model, PRIOR_1D, method="kalman", state_names=["level"])
        estimates = stream.filter(frame, columns=["position"], batch=3)
        assert stream.get().step == 7
        by_position = client.create_stream(ct_model, PRIOR_1D, method="kalman").filter(frame, columns=[2])
        items = [{"value": [None if math.isnan(v) else v], "dt": d} for v, d in zip(values, dts, strict=True)]
        reference = client.create_stream(ct_model, PRIOR_1D, method="kalman").update(items)
    assert list(estimates.index) == list(range(1, 8)) and estimates.index.name == "step"
    want = reference["per_step"]
    np.testing.assert_allclose(estimates["mean_level"], [s["mean"][0] for s in want], atol=1e-12)
    np.testing.assert_allclose(estimates["std_level"], [s["std"][0] for s in want], atol=1e-12)
    np.testing.assert_allclose(estimates["q0.95_level"], [s["quantiles"]["0.95"][0] for s in want], atol=1e-12)
    assert math.isnan(estimates["log_evidence_increment"].iloc[2])  # NaN: no measurement, no score
    np.testing.assert_allclose(by_position["mean_x0"], estimates["mean_level"], atol=1e-12)


def test_the_async_client_awaits_a_dataframes_estimates(redis_url):
    from mpflow.service.client import AsyncClient

    prefix = f"mpflowtest-{uuid.uuid4().hex}"
    frame = pd.DataFrame({"y": [0.5, np.nan, 1.2, 0.3, -0.4]})

    async def main():
        try:
            async with serve_in_process(_settings(redis_url, prefix)) as (app, _):
                transport = httpx.ASGITransport(app=app)
                async with AsyncClient("http://mpflow", transport=transport) as client:
                    stream = await client.create_stream(MODEL_1D, PRIOR_1D, method="kalman")
                    estimates = await stream.filter(frame, batch=2)
                    reference = await (await client.create_stream(MODEL_1D, PRIOR_1D, method="kalman")).update(frame)
                    answers = [a async for a in stream.filter([[0.1], [0.2]])]  # a list still yields answers
                    return estimates, reference, answers
        finally:
            await drop_prefix(redis_url, prefix)

    estimates, reference, answers = asyncio.run(main())
    assert list(estimates.index) == [1, 2, 3, 4, 5]
    np.testing.assert_allclose(estimates["mean_x0"], [s["mean"][0] for s in reference["per_step"]], atol=1e-12)
    assert [a["step"] for a in answers] == [6, 7]

"""The Python client's side of issue 19, against a real server and Redis: ``stream.update(None)``,
``stream.update(obs, dt=…, u=…)``, ``filter`` with gaps and ``(t, obs)`` pairs, ``stream.forecast(k)``,
``stream.export()`` / ``client.import_stream(blob)`` (an unsigned snapshot only with ``foreign=True``), sync and
async."""

from __future__ import annotations

import asyncio

import pytest
from mpflow.service.client import AsyncClient, Client, MpflowError

from tests.harness.snapshots import unsigned
from tests.integration import test_client

server = test_client.server  # the uvicorn server in a thread, one per module

MODEL = {
    "family": "lds",
    "params": {"F": [[0.0, 1.0], [0.0, 0.0]], "Qc": [[0.0, 0.0], [0.0, 0.5]], "B": [[1.0, 0.0]], "C": [[0.0], [1.0]]},
}
PRIOR = {"type": "gaussian", "mean": [0.0, 1.0], "cov": [[1.0, 0.0], [0.0, 1.0]]}


def test_sync_client_gaps_time_inputs_forecast_and_snapshots(server: str) -> None:
    with Client(server) as client:
        stream = client.create_stream(MODEL, PRIOR, method="kalman", seed=1)
        doc = stream.update(None)
        assert doc["step"] == 1 and doc["per_step"][0]["log_evidence_increment"] is None
        doc = stream.update([0.7], dt=0.5, u=[0.2])
        assert doc["step"] == 2
        docs = list(stream.filter([(1.0, [1.1]), None, (2.5, [2.0]), [2.2]], batch=2, t0=0.5))
        assert docs[-1]["step"] == 6
        forecast = stream.forecast(3, dt=0.5, samples=4)
        assert forecast["step"] == 6 and [h["step"] for h in forecast["forecast"]] == [7, 8, 9]
        assert len(forecast["forecast"][0]["state"]["samples"]) == 4
        blob = stream.export()
        assert isinstance(blob, bytes)
        copy = client.import_stream(blob, stream_id=f"{stream.stream_id}-copy")
        assert copy.stream_id == f"{stream.stream_id}-copy" and copy.document["step"] == 6
        assert stream.update([[3.0]])["summary"] == copy.update([[3.0]])["summary"]
        with pytest.raises(MpflowError, match="hmac: the snapshot is not signed") as refused:
            client.import_stream(unsigned(blob))
        assert refused.value.code == "untrusted_snapshot"
        assert client.import_stream(unsigned(blob), foreign=True).document["step"] == 6  # on our word


def test_async_client_forecast_and_snapshots(server: str) -> None:
    async def main() -> None:
        async with AsyncClient(server) as client:
            stream = await client.create_stream(MODEL, PRIOR, method="smc", num_particles=64, seed=2)
            await stream.update(None, dt=2.0)
            assert (await stream.forecast(2))["forecast"][1]["t"] == 2.0
            copy = await client.import_stream(await stream.export(), foreign=True)  # ours: accepted either way
            a = await stream.update([[0.5]], seq=2)
            b = await copy.update([[0.5]], seq=2)
            assert a["summary"] == b["summary"]

    asyncio.run(main())

"""``stream.history()`` of the Python client (sync and async) against a real server and Redis (the fixtures of
``test_client``): the kept steps as numpy arrays with their observations, ``limit``, dimensions named by the
stream's ``state_names`` (set at creation), and ``to_pandas()`` where pandas is installed."""

from __future__ import annotations

import asyncio
import importlib.util
import sys

import numpy as np
import pytest
from mpflow.service.client import AsyncClient, Client, MpflowError
from mpflow.service.results import History

from tests.integration.test_client import MODEL, OBS, PRIOR, server  # noqa: F401  (fixture)

NAMES = ["x", "v"]
HAS_PANDAS = importlib.util.find_spec("pandas") is not None


def _posted(client: Client, **extra):
    stream = client.create_stream(model=MODEL, prior=PRIOR, method="smc", num_particles=32, seed=3, **extra)
    answers = [stream.update(OBS[:3]), stream.update([None, {"value": OBS[3], "dt": 1.0}])]
    return stream, [s for a in answers for s in a["per_step"]]


def test_history_as_arrays_with_observations_and_names(server):  # noqa: F811
    with Client(server) as client:
        stream, per_step = _posted(client, state_names=NAMES)
        history = stream.history()
        latest = client.stream(stream.stream_id).history(limit=np.int64(2))  # a handle without a document
        unnamed = _posted(client)[0].history()
    assert isinstance(history, History) and history.names == NAMES and len(history) == 5
    assert history.steps.tolist() == [1, 2, 3, 4, 5] and history.current_step == 5
    np.testing.assert_array_equal(history.mean, np.array([s["mean"] for s in per_step]))
    np.testing.assert_array_equal(history.std, np.array([s["std"] for s in per_step]))
    assert history.observations == [*OBS[:3], None, OBS[3]]
    assert np.isnan(history.dt[:4]).all() and history.dt[4] == 1.0
    assert latest.names == NAMES and latest.steps.tolist() == [4, 5] and latest.mean.shape == (2, 2)
    assert unnamed.names == ["x0", "x1"]


def test_history_limit_above_what_is_kept_is_the_clients_error(server):  # noqa: F811
    with Client(server) as client:
        stream, _ = _posted(client)
        with pytest.raises(MpflowError) as caught:
            stream.history(limit=10**6)
    assert caught.value.status == 422 and "limit" in caught.value.message


def test_async_history(server):  # noqa: F811
    async def main():
        async with AsyncClient(server) as client:
            stream = await client.create_stream(
                model=MODEL, prior=PRIOR, method="smc", num_particles=32, state_names=NAMES
            )
            await stream.update(OBS[:2])
            return await stream.history(), await client.stream(stream.stream_id).history(limit=1)

    history, latest = asyncio.run(main())
    assert history.names == NAMES and history.steps.tolist() == [1, 2] and history.observations == OBS[:2]
    assert latest.steps.tolist() == [2] and latest.names == NAMES


@pytest.mark.skipif(not HAS_PANDAS, reason="pandas is optional and not installed")
def test_history_to_pandas_names_the_columns(server):  # noqa: F811
    with Client(server) as client:
        history = _posted(client, state_names=NAMES)[0].history()
    frame = history.to_pandas()
    assert list(frame.index) == [1, 2, 3, 4, 5] and frame.index.name == "step"
    assert {"mean_x", "mean_v", "std_x", "std_v", "observation", "dt"} <= set(frame.columns)
    np.testing.assert_array_equal(frame["mean_v"].to_numpy(), history.mean[:, 1])


def test_history_to_pandas_without_pandas_says_how_to_get_it(server, monkeypatch):  # noqa: F811
    with Client(server) as client:
        history = _posted(client)[0].history()
    monkeypatch.setitem(sys.modules, "pandas", None)  # as if pandas were not installed
    with pytest.raises(ImportError, match="pip install pandas"):
        history.to_pandas()

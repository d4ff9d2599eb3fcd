"""The load generator of ``benchmarks/service_load.py`` (:mod:`tests.harness.load`) against a real server
(``python -m mpflow serve`` on the real Redis): both HTTP clients complete a short cell without errors and report
their own CPU per request; the aiohttp client turns an API error into the API's error code and the closed loop
resynchronises ``seq``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from mpflow.service.client import MpflowError

from tests.harness import load as sl


@pytest.fixture(scope="module")
def url(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One batching server on a fresh key prefix (dropped afterwards)."""
    with sl.choose_store("redis", redis_url) as store, sl.server(store, True, tmp_path_factory.mktemp("logs")) as u:
        yield u


@pytest.mark.parametrize("client", sorted(sl.CLIENTS))
def test_cell_completes_without_errors(url: str, client: str) -> None:
    row = asyncio.run(sl.run_cell(url, "gpf", 64, 2, warmup_s=0.2, window_s=0.5, client=client))
    assert row["errors"] == {}
    assert row["completed"] >= sl.MIN_COMPLETIONS
    assert row["client_cpu_ms_per_request"] is not None and row["client_cpu_ms_per_request"] > 0
    assert row["p50_ms"] is not None and row["p50_ms"] <= row["p99_ms"]


AHEAD = 3  # steps written out of band before the closed loop starts (it believes the stream is at step 0)


class GapFirst(sl.AiohttpStream):
    """Sends its first update 5 steps ahead (a gap: the server answers 409), then as asked."""

    gapped = False

    async def update(self, observation: list[float], seq: int) -> None:
        if not self.gapped:
            self.gapped = True
            seq += 5
        await super().update(observation, seq)


async def _gap_then_drive(url: str) -> tuple[MpflowError, sl.Tally, int]:
    async with sl.aiohttp_streams(url, 1) as create:
        stream = await create("gpf", 64, 0)
        with pytest.raises(MpflowError) as gap:
            await stream.update([0.1, 0.2], 3)
        for seq in range(1, AHEAD + 1):
            await stream.update([0.1, 0.2], seq)
        gapped = GapFirst(stream.session, stream.document)
        stop, tally = asyncio.Event(), sl.Tally()
        task = asyncio.create_task(sl.drive(gapped, sl.Target(0), [0.0, float("inf")], stop, tally))
        while tally.done < 3:
            await asyncio.sleep(0.01)
        stop.set()
        await task
        step = await stream.step()
        await stream.delete()
        with pytest.raises(MpflowError) as gone:
            await stream.step()
        assert gone.value.status == 404
    return gap.value, tally, step


def test_aiohttp_errors_are_counted_and_seq_resynchronised(url: str) -> None:
    gap, tally, step = asyncio.run(_gap_then_drive(url))
    assert gap.status == 409 and gap.code != "http_409"  # the API's own code, read from its error body
    assert tally.errors == {gap.code: 1}
    # after the 409 the loop re-read the step (AHEAD) and went on from there: every update it completed was
    # applied (without the resync its first AHEAD updates would have been duplicates)
    assert tally.done >= 3 and step == AHEAD + tally.done

"""The exactly-once protocol of :mod:`mpflow.service.engine.sequencing`: the ``seq`` rules (applied / duplicate /
conflict),
the compare-and-set retry loop, the per-stream locks, and the status each refusal carries."""

from __future__ import annotations

import asyncio

import pytest
from mpflow.service import stream_errors
from mpflow.service.engine.sequencing import MAX_WRITE_ATTEMPTS, KeyedLocks, Seq, check_seq, until_written
from mpflow.service.errors import ApiError
from mpflow.service.stream_errors import ConcurrentUpdateError, SeqConflictError


@pytest.mark.parametrize(
    ("seq", "count", "step", "expected"),
    [
        (None, 3, 7, Seq.APPLY),  # no seq: appended
        (8, 1, 7, Seq.APPLY),  # the next step
        (8, 5, 7, Seq.APPLY),
        (1, 1, 0, Seq.APPLY),  # a new stream
        (7, 1, 7, Seq.DUPLICATE),  # the last step again
        (3, 5, 7, Seq.DUPLICATE),  # steps 3..7, all applied
        (1, 7, 7, Seq.DUPLICATE),
    ],
)
def test_seq_rules(seq, count, step, expected):
    assert check_seq(seq, count, step) is expected


@pytest.mark.parametrize(("seq", "count", "step"), [(9, 1, 7), (20, 2, 7), (6, 3, 7), (7, 2, 7), (2, 1, 0)])
def test_a_gap_or_a_partial_overlap_is_a_conflict(seq, count, step):
    with pytest.raises(SeqConflictError) as exc:
        check_seq(seq, count, step)
    assert exc.value.status == 409 and exc.value.code == "seq_conflict"
    assert f"at step {step}" in exc.value.message and "nothing was applied" in exc.value.message


def test_until_written_retries_lost_races_then_gives_up():
    calls = []

    async def lose_twice() -> str | None:
        calls.append(1)
        return "doc" if len(calls) == 3 else None

    assert asyncio.run(until_written(lose_twice)) == "doc" and len(calls) == 3

    calls.clear()

    async def always_lose() -> None:
        calls.append(1)

    with pytest.raises(ConcurrentUpdateError) as exc:
        asyncio.run(until_written(always_lose))
    assert len(calls) == MAX_WRITE_ATTEMPTS and exc.value.status == 409 and exc.value.code == "concurrent_update"


def test_keyed_locks_serialise_one_key_and_are_dropped_when_free():
    locks = KeyedLocks()
    order: list[str] = []

    async def hold(key: str, tag: str) -> None:
        async with locks.hold(key):
            order.append(f"{tag}+")
            await asyncio.sleep(0.01)
            order.append(f"{tag}-")

    async def main() -> None:
        await asyncio.gather(hold("a", "1"), hold("a", "2"), hold("b", "3"))

    asyncio.run(main())
    assert order.index("1-") < order.index("2+")  # one key: one at a time
    assert order.index("3+") < order.index("1-")  # another key: concurrently
    assert locks._locks == {}


def test_every_stream_error_fixes_its_status_and_code():
    classes = [getattr(stream_errors, name) for name in stream_errors.__all__ if name != "StreamError"]
    seen = set()
    for cls in classes:
        err = cls("field: what to fix")
        assert isinstance(err, ApiError) and err.status == cls.STATUS and err.code == cls.CODE
        assert err.body() == {"error": {"code": cls.CODE, "message": "field: what to fix"}}
        seen.add(cls.CODE)
    assert len(seen) == len(classes)

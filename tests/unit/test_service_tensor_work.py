"""Where :class:`mpflow.service.engine.tensor_work.TensorWork` runs tensor work: small work on the event loop while at
most one observation request is in flight, everything else on the engine's auxiliary threads."""

from __future__ import annotations

import asyncio
import threading

from mpflow.service.engine.tensor_work import INLINE_MAX_ELEMENTS, TensorWork, small


class Engine:
    """The one method of the update engine that TensorWork uses, on a thread of its own."""

    async def run(self, fn, *args):
        return await asyncio.to_thread(fn, *args)


def meta(n: int, d: int = 2) -> dict:
    return {"num_particles": n, "state_dim": d}


def where(work: TensorWork, m: dict, **kw) -> str:
    loop_thread = threading.get_ident()

    def fn() -> str:
        return "loop" if threading.get_ident() == loop_thread else "thread"

    return asyncio.run(work.run(m, fn, **kw))


def test_small_counts_particles_or_draws_times_dimension():
    assert small(meta(INLINE_MAX_ELEMENTS // 2, 2))
    assert not small(meta(INLINE_MAX_ELEMENTS // 2 + 1, 2))
    assert not small(meta(16, 2), draws=INLINE_MAX_ELEMENTS)


def test_placement():
    work = TensorWork(Engine())  # type: ignore[arg-type]
    assert where(work, meta(256)) == "loop"
    assert where(work, meta(256), draws=INLINE_MAX_ELEMENTS) == "thread"
    assert where(work, meta(INLINE_MAX_ELEMENTS)) == "thread"
    with work.observation():
        assert where(work, meta(256)) == "loop"  # the one request in flight is this one
        with work.observation():
            assert where(work, meta(256)) == "thread"
    assert work.observing == 0
    assert asyncio.run(work.off_loop(lambda: threading.current_thread().name)) != threading.current_thread().name

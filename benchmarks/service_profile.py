"""Where the milliseconds of one observation request go: ``python -m benchmarks.service_profile [--cprofile]``.

One stream (``lds``, d = 2, N particles, method ``mpf`` by default) is served by uvicorn in a thread of this
process (:func:`service.testing.serve_in_thread`, real HTTP, the local Redis or ``--redis-url``) and fed
single-observation updates, one after the other, by :class:`service.client.Client`. Stage timers are wrapped
around the service's own functions (class-level wrappers, so nothing in the service changes):

* ``client e2e``: the request as the client sees it (``Client.request``);
* ``app``: the ASGI app, outermost middleware to the last byte (:class:`service.middleware.Observe`);
* ``observe()``: :meth:`StreamService.observe`, the handler's work; ``app − observe()`` is routing, body
  parsing/validation (pydantic), the JSON answer and the middleware; ``client e2e − app`` is HTTP (uvicorn,
  sockets, httpx);
* inside ``observe()``: ``store.get`` / ``store.compare_and_set`` (Redis round trips), ``_resolve`` (the
  cached model and updater), ``_decode`` (the stored state), ``engine.update`` (queue, thread hop, the update
  and the job's ``after`` hook) with ``updater.update`` (compute only) and ``_finish`` (summary, encode the state,
  on the worker) inside it, each ``engine.run(fn)`` (aux thread hop + fn) where one happens.

The table gives the median and mean ms per request of each stage over ``--requests`` requests (after
``--warmup``). ``--cprofile`` also profiles the event-loop thread (the uvicorn thread) with cProfile and prints
the top functions by cumulative time. Timings on a shared machine vary; compare runs taken close together.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import functools
import io
import os
import pstats
import statistics
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from service import middleware, store, streams, summary
from service.client import Client
from service.engine import UpdateEngine
from service.settings import Settings
from service.testing import serve_in_thread

TIMES: dict[str, list[float]] = defaultdict(list)
LOOP: list[asyncio.AbstractEventLoop] = []  # the server's event loop, seen by the first observe()
LDS_D2 = {"A": [[0.9, 0.2], [-0.2, 0.9]], "Q": [[0.1, 0.0], [0.0, 0.1]], "B": [[1.0, 0.0], [0.0, 1.0]]}
PRIOR_D2 = {"type": "gaussian", "mean": [0.0, 0.0], "cov": [[1.0, 0.0], [0.0, 1.0]]}


def _record(name: str, t0: float) -> None:
    TIMES[name].append(time.perf_counter() - t0)


def _timed_async(name: Callable[..., str] | str, fn: Callable) -> Callable:
    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return await fn(*args, **kwargs)
        finally:
            _record(name(*args, **kwargs) if callable(name) else name, t0)

    return wrapper


def _timed(name: str, fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _record(name, t0)

    return wrapper


def instrument() -> None:
    """Wrap the stages (module docstring) at class level."""
    observe_app = middleware.Observe.__call__

    async def app(self: middleware.Observe, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":  # not the lifespan
            return await observe_app(self, scope, receive, send)
        t0 = time.perf_counter()
        try:
            return await observe_app(self, scope, receive, send)
        finally:
            _record("app", t0)

    middleware.Observe.__call__ = app  # type: ignore[method-assign]
    observe = _timed_async("observe()", streams.StreamService.observe)

    async def observe_seen(*args: Any, **kwargs: Any) -> Any:
        if not LOOP:
            LOOP.append(asyncio.get_running_loop())
        return await observe(*args, **kwargs)

    streams.StreamService.observe = observe_seen  # type: ignore[method-assign]
    store.StreamStore.get = _timed_async("  store.get", store.StreamStore.get)
    store.StreamStore.compare_and_set = _timed_async("  store.compare_and_set", store.StreamStore.compare_and_set)
    UpdateEngine.update = _timed_async("  engine.update (queue+hop+update)", UpdateEngine.update)
    for name in ("_resolve", "_finish", "_view"):  # the tensor work, wherever it runs
        setattr(streams.StreamService, name, _timed(f"    {name}", getattr(streams.StreamService, name)))
    streams.StreamService._decode = _timed_async("    _decode", streams.StreamService._decode)
    summary.step_summary = _timed("    step_summary", summary.step_summary)
    original_run = UpdateEngine.run

    async def run(self: UpdateEngine, fn: Callable, *args: Any) -> Any:
        name = getattr(fn, "__name__", "fn")
        t0 = time.perf_counter()
        try:
            return await original_run(self, fn, *args)
        finally:
            _record(f"  engine.run({name}) (hop+fn)", t0)

    UpdateEngine.run = run  # type: ignore[method-assign]
    original_call = UpdateEngine._call

    def call(self: UpdateEngine, jobs: list) -> list:
        upd = jobs[0].updater
        if not getattr(upd, "_profiled", False):
            upd.update = _timed("    updater.update (compute)", upd.update)
            upd._profiled = True
        return _timed("    engine._call (in worker)", original_call)(self, jobs)

    UpdateEngine._call = call  # type: ignore[method-assign]
    Client.request = _timed("client e2e", Client.request)


def table(n: int) -> str:
    lines = ["| stage | median ms | mean ms | calls/request |", "|---|---:|---:|---:|"]
    for name, xs in TIMES.items():
        med, mean = statistics.median(xs) * 1e3, statistics.fmean(xs) * 1e3
        lines.append(f"| {name} | {med:.3f} | {mean:.3f} | {len(xs) / n:.1f} |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> str:
    torch.set_num_threads(1)
    instrument()
    prefix = f"mpflowprof-{uuid.uuid4().hex[:12]}"
    settings = Settings(redis_url=args.redis_url, redis_prefix=prefix, log_level="WARNING")
    profiler = cProfile.Profile() if args.cprofile else None
    with serve_in_thread(settings) as url, Client(url) as client:
        stream = client.create_stream(
            model={"family": "lds", "params": LDS_D2},
            prior=PRIOR_D2,
            method=args.method,
            num_particles=args.particles,
            seed=0,
        )
        gen = torch.Generator().manual_seed(0)
        obs = torch.randn(args.warmup + args.requests, 2, generator=gen).tolist()
        for i in range(args.warmup):
            stream.update([obs[i]], seq=i + 1)
        TIMES.clear()
        if profiler is not None:
            _in_loop_thread(profiler.enable)
        for i in range(args.warmup, args.warmup + args.requests):
            stream.update([obs[i]], seq=i + 1)
        if profiler is not None:
            _in_loop_thread(profiler.disable)
        stream.delete()
    out = [
        f"one stream, lds d=2, method {args.method}, N={args.particles}, {args.requests} single-observation "
        f"requests (after {args.warmup} warm-up), Redis {args.redis_url}",
        "",
        table(args.requests),
    ]
    if profiler is not None:
        buf = io.StringIO()
        pstats.Stats(profiler, stream=buf).sort_stats("cumulative").print_stats(args.top)
        out += ["", "cProfile of the event-loop thread (cumulative):", buf.getvalue()]
    return "\n".join(out)


def _in_loop_thread(fn: Callable[[], None]) -> None:
    """Run ``fn`` on the server's event-loop thread (cProfile.enable/disable act on the calling thread)."""
    done = threading.Event()

    def call() -> None:
        fn()
        done.set()

    LOOP[0].call_soon_threadsafe(call)
    if not done.wait(10):
        raise RuntimeError("the server's event loop did not answer")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.service_profile", description=__doc__.split("\n")[0])
    p.add_argument("--method", default="mpf")
    p.add_argument("--particles", type=int, default=256)
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--redis-url", default=os.environ.get("MPFLOW_REDIS_URL") or "redis://127.0.0.1:6379/0")
    p.add_argument("--cprofile", action="store_true", help="also cProfile the event-loop thread")
    p.add_argument("--top", type=int, default=40, help="functions listed by --cprofile")
    print(run(p.parse_args(argv)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

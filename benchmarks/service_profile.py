"""Where the milliseconds of one observation request go: ``python -m benchmarks.service_profile [--cprofile]``.

One stream (``lds``, d = 2, N particles, method ``mpf`` by default) is served by uvicorn in a thread of this
process (:func:`tests.harness.server.serve_in_thread`, real HTTP, the local Redis or ``--redis-url``) and fed
single-observation updates, one after the other, by :class:`mpflow.client.http.Client`. Stage timers are wrapped
around the service's own functions (class-level wrappers, so nothing in the service changes):

* ``client e2e``: the request as the client sees it (``Client.request``);
* ``app``: the ASGI app, outermost middleware to the last byte (:class:`mpflow.service.api.middleware.Observe`);
* ``observe()``: :meth:`StreamService.observe`, the handler's work; ``app − observe()`` is routing, body
  parsing/validation (pydantic), the JSON answer and the middleware; ``client e2e − app`` is HTTP (uvicorn,
  sockets, httpx);
* inside ``observe()``: ``store.get`` / ``store.compare_and_set`` (Redis round trips), ``resolve`` (the
  cached model and updater, :meth:`mpflow.service.engine.methods.Methods.resolve`), ``decode`` (the stored state,
  :meth:`mpflow.service.engine.tensor_work.TensorWork.decode`), ``engine.update`` (queue, thread hop, the update and the
  job's ``after`` hook) with ``updater.update`` (compute only) and ``finish`` (summary, encode the state, draws:
  :func:`mpflow.service.engine.stepping.finish`, on the worker) inside it, each ``engine.run(fn)`` (aux thread hop + fn)
  where one happens.

A stage whose function the service no longer has is left out and listed (``not_instrumented``): the wrappers
name the service's own functions, which move as the service is refactored.

The table gives the median and mean ms per request of each stage over ``--requests`` requests (after
``--warmup``; 300 and 30, or 50 and 5 with ``--quick``). ``--cprofile`` also profiles the event-loop thread (the
uvicorn thread) with cProfile and prints the top functions by cumulative time. Timings on a shared machine vary;
compare runs taken close together. Results: the table on stdout, ``<out>.json`` and ``<out>.png`` (the stages'
medians; ``--out`` defaults to ``benchmarks/results/service_profile``, ``service_profile-quick``, git-ignored, with
``--quick``).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import datetime as dt
import functools
import io
import os
import pstats
import statistics
import textwrap
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from mpflow.service.api import middleware
from mpflow.service.engine import methods, stepping, summary, tensor_work
from mpflow.service.engine.update_engine import UpdateEngine
from mpflow.service.settings import Settings
from mpflow.service.store import stream_store as store
from mpflow.service.streams import service as streams

from benchmarks import report
from mpflow.client.http import Client
from tests.harness.server import serve_in_thread

NAME = "service_profile"
COUNTS = {"full": {"requests": 300, "warmup": 30}, "quick": {"requests": 50, "warmup": 5}}
TIMES: dict[str, list[float]] = defaultdict(list)
MISSING: list[str] = []  # stages whose function was not found (``not_instrumented``)
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


def _wrap(owner: Any, attr: str, label: str) -> None:
    """Replace ``owner.attr`` by a timed wrapper recording under ``label`` (async functions stay async); a
    missing attribute is listed in :data:`MISSING` instead."""
    fn = getattr(owner, attr, None)
    if fn is None:
        MISSING.append(f"{getattr(owner, '__name__', owner)}.{attr}")
        return
    wrap = _timed_async if asyncio.iscoroutinefunction(fn) else _timed
    setattr(owner, attr, wrap(label, fn))


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
    _wrap(store.StreamStore, "get", "  store.get")
    _wrap(store.StreamStore, "compare_and_set", "  store.compare_and_set")
    _wrap(UpdateEngine, "update", "  engine.update (queue+hop+update)")
    # the tensor work, wherever it runs (module-level functions are looked up at call time: wrapped in place)
    _wrap(methods.Methods, "resolve", "    resolve")
    _wrap(tensor_work.TensorWork, "decode", "    decode")
    _wrap(stepping, "finish", "    finish")
    _wrap(summary, "step_summary", "    step_summary")
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


def stages(n: int) -> list[dict[str, Any]]:
    """Per stage: median and mean ms, calls per request (``n`` requests)."""
    return [
        {
            "stage": name,
            "median_ms": round(statistics.median(xs) * 1e3, 4),
            "mean_ms": round(statistics.fmean(xs) * 1e3, 4),
            "calls_per_request": round(len(xs) / n, 2),
        }
        for name, xs in TIMES.items()
    ]


def table(rows: list[dict[str, Any]]) -> str:
    cells = (
        (r["stage"], f"{r['median_ms']:.3f}", f"{r['mean_ms']:.3f}", f"{r['calls_per_request']:.1f}") for r in rows
    )
    return report.markdown_table(("stage", "median ms", "mean ms", "calls/request"), cells, "lrrr")


def plot(result: dict[str, Any], path: Path) -> None:
    """The stages' median ms per request; a nested stage is marked with a dot per level (``· · finish``)."""
    rows = result["stages"]
    with report.figure(path, figsize=(8, 0.3 * len(rows) + 1.5)) as (fig, ax):
        ax.barh(range(len(rows)), [r["median_ms"] for r in rows], color="tab:blue")
        ax.set_yticks(range(len(rows)))
        depth = [(len(r["stage"]) - len(r["stage"].lstrip())) // 2 for r in rows]
        ax.set_yticklabels([f"{'· ' * k}{r['stage'].strip()}" for k, r in zip(depth, rows, strict=True)], fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("median ms per request")
        ax.grid(axis="x", alpha=0.3)
        ax.set_title(textwrap.fill(result["setup"], 100), fontsize=8)
        fig.tight_layout()


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Serve, warm up, time ``args.requests`` requests stage by stage (module docstring); the result to write."""
    torch.set_num_threads(1)
    instrument()
    prefix = f"mpflowprof-{uuid.uuid4().hex[:12]}"
    settings = Settings(redis_url=args.redis_url, redis_prefix=prefix, log_level="WARNING")
    profiler = cProfile.Profile() if args.cprofile else None
    load_before = os.getloadavg()
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
    result: dict[str, Any] = {
        "benchmark": NAME,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "quick": bool(args.quick),
        "setup": f"one stream, lds d=2, method {args.method}, N={args.particles}, {args.requests} single-observation "
        f"requests (after {args.warmup} warm-up), Redis {args.redis_url}",
        "stages": stages(args.requests),
        "not_instrumented": MISSING,
        **report.machine_meta(load_before),
    }
    if profiler is not None:
        buf = io.StringIO()
        pstats.Stats(profiler, stream=buf).sort_stats("cumulative").print_stats(args.top)
        result["cprofile"] = buf.getvalue()
    return result


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
    quick, full = COUNTS["quick"], COUNTS["full"]
    p = report.parser(NAME, __doc__, f"{quick['requests']} requests after {quick['warmup']} warm-up")
    p.add_argument("--method", default="mpf")
    p.add_argument("--particles", type=int, default=256)
    p.add_argument("--requests", type=int, default=None, help=f"timed requests ({full['requests']})")
    p.add_argument("--warmup", type=int, default=None, help=f"requests before timing ({full['warmup']})")
    p.add_argument("--redis-url", default=os.environ.get("MPFLOW_REDIS_URL") or "redis://127.0.0.1:6379/0")
    p.add_argument("--cprofile", action="store_true", help="also cProfile the event-loop thread")
    p.add_argument("--top", type=int, default=40, help="functions listed by --cprofile")
    args = p.parse_args(argv)
    counts = quick if args.quick else full
    args.requests = args.requests or counts["requests"]
    args.warmup = args.warmup if args.warmup is not None else counts["warmup"]
    stem = report.out_stem(args, NAME)
    result = run(args)
    print(result["setup"])
    print()
    print(table(result["stages"]))
    if result["not_instrumented"]:
        print(f"\nnot instrumented (not found in the service): {', '.join(result['not_instrumented'])}")
    if "cprofile" in result:
        print("\ncProfile of the event-loop thread (cumulative):")
        print(result["cprofile"])
    report.write_outputs(result, stem, lambda path: plot(result, path))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

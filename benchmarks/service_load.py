"""Service load benchmark: closed-loop streams against a server started as a user starts it.

``python -m benchmarks.service_load [--quick] [--client {aiohttp,httpx}] [--workers W] [--cluster]``

The server is a subprocess ``python -m mpflow serve --port <free port>`` as ``make serve`` starts it: no
``--workers`` (``--workers 0``, the default), so the server's own default — one worker process per usable core, at
most 8 (:func:`mpflow.cli.serve.default_workers`); the number it started is read off its log and recorded
(``workers``) — or ``--workers W`` for W ≥ 1 (uvicorn; default settings otherwise). Its store: the local Redis
(``--redis-url``, default redis://127.0.0.1:6379/0) under a key prefix of its own
(``MPFLOW_REDIS_PREFIX=mpflowbench-<random>``, deleted afterwards) — or, when that Redis does not answer (or with
``--store embedded``), the embedded Redis in a temporary ``MPFLOW_DATA_DIR`` — or, with ``--cluster``, a fresh
local Redis Cluster of 3 primaries and 3 replicas (``redis-server`` processes on loopback ports,
:class:`tests.harness.cluster.LocalCluster`, on the same cores; ``MPFLOW_REDIS_URL`` one of its nodes, as a user
points the service at a cluster), stopped afterwards. The output says which.

Every stream: ``lds``, d = 2, x_m = A x_{m−1} + N(0, Q), o_m = x_m + N(0, R) with A = 0.95·rot(0.1 rad),
Q = 0.1 I, R = 0.5 I, prior N(0, I); the observations are simulated on the fly (numpy, seeded per stream).
One cell = (method, N particles, K streams, batching on/off): K streams are created, then each sends
single-observation updates (with ``seq``) as fast as it gets answers — K concurrent closed-loop clients, all on
one event loop, no retries (a failure is counted, never hidden; the loop then re-reads the stream's step). The
load generator, the server and the store are the test harness's (:mod:`tests.harness.load`); this module picks
the grid, judges the targets and reports.

The load generator's HTTP client (``--client``): ``aiohttp`` (default) — one ``aiohttp.ClientSession`` with K
keep-alive connections, sending the very bodies :class:`mpflow.client.http.AsyncClient` sends (stdlib ``json``) — or
``httpx`` — :class:`mpflow.client.http.AsyncClient` itself, one per stream with one keep-alive connection. Why
aiohttp: the load generator runs on the same machine as the server and shares its cores (2 here), so every
millisecond of CPU it spends per request is taken from the server being measured. Measured (same server, cells
alternated, mpf N = 256; the load generator's own process CPU time over the window ÷ completed updates):
httpx ≈ 0.8–1.1 ms CPU per request at K = 16 and 64 (1.15–1.2 ms at K = 1), aiohttp ≈ 0.2–0.35 ms
(≈ 0.37 ms at K = 1) — 3–4× less; on a quiet 2-core machine that showed as ~40 % more measured throughput
(K = 16: 486 vs 341 updates/s; K = 64: 444 vs 325), under other jobs' load the noise hides it.
(orjson would save another ~0.01 ms per request over stdlib ``json`` — ~4 %, not worth a dependency; uvloop
saved nothing measurable.) The **client CPU ms/req** column reports that figure for every cell.

After a warm-up, requests *completing* inside the measurement window count:

* **updates/s** = completed updates / window length;
* **p50 / p99**: end-to-end latency (client send → answer parsed) of those requests;
* **mean batch**: stream-steps per operator call inside the window (server's ``mpflow_batch_size``), and
  **compute ms**: mean operator time per call (``mpflow_update_duration_seconds``);
* **client CPU ms/req**: the load generator's own CPU time (``time.process_time``: user + system, all its
  threads; not the server's) over the window ÷ updates completed in it.

Grid: method ∈ {mpf, smc, gpf} × N ∈ {256, 1024} × K ∈ {1, 16, 64} with micro-batching on (the default), then
K = 64 again against a second server with ``MPFLOW_BATCHING=false``. ``--quick``: K ∈ {1, 16}, N = 256, short
windows (the batching-off server then runs at K = 16). ``mpf`` uses a trained operator when one fits
(lds, d = 2), else the untrained Daum–Huang base flow; the output names which.

Targets (issue 21, for the server's defaults, on the single Redis and on the cluster alike: one stream's p50 ≤ 4 ms;
≥ 1000 updates/s at 64 streams; batching ≥ 2× unbatched throughput at 64 streams; all for mpf at N = 256) are
reported as met / not met / not measured. The load generator runs on the same machine as the server and shares its
cores (its CPU per request is in the table); on a machine loaded by other jobs (the load average is recorded) the
numbers are pessimistic. One worker process runs the event loop and the operator's worker thread under one GIL,
which is why the server's default is one worker per core; ``--workers 1`` measures a single worker.

Results: a markdown table on stdout, ``<out>.json`` and ``<out>.png`` (``--out`` defaults to
``benchmarks/results/service_load``, ``-cluster`` appended with ``--cluster``, ``-workers<W>`` for W ≥ 1, then
``-quick`` with ``--quick``, or ``-partial`` when ``--methods``, ``--particles``, ``--streams``, ``--warmup`` or
``--window`` narrow the grid: both git-ignored, so a partial run never overwrites the full grid's results). Measured
beside each other: ``service_load.json`` (single Redis) and
``service_load-cluster.json`` (cluster), both with the server's default workers.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import report
from tests.harness.load import CLIENT_LABELS, CLIENTS, choose_store, run_cell, server, server_log, started_workers
from tests.harness.specs import LDS_MODEL, PRIOR

NAME = "service_load"
METHODS = ("mpf", "smc", "gpf")
FULL = {"particles": (256, 1024), "streams": (1, 16, 64), "warmup_s": 2.0, "window_s": 8.0}
QUICK = {"particles": (256,), "streams": (1, 16), "warmup_s": 1.0, "window_s": 3.0}
TARGETS = {"p50_ms_k1": 4.0, "updates_per_s_k64": 1000.0, "batching_speedup_k64": 2.0}


# ----------------------------------------------------------------------------------------------------------
# the run


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    grid = QUICK if args.quick else FULL
    particles = tuple(args.particles or grid["particles"])
    ks = tuple(args.streams or grid["streams"])
    methods = tuple(args.methods or METHODS)
    warmup_s = args.warmup if args.warmup is not None else grid["warmup_s"]
    window_s = args.window if args.window is not None else grid["window_s"]
    k_off = max(ks)
    rows: list[dict[str, Any]] = []
    started: dict[str, int] = {}
    load_before = os.getloadavg()
    t_start = time.perf_counter()
    store_kind = "cluster" if args.cluster else args.store
    with choose_store(store_kind, args.redis_url) as store, tempfile.TemporaryDirectory() as logs:
        print(f"store: {store.label}; client: {args.client}", file=sys.stderr)
        for batching, ks_run in ((True, ks), (False, (k_off,))):
            with server(store, batching, Path(logs), args.workers or None) as url:
                for method in methods:
                    for n in particles:
                        for k in ks_run:
                            row = asyncio.run(run_cell(url, method, n, k, warmup_s, window_s, args.client))
                            row["batching"] = batching
                            rows.append(row)
                            print(format_row(row), file=sys.stderr, flush=True)
            # None: not in its log (uvicorn logs each worker's start at level info, the default)
            count = started_workers(server_log(Path(logs), batching)) or None
            started["batching on" if batching else "batching off"] = count
    meta = metadata(args, store.label, methods, particles, ks, k_off, warmup_s, window_s, load_before)
    meta["workers"], meta["workers_started"] = started["batching on"], started
    meta["wall_s"] = round(time.perf_counter() - t_start, 1)
    return {"meta": meta, "rows": rows, "batching_speedup": speedups(rows), "targets": targets(rows)}


def speedups(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Throughput with batching ÷ without, per (method, N) at the K both servers ran."""
    out = []
    for off in (r for r in rows if not r["batching"]):
        on = next(
            (r for r in rows if r["batching"] and (r["method"], r["N"], r["K"]) == (off["method"], off["N"], off["K"])),
            None,
        )
        if on is not None and off["updates_per_s"] > 0:
            ratio = on["updates_per_s"] / off["updates_per_s"]
            out.append({"method": off["method"], "N": off["N"], "K": off["K"], "speedup": ratio})
    return out


def metadata(args, store_label, methods, particles, ks, k_off, warmup_s, window_s, load_before) -> dict[str, Any]:
    return {
        "benchmark": "service_load",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "quick": bool(args.quick),
        "store": store_label,
        "server": f"python -m mpflow serve{f' --workers {args.workers}' if args.workers else ''} (uvicorn, default "
        "settings otherwise; MPFLOW_BATCHING=false for the off rows)",
        "workers_requested": args.workers or "server default",
        "cluster": bool(args.cluster),
        "client_kind": args.client,
        "client": CLIENT_LABELS[args.client],
        "model": LDS_MODEL,
        "prior": PRIOR,
        "methods": list(methods),
        "particles": list(particles),
        "streams": list(ks),
        "unbatched_at_K": k_off,
        "warmup_s": warmup_s,
        "window_s": window_s,
        **report.machine_meta(load_before),
    }


def _find(rows: list[dict[str, Any]], k: int, batching: bool) -> dict[str, Any] | None:
    return next(
        (r for r in rows if r["method"] == "mpf" and r["N"] == 256 and r["K"] == k and r["batching"] == batching),
        None,
    )


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The three targets (module docstring) as measured: met / not met / not measured."""

    def verdict(value: float | None, ok: bool) -> str:
        return "not measured" if value is None else ("met" if ok else "not met")

    one, on64, off64 = _find(rows, 1, True), _find(rows, 64, True), _find(rows, 64, False)
    p50 = one["p50_ms"] if one else None
    rate = on64["updates_per_s"] if on64 else None
    speedup = on64["updates_per_s"] / off64["updates_per_s"] if on64 and off64 and off64["updates_per_s"] else None
    return [
        {
            "target": f"one stream (mpf, N=256) p50 ≤ {TARGETS['p50_ms_k1']:g} ms end to end",
            "measured": p50,
            "status": verdict(p50, p50 is not None and p50 <= TARGETS["p50_ms_k1"]),
        },
        {
            "target": f"64 streams (mpf, N=256) ≥ {TARGETS['updates_per_s_k64']:g} updates/s",
            "measured": rate,
            "status": verdict(rate, rate is not None and rate >= TARGETS["updates_per_s_k64"]),
        },
        {
            "target": f"batching ≥ {TARGETS['batching_speedup_k64']:g}× unbatched throughput, 64 streams (mpf, N=256)",
            "measured": speedup,
            "status": verdict(speedup, speedup is not None and speedup >= TARGETS["batching_speedup_k64"]),
        },
    ]


# ----------------------------------------------------------------------------------------------------------
# reporting


def _fmt(x: float | None, spec: str) -> str:
    return "—" if x is None else format(x, spec)


COLUMNS = (
    "method",
    "N",
    "K streams",
    "batching",
    "updates/s",
    "p50 ms",
    "p99 ms",
    "mean batch",
    "compute ms/call",
    "client CPU ms/req",
    "requests",
    "errors",
)
ALIGN = "lrrlrrrrrrrl"


def row_cells(r: dict[str, Any]) -> list[str]:
    errors = ", ".join(f"{k}×{v}" for k, v in r["errors"].items()) or "0"
    method = r["method"] + (
        f" ({r['operator']})" if r.get("operator") else (" (base flow)" if r["method"] == "mpf" else "")
    )
    return [
        method,
        str(r["N"]),
        str(r["K"]),
        "on" if r["batching"] else "off",
        f"{r['updates_per_s']:.1f}",
        _fmt(r["p50_ms"], ".1f"),
        _fmt(r["p99_ms"], ".1f"),
        _fmt(r["mean_batch"], ".1f"),
        _fmt(r["compute_ms_per_call"], ".1f"),
        _fmt(r.get("client_cpu_ms_per_request"), ".2f"),
        str(r["completed"]),
        errors,
    ]


def format_row(r: dict[str, Any]) -> str:
    """One row of :func:`format_table` (the progress line of a cell)."""
    return "| " + " | ".join(row_cells(r)) + " |"


def format_table(rows: list[dict[str, Any]]) -> str:
    return report.markdown_table(COLUMNS, map(row_cells, rows), ALIGN)


def format_targets(items: list[dict[str, Any]]) -> str:
    lines = []
    for t in items:
        value = "—" if t["measured"] is None else f"{t['measured']:.2f}"
        lines.append(f"- {t['target']}: measured {value} → **{t['status']}**")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path, meta: dict[str, Any]) -> None:
    """Throughput, p50 and p99 per cell (bars), one group per (method, N)."""
    groups = list(dict.fromkeys((r["method"], r["N"]) for r in rows))
    series = list(dict.fromkeys((r["K"], r["batching"]) for r in rows))
    width = 0.8 / max(1, len(series))
    size = (min(13.0, max(7.0, 0.45 * len(groups) * len(series) + 2)), 9)
    with report.figure(path, 3, 1, figsize=size, sharex=True) as (fig, axes):
        panels = (("updates_per_s", "updates / s"), ("p50_ms", "p50 latency, ms"), ("p99_ms", "p99 latency, ms"))
        for ax, (key, label) in zip(axes, panels, strict=True):
            for j, (k, batching) in enumerate(series):
                xs, ys = [], []
                for i, g in enumerate(groups):
                    r = next(
                        (r for r in rows if (r["method"], r["N"]) == g and (r["K"], r["batching"]) == (k, batching)),
                        None,
                    )
                    if r is not None and r[key] is not None:
                        xs.append(i + (j - (len(series) - 1) / 2) * width)
                        ys.append(r[key])
                hatch = None if batching else "//"
                ax.bar(xs, ys, width, label=f"K={k}, batching {'on' if batching else 'off'}", hatch=hatch)
            ax.set_ylabel(label)
            ax.set_yscale("log")
            ax.grid(axis="y", alpha=0.3)
        handles, labels = axes[0].get_legend_handles_labels()
        ncol = min(4, len(series))
        fig.legend(handles, labels, loc="upper center", ncol=ncol, fontsize=7, bbox_to_anchor=(0.5, 0.955))
        axes[-1].set_xticks(range(len(groups)))
        axes[-1].set_xticklabels([f"{m}\nN={n}" for m, n in groups])
        fig.suptitle(
            f"service load: lds d=2, closed-loop streams, {meta['store'].split(' (')[0]}, {meta['workers']} "
            f"workers, {meta['machine_cores']} cores (load avg before {meta['load_average_before'][0]})",
            fontsize=9,
        )
        fig.tight_layout(rect=(0, 0, 1, 0.92))


#: options that run part of the grid, or shorter cells; such a run writes ``<name>-partial.*`` (git-ignored) unless
#: ``--out`` names the file
PARTIAL_GRID_OPTIONS = ("methods", "particles", "streams", "warmup", "window")
PARTIAL_SUFFIX = "-partial"


def output_stem(args: argparse.Namespace) -> Path:
    """Where the results go (module docstring): ``-cluster``, ``-workers<W>``, then ``-quick`` or ``-partial``."""
    suffix = ("-cluster" if args.cluster else "") + (f"-workers{args.workers}" if args.workers else "")
    if not args.quick and any(getattr(args, k) is not None for k in PARTIAL_GRID_OPTIONS):
        suffix += PARTIAL_SUFFIX  # part of the grid: never the tracked full-grid results
    return report.out_stem(args, NAME + suffix)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def build_parser() -> argparse.ArgumentParser:
    p = report.parser(NAME, __doc__, "K ∈ {1, 16}, N = 256, short windows")
    p.add_argument("--store", choices=("auto", "redis", "embedded"), default="auto")
    p.add_argument("--client", choices=tuple(CLIENTS), default="aiohttp", help="the load generator's HTTP client")
    p.add_argument("--redis-url", default=os.environ.get("MPFLOW_REDIS_URL") or "redis://127.0.0.1:6379/0")
    p.add_argument("--methods", type=lambda s: [x for x in s.split(",") if x], default=None, help="e.g. mpf,smc")
    p.add_argument("--particles", type=_ints, default=None, help="e.g. 256,1024")
    p.add_argument("--streams", type=_ints, default=None, help="K values, e.g. 1,16,64")
    p.add_argument("--warmup", type=float, default=None, help="seconds per cell before measuring")
    p.add_argument("--window", type=float, default=None, help="seconds measured per cell")
    p.add_argument(
        "--workers",
        type=int,
        default=0,
        help="server worker processes (mpflow serve --workers W); 0, the default: the server's default, as make serve",
    )
    p.add_argument(
        "--cluster", action="store_true", help="store: a fresh local Redis Cluster, 3 primaries + 3 replicas"
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.workers < 0:
        p.error(f"--workers: a whole number >= 0 (0: the server's default), got {args.workers}")
    if args.cluster and args.store != "auto":
        p.error("--cluster: the store is the local cluster; leave --store out")
    stem = output_stem(args)
    result = run_benchmark(args)
    meta = result["meta"]
    print(
        f"store: {meta['store']}; client: {meta['client_kind']} ({meta['client']}); workers: {meta['workers']} "
        f"({meta['workers_requested']}); load average before {meta['load_average_before']}, "
        f"after {meta['load_average_after']}"
    )
    print()
    print(format_table(result["rows"]))
    print()
    speedup = ", ".join(f"{x['method']} N={x['N']}: {x['speedup']:.2f}×" for x in result["batching_speedup"])
    print(f"batching on ÷ off, updates/s at K={meta['unbatched_at_K']}: {speedup}")
    print()
    print(format_targets(result["targets"]))
    report.write_outputs(result, stem, lambda path: plot(result["rows"], path, meta))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

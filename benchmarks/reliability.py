"""Reliability under faults and load, measured: store faults, process faults and a soak.

``python -m benchmarks.reliability [--quick]``

Every scenario runs the server as a user runs it — a subprocess ``python -m mpflow serve --port <free port>`` — and
drives it through :mod:`mpflow.client.http` (one :class:`~mpflow.client.http.AsyncClient` per stream, one
keep-alive connection each, all on one event loop), every HTTP exchange on record. The scenarios are the test
harness's, the tests in ``tests/reliability`` run them on smaller loads; this runs them at full size and reports:

* **store faults** (:mod:`tests.harness.faults`, ``--store-modes``): an external ``redis-server`` with AOF is
  SIGKILLed (``appendfsync always``), shut down (``everysec``) or frozen for 12 s once 40 % of the steps are
  acknowledged, and comes back on the same files. While it is down the API must answer 503 with
  ``Retry-After`` and no other 5xx.
* **process faults** (``--process-modes``): the server alone, or the server and its embedded redis-server,
  SIGKILLed at 40 % and restarted on the same port and data dir.

  Both on 20 streams × 200 steps (5 steps per request; ``--fault-streams``, ``--fault-steps``, ``--batch``) of
  ``kalman`` on ``lds`` d = 2. Afterwards, for every stream, the stored step must equal the number of
  distinct acknowledged steps (none **lost**), and the float64 Kalman filter run offline on the acknowledged
  observations must reproduce the stored posterior and every acknowledged per-step mean (**reference
  mismatches**: a step applied twice, skipped or out of order; :mod:`tests.harness.verify`).
* **soak** (:mod:`tests.harness.soak`): 100 streams × 1000 steps, one step per request (``--soak-streams``,
  ``--soak-steps``), ``mpf`` N = 64 on ``linear_gaussian`` d = 2, embedded store: the server's RSS over time (flat:
  at most 10 % growth after the warm-up), Redis memory per stream against the size computed from N and d, p99
  latency of the first and the last 10 % of the requests (stable: last ≤ 1.5 × first), every HTTP status.

The load generator shares the machine's cores with the server (and with whatever else runs: the load average
is recorded). Results (:mod:`benchmarks.reliability_report`): markdown tables on stdout, ``<out>.json`` and
``<out>.png`` (``--out`` defaults to ``benchmarks/results/reliability``; ``reliability-quick``, git-ignored, with
``--quick``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from benchmarks import report
from benchmarks.reliability_report import format_fault_table, format_soak, plot
from tests.harness.faults import (
    FAULT_METHOD,
    FAULT_PARTICLES,
    FAULT_RETRY,
    PROCESS_MODES,
    STORE_MODES,
    StoreFaultRig,
    process_fault,
)
from tests.harness.server import kill_started, redis_server_binary
from tests.harness.soak import soak
from tests.harness.specs import LDS_MODEL, PRIOR

NAME = "reliability"
FAULT_DEFAULTS = {"streams": 20, "steps": 200, "batch": 5}
SOAK_DEFAULTS = {"streams": 100, "steps": 1000}
SOAK_QUICK = {"streams": 10, "steps": 100}


def metadata(args: argparse.Namespace, load_before: tuple[float, ...]) -> dict[str, Any]:
    return {
        "benchmark": NAME,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "quick": bool(args.quick),
        "server": "python -m mpflow serve (uvicorn, 1 worker, default settings), restarted on the same port",
        "client": "mpflow.client.AsyncClient per stream (1 connection), AsyncStream.filter with seq; "
        f"retries: {FAULT_RETRY} under faults",
        "fault_load": {"model": LDS_MODEL, "prior": PRIOR, "method": FAULT_METHOD, "num_particles": FAULT_PARTICLES},
        "redis_server": redis_server_binary(),
        **report.machine_meta(load_before),
    }


def _progress_line(result: dict[str, Any]) -> None:
    print(format_fault_table([result]).splitlines()[-1], file=sys.stderr, flush=True)


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """The store faults (one server for all), the process faults, then the soak; {meta, faults, soak}."""
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    faults: list[dict[str, Any]] = []
    kw = {"streams": args.fault_streams, "steps": args.fault_steps, "batch": args.batch, "progress": True}
    try:
        if args.store_modes:
            with StoreFaultRig() as rig:
                for mode in args.store_modes:
                    faults.append(rig.run(mode, **kw))
                    _progress_line(faults[-1])
        for mode in args.process_modes:
            faults.append(process_fault(mode, **kw))
            _progress_line(faults[-1])
        soaked = soak(args.soak_streams, args.soak_steps, progress=True) if args.soak_steps > 0 else None
    finally:
        kill_started()
    meta = metadata(args, load_before)
    meta["wall_s"] = round(time.perf_counter() - t0, 1)
    return {"meta": meta, "faults": faults, "soak": soaked}


def _modes(allowed: Sequence[str]) -> Any:
    def parse(text: str) -> list[str]:
        modes = [x for x in text.split(",") if x]
        unknown = sorted(set(modes) - set(allowed))
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown mode(s) {unknown}; choose from {list(allowed)}")
        return modes

    return parse


def main(argv: Sequence[str] | None = None) -> int:
    quick = SOAK_QUICK
    p = report.parser(NAME, __doc__, f"a {quick['streams']} × {quick['steps']} soak (the faults as usual)")
    p.add_argument("--soak-streams", type=int, default=None, help="streams of the soak (100; 10 with --quick)")
    p.add_argument("--soak-steps", type=int, default=None, help="steps per stream of the soak (1000; 100 --quick)")
    p.add_argument("--fault-streams", type=int, default=FAULT_DEFAULTS["streams"])
    p.add_argument("--fault-steps", type=int, default=FAULT_DEFAULTS["steps"])
    p.add_argument("--batch", type=int, default=FAULT_DEFAULTS["batch"], help="steps per request under faults")
    p.add_argument("--store-modes", type=_modes(STORE_MODES), default=list(STORE_MODES), help="e.g. kill,freeze")
    p.add_argument("--process-modes", type=_modes(PROCESS_MODES), default=list(PROCESS_MODES), help="e.g. app")
    args = p.parse_args(argv)
    soak_size = SOAK_QUICK if args.quick else SOAK_DEFAULTS
    args.soak_streams = args.soak_streams or soak_size["streams"]
    args.soak_steps = args.soak_steps if args.soak_steps is not None else soak_size["steps"]
    stem = report.out_stem(args, NAME)
    result = run_benchmark(args)
    meta = result["meta"]
    print(f"load average before {meta['load_average_before']}, after {meta['load_average_after']}")
    print()
    if result["faults"]:
        print(format_fault_table(result["faults"]))
        print()
    if result["soak"]:
        print(format_soak(result["soak"]))
    report.write_outputs(result, stem, (lambda path: plot(result, path)) if result["soak"] else None, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Bad input and numerical faults, measured: fuzzing every endpoint, hostile bodies, extreme observations.

``python -m benchmarks.reliability_input [--quick] [--examples N]``

The server runs as a user runs it — ``python -m mpflow serve`` on a free port
(:func:`tests.harness.server.serve_as_user`), on the Redis of ``MPFLOW_REDIS_URL`` (else redis://127.0.0.1:6379/0)
under a fresh key prefix that is deleted afterwards, with small limits
(:data:`tests.harness.specs.SERVER_ENV`: at most 64 particles, d ≤ 4, 5 steps and 200 draws per request) and the
iterative methods cut short, so that generated streams are cheap. Three parts, the test harness's:

* **fuzz** (:func:`tests.harness.hostile.fuzz`) — schemathesis requests for every operation of ``/openapi.json``,
  ``examples`` valid and ``examples`` invalid ones each (150; 25 with ``--quick``), every answer checked: no 5xx,
  the status and the body documented for the operation. Counted per operation: requests, statuses, 5xx, failed
  checks.
* **hostile bodies** (:data:`tests.harness.hostile.HOSTILE`) — 100 000-deep arrays, 7 MiB of numbers in the wrong
  shape, hundreds of thousands of unknown keys, ``NaN``/``1e400``/``1e39`` literals, bodies over the 8 MiB limit,
  invalid UTF-8, ...: each must be answered with its 4xx, and fast (the seconds to the answer are measured).
* **numerical faults** (:func:`tests.harness.numerics.numerical_faults`) — every family × method fed observations
  of scale ±1e6 … 3e38: statuses, fall-backs, non-finite values stored (must be 0).

Results: tables on stdout and ``benchmarks/results/reliability_input.json`` (``reliability_input-quick.json``,
git-ignored, with ``--quick``). The tests in ``tests/reliability/test_bad_input.py`` run the same functions on
smaller counts. Exit status 1 when anything was not as expected.
"""

from __future__ import annotations

import asyncio
import collections
import datetime as dt
import os
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from benchmarks import report
from tests.harness.hostile import MiB, fuzz, fuzz_targets, hostile_bodies
from tests.harness.numerics import all_finite, numerical_faults
from tests.harness.server import drop_prefix, serve_as_user
from tests.harness.specs import DEFAULT_REDIS, LINEAR_STREAM, SERVER_ENV

NAME = "reliability_input"
EXAMPLES = {"full": 150, "quick": 25}


# ----------------------------------------------------------------------------------------------------------
# the run


def summarize(fuzzed: dict, targets: list[str], fuzzed_non_finite: int, hostile: list, faults: dict) -> dict:
    rows = faults["rows"]
    return {
        "fuzz_requests": sum(s["requests"] for s in fuzzed.values()),
        "fuzz_5xx": sum(s["5xx"] for s in fuzzed.values()),
        "fuzz_failed_checks": sum(s["failed_checks"] for s in fuzzed.values()),
        "fuzz_target_streams": len(targets),
        "fuzz_target_streams_non_finite": fuzzed_non_finite,
        "hostile_cases": len(hostile),
        "hostile_not_as_expected": sum(not r["ok"] for r in hostile),
        "hostile_5xx": sum(r["status"] >= 500 for r in hostile),
        "hostile_max_seconds": max(r["seconds"] for r in hostile),
        "hostile_max_case": max(hostile, key=lambda r: r["seconds"])["case"],
        "fault_requests": sum(r["requests"] for r in rows),
        "fault_5xx": sum(v for r in rows for k, v in r["statuses"].items() if k.startswith("5")),
        "fallbacks_triggered": sum(sum(r["fallbacks"].values()) for r in rows),
        "fallbacks_by_method": dict(
            collections.Counter(k for r in rows for k, v in r["fallbacks"].items() for _ in range(v))
        ),
        "fallbacks_counted_by_metric": sum(v for k, v in faults["metric_increase"].items() if not k.endswith("/none")),
        "non_finite_stored": sum(r["non_finite_stored"] for r in rows),
    }


def run(examples: int) -> dict[str, Any]:
    """The three parts against one server (module docstring); the result to write."""
    redis_url = os.environ.get("MPFLOW_REDIS_URL") or DEFAULT_REDIS
    prefix = f"mpflowbench-input-{uuid.uuid4().hex[:12]}"
    env = {**SERVER_ENV, "MPFLOW_REDIS_URL": redis_url, "MPFLOW_REDIS_PREFIX": prefix}
    load_before = os.getloadavg()
    try:
        with tempfile.TemporaryDirectory() as logs, serve_as_user(env, Path(logs) / "service.log") as server:
            sid = httpx.post(f"{server.url}/v1/streams", json=LINEAR_STREAM, timeout=30).json()["stream_id"]
            t0 = time.perf_counter()
            hostile = hostile_bodies(server.url, sid)
            faults = numerical_faults(server.url)
            targets = fuzz_targets(server.url)
            fuzzed = {k: v.to_json() for k, v in fuzz(server.url, examples, stream_ids=targets).items()}
            stored = [httpx.get(f"{server.url}/v1/streams/{t}/particles", timeout=30) for t in targets]
            fuzzed_non_finite = sum(r.status_code == 200 and not all_finite(r.json()) for r in stored)
            wall = time.perf_counter() - t0
            alive = httpx.get(f"{server.url}/healthz", timeout=10).status_code == 200
    finally:
        asyncio.run(drop_prefix(redis_url, prefix))
    return {
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "examples_per_mode": examples,
        "server_env": SERVER_ENV,
        "load_average": {"before": load_before, "after": os.getloadavg()},
        "cpu_count": os.cpu_count(),
        "wall_s": round(wall, 1),
        "server_alive_after": alive,
        "summary": summarize(fuzzed, targets, fuzzed_non_finite, hostile, faults),
        "fuzz": fuzzed,
        "hostile": hostile,
        "numerical_faults": faults,
    }


# ----------------------------------------------------------------------------------------------------------
# tables


def _counts(counts: dict[str, int]) -> str:
    return " ".join(f"{k}×{v}" for k, v in counts.items())


def format_fuzz(stats: dict[str, Any]) -> str:
    rows = (
        (f"`{label}`", s["requests"], _counts(s["statuses"]), s["5xx"], s["failed_checks"], s["seconds"])
        for label, s in stats.items()
    )
    return report.markdown_table(("operation", "requests", "statuses", "5xx", "failed checks", "s"), rows, "lrlrrr")


def _yes(ok: bool) -> str:
    return "yes" if ok else "NO"


def format_hostile(rows: list[dict[str, Any]]) -> str:
    cells = (
        (
            r["case"],
            f"{r['bytes'] / MiB:.2f}",
            r["status"],
            r["code"],
            f"{r['seconds']:.3f}",
            "yes" if r["ok"] else "NO",
        )
        for r in rows
    )
    return report.markdown_table(("body", "MiB", "status", "code", "s", "ok"), cells, "lrrlrl")


def format_faults(result: dict[str, Any]) -> str:
    cells = (
        (
            r["family"],
            r["method"],
            r["requests"],
            _counts(dict(sorted(r["statuses"].items()))),
            _counts(dict(sorted(r["fallbacks"].items()))) or "–",
            r["non_finite_stored"],
        )
        for r in result["rows"]
    )
    header = ("family", "method", "requests", "statuses", "fall-backs", "non-finite stored")
    return report.markdown_table(header, cells, "llrllr")


def main(argv: list[str] | None = None) -> int:
    p = report.parser(NAME, __doc__, f"{EXAMPLES['quick']} examples per mode (default {EXAMPLES['full']})")
    p.add_argument("--examples", type=int, default=None, help="fuzz examples per operation and mode")
    args = p.parse_args(argv)
    examples = args.examples or EXAMPLES["quick" if args.quick else "full"]
    stem = report.out_stem(args, NAME)
    result = run(examples)
    print("## fuzz (schemathesis, every operation)\n")
    print(format_fuzz(result["fuzz"]))
    print("\n## hostile bodies\n")
    print(format_hostile(result["hostile"]))
    print("\n## numerical faults (observations ±1e6 … 3e38, one per request)\n")
    print(format_faults(result["numerical_faults"]))
    print("\n## summary\n")
    for k, v in result["summary"].items():
        print(f"- {k}: {v}")
    report.write_outputs(result, stem)
    s = result["summary"]
    bad = (
        s["fuzz_5xx"] + s["fuzz_failed_checks"] + s["hostile_not_as_expected"] + s["fault_5xx"] + s["non_finite_stored"]
    )
    return 1 if bad or not result["server_alive_after"] else 0


if __name__ == "__main__":
    raise SystemExit(main())

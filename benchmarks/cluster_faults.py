"""Faults of a Redis Cluster under load, checked as Jepsen would: what was acknowledged, what was stored, and
whether every acknowledgment had the replicas ``MPFLOW_REDIS_WAIT_REPLICAS`` promises.

``python -m benchmarks.cluster_faults [--faults primary_kill ...] [--waits 0 1] [--replicas 1 2] [--repeat K]
[--out PATH]``

The matrix: every fault of :data:`tests.harness.cluster_faults.FAULTS` — a primary SIGKILLed (down until its
replica took over, 3 s more, then back as a replica), a primary SIGSTOPped until its replica took over and then
SIGCONTed, a replica SIGKILLed for 3 s, 200 slots migrated under load (``redis-cli --cluster reshard``), the
service itself SIGKILLed and restarted mid-write — with ``WAIT`` 0 and 1 and one and two replicas per primary,
each on a fresh local cluster (3 primaries, ``cluster-node-timeout`` 1 s, Redis' default
``cluster-require-full-coverage yes``) and a fresh ``python -m mpflow serve --workers 1``; plus the primary's
SIGKILL with ``WAIT`` 1 and ``cluster-require-full-coverage no`` (the other shards serve through a failover). Each
case: 6 streams (2 per primary), one sequential writer each that retries the same ``seq`` until 200 as docs/API.md
says (:mod:`tests.harness.cluster_faults`, which the tests in ``tests/reliability/test_cluster_faults.py`` run
too). First, per layout, what ``WAIT`` costs one compare-and-set on the store alone (p50/p99).

``--repeat K`` runs each case K times (rows numbered ``repeat``), to measure how often a rare outcome happens;
``--out`` names the results file.

Results: ``benchmarks/results/cluster_faults.json`` (written after every case; per case up to 5 acknowledgments
of each kind — without the promised replicas, unverifiable, lost — with what every node of the shard said right
after the answer) and a table on stdout. The exit
status is 1 when a ``WAIT 1`` case lost or doubled an acknowledged update or acknowledged one without its replica,
or any case doubled one.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from mpflow.service.store.stream_store import StreamStore

from tests.harness.cluster import LocalCluster
from tests.harness.cluster_faults import FAULTS, run_case

RESULTS = Path(__file__).resolve().parent / "results" / "cluster_faults.json"


def _p(values: list[float], q: int) -> float:
    return round(1000 * statistics.quantiles(values, n=100)[q - 1], 2)


async def _cas_latency(url: str, wait_replicas: int, n: int = 300) -> dict[str, float]:
    """p50/p99 (ms) of one compare-and-set (a 2 KB state) after another, straight on the store: what ``WAIT``
    adds to a write, without the service's compute."""
    store = StreamStore.from_url(url, prefix=f"cf-cas-{uuid.uuid4().hex[:8]}", wait_replicas=wait_replicas)
    try:
        assert await store.create("t", "cas", {"step": 0}, b"x" * 2048, 600)
        times = []
        for version in range(1, n + 1):
            t0 = time.perf_counter()
            assert await store.compare_and_set("t", "cas", version, {"step": version}, b"y" * 2048, 600)
            times.append(time.perf_counter() - t0)
        await store.delete("t", "cas")
    finally:
        await store.aclose()
    return {"p50_ms": _p(times, 50), "p99_ms": _p(times, 99)}


def cas_latency(replicas: int) -> dict[str, dict[str, float]]:
    """``{"WAIT 0": ..., "WAIT 1": ...}`` on one fresh cluster with ``replicas`` per primary."""
    with tempfile.TemporaryDirectory(prefix="cluster-cas-") as tmp, LocalCluster(tmp, replicas=replicas) as cluster:
        return {f"WAIT {w}": asyncio.run(_cas_latency(cluster.url, w)) for w in (0, 1)}


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as the Markdown table of docs/operations.md."""
    out = [
        "| fault | WAIT | replicas per primary | acknowledged / stored | lost | doubled | acks (on a retry) "
        "| without the promised replicas (unverifiable) | on one node | while struck "
        "| longest outage, victim / other shards (s) | 503s, victim / other shards |",
        "|" + "---|" * 12,
    ]
    for r in rows:
        fault = r["fault"] + ("" if r["full_coverage"] else " (full-coverage no)")
        out.append(
            f"| {fault} | {r['wait']} | {r['replicas']} | {r['acknowledged']} / {r['stored']} | {r['lost']} "
            f"| {r['doubled']} | {r['acks']} ({r['acks_on_retry']}) | {r['acks_without_promised_replicas']} "
            f"({r['acks_unverifiable']}) | {r['acks_on_one_node']} | {r['acks_while_struck']} "
            f"| {r['outage_victim_s']} / {r['outage_healthy_s']} "
            f"| {r['answers_victim'].get('503', 0)} / {r['answers_healthy'].get('503', 0)} |"
        )
    return "\n".join(out)


def _bad(rows: list[dict[str, Any]]) -> bool:
    promised = [r for r in rows if r["wait"]]
    return any(r["doubled"] for r in rows) or any(r["lost"] or r["acks_without_promised_replicas"] for r in promised)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cluster_faults", description=__doc__.split("\n")[0])
    parser.add_argument("--faults", nargs="+", choices=sorted(FAULTS), default=list(FAULTS))
    parser.add_argument("--waits", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--replicas", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--repeat", type=int, default=1, help="run each case this many times")
    parser.add_argument("--out", type=Path, default=RESULTS, help="the results file")
    args = parser.parse_args(argv)
    t0 = time.monotonic()
    results: dict[str, Any] = {"cas_latency": {}, "runs": []}
    cases = [(f, w, r, True) for r in args.replicas for w in args.waits for f in args.faults]
    if "primary_kill" in args.faults and 1 in args.waits:
        cases += [("primary_kill", 1, r, False) for r in args.replicas]
    for replicas in args.replicas:
        results["cas_latency"][f"{replicas} replica(s)"] = cas_latency(replicas)
    for (fault, wait, replicas, full_coverage), k in itertools.product(cases, range(args.repeat)):
        row = run_case(fault, wait, replicas, full_coverage=full_coverage)
        results["runs"].append(row if args.repeat == 1 else {"repeat": k, **row})
        results["wall_s"] = round(time.monotonic() - t0)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")
        print(json.dumps({k: v for k, v in row.items() if not k.endswith("_examples")}), flush=True)
    print(table(results["runs"]))
    print("store compare-and-set alone:", json.dumps(results["cas_latency"]))
    print(f"wall time {results['wall_s']} s")
    return 1 if _bad(results["runs"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())

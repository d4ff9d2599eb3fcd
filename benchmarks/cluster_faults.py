"""Faults of a Redis Cluster under load, measured: a slot migration and a primary's crash with its failover.

``python -m benchmarks.cluster_faults [--streams 20] [--settle 3]``

For each setting of ``MPFLOW_REDIS_WAIT_REPLICAS`` (0: acknowledged once the primary has the write; 1: once its
replica has it too), on a fresh local cluster (:class:`tests.harness.cluster.LocalCluster`: 3 primaries + 3
replicas on loopback, ``cluster-node-timeout`` 1 s) and a fresh ``python -m mpflow serve --workers 1`` pointed at
one node (:func:`tests.harness.server.serve_as_user`), ``--streams`` streams (``linear_gaussian``, ``kalman``:
cheap steps, so the store is what is measured) are updated continuously, one observation per request, each
request carrying the next ``seq``. A 503 is retried with the same ``seq`` (a ``duplicate`` answer confirms an
earlier try was applied); a 409 ``seq_gap`` means the stream lost steps: they are counted as lost and the client
carries on from the stream's step. Phases, under that load:

0. before the service starts, the latency of the store's compare-and-set alone, one after another (what ``WAIT``
   costs a write);
1. **steady** (``--settle`` s): update latency (p50/p99 of the 200 answers);
2. **reshard**: ``redis-cli --cluster reshard`` moves a third of the slots (5461), taken from two primaries, to the
   third while updates run;
3. **failover**: SIGKILL one primary (not the node of the URL), until its replica has taken over; 1 s later
   the killed node is started again and rejoins as the new primary's replica;
4. **after**: ``--settle`` s more. The service is not restarted.

At the end every stream is read: **lost** = acknowledged updates that are not in the stream (its step fell behind
what was acknowledged), **doubled** = steps beyond the highest ``seq`` sent, or an applied answer whose step is not
its ``seq``. Errors are counted by phase and status (503s are retried; anything else is an error). Keys per
primary are counted after the run. Results: a table on stdout and ``benchmarks/results/cluster_faults.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
from mpflow.service.store import StreamStore

from tests.harness.cluster import LocalCluster
from tests.harness.server import serve_as_user

RESULTS = Path(__file__).resolve().parent / "results" / "cluster_faults.json"
SLOTS_MOVED = 16384 // 3
STREAM = {
    "model": {"family": "linear_gaussian", "params": {}},
    "prior": {"type": "gaussian", "mean": [0.0, 0.0], "cov": [[1.0, 0.0], [0.0, 1.0]]},
    "method": "kalman",
}


class Load:
    """``streams`` clients, each updating its stream with the next ``seq`` until :meth:`stop`."""

    def __init__(self, url: str, streams: int):
        self.url = url
        # random ids: the streams land on other slots in every run
        self.ids = [f"load-{i:02d}-{uuid.uuid4().hex[:6]}" for i in range(streams)]
        self.acked = dict.fromkeys(self.ids, 0)  # the highest seq acknowledged, per stream
        self.sent = dict.fromkeys(self.ids, 0)  # the highest seq sent
        self.lost = 0
        self.misapplied = 0  # an applied answer whose step is not its seq
        self.phase = "steady"
        self.statuses: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.latencies: dict[str, list[float]] = collections.defaultdict(list)
        self._stop = asyncio.Event()

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=30) as client:
            for sid in self.ids:
                answer = await client.post("/v1/streams", json={**STREAM, "stream_id": sid})
                assert answer.status_code == 201, answer.text
            await asyncio.gather(*(self._updates(client, sid) for sid in self.ids))

    async def _updates(self, client: httpx.AsyncClient, sid: str) -> None:
        seq = 1
        while not self._stop.is_set():
            self.sent[sid] = max(self.sent[sid], seq)
            phase, t0 = self.phase, time.perf_counter()
            try:
                answer = await client.post(
                    f"/v1/streams/{sid}/observations", json={"seq": seq, "observations": [[0.1 * seq % 1, 0.2]]}
                )
            except httpx.HTTPError as exc:
                self.statuses[phase][type(exc).__name__] += 1
                await asyncio.sleep(0.05)
                continue
            self.statuses[phase][str(answer.status_code)] += 1
            if answer.status_code == 200:
                doc = answer.json()
                if not doc.get("duplicate"):
                    self.latencies[phase].append(time.perf_counter() - t0)
                    if doc["step"] != seq:
                        self.misapplied += 1
                self.acked[sid] = seq
                seq += 1
            elif answer.status_code == 409 and answer.json()["error"]["code"] == "seq_gap":
                step = (await client.get(f"/v1/streams/{sid}")).json()["step"]
                self.lost += max(0, self.acked[sid] - step)
                self.acked[sid] = step
                seq = step + 1
            else:  # 503 (retried with the same seq) or an error
                await asyncio.sleep(0.05)

    async def final_check(self) -> tuple[int, int]:
        """``(lost, doubled)`` over every stream, read after the load stopped."""
        lost, doubled = self.lost, self.misapplied
        async with httpx.AsyncClient(base_url=self.url, timeout=30) as client:
            for sid in self.ids:
                step = (await client.get(f"/v1/streams/{sid}")).json()["step"]
                lost += max(0, self.acked[sid] - step)
                doubled += max(0, step - self.sent[sid])
        return lost, doubled


def _p(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return round(1000 * statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else 1000 * values[0], 2)


async def _measure(cluster: LocalCluster, url: str, streams: int, settle: float) -> dict[str, Any]:
    load = Load(url, streams)
    task = asyncio.create_task(load.run())
    await asyncio.sleep(settle)
    *sources, target = cluster.primary_ports()
    load.phase = "reshard"
    t0 = time.monotonic()
    await asyncio.to_thread(cluster.reshard, sources, target, SLOTS_MOVED)
    reshard_s = time.monotonic() - t0
    await asyncio.sleep(1.0)
    load.phase = "failover"
    victim = next(p for p in cluster.primary_ports() if p != cluster.ports[0])
    t0 = time.monotonic()
    cluster.kill(victim)
    await asyncio.to_thread(cluster.wait_promoted, victim)
    failover_s = time.monotonic() - t0
    await asyncio.sleep(1.0)
    # the killed node comes back (what a supervisor does) and rejoins as its replacement's replica: with WAIT on,
    # that shard takes acknowledged writes again only then
    await asyncio.to_thread(cluster.restart, victim)
    await asyncio.to_thread(cluster.wait_ok)
    rejoined_s = time.monotonic() - t0
    load.phase = "after"
    await asyncio.sleep(settle)
    load.stop()
    await task
    lost, doubled = await load.final_check()
    errors = {
        phase: {status: n for status, n in counts.items() if status not in ("200", "503")}
        for phase, counts in load.statuses.items()
    }
    return {
        "updates_acknowledged": sum(c["200"] for c in load.statuses.values()),
        "retried_503": {phase: counts["503"] for phase, counts in load.statuses.items()},
        "errors": errors,
        "lost": lost,
        "doubled": doubled,
        "steady_p50_ms": _p(load.latencies["steady"], 50),
        "steady_p99_ms": _p(load.latencies["steady"], 99),
        "reshard_s": round(reshard_s, 1),
        "failover_s": round(failover_s, 1),
        "rejoined_s": round(rejoined_s, 1),
        "updates_after_rejoin": load.statuses["after"]["200"],
        "keys_per_primary": {str(p): n for p, n in cluster.keys_per_primary("cf-*").items()},
    }


def _logged_errors(log_path: Path, limit: int = 5) -> dict[str, int]:
    """The server's ERROR lines (JSON log records), by message and the last line of their traceback."""
    seen: collections.Counter = collections.Counter()
    for line in log_path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("level") in ("ERROR", "CRITICAL"):
            exc = (record.get("exc") or "").strip().splitlines()
            seen[f"{str(record.get('msg'))[:120]} | {exc[-1][:200] if exc else ''}"] += 1
    return dict(seen.most_common(limit))


async def _cas_latency(url: str, wait_replicas: int, n: int = 300) -> dict[str, float | None]:
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
    return {"cas_p50_ms": _p(times, 50), "cas_p99_ms": _p(times, 99)}


def run(wait_replicas: int, streams: int, settle: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="cluster-faults-") as tmp, LocalCluster(tmp) as cluster:
        cas = asyncio.run(_cas_latency(cluster.url, wait_replicas))
        env = {
            "MPFLOW_REDIS_URL": cluster.url,
            "MPFLOW_REDIS_PREFIX": f"cf-{uuid.uuid4().hex[:8]}",
            "MPFLOW_REDIS_WAIT_REPLICAS": str(wait_replicas),
            "MPFLOW_LOG_LEVEL": "WARNING",
        }
        with serve_as_user(env, Path(tmp) / "service.log", args=["--workers", "1"]) as server:
            result = asyncio.run(_measure(cluster, server.url, streams, settle))
        result["server_errors"] = _logged_errors(Path(tmp) / "service.log")
        return {"wait_replicas": wait_replicas, **cas, **result}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cluster_faults", description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=20)
    parser.add_argument("--settle", type=float, default=3.0, help="seconds of load before and after the faults")
    args = parser.parse_args(argv)
    rows = [run(n, args.streams, args.settle) for n in (0, 1)]
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"streams": args.streams, "runs": rows}, indent=2) + "\n")
    head = (
        "| WAIT replicas | acked | lost | doubled | 503 retried (reshard/failover) | other errors "
        "| update p50 / p99 ms | store CAS p50 / p99 ms |"
    )
    print(head)
    print("|" + "---|" * 8)
    for r in rows:
        others = {f"{ph}:{s}": n for ph, c in r["errors"].items() for s, n in c.items()}
        retried = f"{r['retried_503'].get('reshard', 0)} / {r['retried_503'].get('failover', 0)}"
        print(
            f"| {r['wait_replicas']} | {r['updates_acknowledged']} | {r['lost']} | {r['doubled']} | {retried} "
            f"| {others or 0} | {r['steady_p50_ms']} / {r['steady_p99_ms']} | {r['cas_p50_ms']} / {r['cas_p99_ms']} |"
        )
    for r in rows:
        print(
            f"WAIT {r['wait_replicas']}: keys per primary {r['keys_per_primary']}; reshard {r['reshard_s']} s, "
            f"failover {r['failover_s']} s, rejoined {r['rejoined_s']} s, 200s after {r['updates_after_rejoin']}; "
            f"server errors {r['server_errors']}"
        )
    bad = any(r["lost"] or r["doubled"] for r in rows if r["wait_replicas"]) or any(
        r["errors"].get("reshard") for r in rows
    )
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())

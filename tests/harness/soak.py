"""The soak: many streams, many one-step updates, one server, the embedded store; memory and latency over time.

``soak(streams, steps)`` runs the server as a user runs it (:class:`~tests.harness.server.ServiceProcess`,
``MPFLOW_DATA_DIR`` a temporary dir, no ``MPFLOW_REDIS_URL``) and feeds every stream one step per request through
recorded clients (:mod:`tests.harness.traffic`). Method ``mpf`` with the trained ``linear_gaussian-d2-v2``
operator, N = 64, on ``linear_gaussian`` d = 2 (o ~ N(x, 3I)): the method a user gets by default for this model,
i.e. the service's fast path (learned operator, ODE integration, micro-batching) with a small state, so that the
time goes to the per-request machinery a soak is about (HTTP, store, engine), and numerically stable over 1000
steps (the posterior sd follows √(3/m)).

Measured: the server's resident memory (RSS) over time — flat means at most 10 % growth from the end of the
warm-up (the first 10 % of the updates) to the end, plus the slope in bytes per update; Redis memory per stream
against the size computed from N and d (:func:`expected_state_bytes`: the safetensors layout of
``ParticleState.to_bytes``) — ``MEMORY USAGE`` of each stream's keys, and ``used_memory`` /
``used_memory_dataset`` per stream (the former also holds the connections' buffers); p99 latency of the first
and the last 10 % of the requests (stable: last ≤ 1.5 × first); every HTTP status (a soak has no fault: any 5xx
is a finding), with the server's warning log lines and the redis-server's, counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import os
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from mpflow.service.store.embedded import running_server
from mpflow.service.store.stream_store import StreamStore

from mpflow.client.http import Retry
from tests.harness.deadline import run_with_deadline
from tests.harness.server import ServiceProcess, kill_embedded, redis_log_warnings
from tests.harness.specs import STATE_DIM, TENANT
from tests.harness.traffic import Recorder, clients, create_streams, drive, percentile, progress, tally

SOAK_MODEL = {"family": "linear_gaussian"}  # H = I, R = 3I
SOAK_METHOD = "mpf"
SOAK_PARTICLES = 64
WARMUP_FRACTION = 0.1
TARGETS = {"rss_growth": 0.10, "p99_ratio": 1.5}
#: a run that takes longer than this (seconds: a base plus per update, ~20× the measured pace on 2 cores) has
#: stalled, and fails with what the server logged instead of hanging
STALL_BASE_S, STALL_PER_UPDATE_S = 60.0, 0.15
#: the whole run (connect, create, update, read back) is stopped after this plus STALL_PER_UPDATE_S per update, so
#: that a hang anywhere in it (not only in the updates) fails with where it was and every pending task's stack
#: (:func:`~tests.harness.deadline.run_with_deadline`), before pytest's own timeout
RUN_DEADLINE_S = 90.0


def expected_state_bytes(num_particles: int, dim: int, method: str) -> dict[str, int]:
    """The size of ``ParticleState.to_bytes()`` for one stream, from N and d.

    safetensors lays out an 8-byte little-endian header length, a JSON header (``__metadata__`` and, per
    tensor, dtype, shape and byte offsets; padded with spaces to a multiple of 8) and the raw tensors. The
    tensors of a state: particles [1, N, d] f32, log_weights [1, N] f32, step [1] i64, log_evidence [1] f64,
    rng [1, 2] i64 (the stream's counter-based generator: key and counter), plus for
    ``kalman`` extras.mean [1, d] and extras.cov [1, d, d] f64. (``mpf`` with a trained operator keeps no
    ``log_density``.)"""
    from mpflow.operators.state import FORMAT

    rng = 16
    tensors = {
        "particles": ("F32", [1, num_particles, dim], 4),
        "log_weights": ("F32", [1, num_particles], 4),
        "step": ("I64", [1], 8),
        "log_evidence": ("F64", [1], 8),
        "rng": ("I64", [1, 2], 8),
    }
    if method == "kalman":
        tensors |= {"extras.mean": ("F64", [1, dim], 8), "extras.cov": ("F64", [1, dim, dim], 8)}
    elif method != "mpf":
        raise ValueError(f"method: the layout is written out for mpf and kalman only, not {method!r}")
    # safetensors orders tensors by dtype (I64 > F64 > F32 > U8 in its enum), then by name
    rank = {"I64": 0, "F64": 1, "F32": 2, "U8": 3}
    header: dict[str, Any] = {"__metadata__": {"format": FORMAT}}
    offset = 0
    data = 0
    for name, (dtype, shape, size) in sorted(tensors.items(), key=lambda kv: (rank[kv[1][0]], kv[0])):
        nbytes = math.prod(shape) * size
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
        data += nbytes
    head = len(json.dumps(header, separators=(",", ":")))
    head += -head % 8
    return {
        "total": 8 + head + data,
        "tensors": data,
        "header": 8 + head,
        "rng": rng,
        "particles": num_particles * dim * 4,
    }


async def _redis_memory(store: StreamStore, stream_ids: Sequence[str]) -> dict[str, Any]:
    r = store.client
    info = await r.info("memory")
    strlen, state_mem, meta_mem = [], [], []
    for sid in stream_ids:
        meta_key, state_key = store.keys(TENANT, sid)
        strlen.append(await r.strlen(state_key))
        state_mem.append(await r.memory_usage(state_key, samples=0))
        meta_mem.append(await r.memory_usage(meta_key, samples=0))
    return {
        "used_memory": int(info["used_memory"]),
        "used_memory_dataset": int(info.get("used_memory_dataset", 0)),
        "mem_clients_normal": int(info.get("mem_clients_normal", 0)),
        "state_strlen": strlen,
        "state_memory_usage": state_mem,
        "meta_memory_usage": meta_mem,
    }


async def sample_until(stop: asyncio.Event, interval: float, take: Callable[[], Awaitable[None]]) -> None:
    """``take()`` every ``interval`` seconds until ``stop`` is set (then at most one more ``take`` finishes).

    The sampler is stopped by the event, never by ``Task.cancel()``: redis-py's asyncio client (8.1.0) now and then
    swallows a cancellation that lands inside a command (about one in ten cancels of a loop of ``INFO`` calls,
    measured against a local Redis; redis/redis-py#2028 describes the same for blocking commands), and the task
    then runs on. The soak's sampler was cancelled that way, and the run waited on it for ever: CI's soak hangs."""
    while not stop.is_set():
        await take()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval)


def tree_rss(proc) -> int:
    """Resident memory of ``proc`` and every process under it: the uvicorn supervisor and its workers (a server
    with several workers grows in its workers, not in the supervisor)."""
    import psutil

    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            total += p.memory_info().rss
    return total


async def _soak_run(
    service: ServiceProcess,
    store_url: str,
    streams: int,
    steps: int,
    show_progress: bool,
    sample_s: float,
    where: dict[str, Any],
) -> dict[str, Any]:
    """The soak itself; ``where`` says which phase it is in (and the updates done), for a run stopped from outside."""
    import psutil

    where["phase"] = "connecting"
    rec = Recorder()
    proc = psutil.Process(service.pid)
    memory_store = StreamStore.from_url(store_url, prefix="mpflow")
    stop = asyncio.Event()
    sampler: asyncio.Task | None = None
    samples: list[dict[str, float]] = []
    try:
        empty = await _redis_memory(memory_store, [])
        async with clients(service.url, streams, rec, Retry(attempts=3)) as cs:
            where["phase"] = "creating the streams"
            pairs = await create_streams(cs, SOAK_MODEL, SOAK_METHOD, SOAK_PARTICLES, steps, "soak")
            runs = [r for _, r in pairs]
            ids = [r.stream_id for r in runs]
            created = await _redis_memory(memory_store, ids)
            operator = pairs[0][0].document.get("operator") if pairs[0][0].document else None
            bar = progress(streams * steps, "soak", show_progress)
            done = [0]
            t_start = time.monotonic()

            def on_steps(n: int) -> None:
                done[0] += n
                where["updates"] = done[0]
                bar.update(n)

            async def sample() -> None:
                mem = await _redis_memory(memory_store, [])
                samples.append(
                    {
                        "t": round(time.monotonic() - t_start, 3),
                        "updates": done[0],
                        "rss": tree_rss(proc),
                        "redis_used_memory": mem["used_memory"],
                        "redis_dataset": mem["used_memory_dataset"],
                        "redis_clients": mem["mem_clients_normal"],
                        "load1": os.getloadavg()[0],
                    }
                )

            sampler = asyncio.create_task(sample_until(stop, sample_s, sample))
            where["phase"] = "updating"
            budget = STALL_BASE_S + STALL_PER_UPDATE_S * streams * steps
            try:
                await asyncio.wait_for(
                    asyncio.gather(*(drive(s, r, 1, on_steps, keep_means=False) for s, r in pairs)), budget
                )
            except TimeoutError:
                raise RuntimeError(
                    f"{done[0]} of {streams * steps} updates in {budget:.0f} s; per stream acknowledged: "
                    f"{[len(r.acked) for r in runs]}, errors: {[dict(r.errors) for r in runs if r.errors]}"
                ) from None
            wall = time.monotonic() - t_start
            where["phase"] = "reading the end state"
            await asyncio.sleep(sample_s)  # one sample after the end
            stop.set()
            await sampler
            bar.close()
            final = await _redis_memory(memory_store, ids)
            steps_stored = [int((await s.get())["step"]) for s, _ in pairs]
    finally:
        stop.set()
        if sampler is not None and not sampler.done():
            await asyncio.wait({sampler}, timeout=10.0)
        await memory_store.aclose()
    lat = sorted(((t - t_start, x) for r in runs for t, x in r.latencies), key=lambda p: p[0])
    return {
        "operator": operator,
        "wall_s": round(wall, 1),
        "updates": sum(len(r.acked) for r in runs),
        "updates_per_s": round(sum(len(r.acked) for r in runs) / wall, 1),
        "stored_steps_ok": sum(s == steps for s in steps_stored),
        "tally": tally(runs, rec),
        "samples": samples,
        "latencies": lat,
        "redis": {"empty": empty, "created": created, "final": final},
    }


def rss_figures(samples: list[dict[str, float]], total: int) -> dict[str, Any]:
    """RSS at the end of the warm-up (first sample with ≥ 10 % of the updates done) and at the end; the growth,
    and the least-squares slope of RSS against updates after the warm-up (bytes per update)."""
    warm = next((s for s in samples if s["updates"] >= WARMUP_FRACTION * total), samples[-1])
    after = [s for s in samples if s["t"] >= warm["t"]]
    end = samples[-1]
    slope = None
    if len(after) >= 3 and after[-1]["updates"] > after[0]["updates"]:
        u = np.array([s["updates"] for s in after], dtype=float)
        r = np.array([s["rss"] for s in after], dtype=float)
        slope = float(np.polyfit(u, r, 1)[0])
    return {
        "rss_start_mb": round(samples[0]["rss"] / 2**20, 1),
        "rss_after_warmup_mb": round(warm["rss"] / 2**20, 1),
        "rss_end_mb": round(end["rss"] / 2**20, 1),
        "rss_max_mb": round(max(s["rss"] for s in samples) / 2**20, 1),
        "rss_growth": round(end["rss"] / warm["rss"] - 1.0, 4),
        "rss_slope_bytes_per_update": round(slope, 1) if slope is not None else None,
    }


def latency_figures(lat: list[tuple[float, float]]) -> dict[str, Any]:
    """p50/p99 overall and of the first and the last 10 % of the requests (by completion time)."""
    k = max(1, int(len(lat) * 0.1))
    first = sorted(x for _, x in lat[:k])
    last = sorted(x for _, x in lat[-k:])
    allx = sorted(x for _, x in lat)
    p99_first, p99_last = percentile(first, 0.99), percentile(last, 0.99)
    return {
        "requests": len(lat),
        "p50_ms": round(percentile(allx, 0.5) * 1e3, 2),
        "p99_ms": round(percentile(allx, 0.99) * 1e3, 2),
        "p99_first10_ms": round(p99_first * 1e3, 2),
        "p99_last10_ms": round(p99_last * 1e3, 2),
        "p50_first10_ms": round(percentile(first, 0.5) * 1e3, 2),
        "p50_last10_ms": round(percentile(last, 0.5) * 1e3, 2),
        "p99_ratio_last_first": round(p99_last / p99_first, 3),
    }


def latency_windows(lat: list[tuple[float, float]], windows: int = 60) -> list[dict[str, float]]:
    """p50/p99 of the requests completing in each of ``windows`` equal time windows: (t mid, n, p50_ms, p99_ms)."""
    if not lat:
        return []
    t = np.array([x[0] for x in lat])
    v = np.array([x[1] for x in lat])
    out = []
    for a, b in itertools.pairwise(np.linspace(t[0], t[-1] + 1e-9, windows + 1)):
        x = v[(t >= a) & (t < b)]
        if len(x):
            mid = round(float(a + b) / 2, 2)
            p50, p99 = (round(float(np.quantile(x, q)) * 1e3, 2) for q in (0.5, 0.99))
            out.append({"t": mid, "n": len(x), "p50_ms": p50, "p99_ms": p99})
    return out


def memory_figures(redis: dict[str, Any], streams: int, expected: dict[str, int]) -> dict[str, Any]:
    """Redis memory per stream: the state's STRLEN against :func:`expected_state_bytes`, ``MEMORY USAGE`` of the
    keys, ``used_memory`` / ``used_memory_dataset`` per stream after the creation and at the end."""
    final, created = redis["final"], redis["created"]
    state_mem = final["state_memory_usage"]
    meta_mem = final["meta_memory_usage"]
    return {
        "expected_state_bytes": expected["total"],
        "expected_breakdown": expected,
        "state_strlen_created": sorted(set(created["state_strlen"])),
        "state_strlen_final": sorted(set(final["state_strlen"])),
        "state_memory_usage_mean": round(float(np.mean(state_mem)), 1),
        "meta_memory_usage_mean": round(float(np.mean(meta_mem)), 1),
        "per_stream_keys_bytes": round(float(np.mean(state_mem) + np.mean(meta_mem)), 1),
        "used_memory_per_stream_created": round((created["used_memory"] - redis["empty"]["used_memory"]) / streams, 1),
        "used_memory_per_stream_final": round((final["used_memory"] - redis["empty"]["used_memory"]) / streams, 1),
        "dataset_per_stream_created": round(
            (created["used_memory_dataset"] - redis["empty"]["used_memory_dataset"]) / streams, 1
        ),
        "dataset_per_stream_final": round(
            (final["used_memory_dataset"] - redis["empty"]["used_memory_dataset"]) / streams, 1
        ),
        "client_buffers_final": final["mem_clients_normal"],
    }


def soak(streams: int = 100, steps: int = 1000, progress: bool = False, sample_s: float = 1.0) -> dict[str, Any]:
    """``streams`` × ``steps`` one-step updates (module docstring); RSS, Redis memory and latency figures.
    ``series`` holds the samples (t, updates, rss, redis_used_memory, load1) and the latency per time window
    (:func:`latency_windows`) for a plot."""
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mpflow-soak-") as tmp:
        data_dir = Path(tmp) / "data"
        try:
            with ServiceProcess({"MPFLOW_DATA_DIR": str(data_dir), "MPFLOW_REDIS_URL": ""}, Path(tmp)) as service:
                service.start()
                found = running_server(data_dir)
                assert found is not None, "the server started no embedded redis-server"
                where: dict[str, Any] = {"phase": "starting"}
                deadline = RUN_DEADLINE_S + STALL_PER_UPDATE_S * streams * steps
                store = f"unix://{found[1]}"
                try:
                    run = run_with_deadline(
                        _soak_run(service, store, streams, steps, progress, sample_s, where), deadline
                    )
                except Exception as exc:  # a stalled or failed run: say where, and what the server said
                    raise AssertionError(
                        f"the soak stopped ({where}, {time.monotonic() - t0:.0f} s in): {type(exc).__name__}: {exc}\n"
                        f"server log:\n{service.log_tail()}"
                    ) from exc
                aof = sum(f.stat().st_size for f in data_dir.glob("appendonly*"))
                redis_log = redis_log_warnings(Path(found[1]).parent / "redis.log")
            warnings = service.warnings()
        finally:
            kill_embedded(data_dir)
    total = streams * steps
    expected = expected_state_bytes(SOAK_PARTICLES, STATE_DIM, SOAK_METHOD)
    rss = rss_figures(run["samples"], total)
    latency = latency_figures(run["latencies"])
    memory = memory_figures(run["redis"], streams, expected)
    loads = [s["load1"] for s in run["samples"]]
    return {
        "scenario": "soak",
        "streams": streams,
        "steps": steps,
        "method": SOAK_METHOD,
        "operator": run["operator"],
        "num_particles": SOAK_PARTICLES,
        "model": SOAK_MODEL,
        "updates": run["updates"],
        "stored_steps_ok": run["stored_steps_ok"],
        "wall_s": run["wall_s"],
        "total_s": round(time.monotonic() - t0, 1),
        "updates_per_s": run["updates_per_s"],
        **run["tally"],
        "rss": rss,
        "latency": latency,
        "redis_memory": memory,
        "aof_bytes_end": aof,
        "service_warnings": warnings,
        "redis_log_warnings": redis_log,
        "load1_mean": round(float(np.mean(loads)), 2) if loads else None,
        "load1_max": round(float(np.max(loads)), 2) if loads else None,
        "targets": {
            "rss_growth_le": TARGETS["rss_growth"],
            "rss_flat": rss["rss_growth"] <= TARGETS["rss_growth"],
            "p99_ratio_le": TARGETS["p99_ratio"],
            "p99_stable": latency["p99_ratio_last_first"] <= TARGETS["p99_ratio"],
            "state_bytes_as_computed": memory["state_strlen_final"] == [expected["total"]],
        },
        "series": {"samples": run["samples"], "latency_windows": latency_windows(run["latencies"])},
    }

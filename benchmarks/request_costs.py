"""The worst request each endpoint accepts at the default limits: its time and the server's peak memory
(docs/API.md "Limits", the cost model of :mod:`mpflow.service.streams.costs`).

For each case — an endpoint, a stream (family, method, N, d) and the request grown to the largest size the cost
model accepts (:func:`mpflow.service.streams.costs.largest`, from the same estimates the server checks) — the stream is
created on a real server (``python -m mpflow serve`` with its default limits, on the Redis of
``MPFLOW_REDIS_URL``, else redis://127.0.0.1:6379/0), the server's peak RSS is reset to its current RSS
(``/proc/PID/clear_refs`` 5), the request is sent, and its wall time and the growth of the server's peak RSS
(``VmHWM`` − ``VmRSS`` before) are recorded with the cost model's estimate. One size larger is refused (413): checked
too. ``GET .../smoothed`` has no size of its own: its stream's N is grown to the largest that stream's creation
accepts (the read being the stream's dearest request), its window filled first, and one more particle is the
creation refused. Writes ``benchmarks/results/request_costs.json`` and prints a table.

    python -m benchmarks.request_costs [--only NAME ...]

:func:`cases` and :func:`measure` are importable (``benchmarks/abuse.py`` may run them).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import torch
from mpflow.operators.models import make_model
from mpflow.operators.models.priors import prior_from_spec
from mpflow.operators.updaters import get_updater
from mpflow.service.settings import Settings
from mpflow.service.streams import costs

from tests.harness import rts
from tests.harness.server import drop_prefix, serve_as_user
from tests.harness.specs import DEFAULT_REDIS

RESULTS = Path(__file__).parent / "results" / "request_costs.json"


def eye(d: int, scale: float = 1.0) -> list[list[float]]:
    return [[scale * float(i == j) for j in range(d)] for i in range(d)]


def stream(family: str, method: str, n: int, d: int) -> dict[str, Any]:
    """A stream of ``family`` (lds: A = 0.9 I, B = I; lorenz96: its defaults; linear_gaussian: H = I) with a
    standard Gaussian prior (lorenz96: centred at F = 8)."""
    params = {"A": eye(d, 0.9), "B": eye(d)} if family == "lds" else {}
    mean = 8.0 if family == "lorenz96" else 0.0
    return {
        "model": {"family": family, "params": params},
        "prior": {"type": "gaussian", "mean": [mean] * d, "cov": eye(d)},
        "method": method,
        "num_particles": n,
        "seed": 7,
    }


@dataclass
class Case:
    """One endpoint's request on one stream: ``request(value)`` the (method, path, params, body) of the request of
    size ``value`` (the field ``field``, at most ``cap``), ``cost(value)`` the cost model's estimate of it."""

    name: str
    endpoint: str
    spec: dict[str, Any]
    field: str
    cap: int
    request: Callable[[str, int], tuple[str, str, dict | None, dict | None]]
    cost: Callable[[int], costs.Cost]
    creates: bool = False
    #: what bounds the value where it is not the request's own cost: a smoothing stream's N, refused at its creation
    #: when the dearest of the stream's requests is over a budget (:func:`costs.smoothing_stream_cost`); "one more"
    #: is then that creation
    bound: Callable[[int], costs.Cost] | None = None
    #: requests sent to the stream before the measured one (a smoothing window filled)
    setup: Callable[[str], list[tuple[str, str, dict | None, dict | None]]] | None = None


def _parts(spec: dict[str, Any], settings: Settings):
    d = len(spec["prior"]["mean"])
    model = make_model(spec["model"]["family"], spec["model"]["params"], d)
    options = {**settings.method_options.get(spec["method"], {}), **spec.get("method_options", {})}
    updater = get_updater(spec["method"], **options)
    return model, updater, prior_from_spec(spec["prior"]), spec["num_particles"], d


def cases(settings: Settings) -> list[Case]:
    """The worst accepted request per endpoint (module docstring)."""
    out = []
    # POST /v1/streams: N grown at d = 64 and d = 128 (smc), and svgd's n² kernel at d = 8
    for name, family, method, d in (
        ("create smc d=64", "lds", "smc", 64),
        ("create smc d=128", "lds", "smc", 128),
        ("create svgd d=8", "lds", "svgd", 8),
        ("create mpf sv d=1 (marginal, N² pairs)", "stochastic_volatility", "mpf", 1),
    ):
        spec = stream(family, method, 1, d)
        model, updater, prior, _, _ = _parts(spec, settings)
        out.append(
            Case(
                name,
                "POST /v1/streams",
                spec,
                "num_particles",
                settings.max_particles,
                lambda _sid, n, spec=spec: ("POST", "/v1/streams", None, {**spec, "num_particles": n}),
                lambda n, m=model, u=updater, p=prior: costs.creation_cost(m, u, p, n),
                creates=True,
            )
        )
    # POST observations: the number of steps grown (smc d = 64 at N = 16384; lorenz96 at 1000 RK4 sub-steps each;
    # gpf's default iterations at N = 16, d = 2, each priced at its fixed cost: max_iters = 500 of them a step)
    l96_dt = settings.max_integration_substeps * 0.05 / 0.05 / 1.001  # Δ = h = 0.05: dt sub-steps per step
    # issue 54's multi-second step: ienkf's 20 iterations, each integrating dt = 40 sub-steps
    ienkf_20 = {**stream("lorenz96", "ienkf", 1500, 40), "method_options": {"iterations": 20}}
    for name, spec, dt_, value in (
        ("observe smc d=64 N=16384", stream("lds", "smc", 16384, 64), 1.0, [0.0] * 64),
        ("observe lorenz96 d=40 N=1024 dt=999", stream("lorenz96", "smc", 1024, 40), l96_dt, [8.0] * 40),
        ("observe gpf d=2 N=16", stream("lds", "gpf", 16, 2), 1.0, [0.0] * 2),
        ("observe ienkf lorenz96 d=40 N=1500 iterations=20", ienkf_20, 40.0, [8.0] * 40),
    ):
        model, updater, _, n, _ = _parts(spec, settings)
        item = {"value": value, "dt": dt_}
        k = len(value)
        out.append(
            Case(
                name,
                "POST /v1/streams/{id}/observations",
                spec,
                "observations",
                settings.max_observations_per_request,
                lambda sid, m, item=item: (
                    "POST",
                    f"/v1/streams/{sid}/observations",
                    None,
                    {"observations": [item] * m},
                ),
                lambda m, mo=model, u=updater, n=n, dt_=dt_, k=k: costs.observations_cost(mo, u, n, [(dt_, k)] * m, 0),
            )
        )
    # GET forecast: steps grown
    for name, spec, dt_ in (
        ("forecast smc d=64 N=16384", stream("lds", "smc", 16384, 64), 1.0),
        ("forecast lorenz96 d=40 N=1024 dt=999", stream("lorenz96", "smc", 1024, 40), l96_dt),
        ("forecast kalman d=128", stream("lds", "kalman", 256, 128), 1.0),
    ):
        model, updater, _, n, _ = _parts(spec, settings)
        out.append(
            Case(
                name,
                "GET /v1/streams/{id}/forecast",
                spec,
                "steps",
                settings.max_forecast_steps,
                lambda sid, k, dt_=dt_: ("GET", f"/v1/streams/{sid}/forecast", {"steps": k, "dt": dt_}, None),
                lambda k, mo=model, u=updater, n=n, dt_=dt_: costs.forecast_cost(mo, u, n, k, dt_, 0),
            )
        )
    # GET samples at d = 512 and GET particles at d = 64: n, and N grown
    spec = stream("linear_gaussian", "smc", 256, 512)
    meta = {"num_particles": 256, "state_dim": 512}
    out.append(
        Case(
            "samples d=512",
            "GET /v1/streams/{id}/samples",
            spec,
            "n",
            settings.max_samples_per_request,
            lambda sid, n: ("GET", f"/v1/streams/{sid}/samples", {"n": n}, None),
            lambda n: costs.summary_cost(meta["num_particles"], 512).then(costs.draws_cost(n, 512)),
        )
    )
    out.append(
        Case(
            "particles d=64",
            "GET /v1/streams/{id}/particles",
            stream("linear_gaussian", "smc", 1, 64),
            "num_particles",
            settings.max_particles,
            lambda sid, n: ("GET", f"/v1/streams/{sid}/particles", None, None),
            lambda n: costs.particles_cost(n, 64),
        )
    )
    out.append(smoothed_case(settings))
    return out


def smoothed_case(settings: Settings, lag: int = 100) -> Case:
    """``GET .../smoothed`` of an ``smc`` stream of the 2-D ``lds`` of ``tests/harness/rts.py`` at L = ``lag``, its N
    grown to the largest its creation accepts (the read is its dearest request), its window filled by L + 5
    observations: backward simulation, priced at its worst case (every proposal rejected)."""
    spec = {
        "model": {"family": "lds", "params": rts.PARAMS},
        "prior": rts.PRIOR,
        "method": "smc",
        "num_particles": 1,
        "smoothing_lag": lag,
        "seed": 7,
    }
    model, updater, prior, _, d = _parts(spec, settings)
    observations = {"observations": rts.data(lag + 5)}
    return Case(
        f"smoothed smc d={d} L={lag}",
        "GET /v1/streams/{id}/smoothed",
        spec,
        "num_particles",
        settings.max_particles,
        lambda sid, _n: ("GET", f"/v1/streams/{sid}/smoothed", None, None),
        lambda n: costs.smoothing_cost(model, updater, n, lag),
        bound=lambda n: costs.smoothing_stream_cost(model, updater, prior, n, lag),
        setup=lambda sid: [("POST", f"/v1/streams/{sid}/observations", None, observations)],
    )


def _status(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def measure(url: str, pid: int, case: Case, settings: Settings) -> dict[str, Any]:
    """The case's largest accepted request: its size, status, wall time, the server's peak RSS growth and the
    estimate; and the status of one size larger (413 expected unless the size is the field's own cap)."""
    value = costs.largest(settings, case.cap, case.bound or case.cost)
    with httpx.Client(base_url=url, timeout=600) as c:
        sid = None
        spec = case.spec
        if case.field == "num_particles" and not case.creates:
            spec = {**spec, "num_particles": value}
        if not case.creates:
            r = c.post("/v1/streams", json=spec)
            assert r.status_code == 201, r.text
            sid = r.json()["stream_id"]
            for method, path, params, body in case.setup(sid) if case.setup else []:
                r = c.request(method, path, params=params, json=body)
                assert r.status_code == 200, r.text

        def send(v: int) -> httpx.Response:
            method, path, params, body = case.request(sid or "", v)
            return c.request(method, path, params=params, json=body)

        before = _status(pid, "VmRSS")
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        t0 = time.perf_counter()
        r = send(value)
        seconds = time.perf_counter() - t0
        peak = _status(pid, "VmHWM") - before
        over = None
        if value < case.cap and case.bound is not None:  # one more particle: the stream's creation is refused
            one_more = c.post("/v1/streams", json={**spec, "num_particles": value + 1})
            over = one_more.status_code
            if over == 201:
                c.delete(f"/v1/streams/{one_more.json()['stream_id']}")
        elif value < case.cap and not (case.field == "num_particles" and not case.creates):
            over = send(value + 1).status_code
        if sid is not None:
            c.delete(f"/v1/streams/{sid}")
        if case.creates and r.status_code == 201:
            c.delete(f"/v1/streams/{r.json()['stream_id']}")
    estimate = case.cost(value)
    return {
        "case": case.name,
        "endpoint": case.endpoint,
        "field": case.field,
        "largest_accepted": value,
        "status": r.status_code,
        "seconds": round(seconds, 3),
        "peak_rss_growth_mib": round(peak / 2**20, 1),
        "estimated_gflop": round(estimate.flops / 1e9, 2),
        "estimated_mib": round(estimate.bytes / 2**20, 1),
        "one_more_status": over,
    }


def run(only: list[str] | None = None) -> dict[str, Any]:
    settings = Settings()  # the defaults: the server below runs with them too
    redis_url = os.environ.get("MPFLOW_REDIS_URL") or DEFAULT_REDIS
    prefix = f"mpflowbench-costs-{uuid.uuid4().hex[:12]}"
    env = {"MPFLOW_REDIS_URL": redis_url, "MPFLOW_REDIS_PREFIX": prefix, "MPFLOW_LOG_LEVEL": "WARNING"}
    rows = []
    try:
        with (
            tempfile.TemporaryDirectory() as logs,
            serve_as_user(env, Path(logs) / "service.log", args=["--workers", "1"]) as server,
        ):
            for case in cases(settings):
                if only and case.name not in only:
                    continue
                rows.append(measure(server.url, server.pid, case, settings))
                print(json.dumps(rows[-1]), flush=True)
    finally:
        asyncio.run(drop_prefix(redis_url, prefix))
    return {
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "budgets": {
            "max_request_flops": settings.max_request_flops,
            "max_request_bytes": settings.max_request_bytes,
            "max_integration_substeps": settings.max_integration_substeps,
        },
        "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "load": os.getloadavg()},
        "cases": rows,
    }


def table(result: dict[str, Any]) -> str:
    lines = [
        "| case | endpoint | largest accepted | time (s) | peak RSS growth (MiB) | estimate (GFLOP, MiB) | one more |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["cases"]:
        lines.append(
            f"| {r['case']} | `{r['endpoint']}` | {r['field']} = {r['largest_accepted']} | {r['seconds']} | "
            f"{r['peak_rss_growth_mib']} | {r['estimated_gflop']}, {r['estimated_mib']} | {r['one_more_status']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="case names to run (default: all)")
    args = parser.parse_args()
    result = run(args.only)
    if not args.only:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))


if __name__ == "__main__":
    main()

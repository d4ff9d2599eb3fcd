"""Bad input and numerical faults, measured: fuzzing every endpoint, hostile bodies, extreme observations.

``python -m benchmarks.reliability_input [--quick] [--examples N]``

The server runs as a user runs it — ``python -m service`` on a free port (:func:`service.testing.serve_as_user`),
on the Redis of ``MPFLOW_REDIS_URL`` (else redis://127.0.0.1:6379/0) under a fresh key prefix
that is deleted afterwards, with small limits (:data:`SERVER_ENV`: at most 64 particles, d ≤ 4, 5 steps and 200
draws per request) and the iterative methods cut short, so that generated streams are cheap. Three parts:

* **fuzz** — schemathesis generates requests from ``/openapi.json`` for every operation, ``examples`` valid
  (positive) and ``examples`` invalid (negative) ones each, deterministic (hypothesis ``derandomize``), and checks
  every answer: no 5xx, the status and the body documented for the operation, schema-violating requests refused
  (its default checks, less ``positive_data_acceptance``: a schema-valid request may still be over a configured
  limit or wrong for its model family). Counted per operation: requests, statuses, 5xx, failed checks.
* **hostile bodies** (:data:`HOSTILE`) — arrays nested 100 000 deep, 7 MiB of numbers in the wrong shape,
  hundreds of thousands of unknown keys or bad items, number literals beyond float64 (``1e400``, ``NaN``,
  ``Infinity``) or float32 (``1e39``), 4000-digit integers, bodies over the 8 MiB limit (declared and chunked),
  invalid UTF-8; each must be answered with its 4xx, and fast: the seconds to the answer are measured
  (client-side, loopback HTTP).
* **numerical faults** — for every family and every method ``GET /v1/models`` lists for it, a stream fed
  observations of scale ±1e6 … 3e38 (:data:`EXTREME`), one per request: the statuses, the steps that fell back
  (by fall-back method, from the answers' ``"fallback"``; cross-checked against ``mpflow_update_fallbacks_total``)
  and — read back through ``/particles``, the document and ``/samples`` after every request — any non-finite
  value stored (must be 0).

Results: tables on stdout and ``benchmarks/results/reliability_input.json`` (``reliability_input-quick.json``
with ``--quick``). The tests in ``tests/reliability/test_bad_input.py`` run the same functions on smaller counts.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import datetime as dt
import json
import os
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_REDIS = "redis://127.0.0.1:6379/0"
MiB = 1024 * 1024

#: the server's settings for these runs: small limits and short iterative methods keep generated streams cheap
SERVER_ENV = {
    "MPFLOW_MAX_PARTICLES": "64",
    "MPFLOW_MAX_STATE_DIM": "4",
    "MPFLOW_MAX_SAMPLES_PER_REQUEST": "200",
    "MPFLOW_MAX_OBSERVATIONS_PER_REQUEST": "5",
    "MPFLOW_METHOD_OPTIONS": json.dumps(
        {"nvgd": {"max_iters": 3, "inner_steps": 3}, "gpf": {"max_iters": 60}, "svgd": {"max_iters": 10}}
    ),
}
LINEAR_STREAM = {
    "model": {"family": "linear_gaussian"},
    "prior": {"type": "gaussian", "mean": [0.0, 0.0], "cov": [[1.0, 0.0], [0.0, 1.0]]},
    "method": "smc",
    "num_particles": 16,
    "seed": 1,
}


# ----------------------------------------------------------------------------------------------------------
# fuzzing


@dataclass
class OperationStats:
    """What the fuzzer saw for one operation."""

    requests: int = 0
    statuses: collections.Counter = field(default_factory=collections.Counter)
    server_errors: int = 0
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "statuses": {str(k): v for k, v in sorted(self.statuses.items())},
            "5xx": self.server_errors,
            "failed_checks": len(self.failures),
            "failures": self.failures[:5],
            "seconds": round(self.seconds, 2),
        }


def fuzz(
    url: str,
    examples: int,
    headers: dict[str, str] | None = None,
    raise_on_failure: bool = False,
    stream_ids: list[str] | None = None,
) -> dict[str, OperationStats]:
    """Fuzz every operation of ``{url}/openapi.json`` with ``examples`` positive and ``examples`` negative
    cases (module docstring); {operation label: stats}. ``raise_on_failure``: re-raise the first failed check
    (with schemathesis' report of the shrunk case) instead of recording it. ``stream_ids``: existing streams;
    the positive cases of every operation on one stream but DELETE address them in turn (a generated id is
    almost never a stream's: the bodies would only ever meet a 404)."""
    import schemathesis
    from hypothesis import HealthCheck, given
    from hypothesis import settings as hypothesis_settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode
    from schemathesis.specs.openapi.checks import positive_data_acceptance

    from service.dashboard.events import NOT_FUZZED

    schema = schemathesis.openapi.from_url(f"{url}/openapi.json").exclude(path_regex=NOT_FUZZED)
    out: dict[str, OperationStats] = {}

    def runner(op: Any, mode: GenerationMode, stats: OperationStats) -> Callable[[], None]:
        @given(case=op.as_strategy(generation_mode=mode))
        @hypothesis_settings(
            max_examples=examples,
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        )
        def check(case: Any) -> None:
            known = stream_ids and mode == GenerationMode.POSITIVE and op.method.upper() != "DELETE"
            if known and "stream_id" in (case.path_parameters or {}):
                case.path_parameters = {
                    **case.path_parameters,
                    "stream_id": stream_ids[stats.requests % len(stream_ids)],
                }
            response = case.call(headers=headers)
            stats.requests += 1
            stats.statuses[response.status_code] += 1
            if response.status_code >= 500:
                stats.server_errors += 1
            case.validate_response(response, excluded_checks=[positive_data_acceptance], headers=headers)

        return check

    for result in schema.get_all_operations():
        op = result.ok()
        stats = out.setdefault(op.label, OperationStats())
        t0 = time.perf_counter()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            try:
                runner(op, mode, stats)()
            except Unsatisfiable:  # nothing to make invalid (an operation without parameters or body)
                continue
            except Exception as exc:
                if raise_on_failure:
                    raise
                stats.failures.append(f"{mode.value}: {str(exc).strip().splitlines()[0][:300]}")
        stats.seconds = time.perf_counter() - t0
    return out


# ----------------------------------------------------------------------------------------------------------
# hostile bodies


def _nested(depth: int, inner: str = "") -> str:
    return "[" * depth + inner + "]" * depth


def _numbers(n: int, value: str = "0.1234567") -> str:
    return ",".join([value] * n)


@dataclass
class Hostile:
    """One hostile request: ``path`` (``{sid}`` is an existing stream), the raw body (or a chunk iterator), the
    statuses it may be answered with."""

    name: str
    path: str
    body: Callable[[], bytes | Iterator[bytes]]
    expect: tuple[int, ...]
    method: str = "POST"
    headers: dict[str, str] = field(default_factory=lambda: {"content-type": "application/json"})
    field: str | None = None  # the field the error message must start with, if any


def _obs(inner: str) -> bytes:
    return ('{"observations": ' + inner + "}").encode()


def _create(prior: str, model: str = '{"family": "linear_gaussian"}', extra: str = "") -> bytes:
    return ('{"model": ' + model + ', "prior": ' + prior + extra + "}").encode()


_GAUSS = '{"type": "gaussian", "mean": [0, 0], "cov": [[1, 0], [0, 1]]}'
_OBS = "/v1/streams/{sid}/observations"
_SEVEN_MIB = 7 * MiB // 10  # numbers of "0.1234567," (10 bytes each) in 7 MiB


def _chunks(total: int, size: int = 256 * 1024) -> Iterator[bytes]:
    sent = 0
    yield b'{"observations": [['
    while sent < total:
        yield b"0.1234567," * (size // 10)
        sent += size
    yield b"1]]}"


HOSTILE: list[Hostile] = [
    Hostile("100k nested arrays (whole body)", _OBS, lambda: _nested(100_000).encode(), (400,)),
    Hostile("100k nested arrays in observations", _OBS, lambda: _obs(_nested(100_000)), (400,)),
    Hostile(
        "100k nested arrays in model.params.A",
        "/v1/streams",
        lambda: _create(_GAUSS, '{"family": "lds", "params": {"A": ' + _nested(100_000) + "}}"),
        (400,),
    ),
    Hostile("50 nested arrays in observations", _OBS, lambda: _obs(_nested(50, "1")), (422,), field="observations[0]"),
    Hostile(
        "7 MiB observation of the wrong shape",
        _OBS,
        lambda: _obs("[[" + _numbers(_SEVEN_MIB) + "]]"),
        (422,),
        field="observations[0]",
    ),
    Hostile(
        "7 MiB matrix as one observation",
        _OBS,
        lambda: _obs("[[" + ",".join(["[" + _numbers(99) + "]"] * (_SEVEN_MIB // 100)) + "]]"),
        (422,),
        field="observations[0]",
    ),
    Hostile(
        "7 MiB of one-number steps", _OBS, lambda: _obs("[" + _numbers(_SEVEN_MIB) + "]"), (413,), field="observations"
    ),
    Hostile(
        "600k strings as steps",
        _OBS,
        lambda: _obs("[" + ",".join(['"abc"'] * 600_000) + "]"),
        (422,),
        field="observations[0]",
    ),
    Hostile(
        "600k booleans as steps",
        _OBS,
        lambda: _obs("[" + ",".join(["true"] * 600_000) + "]"),
        (422,),
        field="observations[0]",
    ),
    Hostile(
        "400k unknown keys",
        _OBS,
        lambda: ("{" + ",".join(f'"k{i}": {i}' for i in range(400_000)) + "}").encode(),
        (422,),
        field="body",
    ),
    Hostile(
        "300k-particle prior",
        "/v1/streams",
        lambda: _create('{"type": "particles", "particles": [' + ",".join(["[0.5, 0.5]"] * 300_000) + "]}"),
        (413,),
        field="num_particles",
    ),
    Hostile(
        "100k mixture components",
        "/v1/streams",
        lambda: _create(
            '{"type": "mixture", "weights": ['
            + _numbers(100_000, "1")
            + '], "means": ['
            + ",".join(["[0, 0]"] * 100_000)
            + '], "covs": ['
            + ",".join(["[[1, 0], [0, 1]]"] * 100_000)
            + "]}"
        ),
        (422,),
        field="prior.mixture",
    ),
    Hostile(
        "60k batch updates",
        "/v1/observations:batch",
        lambda: (
            '{"updates": [' + ",".join(['{"stream_id": "{sid}", "observations": [[0, 0]]}'] * 60_000) + "]}"
        ).encode(),
        (413,),
        field="updates",
    ),
    Hostile("NaN literal", _OBS, lambda: _obs("[[NaN, 1]]"), (422,), field="observations[0]"),
    Hostile("Infinity literal", _OBS, lambda: _obs("[[1, -Infinity]]"), (422,), field="observations[0]"),
    Hostile("1e400 literal", _OBS, lambda: _obs("[[1e400, 1]]"), (422,), field="observations[0]"),
    Hostile("1e39 (beyond float32)", _OBS, lambda: _obs("[[1e39, 1]]"), (422,), field="observations[0]"),
    Hostile("4000-digit integer", _OBS, lambda: _obs("[[" + "9" * 4000 + ", 1]]"), (422,), field="observations[0]"),
    Hostile("5000-digit integer", _OBS, lambda: _obs("[[" + "9" * 5000 + ", 1]]"), (400,)),
    Hostile(
        "NaN in prior.mean",
        "/v1/streams",
        lambda: _create('{"type": "gaussian", "mean": [NaN, 0], "cov": [[1, 0], [0, 1]]}'),
        (422,),
        field="prior",
    ),
    Hostile(
        "Infinity in model.params.R",
        "/v1/streams",
        lambda: _create(_GAUSS, '{"family": "linear_gaussian", "params": {"R": [[Infinity, 0], [0, 1]]}}'),
        (422,),
        field="model.params.R",
    ),
    Hostile(
        "1e400 in a batch update",
        "/v1/observations:batch",
        lambda: b'{"updates": [{"stream_id": "{sid}", "observations": [[1e400, 0]]}]}',
        (422,),
        field="updates[0].observations[0]",
    ),
    Hostile(
        "9 MiB body (Content-Length)", _OBS, lambda: _obs("[[" + _numbers(9 * MiB // 10) + "]]"), (413,), field="body"
    ),
    Hostile("9 MiB body (chunked)", _OBS, lambda: _chunks(9 * MiB), (413,), field="body"),
    Hostile("invalid UTF-8", _OBS, lambda: b'{"observations": [[1, 1]]}\xff\xfe', (400,)),
    Hostile("empty body", _OBS, lambda: b"", (422,)),
    Hostile("not JSON", _OBS, lambda: b"{observations: [[1, 1]", (400,)),
    Hostile("a JSON array", _OBS, lambda: b"[[1, 1]]", (422,)),
    Hostile("text/plain", _OBS, lambda: b'{"observations": [[1, 1]]}', (422,), headers={"content-type": "text/plain"}),
    Hostile(
        "ttl_seconds 2^63",
        "/v1/streams",
        lambda: _create(_GAUSS, extra=', "ttl_seconds": 9223372036854775808'),
        (422,),
        field="ttl_seconds",
    ),
]


def hostile_bodies(url: str, stream_id: str, headers: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Send every :data:`HOSTILE` request to the server at ``url`` (``{sid}`` → ``stream_id``): one row each with
    the status, the error code and message, the body size and the seconds to the answer, and ``ok`` (the status
    expected and, where given, the message naming the field)."""
    rows = []
    with httpx.Client(base_url=url, headers=headers or {}, timeout=60.0) as client:
        for h in HOSTILE:
            body = h.body()
            if isinstance(body, bytes):
                body = body.replace(b"{sid}", stream_id.encode())
                size = len(body)
            else:
                body, size = list(body), None
                size = sum(len(b) for b in body)
                body = iter(body)
            t0 = time.perf_counter()
            r = client.request(h.method, h.path.replace("{sid}", stream_id), content=body, headers=h.headers)
            seconds = time.perf_counter() - t0
            try:
                error = r.json().get("error", {})
            except ValueError:
                error = {}
            message = str(error.get("message", ""))
            ok = r.status_code in h.expect and (h.field is None or message.startswith(h.field))
            rows.append(
                {
                    "case": h.name,
                    "bytes": size,
                    "status": r.status_code,
                    "expected": list(h.expect),
                    "code": error.get("code"),
                    "message": message[:200],
                    "seconds": round(seconds, 4),
                    "ok": ok,
                }
            )
    return rows


# ----------------------------------------------------------------------------------------------------------
# numerical faults

GAUSS2 = {"type": "gaussian", "mean": [0.0, 0.5], "cov": [[1.0, 0.2], [0.2, 0.8]]}
FAMILIES: dict[str, tuple[dict[str, Any], Callable[[float], Any]]] = {
    "linear_gaussian": ({}, lambda v: [v, -v]),
    "lds": ({"A": [[0.9, 0.1], [0.0, 0.8]], "B": [[1.0, 0.0]], "R": [[0.5]]}, lambda v: [v]),
    "gmm": ({"s": 1.0}, lambda v: v),
    "logistic": ({}, lambda v: {"x": [[v, 1.0], [1.0, -v], [0.5, 0.5]], "y": [1, 0, 1]}),
    "stochastic_volatility": ({"phi": 0.9}, lambda v: [v, -v]),
}
EXTREME = [1e6, -1e6, 1e12, 1e30, -1e30, 3e38, 0.5]


def fuzz_targets(
    url: str, headers: dict[str, str] | None = None, methods: tuple[str, ...] = ("smc", "gpf", "mpf")
) -> list[str]:
    """Streams for the fuzzer to address: every family × ``methods``, 16 particles each; their ids."""
    ids = []
    with httpx.Client(base_url=url, headers=headers or {}, timeout=60.0) as c:
        for family, (params, _) in FAMILIES.items():
            for method in methods:
                spec = {"model": {"family": family, "params": params}, "prior": GAUSS2, "method": method}
                r = c.post("/v1/streams", json={**spec, "num_particles": 16, "seed": 11})
                r.raise_for_status()
                ids.append(r.json()["stream_id"])
    return ids


def all_finite(value: Any) -> bool:
    """No NaN or infinity anywhere in a decoded JSON answer (checked by the standard library's strict encoder,
    independently of the service's own guard)."""
    try:
        json.dumps(value, allow_nan=False)
    except ValueError:
        return False
    return True


def fallback_counts(metrics_text: str) -> dict[tuple[str, str, str], float]:
    """{(family, method, fallback): count} of ``mpflow_update_fallbacks_total`` in a /metrics page."""
    return {
        (s.labels["family"], s.labels["method"], s.labels["fallback"]): s.value
        for fam in text_string_to_metric_families(metrics_text)
        if fam.name == "mpflow_update_fallbacks"
        for s in fam.samples
        if s.name == "mpflow_update_fallbacks_total"
    }


def numerical_faults(
    url: str, headers: dict[str, str] | None = None, values: list[float] | None = None
) -> dict[str, Any]:
    """Every family × method, fed ``values`` (default :data:`EXTREME`) one per request: a row per pair with
    the statuses, the fall-backs (from the answers) and the non-finite values found stored (module docstring);
    plus the fall-back counters of ``/metrics`` before and after."""
    values = EXTREME if values is None else values
    rows = []
    with httpx.Client(base_url=url, headers=headers or {}, timeout=120.0) as c:
        before = fallback_counts(c.get("/metrics").text)
        for fam in c.get("/v1/models").json()["families"]:
            family = fam["family"]
            params, obs = FAMILIES[family]
            for method in fam["methods"]:
                spec = {"model": {"family": family, "params": params}, "prior": GAUSS2, "method": method}
                r = c.post("/v1/streams", json={**spec, "num_particles": 32, "seed": 5})
                row: dict[str, Any] = {"family": family, "method": method, "requests": 0, "statuses": {}}
                row.update(fallbacks={}, non_finite_stored=0, non_finite_answers=0)
                if r.status_code != 201:
                    row["create"] = r.status_code
                    rows.append(row)
                    continue
                sid = r.json()["stream_id"]
                for v in values:
                    r = c.post(f"/v1/streams/{sid}/observations", json={"observations": [obs(v)]})
                    row["requests"] += 1
                    row["statuses"][str(r.status_code)] = row["statuses"].get(str(r.status_code), 0) + 1
                    if r.status_code == 200:
                        answer = r.json()
                        row["non_finite_answers"] += not all_finite(answer)
                        for step in answer["per_step"]:
                            if "fallback" in step:
                                row["fallbacks"][step["fallback"]] = row["fallbacks"].get(step["fallback"], 0) + 1
                    for path, params_ in ((f"/v1/streams/{sid}", None), (f"/v1/streams/{sid}/particles", None)):
                        got = c.get(path, params=params_)
                        row["non_finite_stored"] += got.status_code != 200 or not all_finite(got.json())
                    got = c.get(f"/v1/streams/{sid}/samples", params={"n": 64})
                    row["non_finite_stored"] += got.status_code != 200 or not all_finite(got.json())
                c.delete(f"/v1/streams/{sid}")
                rows.append(row)
        after = fallback_counts(c.get("/metrics").text)
    metric = {"/".join(k): after.get(k, 0) - before.get(k, 0) for k in sorted(set(after) | set(before))}
    return {"rows": rows, "metric_increase": {k: v for k, v in metric.items() if v}}


# ----------------------------------------------------------------------------------------------------------
# tables


def format_fuzz(stats: dict[str, Any]) -> str:
    lines = ["| operation | requests | statuses | 5xx | failed checks | s |", "|---|---:|---|---:|---:|---:|"]
    for label, s in stats.items():
        statuses = " ".join(f"{k}×{v}" for k, v in s["statuses"].items())
        lines.append(
            f"| `{label}` | {s['requests']} | {statuses} | {s['5xx']} | {s['failed_checks']} | {s['seconds']} |"
        )
    return "\n".join(lines)


def format_hostile(rows: list[dict[str, Any]]) -> str:
    lines = ["| body | MiB | status | code | s | ok |", "|---|---:|---:|---|---:|---|"]
    for r in rows:
        mib = f"{r['bytes'] / MiB:.2f}"
        lines.append(
            f"| {r['case']} | {mib} | {r['status']} | {r['code']} | {r['seconds']:.3f} | {'yes' if r['ok'] else 'NO'} |"
        )
    return "\n".join(lines)


def format_faults(result: dict[str, Any]) -> str:
    lines = [
        "| family | method | requests | statuses | fall-backs | non-finite stored |",
        "|---|---|---:|---|---|---:|",
    ]
    for r in result["rows"]:
        statuses = " ".join(f"{k}×{v}" for k, v in sorted(r["statuses"].items()))
        fb = " ".join(f"{k}×{v}" for k, v in sorted(r["fallbacks"].items())) or "–"
        lines.append(
            f"| {r['family']} | {r['method']} | {r['requests']} | {statuses} | {fb} | {r['non_finite_stored']} |"
        )
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------
# the run


def run(examples: int, out: Path) -> dict[str, Any]:
    from service.testing import drop_prefix, serve_as_user

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
    rows = faults["rows"]
    result = {
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "examples_per_mode": examples,
        "server_env": SERVER_ENV,
        "load_average": {"before": load_before, "after": os.getloadavg()},
        "cpu_count": os.cpu_count(),
        "wall_s": round(wall, 1),
        "server_alive_after": alive,
        "summary": {
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
            "fallbacks_counted_by_metric": sum(
                v for k, v in faults["metric_increase"].items() if not k.endswith("/none")
            ),
            "non_finite_stored": sum(r["non_finite_stored"] for r in rows),
        },
        "fuzz": fuzzed,
        "hostile": hostile,
        "numerical_faults": faults,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.reliability_input", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="25 examples per mode (default 150)")
    p.add_argument("--examples", type=int, default=None, help="fuzz examples per operation and mode")
    p.add_argument(
        "--out", type=Path, default=None, help="the JSON file (default benchmarks/results/reliability_input)"
    )
    args = p.parse_args(argv)
    examples = args.examples or (25 if args.quick else 150)
    out = args.out or RESULTS / ("reliability_input-quick.json" if args.quick else "reliability_input.json")
    result = run(examples, out)
    print("## fuzz (schemathesis, every operation)\n")
    print(format_fuzz(result["fuzz"]))
    print("\n## hostile bodies\n")
    print(format_hostile(result["hostile"]))
    print("\n## numerical faults (observations ±1e6 … 3e38, one per request)\n")
    print(format_faults(result["numerical_faults"]))
    print("\n## summary\n")
    for k, v in result["summary"].items():
        print(f"- {k}: {v}")
    print(f"\nwrote {out}")
    s = result["summary"]
    bad = (
        s["fuzz_5xx"] + s["fuzz_failed_checks"] + s["hostile_not_as_expected"] + s["fault_5xx"] + s["non_finite_stored"]
    )
    return 1 if bad or not result["server_alive_after"] else 0


if __name__ == "__main__":
    raise SystemExit(main())

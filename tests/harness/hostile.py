"""Bad input: the fuzzer and the hostile bodies, for tests and benchmarks.

* :func:`fuzz` — schemathesis generates requests from ``/openapi.json`` for every operation, ``examples`` valid
  (positive) and ``examples`` invalid (negative) ones each, deterministic (hypothesis ``derandomize``), and checks
  every answer: no 5xx, the status and the body documented for the operation, schema-violating requests refused
  (its default checks, less ``positive_data_acceptance``: a schema-valid request may still be over a configured
  limit or wrong for its model family). Counted per operation: requests, statuses, 5xx, failed checks.
  :func:`fuzz_targets` creates streams of every family for the positive cases to address.
* :func:`hostile_bodies` (:data:`HOSTILE`) — arrays nested 100 000 deep, 7 MiB of numbers in the wrong shape,
  hundreds of thousands of unknown keys or bad items, number literals beyond float64 (``1e400``, ``NaN``,
  ``Infinity``) or float32 (``1e39``), 4000-digit integers, bodies over the 8 MiB limit (declared and chunked),
  invalid UTF-8; each must be answered with its 4xx, and fast: the seconds to the answer are measured
  (client-side, loopback HTTP).

The server these run against should use the small limits of :data:`tests.harness.specs.SERVER_ENV`.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from tests.harness.specs import FAMILIES, GAUSS2

MiB = 1024 * 1024


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
    from mpflow.service.dashboard.events import NOT_FUZZED
    from schemathesis import GenerationMode
    from schemathesis.specs.openapi.checks import positive_data_acceptance

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
    Hostile(
        "text/plain",
        _OBS,
        lambda: b'{"observations": [[1, 1]]}',
        (415,),
        headers={"content-type": "text/plain"},
        field="content-type",
    ),
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

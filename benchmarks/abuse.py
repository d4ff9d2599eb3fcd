"""Issue 34's abuse items 1–10 and its "Must show" figures, sent as an attacker would to a real server.

``python -m benchmarks.abuse [--quick]``

The server is started as a user starts it: ``python -m mpflow serve --workers 1`` with ``MPFLOW_API_KEYS`` of two
tenants (alpha ``key-a``, beta ``key-b``) on the local Redis at 127.0.0.1:6379 under a fresh key prefix (deleted
at the end), loopback only (:func:`tests.harness.isolation.tenant_server`). The attacks are
:mod:`tests.harness.attacks`; the isolation scenarios :mod:`tests.harness.isolation`.

For each item, each request: the answer's status (or "no answer in T s"), its time, the server's RSS growth (peak
while it ran, and after), ``/healthz``'s worst latency while it ran and its latency after, and whether the server
still served a light update afterwards. ``refused`` says whether the server refused or bounded the attack (what
that means is the attack's own, :mod:`tests.harness.attacks`), never assumed: on a server without a fix it reads
"no". A server that stops answering (an unbounded loop on its worker) is killed and restarted, and the row says so.

The "Must show" tables:

* **(a)** while tenant alpha sends the heaviest requests the limits allow (``smc`` streams at the largest N and
  d this server accepts, :func:`heaviest_stream`), tenant beta's Kalman update p50 against its idle p50 (target
  ≤ 3×) and ``/healthz``'s worst latency (target < 1 s);
* **(b)** 300 keyless connections each announcing 8 MiB (``MPFLOW_MAX_BODY_BYTES``): the server's RSS growth
  (target < 100 MB);
* **(c)** ``/readyz`` 503 within 10 s of a worker on one job past its deadline, and 200 again after (a second
  server, ``MPFLOW_WORKER_DEADLINE_SECONDS=0.1``, and a legitimately heavy request);
* **(d)** per endpoint, the worst request the server accepts — found by asking from the settings' limits down
  (:class:`~mpflow.service.settings.Settings` defaults: ``max_particles``, ``max_state_dim``,
  ``max_observations_per_request``, ``max_forecast_steps``, ``max_samples_per_request``), halving after each
  413 — with its peak RSS growth and time.

Issue 54's tables, the work that each request passes the cost model but that ran together (``--only priced``
runs just these, on a server of their own):

* **(e)** six concurrent accepted multi-second ``lorenz96`` d = 40 steps (three ``enkf`` N = 1024 integrating 800
  RK4 sub-steps, three ``ienkf`` N = 1500 with 20 iterations) while tenant beta updates a Kalman stream: beta's
  p50 against idle (target ≤ 3×) and its slowest update (target ≤ 2 s);
* **(f)** eight concurrent one-step posts to the marginal ``mpf`` filter on ``stochastic_volatility`` at the
  largest N the cost model accepts: the server's RSS peak growth (target ≤ 1 GB).

Machine safety: this script never asks for a Gaussian prior whose per-particle factors would need more than
:data:`PRIOR_GUARD_BYTES` (N · d² · 8 bytes), nor for a forecast that would by its measured footprint (N · d ·
steps · :data:`FORECAST_BYTES_PER_VALUE`: a forecast of 1000 steps at N = 65536, d = 64 had taken 6 GB after 20 s,
one of 62 steps 13 GB after 60 s); a size it skips is reported
(``limited by: script guard``, ``guard_skipped``: the server was not asked). A request that does not answer
within the timeout (60 s, item 1's 15 s; ``--quick`` 20 s and 5 s) is reported so, and the server restarted.

Output: markdown tables on stdout and ``benchmarks/results/abuse.json`` (``abuse-quick.json`` with ``--quick``:
fewer connections, imports and sockets, shorter timeouts).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import math
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import redis
from mpflow.service.settings import Settings

from benchmarks import report
from tests.harness import attacks
from tests.harness.isolation import (
    ALPHA,
    BETA,
    Prober,
    StreamDriver,
    create,
    gaussian_stream,
    healthz_during_particles,
    light_under_heavy,
    readyz_when_stuck,
    rss_during_posts,
    tenant_server,
)
from tests.harness.server import ROOT, UserServer

NAME = "abuse"
#: the most bytes a request this script sends may need by its own estimate (module docstring), machine safety
PRIOR_GUARD_BYTES = 2.5e9
#: a forecast's measured peak bytes per particle coordinate and horizon (item 3: 10 steps at N = 65536, d = 64 took
#: 2.6 GB; 62 steps had taken 13 GB after 60 s)
FORECAST_BYTES_PER_VALUE = 64
MB = 1e6


@dataclass(frozen=True)
class Sizes:
    """How much of each attack (full run, or ``--quick``)."""

    timeout: float
    item1_timeout: float
    keyless: int
    imports: int
    websockets: int
    option_streams: int
    light_requests: int

    @classmethod
    def of(cls, quick: bool) -> Sizes:
        return cls(*_SIZES["quick" if quick else "full"])


#: :class:`Sizes` of a full run and of ``--quick``, in the order of its fields
_SIZES = {"full": (60, 15, 300, 60, 3000, 300, 30), "quick": (20, 5, 50, 10, 200, 50, 15)}


# ------------------------------------------------------------------------------------------------ the server
class RssPeak:
    """The server process's RSS, sampled every 20 ms in a thread while running: its peak."""

    def __init__(self, pid: int) -> None:
        self.proc = psutil.Process(pid)
        self.peak = self.now()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def now(self) -> int:
        try:
            return self.proc.memory_info().rss
        except psutil.Error:
            return 0

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, self.now())

    def __enter__(self) -> RssPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


class Rig:
    """The server under attack, measured around each request (:meth:`measure`) and restarted when it stopped
    answering."""

    def __init__(self, server: UserServer) -> None:
        self.server = server
        self.prefix = server.env["MPFLOW_REDIS_PREFIX"]
        self.rows: list[dict[str, Any]] = []
        self.restarts = 0

    @property
    def url(self) -> str:
        return self.server.url

    def rss(self) -> int:
        return RssPeak(self.server.pid).now()

    def responsive(self, timeout: float = 10.0) -> bool:
        """A light update of tenant beta answers within ``timeout`` seconds."""
        try:
            with httpx.Client(base_url=self.url, headers=BETA, timeout=timeout) as beta:
                _, sid = create(beta, gaussian_stream("kalman", 16, 2))
                if sid is None:
                    return False
                status, _ = StreamDriver(beta, sid, 2).send()
                beta.delete(f"/v1/streams/{sid}")
                return status == 200
        except httpx.HTTPError:
            return False

    def restart(self) -> None:
        self.server.kill()
        self.server.start()
        self.restarts += 1

    def measure(self, item: str, request: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """Run one attack (``fn``: its outcome) measuring the server around it; the row (also kept)."""
        before = self.rss()
        with RssPeak(self.server.pid) as rss, Prober(self.url, timeout=30) as health:
            try:
                outcome = fn()
            except Exception as exc:  # an attack that failed on the client side is reported, never hidden
                outcome = {"status": f"client error: {type(exc).__name__}: {str(exc)[:160]}", "refused": None}
        t0 = time.perf_counter()
        try:
            httpx.get(f"{self.url}/healthz", timeout=30)
            healthz_after: float | None = time.perf_counter() - t0
        except httpx.HTTPError:
            healthz_after = None
        alive = self.responsive()
        row = {
            "item": item,
            "request": outcome.pop("request", request),
            **outcome,
            "rss_before_mb": before / MB,
            "rss_peak_growth_mb": (rss.peak - before) / MB,
            "rss_after_growth_mb": (self.rss() - before) / MB,
            "healthz_max_during_s": health.max_seconds(),
            "healthz_after_s": healthz_after,
            "responsive_after": alive,
        }
        if not alive or str(row.get("status", "")).startswith("no answer"):
            self.restart()
            row["restarted"] = True
        self.rows.append(row)
        print(f"  [{item}] {row['request']}: {row.get('status')} ({row.get('seconds', 0):.2f} s)", flush=True)
        return row

    def redis_bytes(self) -> int:
        """The bytes of this server's keys in Redis (``MEMORY USAGE`` of each)."""
        client = redis.Redis(host="127.0.0.1", port=6379)
        try:
            return sum(client.memory_usage(k) or 0 for k in client.scan_iter(match=f"{self.prefix}:*", count=1000))
        finally:
            client.close()

    def http_500s(self) -> float:
        """``mpflow_http_requests_total`` with status 500, summed over routes."""
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("mpflow_http_requests_total{") and 'status="500"' in line
        )


# ------------------------------------------------------------------------------------------------ heaviest sizes
def halving(start: int, floor: int = 1) -> list[int]:
    """start, start/2, … down to ``floor`` (whole numbers)."""
    out = []
    v = start
    while v >= floor:
        out.append(v)
        v //= 2
    return out


def heaviest_stream(rig: Rig, settings: Settings, method: str = "smc") -> dict[str, Any]:
    """The heaviest ``method`` stream the server accepts: N = ``max_particles``, d from ``max_state_dim`` halving
    after each 413 (sizes above :data:`PRIOR_GUARD_BYTES` skipped: not asked). The spec, and what limited it."""
    n = settings.max_particles
    tried = []
    for d in halving(settings.max_state_dim, 2):
        if n * d * d * 8 > PRIOR_GUARD_BYTES:
            tried.append({"d": d, "status": "skipped: script guard"})
            continue
        spec = gaussian_stream(method, n, d)
        with httpx.Client(base_url=rig.url, headers=ALPHA, timeout=600) as alpha:
            status, sid = create(alpha, spec)
            if sid is not None:
                alpha.delete(f"/v1/streams/{sid}")
        tried.append({"d": d, "status": status})
        if status == 201:
            refused = [t for t in tried if t["status"] == 413]
            return {
                "spec": spec,
                "n": n,
                "d": d,
                "tried": tried,
                "limited_by": "server (413 above)" if refused else "script guard",
            }
    raise RuntimeError(f"no {method} stream was accepted: {tried}")


def worst_accepted(
    rig: Rig,
    endpoint: str,
    values: Sequence[int],
    attempt: Callable[[int], dict[str, Any]],
    guard: Callable[[int], bool] = lambda v: True,
) -> dict[str, Any]:
    """The first of ``values`` (largest first) whose request is not refused with 413, measured; the 413s before,
    and the values the script's ``guard`` skipped (not asked: machine safety)."""
    refused, skipped = [], [v for v in values if not guard(v)]
    for v in (v for v in values if guard(v)):
        row = rig.measure("d", f"{endpoint} {v}", lambda v=v: attempt(v))
        if row.get("status") != 413:
            return {
                "endpoint": endpoint,
                "value": v,
                "refused_above": refused,
                "guard_skipped": skipped,
                **_figures(row),
            }
        refused.append(v)
    return {"endpoint": endpoint, "value": None, "refused_above": refused, "guard_skipped": skipped}


def _figures(row: dict[str, Any]) -> dict[str, Any]:
    keys = ("status", "seconds", "rss_peak_growth_mb", "healthz_max_during_s", "restarted", "detail")
    return {k: row.get(k) for k in keys}


# ------------------------------------------------------------------------------------------------ the run
def run_items(rig: Rig, sizes: Sizes, settings: Settings, log_path: Path) -> None:
    url, t = rig.url, sizes.timeout
    print("items 1-10", flush=True)
    for label, plan in attacks.item1(url, sizes.item1_timeout):
        rig.measure("1", label, plan)

    def keyless() -> dict[str, Any]:
        outcome, socks = attacks.keyless_uploads(url, sizes.keyless, settings.max_body_bytes)
        held = rig.rss()
        for s in socks:
            with contextlib.suppress(OSError):
                s.close()
        time.sleep(2.0)
        return {**outcome, "rss_held_mb": held / MB}

    rig.measure("2", "keyless uploads", keyless)
    for label, plan in attacks.item3(url, t, settings.max_particles, 128, 64, 10):
        rig.measure("3", label, plan)
    rig.measure("4", "particles d=128", lambda: _particles(url, settings.max_particles, 128))
    rig.measure("5", "sampler path", lambda: attacks.item5(url, t))
    rig.measure("6", "feeds", lambda: attacks.item6(url, 64, t))
    rig.measure("7", "method_options", lambda: attacks.item7(url, sizes.option_streams, t))
    rig.measure("8", "imports", lambda: attacks.item8(url, sizes.imports, t, rig.redis_bytes, settings.max_body_bytes))
    for label, plan in attacks.item9(url, t):
        rig.measure("9", label, plan)
    rig.measure("10", "aborted upload", lambda: attacks.aborted_upload(url, rig.http_500s))
    rig.measure("10", "API_KEY in log", lambda: attacks.upper_case_key_in_log(url, log_path))
    rig.measure("10", "websockets", lambda: attacks.many_websockets(url, sizes.websockets))
    rig.measure("10", "torch.load", lambda: attacks.weights_only_source(ROOT))
    print("issue 54: the edge", flush=True)
    rig.measure("54.3", "8 readers of an 84 MB state", lambda: attacks.heavy_reads(url, rig.rss))
    rig.measure("54.4", "800 keyless dribbling heads", lambda: attacks.slow_heads(url, 800))
    rig.measure("54.4", "connections past the cap", lambda: attacks.connection_cap(url, settings.max_connections, 8))
    for label, plan in attacks.batch_ids(url, t) + attacks.bad_heads(url):
        rig.measure("54.5-6", label, plan)


def _particles(url: str, n: int, d: int) -> dict[str, Any]:
    """Item 4's large read: the largest N × d cloud the server (and the script's guard) allows, halving d after a
    refused creation; bounded when ``/healthz`` stays under 1 s meanwhile."""
    while n * d * d * 8 > PRIOR_GUARD_BYTES:  # the script's guard (module docstring)
        d //= 2
    r = healthz_during_particles(url, n, d)
    while r.get("refused_at_creation") and d > 2:
        d //= 2
        r = healthz_during_particles(url, n, d)
    if r.get("refused_at_creation"):
        return {"request": f"GET /particles N={n}", "status": f"stream refused ({r['status']})", "refused": True}
    return {
        "request": f"GET /particles N={n} d={d} ({r['bytes'] / MB:.0f} MB)",
        "status": r["status"],
        "seconds": r["seconds"],
        "refused": r["healthz_max_s"] < 1.0,
        "detail": f"complete: {r['complete']}",
    }


def run_tables(rig: Rig, sizes: Sizes, settings: Settings) -> dict[str, Any]:
    url, t = rig.url, sizes.timeout
    print("(a) light tenant under the heaviest allowed tenant", flush=True)
    heavy = heaviest_stream(rig, settings)
    table_a = light_under_heavy(url, heavy["spec"], heavy_streams=2, heavy_steps=5, requests=sizes.light_requests)
    table_a.update(heavy_limited_by=heavy["limited_by"], heavy_tried=heavy["tried"])
    print("(b) keyless connections", flush=True)
    b_row = next(r for r in rig.rows if r["item"] == "2")
    table_b = {
        k: b_row.get(k)
        for k in (
            "request",
            "status",
            "rss_before_mb",
            "rss_peak_growth_mb",
            "rss_held_mb",
            "rss_after_growth_mb",
            "healthz_max_during_s",
            "responsive_after",
        )
    }
    table_b["rss_held_growth_mb"] = (b_row.get("rss_held_mb") or 0) - b_row["rss_before_mb"]
    print("(d) the worst accepted request per endpoint", flush=True)
    spec, n, d = heavy["spec"], heavy["n"], heavy["d"]
    with httpx.Client(base_url=url, headers=ALPHA, timeout=600) as alpha:
        _, sid = create(alpha, spec)
    path = f"/v1/streams/{sid}"
    table_d = [
        worst_accepted(
            rig,
            f"POST /v1/streams smc N={n}, d",
            [d],
            lambda v: attacks.send("POST", url, "/v1/streams", t, json=gaussian_stream("smc", n, v)),
        ),
        worst_accepted(
            rig,
            "POST observations, steps",
            halving(settings.max_observations_per_request),
            lambda k: _observe(url, path, k, d, t),
        ),
        worst_accepted(
            rig,
            "GET forecast, steps",
            halving(settings.max_forecast_steps),
            lambda k: attacks.send("GET", url, f"{_alive(rig, spec, path)}/forecast?steps={k}", t),
            guard=lambda k: n * d * k * FORECAST_BYTES_PER_VALUE <= PRIOR_GUARD_BYTES,
        ),
        worst_accepted(
            rig,
            "GET samples, n",
            halving(settings.max_samples_per_request),
            lambda k: attacks.send("GET", url, f"{_alive(rig, spec, path)}/samples?n={k}", t),
        ),
        worst_accepted(
            rig, "GET particles", [n], lambda _: attacks.send("GET", url, f"{_alive(rig, spec, path)}/particles", t)
        ),
        worst_accepted(
            rig, "GET export", [n], lambda _: attacks.send("GET", url, f"{_alive(rig, spec, path)}/export", t)
        ),
    ]
    return {"a_light_under_heavy": table_a, "b_keyless_connections": table_b, "d_worst_accepted": table_d}


def lorenz96_heavy() -> list[dict[str, Any]]:
    """Table (e)'s six heavy streams (module docstring)."""
    streams = []
    for method, n, params, options in (
        ("enkf", 1024, {"rk4_step": 0.0025}, {}),
        ("ienkf", 1500, {}, {"iterations": 20}),
    ):
        spec = gaussian_stream(method, n, 40, model={"family": "lorenz96", "params": params})
        streams += [{**spec, "method_options": options} if options else spec] * 3
    return streams


def run_priced(sizes: Sizes, log_dir: Path) -> dict[str, Any]:
    """Issue 54's tables (e) and (f) on a server of their own (module docstring)."""
    with tenant_server(log_dir / "priced.log") as server:
        print("(e) a Kalman update under six multi-second lorenz96 steps", flush=True)
        e = light_under_heavy(
            server.url, lorenz96_heavy(), heavy_steps=1, heavy_dt=40.0, requests=sizes.light_requests * 10
        )
        print("(f) eight concurrent one-step posts of the N² marginal filter", flush=True)
        spec = {
            "model": {"family": "stochastic_volatility", "params": {}},
            "prior": {"type": "gaussian", "mean": [0.0], "cov": [[1.0]]},
            "method": "mpf",
        }
        for n in range(6000, 999, -100):  # the largest N the cost model accepts (to 100)
            f = rss_during_posts(server, {**spec, "num_particles": n}, 8)
            if f["streams"]:
                f["num_particles"] = n
                break
    return {"e_lorenz96_steps": e, "f_pair_filter_memory": f}


def _alive(rig: Rig, spec: dict[str, Any], path: str) -> str:
    """``path`` if that stream is still stored (a restart keeps Redis), else a new one's (same spec)."""
    with httpx.Client(base_url=rig.url, headers=ALPHA, timeout=600) as alpha:
        if alpha.get(path).status_code == 200:
            return path
        _, sid = create(alpha, spec)
    return f"/v1/streams/{sid}"


def _observe(url: str, path: str, steps: int, d: int, timeout: float) -> dict[str, Any]:
    with httpx.Client(base_url=url, headers=ALPHA, timeout=30) as alpha:
        seq = alpha.get(path).json()["step"] + 1
    body = {"seq": seq, "observations": [[0.1] * d for _ in range(steps)]}
    return attacks.send("POST", url, f"{path}/observations", timeout, json=body)


def run_readyz(sizes: Sizes, settings: Settings, log_dir: Path) -> dict[str, Any]:
    print("(c) /readyz around a worker past its deadline", flush=True)
    heavy = gaussian_stream("smc", settings.max_particles, 32)
    with tenant_server(log_dir / "readyz.log", {"MPFLOW_WORKER_DEADLINE_SECONDS": "0.1"}) as server:
        r = readyz_when_stuck(server.url, heavy, steps=10)
    return {"deadline_s": 0.1, "request": f"smc N={settings.max_particles} d=32, 10 steps", **r}


@contextlib.contextmanager
def attacked_server(log_dir: Path) -> Iterator[Rig]:
    with tenant_server(log_dir / "server.log", {"MPFLOW_LOG_LEVEL": "INFO"}) as server:
        yield Rig(server)


# ------------------------------------------------------------------------------------------------ report
def _fmt(v: Any, digits: int = 2) -> str:
    if v is None:
        return "—"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return "—" if math.isnan(v) else f"{v:.{digits}f}"
    if isinstance(v, dict):
        return ", ".join(f"{k}: {x}" for k, x in v.items())
    return str(v)


def priced_tables(result: dict[str, Any]) -> str:
    """Issue 54's tables (e) and (f) (module docstring)."""
    e, f = result["tables"]["e_lorenz96_steps"], result["tables"]["f_pair_filter_memory"]
    heavy = ", ".join(
        f"{h['method']} N={h['num_particles']}" + (f" {h['method_options']}" if h["method_options"] else "")
        for h in e["heavy"][::3]
    )
    return "\n".join(
        [
            "## (e) A Kalman update under six multi-second lorenz96 steps",
            "",
            report.markdown_table(
                [
                    *("heavy (3 streams each, dt 40)", "heavy request p50 s", "idle p50 ms", "loaded p50 ms"),
                    *("ratio (≤ 3)", "slowest update s (≤ 2)", "statuses", "/healthz max s"),
                ],
                [
                    [
                        heavy,
                        _fmt(e["heavy_request_p50_s"]),
                        _fmt(1000 * e["idle_p50_s"], 1),
                        _fmt(1000 * e["loaded_p50_s"], 1),
                        _fmt(e["ratio"]),
                        _fmt(e["loaded_max_s"]),
                        _fmt(e["light_statuses"]),
                        _fmt(e["healthz_max_s"]),
                    ]
                ],
            ),
            "",
            "## (f) Eight concurrent one-step posts of the marginal mpf filter (stochastic_volatility)",
            "",
            report.markdown_table(
                [
                    *("N (largest accepted)", "statuses", "RSS before MB", "RSS peak +MB (≤ 1024)"),
                    *("RSS after +MB", "slowest post s"),
                ],
                [
                    [
                        f.get("num_particles"),
                        _fmt(f["statuses"]),
                        _fmt(f["rss_before_mb"], 0),
                        _fmt(f["peak_growth_mb"], 0),
                        _fmt(f["growth_after_mb"], 0),
                        _fmt(f["slowest_s"]),
                    ]
                ],
            ),
            "",
        ]
    )


def tables(result: dict[str, Any]) -> str:
    if not result["items"]:
        return priced_tables(result)
    out = ["## Items 1–10", ""]
    header = [
        "item",
        "request",
        "status",
        "s",
        "refused",
        "RSS peak +MB",
        "RSS after +MB",
        "/healthz max s",
        "/healthz after s",
        "served after",
    ]
    rows = [
        [
            r["item"],
            r["request"],
            _fmt(r.get("status")),
            _fmt(r.get("seconds")),
            _fmt(r.get("refused")),
            _fmt(r["rss_peak_growth_mb"], 0),
            _fmt(r["rss_after_growth_mb"], 0),
            _fmt(r["healthz_max_during_s"]),
            _fmt(r["healthz_after_s"]),
            _fmt(r["responsive_after"]) + (" (restarted)" if r.get("restarted") else ""),
        ]
        for r in result["items"]
    ]
    out += [report.markdown_table(header, rows), ""]
    a = result["tables"]["a_light_under_heavy"]
    out += [
        "## (a) Light tenant under the heaviest allowed tenant",
        "",
        report.markdown_table(
            [
                "heavy (2 streams, 5 steps/request)",
                "limited by",
                "idle p50 ms",
                "loaded p50 ms",
                "ratio (≤ 3)",
                "/healthz max s (< 1)",
            ],
            [
                [
                    f"{a['heavy'][0]['method']} N={a['heavy'][0]['num_particles']} d={a['state_dim']}",
                    a["heavy_limited_by"],
                    _fmt(1000 * a["idle_p50_s"], 1),
                    _fmt(1000 * a["loaded_p50_s"], 1),
                    _fmt(a["ratio"]),
                    _fmt(a["healthz_max_s"]),
                ]
            ],
        ),
        "",
    ]
    b = result["tables"]["b_keyless_connections"]
    out += [
        "## (b) Keyless connections announcing MPFLOW_MAX_BODY_BYTES",
        "",
        report.markdown_table(
            ["request", "answers", "RSS held +MB (< 100)", "RSS peak +MB", "RSS after +MB"],
            [
                [
                    b["request"],
                    _fmt(b["status"]),
                    _fmt(b["rss_held_growth_mb"], 0),
                    _fmt(b["rss_peak_growth_mb"], 0),
                    _fmt(b["rss_after_growth_mb"], 0),
                ]
            ],
        ),
        "",
    ]
    c = result["tables"]["c_readyz"]
    out += [
        "## (c) /readyz around a worker past its deadline",
        "",
        report.markdown_table(
            ["request", "deadline s", "answer", "request s", "first 503 after s (< 10)", "200 again after answer s"],
            [
                [
                    c["request"],
                    c["deadline_s"],
                    _fmt(c["request_status"]),
                    _fmt(c["request_s"]),
                    _fmt(c["first_503_after_s"]),
                    _fmt(c["ready_again_after_answer_s"]),
                ]
            ],
        ),
        "",
        f"detail: {c['detail']}",
        "",
    ]
    out += [
        "## (d) The worst accepted request per endpoint",
        "",
        report.markdown_table(
            ["endpoint", "value", "413 above", "not asked (guard)", "status", "s", "RSS peak +MB", "/healthz max s"],
            [
                [
                    r["endpoint"],
                    _fmt(r["value"]),
                    _fmt(r["refused_above"] or None),
                    _fmt(r["guard_skipped"] or None),
                    _fmt(r.get("status")),
                    _fmt(r.get("seconds")),
                    _fmt(r.get("rss_peak_growth_mb"), 0),
                    _fmt(r.get("healthz_max_during_s")),
                ]
                for r in result["tables"]["d_worst_accepted"]
            ],
        ),
        "",
        priced_tables(result),
    ]
    return "\n".join(out)


def _strict(v: Any) -> Any:
    """NaN and infinities as None (strict JSON)."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {str(k): _strict(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_strict(x) for x in v]
    return v


def main(argv: list[str] | None = None) -> int:
    parser = report.parser(NAME, __doc__ or "", "fewer connections, imports and sockets; shorter timeouts")
    parser.add_argument("--only", choices=["priced"], help="only issue 54's tables (e) and (f)")
    args = parser.parse_args(argv)
    sizes, settings = Sizes.of(args.quick), Settings()
    load_before = os.getloadavg()
    t0 = time.monotonic()
    rows, restarts, result_tables = [], 0, {}
    with tempfile.TemporaryDirectory(prefix="mpflow-abuse-") as tmp:
        log_dir = Path(tmp)
        if args.only != "priced":
            with attacked_server(log_dir) as rig:
                run_items(rig, sizes, settings, rig.server.log_path)
                result_tables = run_tables(rig, sizes, settings)
                rows, restarts = rig.rows, rig.restarts
            result_tables["c_readyz"] = run_readyz(sizes, settings, log_dir)
        result_tables.update(run_priced(sizes, log_dir))
    result = {
        "benchmark": NAME,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "quick": args.quick,
        "sizes": sizes.__dict__,
        "settings": {k: getattr(settings, k) for k in type(settings).model_fields if k.startswith("max_")},
        "server_restarts": restarts,
        "seconds": time.monotonic() - t0,
        "items": rows,
        "tables": result_tables,
        **report.machine_meta(load_before),
    }
    print(tables(result))
    stem = report.out_stem(args, NAME)
    report.write_outputs(_strict(result), stem.with_name(stem.name + "-priced") if args.only else stem)
    return 0


if __name__ == "__main__":
    sys.exit(main())

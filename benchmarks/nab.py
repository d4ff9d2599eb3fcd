"""The Numenta Anomaly Benchmark through the service, scored by NAB's own code: ``python -m benchmarks.nab --nab PATH``.

``python -m benchmarks.nab --nab PATH [--server URL] [--files GLOB] [--jobs J] [--cache DIR] [--out STEM]``
(``make bench-nab NAB=PATH`` builds the scorer's pinned environment ``.nab-env/`` first and runs it).

PATH is a checkout of numenta/NAB (``data/``, ``labels/combined_windows.json``, ``config/``, ``nab/``, ``run.py``,
``results/<detector>/``); nothing is fetched and the checkout is never written to. Every series of ``data/`` (or
those matching ``--files``, a glob over ``<category>/<file>.csv``) is streamed through an mpflow server as a user
would stream it — by default ``python -m mpflow serve`` started here (:mod:`tests.harness.server`, its default
workers) on the local Redis under a key prefix of its own (deleted afterwards), or the embedded Redis when that
does not answer; ``--server URL`` uses a running one. One configuration for all files, :data:`DETECTOR`:

* the training part is NAB's probationary period, min(⌊0.15 n⌋, 750) steps (``nab.util.getProbationPeriod``:
  ⌊0.15 n⌋ up to n = 5000), the only data a detector may learn from: the values are standardised by its mean
  and sd (sd 1 where it is 0), and the timestamps become each step's ``dt`` in hours (the first step's: the median
  spacing; a step whose timestamp does not advance — a repeated or set-back clock — gets :data:`MIN_DT_SECONDS`);
* the model's parameters are fitted on it by maximum likelihood over :attr:`Detector.grid`: each candidate is a
  stream of the service run over the training part (``POST /v1/observations:batch``, the candidates packed
  together), its ``summary.log_evidence`` compared;
* the whole file is then streamed through one stream with the best candidate (``method`` of the detector,
  ``kalman``), in requests of as many steps as the server takes (``maxItems`` of ``observations`` in its
  ``/openapi.json``; a 413 halves a request), and every step's anomaly score is read off its ``per_step`` entry
  (:func:`score_of`); the training part's steps get 0 (NAB does not score them).

Scoring: the checkout's ``data/``, ``labels/``, ``config/``, ``nab/``, ``run.py`` and the null detector's score
files are copied to a temporary folder, the result files ``results/<name>/<category>/<name>_<file>.csv``
(``timestamp, value, anomaly_score, label`` as NAB writes them, then ``dt_hours``, ``standardised`` and
``log_evidence_increment``, which NAB ignores) are written there, and NAB's ``run.py -d <name> --optimize --score
--normalize`` runs in the pinned Python 3.6 environment (``--nab-python``, default ``.nab-env/bin/python``).

The report: the scoreboard (standard, reward-low-FP and reward-low-FN scores) of the detectors published in the
checkout (``results/final_results.json`` as committed, when the checkout is a git clone) with ours in rank order,
each with its windows detected / total and its false-positive points at its standard threshold; and a per-category
breakdown, normalised per category as NAB normalises the corpus: 100 (S − S_null) / (S_perfect − S_null), S the
sum of the category's per-file scores (``results/<det>/<det>_<profile>_scores.csv``), S_null the null detector's,
S_perfect the category's window count × ``tpWeight``. The numbers are computed over the files run, from the
per-file score files (for the whole corpus they are NAB's own final scores, and the JSON records the check). With
``--files`` the published detectors are re-normalised over the same files, at their corpus-optimised thresholds.

``--no-score``: stream and write the result files (into ``--cache``) only; ``--published-only``: the scoreboard of
the checkout's published detectors, nothing streamed; ``--cached-only``: score the files ``--cache`` holds.
``--cache DIR`` keeps the result files (and, per file, the fit in ``<file>.fit.json``) and reuses those already
there (a run stopped part-way goes on where it stopped; the files are streamed a category at a time in turn).

Outputs: the tables on stdout, ``<out>.json`` and ``<out>.png`` (scoreboard and per-category bars); ``--out``
defaults to ``benchmarks/results/nab``, or ``nab-partial`` (git-ignored) with ``--files``, ``--no-score``,
``--published-only`` or ``--cached-only``.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import fnmatch
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import report
from mpflow.client.observations import step_lengths

NAME = "nab"
ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------------------------
# the detector: its whole configuration, in one place


#: the seasonal components every file's model has: a day (periods in hours, Detector.dt_unit), three harmonics,
#: a pattern that changes slowly (sd per √hour)
DAILY = {"period": 24.0, "harmonics": 3, "sd": 1e-3}
#: ``kalman``'s outlier clip (sd): a spike does not drag the level (docs/methods.md "Outlier clipping")
OUTLIER_CLIP = 3.0


def structural_body(params: Mapping[str, float], dt_unit: str) -> dict[str, Any]:
    """``POST /v1/streams``'s body of a local level plus a daily seasonal in continuous time (``structural``: level
    diffusion variance q per hour, the :data:`DAILY` season; o = level + season + N(0, r)) on the standardised
    scale, prior N(0, I) for every state, filtered by ``kalman`` with :data:`OUTLIER_CLIP`, the anomaly score ranked
    over the whole history."""
    del dt_unit  # q is per hour: the unit the steps' dt are given in (Detector.dt_unit)
    dim = 1 + 2 * DAILY["harmonics"]
    return {
        "model": {
            "family": "structural",
            "params": {"level_sd": math.sqrt(params["q"]), "seasonal": [DAILY], "R": params["r"]},
        },
        "prior": {"type": "gaussian", "mean": [0.0] * dim, "cov": np.eye(dim).tolist()},
        "method": "kalman",
        "method_options": {"outlier_clip": OUTLIER_CLIP},
        "seed": 0,
        "ttl_seconds": 3600,
    }


def _grid(**axes: Sequence[float]) -> tuple[dict[str, float], ...]:
    """Every combination of the axes' values, as parameter dicts."""
    out: list[dict[str, float]] = [{}]
    for name, values in axes.items():
        out = [{**o, name: float(v)} for o in out for v in values]
    return tuple(out)


@dataclass(frozen=True)
class Detector:
    """What the benchmark runs, for every file alike: the model ``family``, ``body(params, dt_unit)`` — the
    creation body from one candidate's parameters —, the candidates ``grid`` (maximum likelihood on the training
    part), the unit of the steps' ``dt``, and the steps per request (``None``: as many as the server takes)."""

    name: str = "mpflow"  # NAB's detector name: no underscores (NAB splits file names on '_')
    family: str = "structural"
    body: Callable[[Mapping[str, float], str], dict[str, Any]] = structural_body
    grid: tuple[dict[str, float], ...] = field(
        default_factory=lambda: _grid(q=[10.0**k for k in (-2, -1, 0)], r=[10.0**k for k in (-2, -1, 0)])
    )
    dt_unit: str = "hours"
    fit_batch: int | None = None
    run_batch: int | None = None
    levels: tuple[float, ...] = (0.5,)  # the answers' quantile levels: one, to keep them small


DETECTOR = Detector()

#: seconds per unit of ``dt`` (:attr:`Detector.dt_unit`)
DT_UNITS = {"seconds": 1.0, "minutes": 60.0, "hours": 3600.0, "days": 86400.0}
#: the ``dt`` of a step whose timestamp does not advance (a repeated timestamp, a clock set back), in seconds
MIN_DT_SECONDS = 1.0


#: what :func:`score_of` computes (recorded in the JSON)
SCORE = "the service's per-step anomaly_score (docs/API.md 'Surprise and anomaly score'); 0 during its warm-up"


def score_of(per_step: Sequence[Mapping[str, Any]]) -> list[float]:
    """The anomaly score of each step of a stream, from its ``per_step`` entries in order: the service's own
    ``anomaly_score`` (null during the stream's warm-up, and for a step with nothing observed: 0)."""
    return [float(e.get("anomaly_score") or 0.0) for e in per_step]


# ---------------------------------------------------------------------------------------------------------------
# the corpus

CATEGORIES = (
    "artificialNoAnomaly",
    "artificialWithAnomaly",
    "realAdExchange",
    "realAWSCloudwatch",
    "realKnownCause",
    "realTraffic",
    "realTweets",
)
PROFILES = ("standard", "reward_low_FP_rate", "reward_low_FN_rate")
PROFILE_LABELS = {"standard": "standard", "reward_low_FP_rate": "low FP", "reward_low_FN_rate": "low FN"}
#: names of a few published detectors, as NAB's scoreboard (README) names them
DISPLAY = {"numenta": "numenta (Numenta HTM)", "numentaTM": "numentaTM (HTM, TM only)", "htmjava": "htmjava (HTM Java)"}
#: the published standard-profile per-category scores of ``numenta`` (NAB's README), the check of
#: :func:`category_scores`
NUMENTA_STANDARD = {
    "realTweets": 68.0,
    "realAdExchange": 76.9,
    "realAWSCloudwatch": 73.4,
    "realTraffic": 82.5,
    "artificialWithAnomaly": 70.2,
    "realKnownCause": 55.5,
}


def probation(n: int) -> int:
    """NAB's probationary period of a file of ``n`` rows (``nab.util.getProbationPeriod``): min(⌊0.15 n⌋, 750)."""
    return int(min(math.floor(0.15 * n), 0.15 * 5000))


def parse_time(text: str) -> dt.datetime:
    return dt.datetime.fromisoformat(text.strip())


def dt_steps(timestamps: Sequence[dt.datetime], unit: str = "hours") -> np.ndarray:
    """Each step's time since the previous one in ``unit``: the first step's is the median spacing; a spacing
    that is not positive becomes :data:`MIN_DT_SECONDS`."""
    steps = step_lengths([(t - timestamps[0]).total_seconds() for t in timestamps])
    if len(timestamps) == 1:  # a lone reading: a step of an hour
        steps = [3600.0]
    return np.maximum(np.array(steps, dtype=float), MIN_DT_SECONDS) / DT_UNITS[unit]


def standardise(values: np.ndarray, train: int) -> tuple[np.ndarray, float, float]:
    """``values`` standardised by the mean and (population) sd of their first ``train``; sd 1 where it is 0."""
    head = values[:train]
    mean = float(head.mean())
    sd = float(head.std())
    sd = sd if sd > 0 and math.isfinite(sd) else 1.0
    return (values - mean) / sd, mean, sd


@dataclass
class Series:
    relpath: str  # "<category>/<file>.csv"
    stamps: list[str]  # as in the file
    values: np.ndarray
    dt: np.ndarray
    train: int

    @property
    def n(self) -> int:
        return len(self.stamps)


def read_series(nab: Path, relpath: str, unit: str = "hours") -> Series:
    with open(nab / "data" / relpath, newline="") as f:
        rows = list(csv.reader(f))[1:]
    stamps = [r[0] for r in rows]
    values = np.array([float(r[1]) for r in rows], dtype=float)
    return Series(relpath, stamps, values, dt_steps([parse_time(s) for s in stamps], unit), probation(len(rows)))


def corpus_files(nab: Path, pattern: str | None) -> list[str]:
    """The data files (``<category>/<file>.csv``) matching ``pattern``, in the order they are streamed: the
    categories in turn (one file of each, then the next of each, ...), so that a run stopped part-way has
    scored some of every category."""
    files = sorted(p.relative_to(nab / "data").as_posix() for p in (nab / "data").glob("*/*.csv"))
    files = [f for f in files if pattern is None or fnmatch.fnmatch(f, pattern)]
    by_cat: dict[str, list[str]] = {}
    for f in files:
        by_cat.setdefault(category(f), []).append(f)
    queues = list(by_cat.values())
    return [q[i] for i in range(max(map(len, queues), default=0)) for q in queues if i < len(q)]


def load_windows(nab: Path) -> dict[str, list[tuple[dt.datetime, dt.datetime]]]:
    raw = json.loads((nab / "labels" / "combined_windows.json").read_text())
    return {k: [(parse_time(a), parse_time(b)) for a, b in v] for k, v in raw.items()}


def labels_of(stamps: Sequence[str], windows: Sequence[tuple[dt.datetime, dt.datetime]]) -> list[int]:
    times = [parse_time(s) for s in stamps]
    return [int(any(a <= t <= b for a, b in windows)) for t in times]


def category(relpath: str) -> str:
    return relpath.split("/")[0]


# ---------------------------------------------------------------------------------------------------------------
# the service


def max_steps(url: str, http: Any) -> int:
    """Steps per request the server takes: ``maxItems`` of ``observations`` in its ``/openapi.json`` (its
    ``MPFLOW_MAX_OBSERVATIONS_PER_REQUEST``), else the settings' default."""
    try:
        schemas = http.get(f"{url}/openapi.json", timeout=30).json()["components"]["schemas"]
        return int(schemas["BatchUpdate"]["properties"]["observations"]["maxItems"])
    except Exception:  # an older server, or a proxy: the default limit
        from mpflow.service.settings import Settings

        return Settings().max_observations_per_request


class Service:
    """The client side: one :class:`mpflow.client.http.Client` per thread, the server's step limit, and the
    seconds spent waiting on requests (client send → answer parsed)."""

    def __init__(self, url: str):
        import httpx

        self.url = url
        self.limit = max_steps(url, httpx)
        self.local = threading.local()
        self.lock = threading.Lock()
        self.request_s = 0.0
        self.requests = 0
        self.steps = 0

    @property
    def client(self) -> Any:
        from mpflow.client.http import Client

        if not hasattr(self.local, "client"):
            self.local.client = Client(self.url, timeout=600)
        return self.local.client

    def _timed(self, fn: Callable[[], Any], steps: int) -> Any:
        t0 = time.perf_counter()
        try:
            return fn()
        finally:
            with self.lock:
                self.request_s += time.perf_counter() - t0
                self.requests += 1
                self.steps += steps

    def create(self, body: dict[str, Any]) -> str:
        from mpflow.client.errors import MpflowError

        for attempt in range(RETRIES):
            try:
                doc = self._timed(lambda: self.client.request("POST", "/v1/streams", safe=False, json=body), 0)
                return doc["stream_id"]
            except MpflowError as exc:  # 503: the store was unreachable (an orphan stream at worst: it expires)
                if exc.status != 503 or attempt == RETRIES - 1:
                    raise
                time.sleep(1.0 + attempt)
        raise AssertionError("unreachable")

    def delete(self, stream_id: str) -> None:
        self._timed(lambda: self.client.request("DELETE", f"/v1/streams/{stream_id}", safe=True), 0)

    def batch(self, updates: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``POST /v1/observations:batch`` of ``updates`` (each ``stream_id``, ``seq``, ``observations``): the
        results in order. A 413 for the whole request, or for one update, halves it and sends the halves."""
        from mpflow.client.errors import MpflowError

        steps = sum(len(u["observations"]) for u in updates)
        sent = [{k: v for k, v in u.items() if k != "tries"} for u in updates]
        try:
            results = self._timed(lambda: self.client.batch(sent), steps)
        except MpflowError as exc:
            if exc.status != 413 or steps <= 1:
                raise
            return [r for part in _halves(updates) for r in self.batch(part)]
        out: list[dict[str, Any]] = []
        for update, result in zip(updates, results, strict=True):
            if result["status"] == 503 and update.get("tries", 0) < RETRIES:  # nothing applied: again, same seq
                time.sleep(1.0 + update.get("tries", 0))
                out += self.batch([{**update, "tries": update.get("tries", 0) + 1}])
            elif result["status"] == 413 and len(update["observations"]) > 1:
                out += [r for part in _halves([update]) for r in self.batch(part)]
            elif result["status"] != 200:
                raise RuntimeError(f"{update['stream_id']}: {result['status']} {result.get('error')}")
            else:
                out.append(result)
        return out


#: tries of a request answered 503 (the store unreachable: nothing applied), and of a file whose streaming failed
RETRIES = 3


def _halves(updates: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Two requests carrying ``updates`` (several updates: split between them; one: its steps split, the
    second half's ``seq`` after the first's)."""
    if len(updates) > 1:
        return [updates[: len(updates) // 2], updates[len(updates) // 2 :]]
    (u,) = updates
    k = len(u["observations"]) // 2
    return [
        [{**u, "observations": u["observations"][:k]}],
        [{**u, "observations": u["observations"][k:], "seq": u["seq"] + k}],
    ]


def observations(z: np.ndarray, dts: np.ndarray) -> list[dict[str, Any]]:
    return [{"value": [float(v)], "dt": float(d)} for v, d in zip(z, dts, strict=True)]


def pack(jobs: list[tuple[str, list[dict[str, Any]]]], size: int, levels: Sequence[float]) -> Iterator[list[dict]]:
    """The requests carrying ``jobs`` (stream id, its observations from step 1), each of at most ``size`` steps in
    all, the updates of one stream in order."""
    request: list[dict[str, Any]] = []
    room = size
    for sid, obs in jobs:
        start = 0
        while start < len(obs):
            take = min(room, len(obs) - start)
            request.append(
                {"stream_id": sid, "seq": start + 1, "observations": obs[start : start + take], "levels": list(levels)}
            )
            start += take
            room -= take
            if room == 0:
                yield request
                request, room = [], size
    if request:
        yield request


def fit(service: Service, detector: Detector, obs: list[dict[str, Any]]) -> tuple[dict[str, float], list[dict]]:
    """Maximum likelihood over ``detector.grid`` on ``obs`` (the training part): the best parameters and every
    candidate's log evidence."""
    ids = [service.create(detector.body(params, detector.dt_unit)) for params in detector.grid]
    evidence: dict[str, float] = {}
    size = min(detector.fit_batch or service.limit, service.limit)
    for request in pack([(sid, obs) for sid in ids], size, detector.levels):
        for result in service.batch(request):
            evidence[result["stream_id"]] = float(result["stream"]["summary"]["log_evidence"])
    for sid in ids:
        service.delete(sid)
    table = [{**params, "log_evidence": evidence[sid]} for params, sid in zip(detector.grid, ids, strict=True)]
    best = max(range(len(table)), key=lambda i: table[i]["log_evidence"])
    return dict(detector.grid[best]), table


def run_stream(service: Service, detector: Detector, params: Mapping[str, float], obs: list[dict]) -> list[dict]:
    """The whole file through one stream with ``params``: every step's ``per_step`` entry, in order."""
    sid = service.create(detector.body(params, detector.dt_unit))
    size = min(detector.run_batch or service.limit, service.limit)
    per_step: list[dict[str, Any]] = []
    for request in pack([(sid, obs)], size, detector.levels):
        for result in service.batch(request):
            per_step += result["stream"]["per_step"]
    service.delete(sid)
    if len(per_step) != len(obs):
        raise RuntimeError(f"{len(per_step)} per_step entries for {len(obs)} steps")
    return per_step


RESULT_HEADER = ["timestamp", "value", "anomaly_score", "label", "dt_hours", "standardised", "log_evidence_increment"]


def detect_file(
    service: Service, detector: Detector, nab: Path, relpath: str, windows: Mapping[str, Any], out: Path
) -> dict[str, Any]:
    """Fit and stream one file; write its NAB result file under ``out`` (``<name>/<category>/<name>_<file>``) and
    the fit beside it (``.fit.json``); the fit's record."""
    t0 = time.perf_counter()
    series = read_series(nab, relpath, detector.dt_unit)
    z, mean, sd = standardise(series.values, series.train)
    obs = observations(z, series.dt)
    params, table = fit(service, detector, obs[: series.train])
    per_step = run_stream(service, detector, params, obs)
    scores = score_of(per_step)
    scores = [0.0 if i < series.train else s for i, s in enumerate(scores)]
    labels = labels_of(series.stamps, windows.get(relpath, []))
    path = result_path(out, detector.name, relpath)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".part")
    with open(tmp, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(RESULT_HEADER)
        for i, stamp in enumerate(series.stamps):
            inc = per_step[i].get("log_evidence_increment")
            w.writerow(
                [stamp, _num(series.values[i]), _num(scores[i]), labels[i], _num(series.dt[i]), _num(z[i]),
                 "" if inc is None else _num(inc)]
            )  # fmt: skip
    tmp.replace(path)
    record = {
        "file": relpath,
        "rows": series.n,
        "train": series.train,
        "mean": mean,
        "sd": sd,
        "dt_first_hours": float(series.dt[0]),
        "params": params,
        "grid": table,
        "log_evidence": float(np.nansum([e.get("log_evidence_increment") or 0.0 for e in per_step])),
        "seconds": time.perf_counter() - t0,
    }
    path.with_name(path.name + ".fit.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def _detect_retried(
    service: Service, detector: Detector, nab: Path, relpath: str, windows: Mapping[str, Any], out: Path
) -> dict[str, Any]:
    """:func:`detect_file`, from scratch again (new streams) after a failure — a store restarted under the run
    loses its streams —, :data:`RETRIES` tries in all."""
    for attempt in range(RETRIES):
        try:
            return detect_file(service, detector, nab, relpath, windows, out)
        except Exception as exc:
            if attempt == RETRIES - 1:
                raise
            print(f"\n{relpath}: {exc}; streaming it again", file=sys.stderr)
            time.sleep(2.0)
    raise AssertionError("unreachable")


def _num(x: float) -> str:
    return repr(float(x))


def result_path(results: Path, det: str, relpath: str) -> Path:
    cat, name = relpath.split("/")
    return results / det / cat / f"{det}_{name}"


@contextmanager
def started_server(redis_url: str, log_dir: Path) -> Iterator[tuple[str, int | None]]:
    """``python -m mpflow serve`` as a user starts it (its default workers) on the local Redis under a key prefix
    of its own, or the embedded Redis; yields (URL, pid)."""
    from tests.harness.load import choose_store
    from tests.harness.server import serve_as_user

    with choose_store("auto", redis_url) as store:
        print(f"server: python -m mpflow serve, store {store.label}", file=sys.stderr)
        with serve_as_user(store.env, log_dir / "server.log", inherit_mpflow_env=True) as srv:
            yield srv.url, srv.pid


def process_cpu(pid: int | None) -> float:
    """CPU seconds (user + system) of ``pid`` and its live children but redis-server."""
    if pid is None:
        return 0.0
    import psutil

    try:
        proc = psutil.Process(pid)
        procs = [proc] + [c for c in proc.children(recursive=True) if "redis" not in c.name()]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def stream_corpus(
    url: str, pid: int | None, detector: Detector, nab: Path, files: list[str], out: Path, jobs: int
) -> dict[str, Any]:
    """Every file of ``files`` not already in ``out`` through the server (``jobs`` files at a time)."""
    from tqdm import tqdm

    windows = load_windows(nab)
    todo = [f for f in files if not _done(out, detector.name, f)]
    service = Service(url) if todo else None
    cpu0, t0 = process_cpu(pid), time.perf_counter()
    records: list[dict[str, Any]] = []
    bar = tqdm(total=len(files), initial=len(files) - len(todo), desc="NAB files", unit="file", file=sys.stderr)
    pool = ThreadPoolExecutor(max_workers=jobs)
    try:
        futures = {pool.submit(_detect_retried, service, detector, nab, f, windows, out): f for f in todo}
        for fut in as_completed(futures):
            rec = fut.result()
            records.append(rec)
            params = " ".join(f"{k}={v:g}" for k, v in rec["params"].items())
            bar.set_postfix_str(f"{futures[fut].split('/')[1][:28]} {params}")
            bar.update()
    finally:
        pool.shutdown(wait=False, cancel_futures=True)  # stopped (an error, SIGTERM): no new file starts
        bar.close()
    wall = time.perf_counter() - t0
    return {
        "files_streamed": len(todo),
        "files_reused": len(files) - len(todo),
        "wall_s": wall,
        "server_cpu_s": process_cpu(pid) - cpu0 if pid is not None else None,
        "request_s": service.request_s if service else 0.0,
        "requests": service.requests if service else 0,
        "steps": service.steps if service else 0,
        "jobs": jobs,
        "steps_per_request_limit": service.limit if service else None,
    }


def _done(out: Path, det: str, relpath: str) -> bool:
    path = result_path(out, det, relpath)
    return path.exists() and path.with_name(path.name + ".fit.json").exists()


def fits(out: Path, det: str, files: list[str]) -> list[dict[str, Any]]:
    recs = []
    for f in files:
        p = result_path(out, det, f)
        recs.append(json.loads(p.with_name(p.name + ".fit.json").read_text()))
    return recs


# ---------------------------------------------------------------------------------------------------------------
# NAB's scorer


def scorer_copy(nab: Path, work: Path, ours: Path, det: str, files: list[str]) -> None:
    """A copy of the checkout NAB's ``run.py`` can score ``det`` in: its code, data, labels, config, the null
    detector's scores, and our result files."""
    for name in ("data", "labels", "config", "nab"):
        shutil.copytree(nab / name, work / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy2(nab / "run.py", work / "run.py")
    (work / "results" / "null").mkdir(parents=True)
    for p in PROFILES:
        shutil.copy2(nab / "results" / "null" / f"null_{p}_scores.csv", work / "results" / "null")
    for f in files:
        dest = result_path(work / "results", det, f)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(result_path(ours, det, f), dest)


def run_scorer(python: str, work: Path, det: str) -> tuple[dict[str, float], float, str]:
    """NAB's ``run.py -d det --optimize --score --normalize`` in ``work``: its final scores, seconds, output."""
    cmd = [python, "run.py", "-d", det, "--optimize", "--score", "--normalize", "--skipConfirmation",
           "-n", str(os.cpu_count() or 1)]  # fmt: skip
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=work, capture_output=True, text=True)
    secs = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"NAB's scorer failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    final = json.loads((work / "results" / "final_results.json").read_text())[det]
    return final, secs, done.stdout


# ---------------------------------------------------------------------------------------------------------------
# the scoreboard


def published(nab: Path) -> dict[str, dict[str, float]]:
    """The checkout's published final scores (``results/final_results.json`` as committed when the checkout is a
    git clone — runs in the checkout rewrite the file —, else as it is): detectors with the three profiles."""
    text = None
    if (nab / ".git").exists():
        done = subprocess.run(
            ["git", "-C", str(nab), "show", "HEAD:results/final_results.json"], capture_output=True, text=True
        )
        text = done.stdout if done.returncode == 0 else None
    final = json.loads(text if text is not None else (nab / "results" / "final_results.json").read_text())
    return {d: s for d, s in final.items() if all(p in s for p in PROFILES)}


def read_scores(path: Path) -> dict[str, dict[str, Any]]:
    """A ``<det>_<profile>_scores.csv``: per file (``File``) its row, numbers as floats; the Totals row left out."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    out = {}
    for r in rows:
        if r["Detector"] == "Totals" or not r["File"]:
            continue
        out[r["File"]] = {
            k: (float(v) if k in ("Threshold", "Score", "TP", "TN", "FP", "FN") else v) for k, v in r.items()
        }
    return out


def normalised(score: float, null: float, windows: int, tp_weight: float) -> float | None:
    """NAB's normalisation (``nab.runner.Runner.normalize``): 100 (S − S_null) / (S_perfect − S_null), S_perfect =
    windows × tpWeight; None without windows."""
    perfect = windows * tp_weight
    return None if windows == 0 or perfect == null else 100.0 * (score - null) / (perfect - null)


def category_scores(
    scores: Mapping[str, Mapping[str, Any]],
    null: Mapping[str, Mapping[str, Any]],
    window_counts: Mapping[str, int],
    tp_weight: float,
    files: Sequence[str],
) -> dict[str, float | None]:
    """Per category of ``files`` (and ``"all"``): :func:`normalised` of the summed per-file scores."""
    groups: dict[str, list[str]] = {"all": list(files)}
    for f in files:
        groups.setdefault(category(f), []).append(f)
    out: dict[str, float | None] = {}
    for name, group in groups.items():
        s = sum(scores[f]["Score"] for f in group)
        s_null = sum(null[f]["Score"] for f in group)
        out[name] = normalised(s, s_null, sum(window_counts.get(f, 0) for f in group), tp_weight)
    return out


def read_anomaly_scores(path: Path) -> list[float]:
    with open(path, newline="") as f:
        return [float(r["anomaly_score"]) for r in csv.DictReader(f)]


def detections(
    results: Path, det: str, threshold: float, windows: Mapping[str, Any], files: Sequence[str], nab: Path
) -> tuple[int, int, int] | None:
    """Windows with a detection (a scored row in it with anomaly_score ≥ ``threshold``), windows in all, and
    false-positive rows (scored rows outside every window at or above it), over ``files``; None where a result
    file is missing."""
    found = total = fp = 0
    for f in files:
        path = result_path(results, det, f)
        if not path.exists():
            return None
        scores = read_anomaly_scores(path)
        with open(nab / "data" / f, newline="") as fh:
            times = [parse_time(r[0]) for r in list(csv.reader(fh))[1:]]
        if len(times) != len(scores):
            return None
        start = probation(len(times))
        wins = windows.get(f, [])
        total += len(wins)
        hit = [False] * len(wins)
        for i in range(start, len(times)):
            if scores[i] < threshold:
                continue
            inside = [k for k, (a, b) in enumerate(wins) if a <= times[i] <= b]
            for k in inside:
                hit[k] = True
            fp += not inside
        found += sum(hit)
    return found, total, fp


def scoreboard(nab: Path, files: list[str], ours: tuple[str, Path, dict[str, float] | None] | None) -> dict[str, Any]:
    """Every published detector's (and ours: name, scored results folder, NAB's final scores) profile scores and
    per-category standard scores over ``files``, its windows detected and false-positive rows at its standard
    threshold."""
    windows = load_windows(nab)
    counts = {f: len(windows.get(f, [])) for f in files}
    profiles = json.loads((nab / "config" / "profiles.json").read_text())
    tp = {p: profiles[p]["CostMatrix"]["tpWeight"] for p in PROFILES}
    null = {p: read_scores(nab / "results" / "null" / f"null_{p}_scores.csv") for p in PROFILES}
    pub = published(nab)
    entries: list[tuple[str, Path, dict[str, float] | None, bool]] = [(d, nab / "results", pub[d], False) for d in pub]
    if ours is not None:
        entries.append((ours[0], ours[1], ours[2], True))
    rows = []
    for det, results, final, is_ours in entries:
        row: dict[str, Any] = {"detector": det, "ours": is_ours, "nab_final": final}
        try:
            scores = {p: read_scores(results / det / f"{det}_{p}_scores.csv") for p in PROFILES}
        except FileNotFoundError:
            row["missing"] = "no per-file score files"
            rows.append(row)
            continue
        if any(f not in scores[p] for p in PROFILES for f in files):
            row["missing"] = "files not scored"
            rows.append(row)
            continue
        per_cat = {p: category_scores(scores[p], null[p], counts, tp[p], files) for p in PROFILES}
        row["scores"] = {p: per_cat[p]["all"] for p in PROFILES}
        if final and set(files) == set(windows):  # the whole corpus: NAB's own final scores, to rounding
            row["matches_nab_final"] = all(abs(row["scores"][p] - final[p]) < 1e-6 for p in PROFILES)
        row["categories"] = {c: v for c, v in per_cat["standard"].items() if c != "all" and v is not None}
        threshold = next(iter(scores["standard"].values()))["Threshold"]
        row["threshold_standard"] = threshold
        row["fp_rows_standard"] = int(sum(scores["standard"][f]["FP"] for f in files))
        found = detections(results, det, threshold, windows, files, nab)
        if found is not None:
            row["windows_detected"], row["windows"], fp = found
            row["fp_rows_check"] = fp
        rows.append(row)
    scored = [r for r in rows if "scores" in r]
    scored.sort(key=lambda r: -r["scores"]["standard"])
    return {"rows": scored + [r for r in rows if "scores" not in r], "whole_corpus": set(files) == set(windows)}


def numenta_check(board: dict[str, Any]) -> dict[str, Any] | None:
    """Our per-category numbers for ``numenta`` against the published ones (:data:`NUMENTA_STANDARD`)."""
    row = next((r for r in board["rows"] if r["detector"] == "numenta" and "categories" in r), None)
    if row is None or not board["whole_corpus"]:
        return None
    got = {c: round(row["categories"][c], 1) for c in NUMENTA_STANDARD if c in row["categories"]}
    return {"published": NUMENTA_STANDARD, "computed": got, "match": got == NUMENTA_STANDARD}


def _f(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}"


def tables(board: dict[str, Any]) -> str:
    rows = [r for r in board["rows"] if "scores" in r]
    main = report.markdown_table(
        ["rank", "detector", "standard", "low FP", "low FN", "windows detected", "FP rows (standard)"],
        [
            [
                i + 1,
                f"**{r['detector']}** (this run)" if r["ours"] else DISPLAY.get(r["detector"], r["detector"]),
                _f(r["scores"]["standard"]),
                _f(r["scores"]["reward_low_FP_rate"]),
                _f(r["scores"]["reward_low_FN_rate"]),
                f"{r['windows_detected']} / {r['windows']}" if "windows" in r else "—",
                r["fp_rows_standard"],
            ]
            for i, r in enumerate(rows)
        ],
        "rlrrrrr",
    )
    cats = [c for c in CATEGORIES if any(c in r["categories"] for r in rows)]
    per_cat = report.markdown_table(
        ["detector", *cats],
        [
            [f"**{r['detector']}**" if r["ours"] else r["detector"], *(_f(r["categories"].get(c)) for c in cats)]
            for r in rows
        ],
        "l" + "r" * len(cats),
    )
    left = [f"{r['detector']} ({r['missing']})" for r in board["rows"] if "scores" not in r]
    note = f"\n\nLeft out: {', '.join(left)}." if left else ""
    return f"{main}{note}\n\nPer category (standard profile, normalised per category):\n\n{per_cat}"


OTHERS = ("tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown")  # ours is red


def plot(result: dict[str, Any], path: Path) -> None:
    rows = [r for r in result["scoreboard"]["rows"] if "scores" in r]
    ours = next((r for r in rows if r["ours"]), None)
    with report.figure(path, 1, 2, figsize=(15, 7), gridspec_kw={"width_ratios": [1, 1.3]}) as (fig, (ax1, ax2)):
        names = [r["detector"] for r in rows][::-1]
        vals = [r["scores"]["standard"] for r in rows][::-1]
        colors = ["tab:red" if r["ours"] else "tab:gray" for r in rows][::-1]
        ax1.barh(names, vals, color=colors)
        for y, v in enumerate(vals):
            ax1.text(
                v + (1 if v >= 0 else -1), y, f"{v:.1f}", va="center", ha="left" if v >= 0 else "right", fontsize=7
            )
        ax1.axvline(0, color="k", lw=0.5)
        ax1.set_xlabel("NAB score, standard profile")
        ax1.set_title("scoreboard" + ("" if result["scoreboard"]["whole_corpus"] else " (files run only)"))
        ax1.tick_params(axis="y", labelsize=8)
        picks = [
            r
            for r in rows
            if r["ours"] or r["detector"] in ("ARTime", "numenta", "windowedGaussian", "randomCutForest")
        ]
        cats = [c for c in CATEGORIES if ours is not None and c in ours.get("categories", {})] or [
            c for c in CATEGORIES if any(c in r["categories"] for r in picks)
        ]
        width = 0.8 / max(len(picks), 1)
        for k, r in enumerate(picks):
            xs = [i + k * width for i in range(len(cats))]
            ax2.bar(xs, [r["categories"].get(c) or 0.0 for c in cats], width,
                    label=r["detector"] + (" (this run)" if r["ours"] else ""),
                    color="tab:red" if r["ours"] else OTHERS[k % len(OTHERS)])  # fmt: skip
        ax2.set_xticks([i + 0.4 - width / 2 for i in range(len(cats))])
        ax2.set_xticklabels([c.replace("real", "").replace("artificial", "art ") for c in cats], fontsize=8)
        ax2.axhline(0, color="k", lw=0.5)
        ax2.set_ylabel("normalised score per category, standard profile")
        ax2.set_title("per category")
        ax2.legend(fontsize=8)
        fig.suptitle(
            f"NAB: {result['detector']['name']} ({result['detector']['family']}) against the published detectors"
        )
        fig.tight_layout()


# ---------------------------------------------------------------------------------------------------------------


def detector_record(detector: Detector) -> dict[str, Any]:
    return {
        "name": detector.name,
        "family": detector.family,
        "body": detector.body.__name__,
        "grid": list(detector.grid),
        "dt_unit": detector.dt_unit,
        "fit_batch": detector.fit_batch,
        "run_batch": detector.run_batch,
        "levels": list(detector.levels),
        "score": SCORE,
    }


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.nab", description=__doc__.strip().split("\n")[0])
    ap.add_argument("--nab", type=Path, required=True, help="a checkout of numenta/NAB (read only)")
    ap.add_argument("--server", help="a running mpflow server's URL (default: start one here)")
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/0", help="the started server's store")
    ap.add_argument("--files", help="only the files matching this glob over <category>/<file>.csv")
    ap.add_argument("--jobs", type=int, default=1, help="files streamed at a time (default 1)")
    ap.add_argument("--cache", type=Path, help="keep the result files here, and reuse those already there")
    ap.add_argument("--cached-only", action="store_true", help="only the files --cache already holds (no streaming)")
    ap.add_argument("--nab-python", default=str(ROOT / ".nab-env" / "bin" / "python"),
                    help="Python 3.6 with pandas 0.23.3 for NAB's scorer (make bench-nab builds .nab-env)")  # fmt: skip
    ap.add_argument("--no-score", action="store_true", help="stream and write the result files only")
    ap.add_argument("--published-only", action="store_true", help="the published detectors' scoreboard only")
    ap.add_argument("--out", type=Path, help="output path without suffix (default benchmarks/results/nab)")
    args = ap.parse_args(argv)

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # leave the started server and store clean
    nab = args.nab.resolve()
    needs = ["data", "labels/combined_windows.json"]
    needs += [] if args.no_score else ["config/profiles.json", "results/null"]
    for need in needs:
        if not (nab / need).exists():
            raise SystemExit(f"--nab {nab}: no {need} (a checkout of numenta/NAB?)")
    partial = bool(args.files or args.no_score or args.published_only or args.cached_only)
    stem = args.out.with_suffix("") if args.out else report.RESULTS / (NAME + ("-partial" if partial else ""))
    files = corpus_files(nab, args.files)
    if args.cached_only:
        if not args.cache:
            raise SystemExit("--cached-only needs --cache")
        files = [f for f in files if _done(args.cache.resolve(), DETECTOR.name, f)]
    if not files:
        raise SystemExit(
            f"no file of {nab / 'data'} matches {args.files!r}" + (" in --cache" if args.cached_only else "")
        )
    scorer_python = args.nab_python
    if not (args.no_score or args.published_only) and not Path(scorer_python).exists():
        raise SystemExit(f"no {scorer_python}: NAB's scorer needs Python 3.6 with pandas 0.23.3 (make bench-nab)")
    load_before = os.getloadavg()
    result: dict[str, Any] = {
        "benchmark": NAME,
        "nab": str(nab),
        "files": len(files),
        "detector": detector_record(DETECTOR),
    }
    t_all = time.perf_counter()

    with tempfile.TemporaryDirectory(prefix="mpflow-nab-") as tmp:
        tmp_path = Path(tmp)
        ours = None
        if not args.published_only:
            cache = args.cache.resolve() if args.cache else tmp_path / "ours"
            if args.server or all(_done(cache, DETECTOR.name, f) for f in files):
                timing = stream_corpus(args.server or "", None, DETECTOR, nab, files, cache, args.jobs)
            else:
                with started_server(args.redis_url, tmp_path) as (url, pid):
                    timing = stream_corpus(url, pid, DETECTOR, nab, files, cache, args.jobs)
            result["timing"] = timing
            result["fits"] = [{k: v for k, v in r.items() if k != "grid"} for r in fits(cache, DETECTOR.name, files)]
            print(
                f"streamed {timing['files_streamed']} files ({timing['files_reused']} reused) in "
                f"{timing['wall_s'] / 60:.1f} min: {timing['steps']} steps in {timing['requests']} requests, "
                f"{timing['request_s'] / 60:.1f} min waiting on the server"
                + (f", server CPU {timing['server_cpu_s'] / 60:.1f} min" if timing["server_cpu_s"] is not None else ""),
                file=sys.stderr,
            )
            if args.no_score:
                print(f"result files in {cache / DETECTOR.name}")
                report.write_json(result, stem.with_name(stem.name + ".json"))
                return
            work = tmp_path / "nabcopy"
            scorer_copy(nab, work, cache, DETECTOR.name, files)
            final, secs, _ = run_scorer(scorer_python, work, DETECTOR.name)
            result["nab_final"] = final
            result["scorer_s"] = secs
            ours = (DETECTOR.name, work / "results", final)
        board = scoreboard(nab, files, ours)
    result["scoreboard"] = board
    result["numenta_check"] = numenta_check(board)
    result["wall_s"] = time.perf_counter() - t_all
    result["machine"] = report.machine_meta(load_before)
    # for the whole corpus, our computed scores are NAB's own: record the check
    own = next((r for r in board["rows"] if r["ours"] and "scores" in r), None)
    if own is not None and own["nab_final"] and board["whole_corpus"]:
        result["nab_final_check"] = {p: abs(own["scores"][p] - own["nab_final"][p]) < 1e-6 for p in PROFILES}

    print(tables(board))
    if result["numenta_check"]:
        c = result["numenta_check"]
        print(f"\nnumenta per category (standard): {c['computed']} — published {c['published']}: "
              f"{'match' if c['match'] else 'DIFFER'}")  # fmt: skip
    if "timing" in result:
        t = result["timing"]
        print(
            f"\nwall: {result['wall_s'] / 60:.1f} min in all; streaming {t['wall_s'] / 60:.1f} min "
            f"({t['request_s'] / 60:.1f} min waiting on requests"
            + (f", server CPU {t['server_cpu_s'] / 60:.1f} min" if t["server_cpu_s"] is not None else "")
            + f"), NAB's scorer {result['scorer_s'] / 60:.1f} min"
        )
    report.write_outputs(result, stem, lambda p: plot(result, p))


if __name__ == "__main__":
    main()

"""benchmarks/nab.py on a tiny NAB-like tree, run as a user runs it (``python -m benchmarks.nab ...``; tests do not
import ``benchmarks``): the per-category normalisation and the windows/false-positive counts of ``--published-only``
against a hand computation (no service, no scorer); the result files of ``--no-score`` (a server started by the
benchmark: dt, standardisation on the probationary part, NAB's file format); and, where the scorer's pinned
environment (``make bench-nab``: ``.nab-env``) and a NAB checkout (``NAB=path``) exist, two NAB files end to end.
"""

from __future__ import annotations

import csv
import datetime as dt
import itertools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
PROFILES = {
    "standard": {"CostMatrix": {"tpWeight": 1.0, "fnWeight": 1.0, "fpWeight": 0.11, "tnWeight": 1.0}},
    "reward_low_FP_rate": {"CostMatrix": {"tpWeight": 1.0, "fnWeight": 1.0, "fpWeight": 0.22, "tnWeight": 1.0}},
    "reward_low_FN_rate": {"CostMatrix": {"tpWeight": 1.0, "fnWeight": 2.0, "fpWeight": 0.11, "tnWeight": 1.0}},
}
T0 = dt.datetime(2020, 1, 1)


def _run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.nab", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def _stamp(t: dt.datetime) -> str:
    return t.strftime("%Y-%m-%d %H:%M:%S")


def _tree(root: Path) -> dict[str, list[dt.datetime]]:
    """Two files — A: 120 five-minute readings with a repeated timestamp at row 60; B: 100 readings, spacing 10
    min then 20 min from row 50 — one window in A, two in B, and the null detector's score files."""
    rng = np.random.default_rng(0)
    times = {
        "artificialWithAnomaly/a.csv": [T0 + dt.timedelta(minutes=5 * i - 5 * (i >= 61)) for i in range(120)],
        "realTraffic/b.csv": [T0 + dt.timedelta(minutes=10 * min(i, 50) + 20 * max(i - 50, 0)) for i in range(100)],
    }
    for rel, ts in times.items():
        path = root / "data" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        values = 10 + np.cumsum(rng.normal(size=len(ts)))
        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["timestamp", "value"])
            w.writerows([_stamp(t), f"{v:.6f}"] for t, v in zip(ts, values, strict=True))
    a, b = times["artificialWithAnomaly/a.csv"], times["realTraffic/b.csv"]
    windows = {
        "artificialWithAnomaly/a.csv": [[_stamp(a[80]) + ".000000", _stamp(a[90]) + ".000000"]],
        "realTraffic/b.csv": [[_stamp(b[30]), _stamp(b[40])], [_stamp(b[70]), _stamp(b[80])]],
    }
    (root / "labels").mkdir()
    (root / "labels" / "combined_windows.json").write_text(json.dumps(windows))
    (root / "config").mkdir()
    (root / "config" / "profiles.json").write_text(json.dumps(PROFILES))
    return times


def _scores_csv(path: Path, det: str, profile: str, threshold: float, rows: dict[str, tuple[float, int]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Detector", "Profile", "File", "Threshold", "Score", "TP", "TN", "FP", "FN", "Total_Count"])
        for file, (score, fp) in rows.items():
            w.writerow([det, profile, file, threshold, score, 1, 10, fp, 1, 13])
        w.writerow(["Totals", "", "", "", sum(s for s, _ in rows.values()), 2, 20, 1, 2, 26])


def test_published_scoreboard_normalises_per_category(tmp_path):
    times = _tree(tmp_path)
    a, b = "artificialWithAnomaly/a.csv", "realTraffic/b.csv"
    res = tmp_path / "results"
    for p in PROFILES:
        _scores_csv(res / "null" / f"null_{p}_scores.csv", "null", p, 1.1, {a: (-1.0, 0), b: (-2.0, 0)})
        _scores_csv(res / "fake" / f"fake_{p}_scores.csv", "fake", p, 0.5, {a: (0.5, 1), b: (1.2, 0)})
    # fake's anomaly scores: one detection in A's window (row 85), one false positive (row 100); in B a score
    # above the threshold inside the probationary part (row 5: not scored) and one just below it in a window
    for rel, hits in ((a, {85: 0.9, 100: 0.7}), (b, {5: 0.99, 35: 0.49})):
        cat, name = rel.split("/")
        path = res / "fake" / cat / f"fake_{name}"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["timestamp", "value", "anomaly_score", "label"])
            w.writerows([_stamp(t), 0, hits.get(i, 0.0), 0] for i, t in enumerate(times[rel]))
    final = {d: dict.fromkeys(PROFILES, 0.0) for d in ("null", "fake")}
    (res / "final_results.json").write_text(json.dumps(final))
    out = tmp_path / "board"
    done = _run("--nab", str(tmp_path), "--published-only", "--out", str(out))
    assert done.returncode == 0, done.stderr
    rows = {r["detector"]: r for r in json.loads(out.with_suffix(".json").read_text())["scoreboard"]["rows"]}
    fake = rows["fake"]
    # 100 (S − S_null) / (windows · tpWeight − S_null), per category and over both files
    assert fake["categories"]["artificialWithAnomaly"] == pytest.approx(100 * (0.5 + 1.0) / (1 + 1.0))
    assert fake["categories"]["realTraffic"] == pytest.approx(100 * (1.2 + 2.0) / (2 + 2.0))
    for p in PROFILES:
        assert fake["scores"][p] == pytest.approx(100 * (1.7 + 3.0) / (3 + 3.0))
    assert rows["null"]["scores"]["standard"] == 0.0
    assert (fake["windows_detected"], fake["windows"], fake["fp_rows_standard"], fake["fp_rows_check"]) == (1, 3, 1, 1)
    assert "| 1 | fake | 78.33 |" in done.stdout and out.with_suffix(".png").stat().st_size > 0


@pytest.mark.slow
def test_result_files(tmp_path):
    times = _tree(tmp_path)
    cache = tmp_path / "cache"
    done = _run("--nab", str(tmp_path), "--no-score", "--cache", str(cache), "--out", str(tmp_path / "r"))
    assert done.returncode == 0, done.stderr
    windows = json.loads((tmp_path / "labels" / "combined_windows.json").read_text())
    for rel, ts in times.items():
        cat, name = rel.split("/")
        path = cache / "mpflow" / cat / f"mpflow_{name}"
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
        with open(tmp_path / "data" / rel, newline="") as f:
            data = list(csv.DictReader(f))
        assert list(rows[0])[:4] == ["timestamp", "value", "anomaly_score", "label"]
        assert [r["timestamp"] for r in rows] == [r["timestamp"] for r in data]  # as in the data file
        assert [float(r["value"]) for r in rows] == [float(r["value"]) for r in data]
        train = math.floor(0.15 * len(ts))
        fit = json.loads(path.with_name(path.name + ".fit.json").read_text())
        assert fit["train"] == train
        # dt in hours: the first is the median spacing; a repeated timestamp gets one second
        gaps = [(b - a).total_seconds() for a, b in itertools.pairwise(ts)]
        want = [float(np.median(gaps))] + [max(g, 1.0) for g in gaps]
        assert [float(r["dt_hours"]) for r in rows] == pytest.approx([g / 3600 for g in want])
        # standardised by the training part's mean and sd
        values = np.array([float(r["value"]) for r in data])
        z = np.array([float(r["standardised"]) for r in rows])
        assert z == pytest.approx((values - values[:train].mean()) / values[:train].std())
        assert (fit["mean"], fit["sd"]) == pytest.approx((values[:train].mean(), values[:train].std()))
        scores = [float(r["anomaly_score"]) for r in rows]
        assert all(s == 0.0 for s in scores[:train]) and all(0.0 <= s <= 1.0 for s in scores)
        assert any(s > 0 for s in scores[train:])
        inside = [
            int(any(dt.datetime.fromisoformat(a) <= t <= dt.datetime.fromisoformat(b) for a, b in windows[rel]))
            for t in ts
        ]
        assert [int(r["label"]) for r in rows] == inside
        assert fit["params"] in [{k: v for k, v in g.items() if k != "log_evidence"} for g in fit["grid"]]
        best = max(fit["grid"], key=lambda g: g["log_evidence"])
        assert best["q"] == fit["params"]["q"] and best["r"] == fit["params"]["r"]


NAB = os.environ.get("NAB")
NAB_PYTHON = ROOT / ".nab-env" / "bin" / "python"


@pytest.mark.slow
@pytest.mark.skipif(not NAB_PYTHON.exists(), reason="no .nab-env (make bench-nab builds NAB's scorer environment)")
@pytest.mark.skipif(not NAB or not Path(NAB, "run.py").exists(), reason="NAB=<a checkout of numenta/NAB> not set")
def test_two_nab_files_end_to_end(tmp_path):
    out = tmp_path / "nab2"
    done = _run("--nab", str(NAB), "--files", "realAdExchange/exchange-2_c*", "--out", str(out))
    assert done.returncode == 0, done.stderr
    result = json.loads(out.with_suffix(".json").read_text())
    ours = next(r for r in result["scoreboard"]["rows"] if r["ours"])
    assert ours["windows"] == 3 and set(ours["categories"]) == {"realAdExchange"}
    assert set(result["nab_final"]) == {"standard", "reward_low_FP_rate", "reward_low_FN_rate"}
    assert ours["fp_rows_standard"] == ours["fp_rows_check"]  # NAB's FP count is ours
    assert "**mpflow** (this run)" in done.stdout

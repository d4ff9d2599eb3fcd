"""Smoke test of the engine benchmark harness (benchmarks/engine.py) on a tiny configuration, run as a user runs
it (``python -m benchmarks.engine ...``; tests do not import ``benchmarks``).

The kalman rows double as a check of the harness's plumbing: its log-evidence is exact (the same
float64 Kalman recursion as the reference, so the error is rounding only) and its particles are N iid
draws of the exact posterior, so the mean error in sd units is ~ 1/√N and the variance ratio ~ 1 ± √(2/N).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: the numbers each row carries (benchmarks.engine.METRIC_KEYS) and all its keys (ROW_KEYS)
NUMERIC = (
    "ms_median",
    "ms_ratio_to_smc",
    "mean_err_sd",
    "var_ratio_avg",
    "var_ratio_last",
    "logz_err_last",
    "logz_inc_err_mean",
)
ROW_KEYS = ("family", "method", "d", "N", *NUMERIC, "error")


def test_engine_benchmark_tiny(tmp_path):
    out = tmp_path / "engine-tiny"
    args = ["--families", "linear_gaussian", "--methods", "kalman,smc", "--dims", "2", "--particles", "64"]
    args += ["--steps", "5", "--seeds", "1", "--out", str(out), "--no-progress"]
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.engine", *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert "| linear_gaussian | kalman | 2 | 64 |" in done.stdout  # the markdown table
    data = json.loads(out.with_suffix(".json").read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    meta = data["meta"]
    assert (meta["T"], meta["S"], meta["threads"]) == (5, 1, 1)
    assert {"date", "torch", "machine_cores"} <= set(meta)
    assert meta["models"] == {"linear_gaussian": "H = I, R = 3I"}

    rows = {r["method"]: r for r in data["rows"]}
    assert set(rows) == {"kalman", "smc"}
    for r in rows.values():
        assert set(r) == set(ROW_KEYS)
        assert (r["family"], r["d"], r["N"], r["error"]) == ("linear_gaussian", 2, 64, None)
        for key in NUMERIC:
            assert isinstance(r[key], float) and math.isfinite(r[key]), (r["method"], key, r[key])
        assert r["ms_median"] > 0 and r["mean_err_sd"] >= 0 and r["var_ratio_avg"] > 0
    assert rows["smc"]["ms_ratio_to_smc"] == 1.0

    kalman = rows["kalman"]
    assert kalman["logz_err_last"] < 1e-8 and kalman["logz_inc_err_mean"] < 1e-8
    assert kalman["mean_err_sd"] < 0.5  # ≈ 1/√64 = 0.125 for iid draws of the exact posterior
    assert 0.5 < kalman["var_ratio_avg"] < 1.5

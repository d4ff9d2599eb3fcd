"""Smoke test of the range-bearing benchmark (benchmarks/range_bearing.py) on a tiny setting, run as a user runs it
(``python -m benchmarks.range_bearing --quick ...``; tests do not import ``benchmarks``).

Six steps are enough for both scenarios to show what they are for: the crossing target's bearing passes ±π, the
close pass comes within about one unit of the sensor. The reference (two pooled bootstrap SMC runs) is the best
estimate there is, so no method's RMSE to the truth is far below the reference's.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
METHODS = {"mpf", "ukf", "enkf", "gpf", "smc"}


def test_range_bearing_benchmark_tiny(tmp_path):
    out = tmp_path / "rb-tiny"
    args = ["--quick", "--streams", "4", "--reference-particles", "4000", "--steps", "6", "--out", str(out)]
    args += ["--gpf-max-iters", "50"]  # gpf runs to its 500 iterations here: 3/4 of the run, a smoke test's waste
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.range_bearing", *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert "RMSE to truth" in done.stdout and "smc err at its compute" in done.stdout  # the markdown tables
    assert out.with_suffix(".png").stat().st_size > 0
    data = json.loads(out.with_suffix(".json").read_text())
    results = {r["scenario"]["name"]: r for r in data["results"]}
    assert set(results) == {"crossing", "close pass"}
    assert results["crossing"]["geometry"]["bearing_crosses_pi_share"] >= 0.5
    assert results["close pass"]["geometry"]["min_range_median"] < 1.5
    for res in results.values():
        ref = res["reference"]
        assert ref["kind"].startswith("bootstrap SMC, M = 4,000")
        assert 0 < ref["error_sd"] < 0.3 and 0 < ref["sd_rel_error"] < 0.3
        rows = res["rows"]
        assert {r["method"] for r in rows} == METHODS
        assert [r["particles"] for r in rows if r["method"] == "smc"] == [256, 1024]
        for r in rows:
            assert r["failed"] is None, r
            assert math.isfinite(r["mean_err"]) and r["ms_single"] > 0 and r["ms_batched"] > 0, r
            assert r["rmse"] > 0.5 * ref["rmse"], (r["label"], r["rmse"], ref["rmse"])
        # every method but smc against smc's ladder, in both regimes
        assert len(res["equal_compute"]) == 2 * sum(r["method"] != "smc" for r in rows)

"""Smoke test of benchmarks/smoothing.py, run as a user runs it (``python -m benchmarks.smoothing --quick``; tests
do not import ``benchmarks``): two seeds of its quick ladder, the table, the JSON and the plot; ``kalman`` is the
numpy RTS and the Monte Carlo smoothers' error falls with N."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_smoothing_benchmark_quick(tmp_path):
    out = tmp_path / "smoothing"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.smoothing", "--quick", "--seeds", "2", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "mean err/sd, max of 2" in done.stdout
    assert out.with_suffix(".png").stat().st_size > 0
    rows = {(r["method"], r["N"]): r for r in json.loads(out.with_suffix(".json").read_text())["rows"]}
    assert rows[("kalman", 256)]["mean_err"]["max"] < 1e-6
    for method, small, large in (("enkf", 256, 2048), ("smc", 256, 1024)):
        assert len(rows[(method, small)]["runs"]) == 2
        assert rows[(method, large)]["mean_err"]["mean"] < rows[(method, small)]["mean_err"]["mean"]

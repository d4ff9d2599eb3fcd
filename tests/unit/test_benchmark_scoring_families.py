"""Smoke test of benchmarks/scoring_families.py on a tiny setting, run as a user runs it (``python -m
benchmarks.scoring_families --quick ...``; tests do not import ``benchmarks``). Shipped operators stand in for the
energy-score ones (the benchmark takes any operator folder or name): ``gmm-d2-v4`` on the grid reference, and
``lorenz96-d10-v1`` (outside its domain with ``arctan``) on the two-run SMC reference.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.scoring_families", *args], cwd=ROOT, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip


@pytest.mark.slow
def test_scoring_families_benchmark_tiny(tmp_path):
    out = tmp_path / "sf-tiny"
    done = _run(
        "--quick", "--streams", "2", "--steps", "3", "--reference-particles", "2000", "--out", str(out),
        "--operator", "gmm=gmm-d2-v4", "--operator", "lorenz96=lorenz96-d10-v1",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "op / base" in done.stdout and "smc err at its compute" in done.stdout  # the markdown tables
    assert out.with_suffix(".png").stat().st_size > 0
    data = json.loads(out.with_suffix(".json").read_text())
    results = {r["family"]: r for r in data["results"]}
    assert set(results) == {"gmm", "lorenz96"}
    assert results["gmm"]["reference"]["kind"].startswith("adaptive grid")
    assert results["lorenz96"]["reference"]["kind"].startswith("bootstrap SMC, M = 2,000")
    for res in results.values():
        labels = [r["label"] for r in res["rows"]]
        assert labels[0] == "energy op" and sum(lab.startswith("base") for lab in labels) == 4
        assert [r["particles"] for r in res["rows"] if r["method"] == "smc"] == [256, 1024]
        for r in res["rows"]:
            assert r["failed"] is None, r
            assert math.isfinite(r["mean_err"]) and r["ms_batched"] > 0, r
        v = res["verdict"]
        # the verdict is the comparison it names, at the operator's compute
        assert v["wins"] == (v["op_err"] < v["base_err_at_op_compute"] and v["op_err"] < v["smc_err_at_op_compute"])
        assert all(len(c) == 3 for c in res["variance_ratio_per_step"].values())
    assert any(r["label"] == "KL op gmm-d2-v4" for r in results["gmm"]["rows"])
    # --merge joins runs (one family each) into one table, JSON and PNG
    merged = tmp_path / "merged"
    done = _run("--merge", str(out.with_suffix(".json")), str(out.with_suffix(".json")), "--out", str(merged))
    assert done.returncode == 0, done.stderr
    assert len(json.loads(merged.with_suffix(".json").read_text())["results"]) == 4
    assert merged.with_suffix(".png").stat().st_size > 0


def test_scoring_families_refuses_an_unknown_family():
    done = _run("--operator", "logistic=somewhere")
    assert done.returncode == 2 and "FAMILY one of" in done.stderr

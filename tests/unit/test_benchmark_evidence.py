"""Smoke test of ``benchmarks/evidence.py --only bias``, run as a user runs it (tests do not import ``benchmarks``):
three seeds of the GBP/USD run at N = 256; the plain flow's total (``marginal: false``) is biased low (its Gaussian
belief: −0.42 ± 0.04 over 32 seeds), ``mpf``'s (the marginal filter, its default there) and ``smc``'s are not
(−0.02 ± 0.11 and −0.01 ± 0.09), the per-seed counts agree with the per-seed totals, every row's filtered posterior
is close to the grid's (0.010–0.016 sd in the mean, sd ratio 1.000–1.006 over 32 seeds), and ``--operator`` adds the
shipped SV operator's row."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_evidence_bias_separates_the_gaussian_belief_from_the_spread(tmp_path):
    out = tmp_path / "bias.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.evidence", "--only", "bias", "--seeds", "3", "--out", str(out),
         "--operator", "stochastic_volatility-d1-v1"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "max |bias|" in done.stdout
    rows = {r["label"]: r for r in json.loads(out.read_text())["bias"]}
    assert set(rows) == {"mpf", "mpf marginal=False", "smc (SQMC)", "mpf stochastic_volatility-d1-v1"}
    assert rows["mpf stochastic_volatility-d1-v1"]["options"] == {"operator": "stochastic_volatility-d1-v1"}
    plain, marginal, smc = rows["mpf marginal=False"], rows["mpf"], rows["smc (SQMC)"]
    assert all(r["seeds"] == 3 and r["particles"] == 256 for r in rows.values())
    assert plain["total_mean"] < -0.3 and plain["seeds_total_within"] == 0
    assert plain["bias_day_144"] < -0.05 and plain["max_abs_bias_day"] == 144
    assert abs(marginal["total_mean"]) < 0.3 and abs(smc["total_mean"]) < 0.3
    for r in rows.values():
        assert r["worst_step_any_seed"] >= r["max_abs_bias"]
        assert 0 <= r["seeds_every_step_within"] <= 3
        assert r["mean_error_sd"] < 0.1 and 0.9 < r["sd_ratio"] < 1.1, r

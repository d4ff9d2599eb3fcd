"""Smoke test of the engine benchmark harness (benchmarks/engine.py) on a tiny configuration.

The kalman rows double as a check of the harness's plumbing: its log-evidence is exact (the same
float64 Kalman recursion as the reference, so the error is rounding only) and its particles are N iid
draws of the exact posterior, so the mean error in sd units is ~ 1/√N and the variance ratio ~ 1 ± √(2/N).
"""

from __future__ import annotations

import json
import math

from benchmarks.engine import METRIC_KEYS as NUMERIC
from benchmarks.engine import ROW_KEYS, run_benchmark


def test_engine_benchmark_tiny(tmp_path):
    out = tmp_path / "engine-tiny"
    run_benchmark(
        families=["linear_gaussian"],
        methods=["kalman", "smc"],
        dims=[2],
        particles=[64],
        steps=5,
        seeds=1,
        out=out,
        progress=False,
    )
    data = json.loads(out.with_suffix(".json").read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    meta = data["meta"]
    assert (meta["T"], meta["S"], meta["threads"]) == (5, 1, 1)
    assert {"date", "torch", "machine_cores"} <= set(meta)

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

"""``examples/sensor_anomalies.py`` (issue 56) run as a user runs it (a subprocess, ``--serve``) on a synthetic
sensor CSV: 3 days of 5-minute readings of a daily sine plus noise, one spike and a level shift at known steps."""

from __future__ import annotations

import csv
import datetime as dt
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
SPIKE, SHIFT = 400, 600  # row indices (0-based): after the training part (the first 15 %: 129 rows)


def _write_series(path: Path) -> list[str]:
    rng = np.random.default_rng(1)
    n = 3 * 288
    hours = np.arange(n) * 5 / 60
    values = 20 + 3 * np.sin(2 * np.pi * hours / 24) + 0.3 * rng.standard_normal(n)
    values[SHIFT:] += 3.0  # 10 noise sds
    values[SPIKE] += 4.0
    t0 = dt.datetime(2024, 1, 1)
    stamps = [(t0 + dt.timedelta(minutes=5 * i)).isoformat(sep=" ") for i in range(n)]
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["timestamp", "value"])
        out.writerows([s, f"{v:.4f}"] for s, v in zip(stamps, values, strict=True))
    return stamps


def test_sensor_anomalies_flags_the_spike_and_the_shift(tmp_path: Path) -> None:
    stamps = _write_series(tmp_path / "sensor.csv")
    flagged, figure = tmp_path / "flagged.csv", tmp_path / "anomalies.png"
    script = str(ROOT / "examples" / "sensor_anomalies.py")
    run = subprocess.run(
        [sys.executable, script, "sensor.csv", "--serve", "--out", str(flagged), "--plot", str(figure)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "864 readings of sensor.csv, the first 129 for training" in run.stdout, run.stdout
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with open(flagged, newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows and list(rows[0]) == ["timestamp", "value", "anomaly_score", "change_score", "surprise"]
    steps = [stamps.index(r["timestamp"]) for r in rows]
    assert all(float(r["anomaly_score"]) >= 0.9995 for r in rows), rows
    assert SPIKE in steps, steps
    after_shift = [s for s in steps if s >= SHIFT]
    assert after_shift and after_shift[0] - SHIFT <= 5, steps
    others = [s for s in steps if s != SPIKE and not SHIFT <= s < SHIFT + 50]
    assert len(others) <= 5, steps  # of 735 scored readings

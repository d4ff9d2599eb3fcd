"""Flag the anomalies of a real sensor's readings: a CSV of ``timestamp,value`` rows, irregular times allowed.

Any file of the Numenta Anomaly Benchmark's ``data/`` folder will do (``git clone
https://github.com/numenta/NAB``; nothing is fetched here). The recipe, the one ``benchmarks/nab.py`` measures:

* the model is ``structural`` in continuous time: a local level plus a daily seasonal (period 24 h, 3 harmonics,
  a pattern that changes slowly), o = level + season + N(0, R); each step's ``dt`` is its time since the previous
  timestamp, in hours, so gaps and irregular sampling need nothing special;
* ``kalman`` filters it exactly, with ``"method_options": {"outlier_clip": 3}``: a spike does not drag the level;
* training uses the first 15 % of the readings only: the values are standardised by their mean and sd, and
  ``level_sd`` and ``R`` are chosen by maximum likelihood over a small grid — one stream per candidate over the
  training part, the largest ``summary.log_evidence`` wins;
* the whole series is then streamed through one stream, and each step's ``anomaly_score`` (its surprise ranked
  among the stream's earlier steps, or its ``change_score`` where larger) is compared with ``--threshold``:
  0.9995 flags a reading more surprising than about 1999 in 2000 before it. The training part is not flagged.

Run a server (``mpflow serve``) and then, from the checkout, or let it start one (``--serve``)::

    .venv/bin/python examples/sensor_anomalies.py NAB/data/realKnownCause/machine_temperature_system_failure.csv \\
        --serve --out flagged.csv --plot anomalies.png

It prints the fit and the flagged readings, writes them (``timestamp, value, anomaly_score, change_score,
surprise``) to ``--out``, and plots the series with the flagged readings circled over the anomaly score.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
from pathlib import Path

from track_target import run_example, save_figure  # first: it says which Python to use where mpflow is missing

# isort: split
import numpy as np

from mpflow import Client
from mpflow.client.observations import step_lengths
from mpflow.client.results import StepTable

#: the daily seasonal component (periods in hours: the unit of the steps' dt)
DAILY = {"period": 24.0, "harmonics": 3, "sd": 1e-3}
#: the candidates of the fit, on the standardised scale: the level's sd per √hour and the noise variance R
LEVEL_SDS = (0.1, 0.3, 1.0)
NOISE_VARIANCES = (0.01, 0.1, 1.0)


def read_series(path: Path, time_column: str, value_column: str) -> tuple[list[str], np.ndarray, np.ndarray]:
    """The timestamps as written, the values, and each step's dt in hours (the first step's: the median spacing;
    a timestamp that does not advance gets one second)."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    stamps = [r[time_column] for r in rows]
    values = np.array([float(r[value_column]) for r in rows])
    times = [dt.datetime.fromisoformat(s.strip()) for s in stamps]
    hours = step_lengths([(t - times[0]).total_seconds() / 3600.0 for t in times]) or [1.0]
    return stamps, values, np.maximum(hours, 1.0 / 3600.0)


def stream_body(level_sd: float, r: float) -> dict:
    dim = 1 + 2 * DAILY["harmonics"]
    return {
        "model": {"family": "structural", "params": {"level_sd": level_sd, "seasonal": [DAILY], "R": r}},
        "prior": {"type": "gaussian", "mean": [0.0] * dim, "cov": np.eye(dim).tolist()},
        "method": "kalman",
        "method_options": {"outlier_clip": 3.0},
        "seed": 0,
    }


def run(client: Client, body: dict, steps: list[dict]) -> tuple[float, StepTable]:
    """Stream ``steps`` through a new stream of ``body``: its log evidence and its per-step table."""
    stream = client.create_stream(**body)
    answers = list(stream.filter(steps, batch=1000))
    stream.delete()
    return float(answers[-1]["summary"]["log_evidence"]), StepTable.of(answers)


def detect(url: str, args: argparse.Namespace) -> None:
    stamps, values, dts = read_series(args.csv, args.time_column, args.value_column)
    train = max(2, int(0.15 * len(values)))
    mean, sd = values[:train].mean(), values[:train].std()
    z = (values - mean) / (sd if sd > 0 else 1.0)
    steps = [{"value": [float(v)], "dt": float(d)} for v, d in zip(z, dts, strict=True)]

    with Client(url) as client:
        fits = {(q, r): run(client, stream_body(q, r), steps[:train])[0] for q in LEVEL_SDS for r in NOISE_VARIANCES}
        level_sd, r = max(fits, key=fits.get)
        _, table = run(client, stream_body(level_sd, r), steps)

    score = np.nan_to_num(table.anomaly_score)
    score[:train] = 0.0  # the training part is not flagged
    flagged = np.flatnonzero(score >= args.threshold)
    print(f"{len(values)} readings of {args.csv.name}, the first {train} for training")
    print(f"fit: level_sd {level_sd:g}, R {r:g} (log evidence {fits[level_sd, r]:.1f} on the training part)")
    print(f"flagged {len(flagged)} readings (anomaly_score >= {args.threshold:g}):")
    with open(args.out, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["timestamp", "value", "anomaly_score", "change_score", "surprise"])
        for i in flagged:
            row = [stamps[i], values[i], table.anomaly_score[i], table.change_score[i], table.surprise[i]]
            out.writerow([row[0], *(f"{x:.6g}" for x in row[1:])])
            print(f"  {stamps[i]}  {values[i]:10.4g}  score {score[i]:.5f}  change {table.change_score[i]:.5f}")
    print(f"wrote {args.out}")
    times = [dt.datetime.fromisoformat(s.strip()) for s in stamps]
    plot(times, values, score, flagged, train, args.threshold, args.plot, f"{args.csv.name}: structural + kalman")
    print(f"wrote {args.plot}")


def plot(times, values, score, flagged, train: int, threshold: float, out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(10, 5), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    ax = axes[0]
    ax.plot(times, values, "-", color="0.4", lw=0.6, label="readings")
    ax.axvspan(times[0], times[train - 1], color="C0", alpha=0.08, label="training part")
    ax.plot([times[i] for i in flagged], values[flagged], "o", mfc="none", color="C3", ms=7, label="flagged")
    ax.set_ylabel("value")
    ax.legend(fontsize=8, ncol=3)
    axes[1].plot(times, score, "C1-", lw=0.6)
    axes[1].axhline(threshold, color="C3", ls="--", lw=0.8, label=f"threshold {threshold:g}")
    axes[1].set_ylim(min(0.95, threshold - 0.01), 1.002)  # the top of the range: where the flags are
    axes[1].set_ylabel("anomaly score")
    axes[1].legend(fontsize=8, loc="lower right")
    fig.autofmt_xdate()
    save_figure(fig, title, out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Flag the anomalies of a sensor's CSV (timestamp,value) with mpflow.")
    p.add_argument("csv", type=Path, help="the readings: a CSV with a header row, e.g. a file of NAB's data/")
    p.add_argument("--time-column", default="timestamp", help="the column of timestamps (ISO 8601)")
    p.add_argument("--value-column", default="value", help="the column of readings")
    p.add_argument(
        "--threshold", type=float, default=0.9995, help="flag a reading whose anomaly_score is at least this"
    )
    p.add_argument("--out", type=Path, default=Path("flagged.csv"), help="the flagged readings (CSV)")
    p.add_argument("--plot", type=Path, default=Path("sensor_anomalies.png"), help="the figure (PNG)")
    return run_example(p, argv, detect)


if __name__ == "__main__":
    raise SystemExit(main())

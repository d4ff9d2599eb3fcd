"""Change detection on simulated level shifts and variance changes: ``python -m benchmarks.change_detection``.

What issue 56 asks of the anomaly score beside the Numenta Anomaly Benchmark: its detection delay and false-alarm
rate on simulated changes, through the service's own stepping (in-process, as ``mpflow filter --data`` runs it:
:func:`mpflow.cli.filter_data.filter_in_process`, the same engine, scores and sketches as a server).

Each stream is a local level o_m = x_m + N(0, 1), x_m = x_{m−1} + N(0, q), q = :data:`Q`, filtered by ``kalman``
with the exact model (``lds`` A = B = 1), with and without ``outlier_clip: 3``; :data:`BEFORE` steps, then at
step :data:`BEFORE` either the level jumps by δ noise sd (δ in :data:`SHIFTS`) or the noise sd doubles, for
:data:`AFTER` steps. A step is an alarm when its ``anomaly_score`` ≥ θ (:data:`THRESHOLDS`). Reported per change
and θ: the share of streams with an alarm within :data:`AFTER` steps of the change, the median delay to the first
(steps after the change), and the false alarms per 1000 steps over steps 200 … BEFORE (the first 200 build the
stream's history: with few steps behind it, any new record ranks 1).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from benchmarks import report
from mpflow.cli.filter_data import filter_in_process

NAME = "change_detection"
#: the level's variance per step, the steps before and after the change
Q = 0.01
BEFORE, AFTER = 1000, 200
#: the level shifts (noise sd), and the noise sd after a variance change
SHIFTS = (1.0, 2.0, 3.0, 5.0)
VARIANCE_RATIO = 2.0
THRESHOLDS = (0.999, 0.9995)
#: the steps whose alarms count as false (before the change, once a history has built up)
FALSE_FROM = 200


def simulate(rng: np.random.Generator, change: str, size: float) -> np.ndarray:
    """The readings of one stream (module docstring)."""
    n = BEFORE + AFTER
    level = np.cumsum(rng.normal(0.0, np.sqrt(Q), n))
    noise = rng.standard_normal(n)
    if change == "shift":
        level[BEFORE:] += size
    else:
        noise[BEFORE:] *= size
    return level + noise


def scores(readings: np.ndarray, clip: float | None) -> np.ndarray:
    """Every step's ``anomaly_score`` (0 where null) of a ``kalman`` stream over ``readings``."""
    body: dict[str, Any] = {
        "model": {"family": "lds", "params": {"A": [[1.0]], "Q": [[Q]], "B": [[1.0]], "R": [[1.0]]}},
        "prior": {"type": "gaussian", "mean": [0.0], "cov": [[1.0]]},
        "method": "kalman",
        "method_options": {"outlier_clip": clip},
        "seed": 0,
    }
    per_step = filter_in_process(body, [[float(v)] for v in readings], 1000, lambda n: None).per_step
    return np.array([e.get("anomaly_score") or 0.0 for e in per_step])


def measure(runs: int) -> list[dict[str, Any]]:
    """One row per change, clip and threshold."""
    changes = [("shift", s) for s in SHIFTS] + [("variance", VARIANCE_RATIO)]
    rows = []
    for clip in (None, 3.0):
        for change, size in changes:
            rng = np.random.default_rng(int(10 * size) + (0 if change == "shift" else 1000))
            runs_scores = [scores(simulate(rng, change, size), clip) for _ in range(runs)]
            for theta in THRESHOLDS:
                delays, false = [], []
                for s in runs_scores:
                    after = np.flatnonzero(s[BEFORE:] >= theta)
                    if after.size:
                        delays.append(int(after[0]))
                    false.append(1000.0 * np.mean(s[FALSE_FROM:BEFORE] >= theta))
                rows.append(
                    {
                        "clip": clip,
                        "change": change,
                        "size": size,
                        "threshold": theta,
                        "detected": len(delays) / runs,
                        "median_delay": float(np.median(delays)) if delays else None,
                        "false_per_1000": float(np.mean(false)),
                    }
                )
    return rows


def main() -> None:
    args = report.parser(NAME, __doc__, "5 streams per change instead of 20").parse_args()
    runs = 5 if args.quick else 20
    start = time.perf_counter()
    rows = measure(runs)
    seconds = time.perf_counter() - start

    def label(r: dict[str, Any]) -> str:
        return f"level +{r['size']:g} sd" if r["change"] == "shift" else f"noise sd ×{r['size']:g}"

    table = report.markdown_table(
        ["outlier_clip", "change", "θ", "detected", "median delay (steps)", "false alarms / 1000 steps"],
        [
            [
                "off" if r["clip"] is None else f"{r['clip']:g}",
                label(r),
                r["threshold"],
                f"{r['detected']:.2f}",
                "—" if r["median_delay"] is None else f"{r['median_delay']:g}",
                f"{r['false_per_1000']:.2f}",
            ]
            for r in rows
        ],
        "llrrrr",
    )
    print(table)
    print(f"\n{runs} streams per change, {BEFORE + AFTER} steps each; {seconds:.0f} s")
    result = {
        "benchmark": NAME,
        "runs": runs,
        "q": Q,
        "before": BEFORE,
        "after": AFTER,
        "rows": rows,
        "seconds": seconds,
    }
    report.write_outputs(result, report.out_stem(args, NAME), lambda path: plot(rows, path))


def plot(rows: list[dict[str, Any]], path: Any) -> None:
    """Detection delay and false alarms per change, with and without the clip, at the first threshold."""
    theta = THRESHOLDS[0]
    picked = [r for r in rows if r["threshold"] == theta]
    labels = list(dict.fromkeys(f"{r['change']} {r['size']:g}" for r in picked))
    with report.figure(path, 1, 2, figsize=(11, 4)) as (fig, (left, right)):
        for k, clip in enumerate((None, 3.0)):
            mine = [r for r in picked if r["clip"] == clip]
            x = np.arange(len(mine)) + 0.4 * k
            name = "clip off" if clip is None else f"outlier_clip {clip:g}"
            left.bar(x, [r["median_delay"] if r["median_delay"] is not None else np.nan for r in mine], 0.4, label=name)
            right.bar(x, [r["false_per_1000"] for r in mine], 0.4, label=name)
        for ax, title in ((left, "median delay to the first alarm (steps)"), (right, "false alarms per 1000 steps")):
            ax.set_xticks(np.arange(len(labels)) + 0.2, labels, rotation=20)
            ax.set_title(title)
            ax.legend()
        fig.suptitle(f"anomaly_score ≥ {theta}: simulated level shifts (noise sd) and a doubled noise sd")
        fig.tight_layout()


if __name__ == "__main__":
    main()

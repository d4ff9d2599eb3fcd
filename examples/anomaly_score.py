"""Score every reading of a sensor stream and flag the anomalous one: the log-evidence increment and its p-value.

A sensor reads a slowly drifting level: a local-level model, mpflow's ``lds`` family with A = B = [[1]],

    x_m = x_{m−1} + N(0, q²),    o_m = x_m + N(0, r²),

and one reading (index ``--at``, from 0) is a fault: ``--size`` noise sds off the level. Every answer's
``per_step`` entry says, for its step,

* ``log_evidence_increment``: log p(o_m | o_1..m−1), how probable the reading was given all the earlier ones — a
  reading far below the usual values is a fault or an event worth a look;
* ``pit``: the predictive p-value P(O_m ≤ o_m | o_1..m−1) per entry of the observation (uniform under the model),
  and ``pit_two_sided`` = 2 min(pit, 1 − pit): the p-value to threshold (here at ``--alpha``).

The Python client gathers them as arrays: ``StepTable.of(answers)`` has ``.log_evidence_increment`` [n] and
``.pit_two_sided`` [n, k]. Run a server (``mpflow serve``) and then ``.venv/bin/python examples/anomaly_score.py``
from the checkout, or let it start one (``--serve``)::

    python examples/anomaly_score.py --serve --out anomaly_score.png

The plot: the readings with the filtered level and its 95 % band (the per-step 0.025 and 0.975 quantiles), the
log-evidence increment per step, and the two-sided p-value per step on a log scale with the threshold.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from track_target import run_example, save_figure  # first: it says which Python to use where mpflow is missing

# isort: split
import numpy as np

from mpflow import Client
from mpflow.client.results import StepTable


def simulate(args: argparse.Namespace) -> tuple[np.ndarray, np.ndarray]:
    """The true level and the readings, the reading at ``args.at`` moved ``args.size`` noise sds up."""
    rng = np.random.default_rng(args.seed)
    level = np.cumsum(args.q * rng.standard_normal(args.steps))
    readings = level + args.r * rng.standard_normal(args.steps)
    readings[args.at] += args.size * args.r
    return level, readings


def plot(level, readings, table: StepTable, alpha: float, flagged, out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = np.arange(1, len(readings) + 1)
    fig, axes = plt.subplots(3, 1, figsize=(10, 7), sharex=True)
    ax = axes[0]
    ax.plot(steps, level, "k-", lw=1.0, label="true level")
    ax.plot(steps, readings, ".", color="0.5", ms=4, label="readings")
    ax.plot(steps, table.mean[:, 0], "C0-", lw=1.0, label="filtered level")
    lo, hi = table.quantiles["0.025"][:, 0], table.quantiles["0.975"][:, 0]
    ax.fill_between(steps, lo, hi, color="C0", alpha=0.2, label="95 % region")
    ax.plot(steps[flagged], readings[flagged], "o", mfc="none", color="C3", ms=9, label="flagged")
    ax.legend(fontsize=8, ncol=5)
    ax.set_ylabel("reading")
    axes[1].plot(steps, table.log_evidence_increment, "C2.-", lw=0.8)
    axes[1].set_ylabel("log-evidence\nincrement")
    axes[2].semilogy(steps, table.pit_two_sided[:, 0], "C1.", ms=4)
    axes[2].axhline(alpha, color="C3", ls="--", lw=0.8, label=f"α = {alpha:g}")
    axes[2].set_ylabel("two-sided p-value")
    axes[2].set_xlabel("step")
    axes[2].legend(fontsize=8)
    save_figure(fig, title, out)


def score(url: str, args: argparse.Namespace) -> None:
    level, readings = simulate(args)
    model = {"family": "lds", "params": {"A": [[1.0]], "B": [[1.0]], "Q": [[args.q**2]], "R": [[args.r**2]]}}
    prior = {"type": "gaussian", "mean": [0.0], "cov": [[1.0]]}
    with Client(url) as client:
        stream = client.create_stream(model, prior, args.method, seed=args.seed)
        answers = list(stream.filter(readings[:, None].tolist(), batch=50))
        stream.delete()
    table = StepTable.of(answers)
    increments, p = table.log_evidence_increment, table.pit_two_sided[:, 0]
    flagged = np.flatnonzero(p < args.alpha)
    lowest = int(np.argmin(increments))
    print(f"{args.steps} readings, {answers[-1]['method']}, outlier injected at step {args.at + 1}:")
    print("  step   reading   log-evidence increment   two-sided p-value")
    for i in sorted({lowest, args.at, *flagged.tolist()}):
        print(f"  {i + 1:4d}   {readings[i]:7.3f}   {increments[i]:22.3f}   {p[i]:17.2e}")
    print(f"lowest log-evidence increment: step {lowest + 1}")
    print(f"flagged (p < {args.alpha:g}): steps {[int(i) + 1 for i in flagged]}")
    print(f"share of the other steps with p > {args.alpha:g}: {np.mean(np.delete(p, args.at) > args.alpha):.3f}")
    plot(level, readings, table, args.alpha, flagged, args.out, f"anomaly scores of a local level, {args.method}")
    print(f"wrote {args.out}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Score each reading of a sensor stream and flag an injected outlier.")
    p.add_argument("--steps", type=int, default=200, help="number of readings")
    p.add_argument("--at", type=int, default=120, help="the outlier's index (0-based)")
    p.add_argument("--size", type=float, default=6.0, help="the outlier's offset, in noise sds")
    p.add_argument("--method", default="kalman", help="kalman, smc, mpf, ...")
    p.add_argument("--q", type=float, default=0.1, help="the level's step sd")
    p.add_argument("--r", type=float, default=0.5, help="the readings' noise sd")
    p.add_argument("--alpha", type=float, default=0.01, help="flag a reading whose two-sided p-value is below this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("anomaly_score.png"))
    return run_example(p, argv, score)


if __name__ == "__main__":
    raise SystemExit(main())

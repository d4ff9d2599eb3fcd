"""The two meta-training objectives side by side on one family: ``mpflow train --loss kl`` against ``--loss energy``.

``python -m benchmarks.objectives --kl DIR --energy DIR [--steps T] [--streams B]``

DIR is the ``--out`` folder of an ``mpflow train`` run (the operator folder and ``_training/*.jsonl`` inside), both
for the same family and d — here ``lorenz96`` d = 10 with the family's task distribution (F = 8, Δ = 0.05, every
variable observed, R ~ U[0.5, 2]), the same seed, batch, T, N and wall-time budget. Reports:

* each run's validation curve, relative to its untrained network's (the base flow's) value: the two objectives are on
  different scales (KL: nats summed over T steps; energy: the mean fair energy score), so the curve shows how far
  training moved each one from the flow it started from;
* the twin experiments of :mod:`benchmarks.lorenz96` at the task distribution's centre (d = 10, R = 1, every variable
  observed, B twins of T steps after a burn-in of 100): analysis RMSE and ensemble spread of ``mpf`` N = 64 with the
  base flow, the KL-trained and the energy-trained operator — the error each objective buys and how calibrated the
  cloud is (spread / RMSE, 1 when calibrated).

Writes ``benchmarks/results/objectives.{json,png}``.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import report
from benchmarks.lorenz96 import Setting, filter_rmse, twin

PARTICLES = 64
BURN_IN = 100
SETTING = Setting("lorenz96-d10-centre", 10, {"R": 1.0, "obs_every": 1})


def curve(run_dir: Path) -> list[dict[str, float]]:
    """(iteration, seconds, validation loss) of a training run's log, from its ``_training/*.jsonl``."""
    (log,) = sorted((run_dir / "_training").glob("*.jsonl"))
    rows = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    return [
        {"iteration": r["iteration"], "seconds": r["seconds"], "val_loss": r["val_loss"]}
        for r in rows
        if r["val_loss"] is not None
    ]


def operator_dir(run_dir: Path) -> Path:
    (found,) = [p for p in run_dir.iterdir() if (p / "config.json").exists()]
    return found


def main(argv: list[str] | None = None) -> int:
    p = report.parser("objectives", __doc__, "200 steps, 2 twins")
    p.add_argument("--kl", type=Path, required=True, help="mpflow train --loss kl's --out folder")
    p.add_argument("--energy", type=Path, required=True, help="mpflow train --loss energy's --out folder")
    p.add_argument("--steps", type=int, default=None, help="steps after the burn-in (1000; 200 with --quick)")
    p.add_argument("--streams", type=int, default=None, help="twin experiments (4; 2 with --quick)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    steps = args.steps or (200 if args.quick else 1000)
    streams = args.streams or (2 if args.quick else 4)
    load, t0 = os.getloadavg(), time.perf_counter()
    runs: dict[str, dict[str, Any]] = {}
    for name, run_dir in (("kl", args.kl), ("energy", args.energy)):
        op = operator_dir(run_dir)
        metrics = json.loads((op / "metrics.json").read_text())
        runs[name] = {"operator": str(op), "curve": curve(run_dir), **metrics}
    model, xs, obs, prior = twin(SETTING, streams, steps + BURN_IN, seed=0)
    rows = {}
    for label, options in (
        ("base flow", {}),
        *((f"{n}-trained", {"operator": r["operator"]}) for n, r in runs.items()),
    ):
        out = filter_rmse("mpf", PARTICLES, options, model, xs, obs, prior, BURN_IN)
        rows[label] = {k: out[k] for k in ("rmse", "rmse_sd_over_streams", "spread", "streams_lost", "ms_per_step")}
        print(f"  {label}: RMSE {out['rmse']:.4f}, spread {out['spread']:.4f} ({out['ms_per_step']} ms/step)")
    body = [
        [
            label,
            f"{r['rmse']:.4f} ± {r['rmse_sd_over_streams']:.4f}",
            f"{r['spread']:.4f}",
            f"{r['spread'] / r['rmse']:.2f}",
            r["ms_per_step"],
        ]
        for label, r in rows.items()
    ]
    print(report.markdown_table(["operator", "analysis RMSE", "spread", "spread / RMSE", "ms/step"], body, "lrrrr"))
    for name, r in runs.items():
        rel = (r["val_loss_best"] - r["val_loss_untrained"]) / abs(r["val_loss_untrained"])
        print(f"  {name}: validation {r['val_loss_untrained']:.4f} → {r['val_loss_best']:.4f} ({100 * rel:+.2f} %)")
    meta = {
        "benchmark": "objectives",
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "steps": steps,
        "burn_in": BURN_IN,
        "streams": streams,
        "particles": PARTICLES,
        "wall_s": round(time.perf_counter() - t0, 1),
        **report.machine_meta(load),
    }
    report.write_outputs(
        {"meta": meta, "training": runs, "twins": rows},
        report.out_stem(args, "objectives"),
        lambda path: plot(runs, path),
    )
    return 0


def plot(runs: dict[str, dict[str, Any]], path: Path) -> None:
    with report.figure(path, 1, 1, figsize=(7, 4)) as (_, ax):
        for name, r in runs.items():
            base = r["val_loss_untrained"]
            c = r["curve"]
            ax.plot(
                [row["iteration"] for row in c],
                [100 * (row["val_loss"] - base) / abs(base) for row in c],
                label=f"--loss {name} (untrained {base:.4g})",
            )
        ax.axhline(0, color="k", lw=0.8)
        ax.set(xlabel="iteration", ylabel="validation loss, % from the untrained network", title="KL vs energy score")
        ax.legend(fontsize=8)


if __name__ == "__main__":
    raise SystemExit(main())

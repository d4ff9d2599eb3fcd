"""Start-up time of the ``mpflow`` command line: ``python -m benchmarks.cli_startup [--repeats R] [--quick]``.

Each command runs R times as a user runs it — a fresh ``.venv/bin/mpflow`` process, its output thrown away — the
commands interleaved round by round so that the load of a shared machine falls on all alike; the table gives the
median, the fastest and the slowest wall time of each (a farm-bench-style repeat). ``mpflow info`` is timed with its
catalogue cached (one run first builds it, untimed), as a user meets it after the first time, and with no
``MPFLOW_*`` variable set (the settings' defaults are cached with it: :mod:`mpflow.cli.info_cache`).
Prints the table and writes ``benchmarks/results/cli_startup.json`` and ``.png``.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import report

#: the commands timed (issue 38's target: each under 0.5 s)
COMMANDS = (["--help"], ["filter", "--help"], ["info"])
TARGET_S = 0.5


def mpflow_script() -> list[str]:
    """The ``mpflow`` console script beside this interpreter (the set-up's), else ``python -m mpflow``."""
    script = Path(sys.executable).with_name("mpflow")
    return [str(script)] if script.exists() else [sys.executable, "-m", "mpflow"]


def timed(argv: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = report.parser("cli_startup", __doc__, "3 repeats instead of 10")
    p.add_argument("--repeats", type=int, default=None, help="runs of each command (default 10; 3 with --quick)")
    args = p.parse_args(argv)
    repeats = args.repeats or (3 if args.quick else 10)
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("MPFLOW_")} | {"OMP_NUM_THREADS": "1"}
    base = mpflow_script()
    load_before = os.getloadavg()
    timed([*base, "info"], env)  # builds the catalogue when it is not cached yet
    times: dict[str, list[float]] = {" ".join(c): [] for c in COMMANDS}
    for _ in range(repeats):
        for command in COMMANDS:
            times[" ".join(command)].append(timed([*base, *command], env))
    rows = [
        (f"mpflow {name}", f"{statistics.median(t):.3f}", f"{min(t):.3f}", f"{max(t):.3f}", len(t))
        for name, t in times.items()
    ]
    print(report.markdown_table(["command", "median s", "min s", "max s", "runs"], rows, "lrrrr"))
    result = {
        "benchmark": "cli_startup",
        "target_s": TARGET_S,
        "repeats": repeats,
        "commands": {name: {"median_s": statistics.median(t), "runs_s": t} for name, t in times.items()},
        **report.machine_meta(load_before),
    }

    def plot(path: Path) -> None:
        with report.figure(path, figsize=(6, 3)) as (_, ax):
            names = list(times)
            ax.boxplot([times[n] for n in names], orientation="horizontal", tick_labels=[f"mpflow {n}" for n in names])
            ax.axvline(TARGET_S, color="#dc2626", linestyle="--", label=f"target {TARGET_S} s")
            ax.set_xlabel("wall time of a fresh process (s)")
            ax.legend(loc="lower right")
            ax.figure.tight_layout()

    report.write_outputs(result, report.out_stem(args, "cli_startup"), plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Fixed-lag smoothing against an independent numpy RTS: ``python -m benchmarks.smoothing [--quick] [--seeds S]``.

The data and reference of ``tests/unit/test_smoothing.py`` (:mod:`tests.harness.rts`): a 2-D ``lds`` of which one
coordinate is observed with R = 4, T = 30 steps, lag L = 10; the reference is a plain-numpy Kalman filter and RTS
smoother. Per method and particle count N, S single runs (seeds 0 … S−1), each scored by

* ``mean err``: max over the window's 10 steps and 2 coordinates of |smoothed mean − RTS mean| / RTS sd;
* ``filter err``: the same for the newest step alone — the filter's own error, which the smoother inherits;
* ``sd err``: max |smoothed sd / RTS sd − 1|;

and, as the floor of any N-particle smoother, ``exact draws`` — N independent draws of the exact smoothed window
(backward sampling from the numpy Kalman filter) scored the same way — reported as the max and the mean over the
seeds (a single stream is what a user holds: the max is the figure that
decides a default), and the seconds of one run (its T steps and one ``smoothed``). ``kalman`` is exact (1e-6 sd is
the test's bound); ``enkf`` (ensemble RTS) and ``smc`` (FFBSm) are Monte Carlo: their error falls as N^{−1/2}, and
even i.i.d. draws from the exact smoothed marginals at N = 256 miss their mean by sd/16 = 0.0625 sd *on average*, so
the max over a window of 20 numbers is above 0.1 sd for most single runs. The count that brings every run within
0.1 sd is the default N of a smoothing stream of that method (``Updater.smoothing_particles``; docs/methods.md).

``smc`` smooths by FFBSm up to N = 512 and by backward simulation (FFBSi by rejection) above;
``smc FFBSm`` forces FFBSm at the larger N, for the comparison at equal N in one run.

Then the time of one ``smoothed`` (the work of one ``GET .../smoothed``) of an ``smc`` stream after L + 5 steps —
N = 4096 at L = 10 and 100, and N = 512 and 2048 at L = 100 — by FFBSm (O(N² L)) and by FFBSi (O(N L)) on the same
state, in one run: wall and CPU seconds (one thread), FFBSi as it runs and in its worst case (every rejection
proposal refused: all its fall-backs, what its price covers), and each one's price in the cost model's flops
(``smooth_flops``). ``--quick``: L = 10 only; ``--reads``: the reads at L = 100, N = 256, 512 and 2048 alone,
medians of ``--repeats`` 3 (``benchmarks/results/smoothing_reads.json``).

Output: the tables on stdout, ``benchmarks/results/smoothing.{json,png}`` (``smoothing-quick.*`` with ``--quick``:
4 seeds, a shorter ladder).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from mpflow.operators.models import make_model
from mpflow.operators.models.priors import prior_from_spec
from mpflow.operators.smoothing import particles
from mpflow.operators.updaters import get_updater

from benchmarks import report
from benchmarks.smoothing_price import rejecting_every_proposal, seconds
from tests.harness.rts import LAG, PARAMS, PRIOR, data, exact_draws, numpy_rts

NAME = "smoothing"
#: ``exact draws``: N independent draws of the exact smoothed window (:func:`tests.harness.rts.exact_draws`), their
#: sample means and covariances — the floor of any N-particle smoother's Monte Carlo error
EXACT = "exact draws"
LADDERS = {
    "kalman": (256,),
    EXACT: (256, 512, 1024, 2048, 4096),
    "enkf": (256, 512, 1024, 2048, 4096),
    "smc": (256, 512, 1024, 2048, 4096),
    "smc FFBSm": (1024, 2048, 4096),
}
QUICK_LADDERS = {"kalman": (256,), EXACT: (256,), "enkf": (256, 2048), "smc": (256, 1024)}
#: FFBSm forced above its limit: the comparison's method name
FORCED = "smc FFBSm"
#: the (lag, particle count) of each read timed: the default N of a smoothing ``smc`` stream, and both sides of the
#: long lag's range (FFBSm's limit, and the N whose FFBSm read the issue measured at seconds)
READS = ((10, 4096), (100, 512), (100, 2048), (100, 4096))
#: ``--reads``: the reads at L = 100 alone, and at N = 256, where FFBSm's N² and FFBSi's N cross
SHORT_READS = ((100, 256), (100, 512), (100, 2048))
TOLERANCE = 0.1


def smoothed_run(method: str, n: int, seed: int, ys: list) -> tuple[Any, float]:
    """(the smoothed marginals of one stream after ``ys``, the seconds of its steps and its ``smoothed``)."""
    if method == EXACT:
        t0 = time.perf_counter()
        draws = exact_draws(ys, LAG, n, np.random.default_rng(seed))  # [n, L, d]
        centred = draws - draws.mean(0)
        covs = np.einsum("nli,nlj->lij", centred, centred) / n
        return SimpleNamespace(means=torch.tensor(draws.mean(0)), covs=torch.tensor(covs)), time.perf_counter() - t0
    t0 = time.perf_counter()
    updater, state = filtered("smc" if method == FORCED else method, n, seed, ys, LAG)
    with smoother(True if method == FORCED else None):
        out = updater.smoothed(state)
    return out, time.perf_counter() - t0


def filtered(method: str, n: int, seed: int, ys: list, lag: int) -> tuple[Any, Any]:
    """(updater, the state of a stream with a window of ``lag`` steps after ``ys``)."""
    model = make_model("lds", PARAMS, 2)
    updater = get_updater(method)
    state = updater.init(prior_from_spec(PRIOR), model, n, seed, smoothing_lag=lag)
    for y in ys:
        state, _ = updater.update(state, torch.tensor([y], dtype=torch.float32), model)
    return updater, state


@contextlib.contextmanager
def smoother(ffbsm: bool | None) -> Iterator[None]:
    """``smc``'s smoothing while the block runs: by FFBSm at every N (``ffbsm`` True), by FFBSi at every N (False),
    else (None) as shipped."""
    limit = particles.FFBSM_MAX_PARTICLES
    particles.FFBSM_MAX_PARTICLES = limit if ffbsm is None else (1 << 62 if ffbsm else 0)
    try:
        yield
    finally:
        particles.FFBSM_MAX_PARTICLES = limit


def read_times(reads: tuple[tuple[int, int], ...], repeats: int = 1) -> list[dict[str, Any]]:
    """One ``smoothed`` of an ``smc`` stream per (L, N) of ``reads`` by FFBSm, and by FFBSi as it runs and in its
    worst case, on the same state: seconds (medians of ``repeats``) and prices (module docstring)."""
    model = make_model("lds", PARAMS, 2)
    rows = []
    for lag, n in reads:
        updater, state = filtered("smc", n, 0, data(lag + 5), lag)
        row: dict[str, Any] = {"lag": lag, "N": n}
        for name, ffbsm, worst in (("ffbsm", True, False), ("ffbsi", False, False), ("ffbsi_worst", False, True)):
            with smoother(ffbsm), rejecting_every_proposal() if worst else contextlib.nullcontext():
                took = seconds(lambda u=updater, s=state: u.smoothed(s), repeats)
                row[name], row[name + "_cpu"] = took.wall, took.cpu
                row[name + "_priced"] = updater.smoother.smooth_flops(model, lag, n)
        rows.append(row)
        print(
            f"read L={lag} N={n}: FFBSm {row['ffbsm']:.2f} s, FFBSi {row['ffbsi']:.3f} s "
            f"(worst case {row['ffbsi_worst']:.3f} s)",
            flush=True,
        )
    return rows


def read_table(rows: list[dict[str, Any]]) -> str:
    cells = [
        (
            r["lag"],
            r["N"],
            f"{r['ffbsm']:.2f}",
            f"{r['ffbsi']:.3f}",
            f"{r['ffbsi_worst']:.3f}",
            f"{r['ffbsm'] / r['ffbsi']:.1f}",
            f"{r['ffbsm_priced']:.3g}",
            f"{r['ffbsi_priced']:.3g}",
        )
        for r in rows
    ]
    header = ("lag L", "N", "FFBSm s", "FFBSi s", "FFBSi worst s", "FFBSm / FFBSi", "FFBSm priced", "FFBSi priced")
    return report.markdown_table(header, cells, "rrrrrrrr")


def scores(out: Any, means: np.ndarray, covs: np.ndarray) -> dict[str, float]:
    """One run's ``mean err``, ``filter err`` and ``sd err`` (module docstring)."""
    sd = np.sqrt(np.diagonal(covs, axis1=1, axis2=2))
    err = np.abs((out.means.numpy() - means) / sd)
    got_sd = np.sqrt(np.diagonal(out.covs.numpy(), axis1=1, axis2=2))
    return {
        "mean_err": float(err.max()),
        "filter_err": float(err[-1].max()),
        "sd_err": float(np.abs(got_sd / sd - 1).max()),
    }


def measure(ladders: dict[str, tuple[int, ...]], seeds: int) -> list[dict[str, Any]]:
    ys = data()
    _, means, covs = numpy_rts(ys, LAG)
    rows = []
    for method, ns in ladders.items():
        for n in ns:
            runs, seconds = [], []
            for seed in range(seeds):
                out, s = smoothed_run(method, n, seed, ys)
                runs.append(scores(out, means, covs))
                seconds.append(s)
            row = {"method": method, "N": n, "seconds": float(np.median(seconds)), "runs": runs}
            for key in ("mean_err", "filter_err", "sd_err"):
                values = [r[key] for r in runs]
                row[key] = {"max": float(max(values)), "mean": float(np.mean(values))}
            rows.append(row)
            print(f"{method} N={n}: mean err max {row['mean_err']['max']:.3f}", flush=True)
    return rows


def table(rows: list[dict[str, Any]], seeds: int) -> str:
    cells = [
        (
            r["method"],
            r["N"],
            f"{r['mean_err']['max']:.3f}",
            f"{r['mean_err']['mean']:.3f}",
            f"{r['filter_err']['max']:.3f}",
            f"{r['sd_err']['max']:.3f}",
            f"{r['seconds']:.2f}",
        )
        for r in rows
    ]
    header = (
        "method",
        "N",
        f"mean err/sd, max of {seeds}",
        "mean of runs",
        "filter err/sd, max",
        "sd err, max",
        "s per run",
    )
    return report.markdown_table(header, cells, "lrrrrrr")


def plot(rows: list[dict[str, Any]]):
    def draw(path):
        with report.figure(path, figsize=(6.0, 4.0), layout="constrained") as (_, ax):
            for method in sorted({r["method"] for r in rows} - {"kalman"}):  # exact draws: the floor
                mine = [r for r in rows if r["method"] == method]
                ns = [r["N"] for r in mine]
                (line,) = ax.loglog(ns, [r["mean_err"]["max"] for r in mine], "o-", label=f"{method}: max of runs")
                ax.loglog(ns, [r["mean_err"]["mean"] for r in mine], "o--", color=line.get_color(), label="mean")
            ax.axhline(TOLERANCE, color="k", lw=0.8, ls=":")
            ns = sorted({r["N"] for r in rows})
            ax.set_xticks(ns, [str(n) for n in ns], minor=False)
            ax.set_xticks([], minor=True)
            ax.set_xlabel("particles N")
            ax.set_ylabel("max |smoothed mean − RTS| / sd")
            ax.set_title(f"lag {LAG} smoothed means against the numpy RTS")
            ax.legend(fontsize=7)

    return draw


def main(argv: list[str] | None = None) -> None:
    p = report.parser(NAME, __doc__, "4 seeds, a shorter ladder")
    p.add_argument("--seeds", type=int, default=None, help="single runs per method and N (default 8)")
    p.add_argument("--reads", action="store_true", help="only the reads at L = 100, N = 256, 512 and 2048")
    p.add_argument("--repeats", type=int, default=None, help="timings per read, their median (default 1; --reads 3)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    seeds = args.seeds or (4 if args.quick else 8)
    load = os.getloadavg()
    if args.reads:
        reads = read_times(SHORT_READS, args.repeats or 3)
        print()
        print(read_table(reads))
        result = {"benchmark": NAME + "_reads", "reads": reads, "meta": report.machine_meta(load)}
        report.write_outputs(result, report.out_stem(args, NAME + "_reads"))
        return
    rows = measure(QUICK_LADDERS if args.quick else LADDERS, seeds)
    reads = read_times(READS[:1] if args.quick else READS, args.repeats or 1)
    print()
    print(table(rows, seeds))
    print()
    print(read_table(reads))
    result = {"benchmark": NAME, "seeds": seeds, "lag": LAG, "tolerance": TOLERANCE, "rows": rows, "reads": reads}
    result["meta"] = report.machine_meta(load)
    report.write_outputs(result, report.out_stem(args, NAME), plot(rows))


if __name__ == "__main__":
    main()

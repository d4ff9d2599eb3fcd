"""Engine benchmark: speed and accuracy of every updater against the exact Kalman posterior.

``python -m benchmarks.engine [--quick] [--out STEM] [--families F,…] [--methods M,…] [--dims D,…]
[--particles N,…] [--steps T] [--seeds S] [--jobs J] [--no-progress]``

For each family with an exact reference (the linear-Gaussian ones: {linear_gaussian, lds}), method ∈
{kalman, smc, gpf, svgd}, state dimension d and particle count N, S held-out sequences of T steps are simulated
(seed s: the ``benchmark_params`` of the family's task distribution, :mod:`mpflow.training.task_distribution`,
and :meth:`ModelFamily.simulate` with a generator seeded from ``DATA_SEED_BASE + s``; the truth x_0 ~ N(0, I), the
prior of every method):

* ``linear_gaussian``: o_t ~ N(H x, R), x static, H = I, R = 3I (the family's defaults; MPF §5.1);
* ``lds``: x_t = A x_{t−1} + N(0, Q), o_t = B x_t + N(0, R) with Q = R = I and, per seed,
  A = 0.9·U (U a Haar-random orthogonal matrix: every singular value 0.9, a stable rotation) and B with
  N(0, 1) entries (MPF §5 LDS).

The exact filtering posteriors N(μ_t, Σ_t) and log p(o_t | o_<t) come from
:func:`mpflow.operators.references.kalman_filter` (float64). Each method runs one stream (B = 1) through
:func:`mpflow.operators.filtering.run_filter`: ``state = updater.init(prior, model, N, seed)`` and
``state, info = updater.update(state, obs[:, t], model)``;
after every step its posterior is read from the particles, m_q, C_q = moments(particles, log_weights)
(float64, :func:`mpflow.operators.gaussian.moments`; for ``kalman`` the particles are N iid draws of the exact
posterior, so its row is the Monte-Carlo floor of N particles), and compared with the exact one:

* **ms/update**: median wall time of ``updater.update`` (one stream, ``torch.set_num_threads(1)``) over
  all steps and seeds; also as a ratio to ``smc``'s median in the same (family, d, N);
* **mean err**: sqrt(mean_d ((m_q,d − μ_t,d) / σ_t,d)²) (:func:`mpflow.operators.accuracy.mean_error_sd`),
  averaged over steps and seeds;
* **var ratio**: mean_d C_q,dd / Σ_t,dd (:func:`mpflow.operators.accuracy.variance_ratio`), averaged over steps and
  seeds, and at the last step (averaged over seeds);
* **logZ err**: |log Ẑ_T − Σ_t log p(o_t | o_<t)| at the last step (``state.log_evidence``), mean over
  seeds; and the mean per-step increment error |log Ẑ_t/Ẑ_{t−1} − log p(o_t | o_<t)|.

Results (:mod:`benchmarks.report`): a markdown table on stdout, ``<out>.json`` (rows + metadata) and
``<out>.png``; ``--out`` defaults to ``benchmarks/results/engine`` (``engine-quick`` with ``--quick``, git-ignored:
a quick run never overwrites the tracked results). Accuracy numbers are deterministic given the seeds; timings are
not.
"""

from __future__ import annotations

import datetime as dt
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from mpflow.operators.filtering import ExactPosterior, run_filter
from mpflow.operators.models import FAMILIES as ALL_FAMILIES
from mpflow.operators.models import ModelFamily, make_model
from mpflow.operators.models import family as family_class
from mpflow.operators.models.lds import EXAMPLE_A_SCALE
from mpflow.operators.models.priors import Prior, prior_from_spec
from mpflow.operators.rng import generator
from mpflow.operators.updaters import NonFiniteError, get_updater
from mpflow.training.task_distribution import task_distribution

from benchmarks import report

#: the families with an exact (Kalman) reference
FAMILIES = tuple(name for name, cls in ALL_FAMILIES.items() if cls.linear_gaussian)
METHODS = ("kalman", "smc", "gpf", "svgd")
FULL = {"dims": (2, 5, 10), "particles": (256, 1024), "steps": 100, "seeds": 5}
QUICK = {"dims": (2,), "particles": (256,), "steps": 20, "seeds": 2}
#: data (model parameters, truth, observations) of seed s are drawn from generator(DATA_SEED_BASE + s),
#: the updater of seed s from generator(s): the two never share a random stream
DATA_SEED_BASE = 1_000_003
LDS_A_SCALE = EXAMPLE_A_SCALE  # kept for older callers: the lds family's benchmark_params use it
NAME = "engine"
RESULTS = report.RESULTS  # kept for older callers
TIMING_NOTE = "median wall time of updater.update for one stream (B = 1), torch.set_num_threads(1)"
#: the numbers each row carries
METRIC_KEYS = (
    "ms_median",
    "ms_ratio_to_smc",
    "mean_err_sd",
    "var_ratio_avg",
    "var_ratio_last",
    "logz_err_last",
    "logz_inc_err_mean",
)
ROW_KEYS = ("family", "method", "d", "N", *METRIC_KEYS, "error")


# ----------------------------------------------------------------------------------------------------------
# problems


@dataclass
class Problem:
    """One held-out sequence with its exact filtering posterior (float64)."""

    model: ModelFamily
    prior: Prior
    obs: torch.Tensor  # [1, T, k]
    means: torch.Tensor  # [1, T, d]
    covs: torch.Tensor  # [1, T, d, d]
    logz: torch.Tensor  # [1, T]  log p(o_t | o_<t)

    @property
    def reference(self) -> ExactPosterior:
        return ExactPosterior(self.means, self.covs, self.logz)


def lds_params(d: int, gen: torch.Generator) -> dict[str, Any]:
    """The lds family's benchmark parameters (its task distribution's ``benchmark_params``; kept for older callers)."""
    return task_distribution("lds").benchmark_params(d, gen)


def make_problem(family: str, d: int, T: int, seed: int) -> Problem:
    """Simulate seed ``seed``'s sequence of T observations and filter it exactly."""
    gen = generator(DATA_SEED_BASE + seed)
    model = make_model(family, task_distribution(family).benchmark_params(d, gen), d)
    prior = prior_from_spec({"type": "gaussian", "mean": [0.0] * d, "cov": torch.eye(d).tolist()}, d)
    x0 = prior.sample(1, [gen])[:, 0]  # the truth's initial state ~ the prior
    _, obs = model.simulate(T, x0, [gen])
    mean0, cov0 = prior.moments()
    exact = ExactPosterior.kalman(mean0, cov0, model, obs)
    return Problem(model, prior, obs, exact.means, exact.covs, exact.log_z)


# ----------------------------------------------------------------------------------------------------------
# one configuration


@dataclass
class Trace:
    """Per-step measurements of one run (one seed)."""

    ms: list[float]
    mean_err: list[float]
    var_ratio: list[float]
    inc_err: list[float]
    logz_err_last: float


def run_one(method: str, N: int, problem: Problem, seed: int) -> Trace:
    """Filter ``problem`` with ``method`` and N particles, timing each update and scoring it
    (:func:`mpflow.operators.filtering.run_filter`)."""
    run = run_filter(get_updater(method), problem.model, problem.prior, problem.obs, N, seed, problem.reference)
    return Trace(
        run.ms,
        run.values["mean_error_sd"][:, 0].tolist(),
        run.values["var_ratio"][:, 0].tolist(),
        run.values["logz_increment_error"][:, 0].tolist(),
        abs(float(run.log_evidence_error[0])),
    )


def _mean(xs: Sequence[float]) -> float:
    return float(statistics.fmean(xs))


def summarize(family: str, method: str, d: int, N: int, traces: list[Trace]) -> dict[str, Any]:
    """One table row: timings pooled over steps and seeds, accuracy averaged over steps and seeds."""
    return {
        "family": family,
        "method": method,
        "d": d,
        "N": N,
        "ms_median": statistics.median([m for tr in traces for m in tr.ms]),
        "ms_ratio_to_smc": None,  # filled in by add_smc_ratios
        "mean_err_sd": _mean([e for tr in traces for e in tr.mean_err]),
        "var_ratio_avg": _mean([v for tr in traces for v in tr.var_ratio]),
        "var_ratio_last": _mean([tr.var_ratio[-1] for tr in traces]),
        "logz_err_last": _mean([tr.logz_err_last for tr in traces]),
        "logz_inc_err_mean": _mean([e for tr in traces for e in tr.inc_err]),
        "error": None,
    }


def failed_row(family: str, method: str, d: int, N: int, exc: Exception) -> dict[str, Any]:
    row = dict.fromkeys(ROW_KEYS)
    row.update(family=family, method=method, d=d, N=N, error=f"{type(exc).__name__}: {exc}")
    return row


def add_smc_ratios(rows: list[dict[str, Any]]) -> None:
    """ms_ratio_to_smc = a row's median ms / smc's median ms in the same (family, d, N)."""
    smc = {(r["family"], r["d"], r["N"]): r["ms_median"] for r in rows if r["method"] == "smc"}
    for r in rows:
        ref = smc.get((r["family"], r["d"], r["N"]))
        if ref and r["ms_median"] is not None:
            r["ms_ratio_to_smc"] = r["ms_median"] / ref


# ----------------------------------------------------------------------------------------------------------
# the whole benchmark


def run_config(family: str, d: int, N: int, method: str, problems: list[Problem]) -> dict[str, Any]:
    """One table row: ``method`` with N particles on every seed's problem."""
    try:
        traces = [run_one(method, N, p, s) for s, p in enumerate(problems)]
    except NonFiniteError as exc:
        return failed_row(family, method, d, N, exc)
    return summarize(family, method, d, N, traces)


def run_config_fresh(family: str, d: int, N: int, method: str, steps: int, seeds: int) -> dict[str, Any]:
    """``run_config`` in a worker process: the problems are rebuilt there (deterministic from the seeds)."""
    return run_config(family, d, N, method, [make_problem(family, d, steps, s) for s in range(seeds)])


@contextmanager
def single_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def run_benchmark(
    families: Sequence[str] = FAMILIES,
    methods: Sequence[str] = METHODS,
    dims: Sequence[int] = FULL["dims"],
    particles: Sequence[int] = FULL["particles"],
    steps: int = FULL["steps"],
    seeds: int = FULL["seeds"],
    out: str | Path | None = RESULTS / NAME,
    progress: bool = True,
    jobs: int = 1,
) -> dict[str, Any]:
    """Run every (family, method, d, N) configuration; return ``{"meta": ..., "rows": [...]}`` and, when
    ``out`` is given, write ``<out>.json`` and ``<out>.png`` (:func:`write`). ``jobs`` > 1 runs configurations in
    that many single-threaded worker processes (use at most one per core, or the timings measure contention)."""
    from tqdm import tqdm

    for name in methods:  # fail on a misspelt name before any work is done
        get_updater(name)
    for name in families:
        family_class(name)
    if steps < 1 or seeds < 1 or min(dims, default=0) < 1 or min(particles, default=0) < 2:
        raise ValueError("steps: steps, seeds and dims must be ≥ 1 and particles ≥ 2")
    configs = [(f, d, N, m) for f in families for d in dims for N in particles for m in methods]
    wall = time.perf_counter()
    bar = tqdm(total=len(configs), desc="engine", unit="config", file=sys.stderr, disable=not progress)
    if jobs <= 1:
        with single_thread():
            problems: dict[tuple[str, int], list[Problem]] = {}
            by_config = {}
            for family, d, N, method in configs:
                bar.set_postfix_str(f"{family} {method} d={d} N={N}")
                if (family, d) not in problems:
                    problems[family, d] = [make_problem(family, d, steps, s) for s in range(seeds)]
                by_config[family, d, N, method] = run_config(family, d, N, method, problems[family, d])
                bar.update()
    else:
        # one single-threaded worker per core; the slowest configurations (large N, svgd/gpf) start first
        heavy_first = sorted(
            configs, key=lambda c: (-c[2], c[3] not in ("svgd", "gpf", "nvgd"), not family_class(c[0]).dynamic)
        )
        with ProcessPoolExecutor(max_workers=jobs, initializer=torch.set_num_threads, initargs=(1,)) as pool:
            futures = {pool.submit(run_config_fresh, *c, steps, seeds): c for c in heavy_first}
            by_config = {}
            for fut in as_completed(futures):
                by_config[futures[fut]] = fut.result()
                bar.update()
    bar.close()
    rows = [by_config[c] for c in configs]
    add_smc_ratios(rows)
    result = {
        "meta": {
            **metadata(families, methods, dims, particles, steps, seeds, time.perf_counter() - wall),
            "jobs": jobs,
        },
        "rows": rows,
    }
    if out is not None:
        write(result, Path(out))
    return result


def write(result: dict[str, Any], stem: Path) -> list[Path]:
    """``<stem>.json`` and ``<stem>.png`` (:func:`benchmarks.report.write_outputs`; a ``.json`` or ``.png`` suffix
    of ``stem`` is dropped)."""
    stem = stem.with_suffix("") if stem.suffix in (".json", ".png") else stem
    return report.write_outputs(result, stem, lambda path: plot(result["rows"], path, result["meta"]))


def metadata(families, methods, dims, particles, steps, seeds, wall_s: float) -> dict[str, Any]:
    return {
        "benchmark": NAME,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine_cores": os.cpu_count(),
        "threads": 1,
        "timing": TIMING_NOTE,
        "T": steps,
        "S": seeds,
        "families": list(families),
        "methods": list(methods),
        "dims": list(dims),
        "particles": list(particles),
        "data_seeds": [DATA_SEED_BASE + s for s in range(seeds)],
        "updater_seeds": list(range(seeds)),
        "prior": "N(0, I)",
        "models": {name: task_distribution(name).benchmark_model for name in families},
        "posterior": "particle moments (float64, log_weights) vs kalman_filter (float64)",
        "wall_s": round(wall_s, 2),
    }


# ----------------------------------------------------------------------------------------------------------
# reporting


def _fmt(x: float | None, spec: str) -> str:
    return "—" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


COLUMNS = (
    "family",
    "method",
    "d",
    "N",
    "ms/update (median)",
    "× smc",
    "mean err (sd units)",
    "var ratio avg / last",
    "logZ err (last)",
    "logZ inc err (mean)",
)


def row_cells(r: dict[str, Any]) -> list[Any]:
    """One table row's cells; a failed configuration says why in its first metric column."""
    key = [r["family"], r["method"], r["d"], r["N"]]
    if r["error"] is not None:
        return [*key, f"failed: {r['error']}"] + [""] * (len(COLUMNS) - len(key) - 1)
    return [
        *key,
        _fmt(r["ms_median"], ".2f"),
        _fmt(r["ms_ratio_to_smc"], ".1f"),
        _fmt(r["mean_err_sd"], ".3g"),
        f"{_fmt(r['var_ratio_avg'], '.3f')} / {_fmt(r['var_ratio_last'], '.3f')}",
        _fmt(r["logz_err_last"], ".3g"),
        _fmt(r["logz_inc_err_mean"], ".3g"),
    ]


def format_table(rows: list[dict[str, Any]]) -> str:
    return report.markdown_table(COLUMNS, map(row_cells, rows))


def ratio_summary(rows: list[dict[str, Any]]) -> str:
    """Geometric mean over configurations of each method's median ms / smc's median ms."""
    parts = []
    for method in dict.fromkeys(r["method"] for r in rows):
        ratios = [r["ms_ratio_to_smc"] for r in rows if r["method"] == method and r["ms_ratio_to_smc"]]
        if ratios:
            geo = math.exp(statistics.fmean(math.log(x) for x in ratios))
            parts.append(f"{method} {geo:.2f}× (range {min(ratios):.2f}–{max(ratios):.2f}×)")
    return "ms/update ÷ smc's in the same config (geometric mean over configs): " + ", ".join(parts)


def plot(rows: list[dict[str, Any]], path: Path, meta: dict[str, Any]) -> None:
    """Mean error, variance ratio and ms/update against d: one column per N, colour = method,
    line style = family (PNG, :func:`benchmarks.report.figure`)."""
    ok = [r for r in rows if r["error"] is None]
    Ns = sorted({r["N"] for r in ok}) or [0]
    panels = (
        ("mean_err_sd", "mean err (posterior sd)", True),
        ("var_ratio_avg", "var_q / var_p (avg)", False),
        ("ms_median", "ms / update (median)", True),
    )
    size = (max(6.0, 4.5 * len(Ns)), 3.2 * len(panels))
    with report.figure(path, len(panels), len(Ns), figsize=size, squeeze=False) as (fig, axes):
        colors = {m: f"C{i}" for i, m in enumerate(dict.fromkeys(r["method"] for r in ok))}
        families = dict.fromkeys(r["family"] for r in ok)
        styles = dict(zip(families, (("-", "o"), ("--", "s"), (":", "^"), ("-.", "D")), strict=False))
        dims = sorted({r["d"] for r in ok})
        for j, N in enumerate(Ns):
            for i, (key, label, log) in enumerate(panels):
                ax = axes[i][j]
                for method, color in colors.items():
                    for family, (style, marker) in styles.items():
                        pts = sorted(
                            (r["d"], r[key])
                            for r in ok
                            if r["N"] == N and r["method"] == method and r["family"] == family
                        )
                        if pts:
                            ax.plot(
                                *zip(*pts, strict=True),
                                style,
                                color=color,
                                marker=marker,
                                mfc="none" if marker != "o" else color,
                                label=f"{method} / {family}",
                            )
                if key == "var_ratio_avg":
                    ax.axhline(1.0, color="0.6", lw=0.8)
                if log:
                    ax.set_yscale("log")
                ax.set_xticks(dims)
                ax.set_xlabel("d")
                ax.set_ylabel(label)
                ax.set_title(f"N = {N}")
        if ok:
            axes[0][0].legend(fontsize=7)
        fig.suptitle(
            f"engine benchmark: T = {meta['T']} steps, S = {meta['S']} seeds\n"
            "timings: one stream (B = 1), torch.set_num_threads(1)",
            fontsize=10,
        )
        fig.tight_layout()


# ----------------------------------------------------------------------------------------------------------
# command line


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _names(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


def main(argv: Sequence[str] | None = None) -> int:
    p = report.parser(NAME, __doc__, "d = 2, N = 256, T = 20, S = 2 (under a minute)")
    p.add_argument("--families", type=_names, help=f"comma-separated (default {','.join(FAMILIES)})")
    p.add_argument("--methods", type=_names, help=f"comma-separated (default {','.join(METHODS)})")
    p.add_argument("--dims", type=_ints, help="comma-separated state dimensions (default 2,5,10)")
    p.add_argument("--particles", type=_ints, help="comma-separated particle counts (default 256,1024)")
    p.add_argument("--steps", type=int, help="T, steps per sequence (default 100)")
    p.add_argument("--seeds", type=int, help="S, sequences (seeds 0..S−1; default 5)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--jobs", type=int, default=1, help="worker processes, one thread each (≤ cores; default 1)")
    a = p.parse_args(argv)
    base = QUICK if a.quick else FULL
    stem = report.out_stem(a, NAME)
    result = run_benchmark(
        families=a.families or FAMILIES,
        methods=a.methods or METHODS,
        dims=a.dims or base["dims"],
        particles=a.particles or base["particles"],
        steps=a.steps or base["steps"],
        seeds=a.seeds or base["seeds"],
        out=None,
        progress=not a.no_progress,
        jobs=a.jobs,
    )
    meta = result["meta"]
    print(
        f"# engine benchmark — T = {meta['T']} steps, S = {meta['S']} seeds, torch {meta['torch']}, "
        f"{meta['machine_cores']} cores"
    )
    print(f"timing: {TIMING_NOTE}")
    print()
    print(format_table(result["rows"]))
    print()
    print(ratio_summary(result["rows"]))
    print(f"wall time {meta['wall_s']:.1f} s")
    write(result, stem)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""MPF serving latency: the compute of one Bayes step of one stream on one CPU thread, against ``smc`` in the
same run (issue 3: median ≤ 2 ms at N = 256 and ≤ 5 ms at N = 1024, d = 2).

``python -m benchmarks.mpf_latency [--quick] [--repeats R] [--families F,…] [--out STEM]``

For each family (those whose task distribution, :mod:`mpflow.training.task_distribution`, has
``latency_benchmark``: ``linear_gaussian``, ``lds``, ``gmm``, ``stochastic_volatility``; d = 2) and
N ∈ {256, 1024}: one stream (B = 1) is initialised from N(0, I) and fed R
simulated observations (truth x_0 ~ N(0, I); the model of the family's ``benchmark_params``, for ``lds`` a random
A, B as in ``benchmarks.engine``); every ``updater.update`` is timed with ``time.perf_counter`` (by
:class:`mpflow.operators.filtering.FilterRun`, without moments) under ``torch.set_num_threads(1)`` after W warm-up
updates. ``mpf`` uses the newest
shipped operator of the family (:func:`mpflow.operators.trained_operators.find_operator`), its solver settings (RK4,
one step) and no density tracking (as served); a family without a shipped operator runs the untrained base
flow and says so. The methods alternate update by update (mpf, smc, mpf, …), so a load spike on this shared
machine hits both alike; the table reports medians, 90th percentiles and the ratio of medians to ``smc``.
"flow_step ms" times the operator alone (:func:`mpflow.operators.mpf.step.flow_step` on the current cloud, under
``torch.inference_mode`` as served: whitening, likelihood linearisation, context, the RK4 integration), "mpf
update" the whole ``update`` (plus the predict step of dynamic families, the evidence estimate, finiteness checks
and the stream's generator state; the predict step hands its whitened cloud to the flow, which then skips its own).

Results (:mod:`benchmarks.report`): a markdown table on stdout, ``<out>.json`` and ``<out>.png``; ``--out``
defaults to ``benchmarks/results/mpf_latency`` (``mpf_latency-quick`` with ``--quick``, git-ignored: a quick run
never overwrites the tracked results).
"""

from __future__ import annotations

import datetime as dt
import platform
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from mpflow.operators.filtering import FilterRun
from mpflow.operators.models import FAMILIES as ALL_FAMILIES
from mpflow.operators.models import make_model
from mpflow.operators.models.priors import prior_from_spec
from mpflow.operators.mpf.step import flow_step
from mpflow.operators.rng import generator
from mpflow.operators.trained_operators import find_operator
from mpflow.operators.updaters import get_updater
from mpflow.training.task_distribution import task_distribution

from benchmarks import report
from benchmarks.engine import single_thread

NAME = "mpf_latency"
FAMILIES = tuple(name for name in ALL_FAMILIES if task_distribution(name).latency_benchmark)
PARTICLES = (256, 1024)
TARGET_MS = {256: 2.0, 1024: 5.0}


def _problem(family: str, d: int, steps: int, seed: int):
    gen = generator(10_000 + seed)
    model = make_model(family, task_distribution(family).benchmark_params(d, gen), d)
    prior = prior_from_spec({"type": "gaussian", "mean": [0.0] * d, "cov": torch.eye(d).tolist()}, d)
    _, obs = model.simulate(steps, prior.sample(1, [gen])[:, 0], [gen])
    return model, prior, obs


def measure(family: str, N: int, repeats: int, warmup: int, d: int = 2) -> dict[str, Any]:
    """Interleaved timings of ``mpf`` and ``smc`` on one stream → a result row."""
    record = find_operator(family, d)
    mpf = get_updater("mpf", operator=str(record.path)) if record is not None else get_updater("mpf")
    updaters = {"mpf": mpf, "smc": get_updater("smc")}
    model, prior, obs = _problem(family, d, repeats + warmup, seed=N)
    runs = {name: FilterRun(u, model, prior, obs, N, seed=0, moments=False) for name, u in updaters.items()}
    for run in runs.values():
        run.start()
    flow: list[float] = []
    net, opts = mpf.network(d, model), mpf.options  # the flow a step of this model runs
    residual = net is not mpf.base_flow(d)
    with single_thread(), torch.no_grad():
        for t in range(repeats + warmup):
            # the operator alone: one flow_step (linearise, context, RK4) on the current cloud
            x = runs["mpf"].state.particles
            t0 = time.perf_counter()
            with torch.inference_mode():  # as the updater runs it (MPFUpdater.autograd_free)
                flow_step(
                    net,
                    model,
                    obs[:, t],
                    x,
                    None,
                    method=opts["solver"],
                    steps=opts["steps"],
                    divergence="none",
                    residual=residual,
                )
            flow.append(1000 * (time.perf_counter() - t0))
            for run in runs.values():  # interleaved, update by update
                run.step()
    times = {**{name: run.ms[warmup:] for name, run in runs.items()}, "flow": flow[warmup:]}
    med = {k: statistics.median(v) for k, v in times.items()}
    p90 = {k: statistics.quantiles(v, n=10)[-1] for k, v in times.items()}
    return {
        "family": family,
        "d": d,
        "N": N,
        "operator": record.name if record is not None else "untrained base flow",
        "flow_ms_median": med["flow"],
        "mpf_ms_median": med["mpf"],
        "mpf_ms_p90": p90["mpf"],
        "smc_ms_median": med["smc"],
        "smc_ms_p90": p90["smc"],
        "ratio_mpf_to_smc": med["mpf"] / med["smc"],
        "target_ms": TARGET_MS.get(N),
        "meets_target": med["mpf"] <= TARGET_MS.get(N, float("inf")),
        "flow_meets_target": med["flow"] <= TARGET_MS.get(N, float("inf")),
    }


COLUMNS = (
    "family",
    "N",
    "operator",
    "flow_step ms",
    "mpf update ms (median / p90)",
    "smc ms (median / p90)",
    "mpf ÷ smc",
    "target",
    "met (update / flow)",
)


def row_cells(r: dict[str, Any]) -> list[Any]:
    met = f"{'yes' if r['meets_target'] else 'no'} / {'yes' if r['flow_meets_target'] else 'no'}"
    return [
        r["family"],
        r["N"],
        r["operator"],
        f"{r['flow_ms_median']:.2f}",
        f"{r['mpf_ms_median']:.2f} / {r['mpf_ms_p90']:.2f}",
        f"{r['smc_ms_median']:.2f} / {r['smc_ms_p90']:.2f}",
        f"{r['ratio_mpf_to_smc']:.1f}",
        f"≤ {r['target_ms']:.0f} ms",
        met,
    ]


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    return report.markdown_table(COLUMNS, map(row_cells, rows))


def plot(rows: Sequence[dict[str, Any]], path: Path) -> None:
    """Median ms of mpf and smc per family, one panel per N, against the target (PNG, :func:`report.figure`)."""
    with report.figure(path, 1, len(PARTICLES), figsize=(5 * len(PARTICLES), 3.6), sharey=True) as (fig, axes):
        for ax, N in zip(axes, PARTICLES, strict=True):
            sub = [r for r in rows if r["N"] == N]
            xs = range(len(sub))
            ax.bar([x - 0.2 for x in xs], [r["mpf_ms_median"] for r in sub], 0.4, label="mpf")
            ax.bar([x + 0.2 for x in xs], [r["smc_ms_median"] for r in sub], 0.4, label="smc")
            ax.axhline(TARGET_MS[N], color="k", ls="--", lw=1, label=f"target {TARGET_MS[N]:.0f} ms")
            ax.set_xticks(list(xs), [r["family"].replace("_", "\n") for r in sub], fontsize=8)
            ax.set_title(f"one update, d = 2, N = {N}, 1 thread")
            ax.set_ylabel("median ms")
        axes[0].legend()
        fig.tight_layout()


def main(argv: Sequence[str] | None = None) -> int:
    # the description: the docstring's first paragraph on one line
    parser = report.parser(NAME, " ".join(__doc__.split("\n\n")[0].split()), "30 timed updates instead of 300")
    parser.add_argument("--repeats", type=int, help="timed updates per configuration")
    parser.add_argument("--families", default=",".join(FAMILIES))
    args = parser.parse_args(argv)
    stem = report.out_stem(args, NAME)
    repeats = args.repeats or (30 if args.quick else 300)
    t0 = time.perf_counter()
    rows = [measure(f, N, repeats, warmup=10) for f in args.families.split(",") for N in PARTICLES]
    print(format_table(rows))
    meta = {
        "benchmark": NAME,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": 1,
        "repeats": repeats,
        "timing": "updater.update of one stream (B = 1), mpf and smc interleaved, after 10 warm-up updates",
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    report.write_outputs({"meta": meta, "rows": rows}, stem, lambda path: plot(rows, path))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Every method's price against its time: the cost model's floating-point operations of one update of one stream
(and of its forecast, and of its predictive p-values where they are work of their own) over the CPU seconds it
takes, against the same rate of the reference ``smc`` step (``lds`` d = 64, N = 16384, priced
:data:`benchmarks.smoothing_price.STEP_FLOPS`: :func:`benchmarks.smoothing_price.step_rate`).

The server refuses (413) a request priced above ``MPFLOW_MAX_REQUEST_FLOPS`` (:mod:`mpflow.service.streams.costs`);
a request is bounded in time only if its price is not far below its work. With r_ref the reference step's priced
flops per CPU second, a work item of price F taking t CPU seconds has the priced rate r = F / t, and

    ratio = r / r_ref = (F / r_ref) / t

is the time its price buys at the reference rate over the time it takes. A row is **underpriced** when its ratio is
below 1 / :data:`UNDERPRICED`: it takes more than 3 times the time its price buys, so the largest request of it the
budget accepts holds a worker more than 3 × as long as the largest reference request. A ratio above 1 is overpriced:
safe, the largest accepted request only smaller than it could be. The reference step is timed again just before
each row (its rate moved from 16 to 83 Gflop/s CPU within an hour on the shared cores of 2026-11-28, the
memory-bound rows' times by a few percent), and each row is read against its own.

Each row: a method with the options that change its work, on a representative family and d, at the largest N the
server's default limits accept for a stream (its creation and a one-step observation:
:func:`mpflow.service.streams.costs.largest`, the bisection the server's 413 quotes), or at a size named in the row
(where a term's share of the step is largest: the mixture evidence's M × K pairs at N = M = K = 1024). Priced as the
server prices it, and timed as the server works: the update's :func:`costs.observations_cost` of one step against
the update and its summary (:func:`mpflow.service.engine.summary.summary`, every step's answer); the forecast's
:func:`costs.forecast_cost` at the largest ``steps`` that fits (at most 1000) against the forecast and its answer
(:func:`mpflow.service.streams.forecasts.document`: moments, quantiles); the p-values' :meth:`Updater.pit_work`
against :meth:`Updater.pit`, for a method that predicts them apart (:meth:`Updater.predicts_once`; the others' are
in their update). Times: the median of ``--repeats`` CPU times (:func:`time.process_time`, one thread: the time
other jobs of the shared cores held it left out), at batch 1.

The iterative solvers' rows at N = 16 (``gpf``, ``svgd``, ``nvgd``; and with ``tol`` 0, the worst case their price
bounds) record the iterations each step ran (:attr:`Measured.ran`): their price is that of ``max_iters``, their time
that of the iterations run, and their constants per iteration are fitted against the price of those.

Then the fits (:data:`FITS`): each measured constant of the cost model from its row — the value at which the row's
price buys its CPU time, the rest of the price as it is — at the row's reference rate and at
:data:`NOMINAL_RATE`, the rate the constants are set at. ``--prices before`` runs the same with the prices as they
were before this audit (:data:`BEFORE`). Writes ``benchmarks/results/price_audit.json`` (``price_audit-before``)
and a bar chart of the ratios (log scale), ``price_audit.png``.

``--merge`` (with ``--only``) replaces the rows and fits it measured in the existing JSON and keeps the others.

    python -m benchmarks.price_audit [--repeats 3] [--only LABEL ...] [--prices before] [--merge]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import torch
from mpflow.operators import mixture_evidence
from mpflow.operators.models import make_model
from mpflow.operators.models.base import ModelFamily
from mpflow.operators.models.priors import GaussianMixture
from mpflow.operators.mpf import marginal
from mpflow.operators.rng import generator
from mpflow.operators.updaters import Updater, base, enkf, get_updater, gpf, kalman, nvgd, svgd
from mpflow.service.engine.lanes import PRICED_FLOPS_PER_SECOND
from mpflow.service.engine.summary import summary
from mpflow.service.settings import Settings
from mpflow.service.streams import costs
from mpflow.service.streams.forecasts import document

from benchmarks import report
from benchmarks.smoothing_price import STEP_N, STEP_REPEATS, Timing, seconds, step_rate

#: a row whose priced rate is below the reference step's by more than this factor is underpriced
UNDERPRICED = 3.0
#: the reference rate the constants are set at (flops per CPU second): the reference step's rate moves 16 to 83
#: Gflop/s (CPU) with the other jobs of the shared cores (2026-11-28), the memory-bound rows' times a few percent,
#: so a constant fitted against the step's rate of the moment moves with it; the cost model's constants are fitted
#: at this rate, the loaded side of that range (the step's median under the helpers' load)
NOMINAL_RATE = PRICED_FLOPS_PER_SECOND  # the engine's lanes convert prices to seconds at the same rate
#: the forecast's horizons: the largest that fits, at most this many
FORECAST_STEPS = 1000
#: ``smc2``'s learned parameter: R of a 1-D ``lds``, log R ~ N(0, 1)
LEARNED_R = {"prior": {"type": "lognormal", "mean": 0.0, "sd": 1.0}}


def eye(d: int, scale: float = 1.0) -> list[list[float]]:
    return [[scale * float(i == j) for j in range(d)] for i in range(d)]


def lds(d: int) -> dict[str, Any]:
    return {"A": eye(d, 0.9), "B": eye(d)}


@dataclass(frozen=True)
class Row:
    """One method's configuration: ``method`` with ``options`` on ``family`` (``params``) of dimension ``d``;
    ``n`` the particle count (None: the largest the default limits accept)."""

    label: str
    family: str
    params: dict[str, Any]
    d: int
    method: str
    options: dict[str, Any] = field(default_factory=dict)
    n: int | None = None
    forecast: bool = True


ROWS = (
    Row("smc lds d=64 N=16384 (the reference step)", "lds", lds(64), 64, "smc", {}, STEP_N),
    Row("smc lds d=64", "lds", lds(64), 64, "smc"),
    Row("smc lds d=1 qmc on", "lds", lds(1), 1, "smc", {"qmc": "auto"}),
    Row("smc lds d=1 qmc off", "lds", lds(1), 1, "smc", {"qmc": False}),
    Row("smc sv d=8 factorised", "stochastic_volatility", {}, 8, "smc"),
    Row("smc2 lds d=1 (R learned)", "lds", {**lds(1), "R": LEARNED_R}, 1, "smc2"),
    Row("mpf lds d=8", "lds", lds(8), 8, "mpf"),
    Row("mpf lds d=8 evidence mixture", "lds", lds(8), 8, "mpf", {"evidence": "mixture"}),
    Row("mpf lds d=8 evidence mixture N=1024", "lds", lds(8), 8, "mpf", {"evidence": "mixture"}, 1024, False),
    Row("mpf lds d=8 correct", "lds", lds(8), 8, "mpf", {"correct": True}),
    Row("mpf sv d=1 marginal", "stochastic_volatility", {}, 1, "mpf", {"marginal": True}),
    Row("mpf sv d=8 marginal", "stochastic_volatility", {}, 8, "mpf", {"marginal": True}),
    Row("mpf logistic d=8 moves window=16", "logistic", {}, 8, "mpf", {"window": 16}),
    Row("kalman lds d=128", "lds", lds(128), 128, "kalman"),
    Row("enkf lds d=64", "lds", lds(64), 64, "enkf"),
    Row("enkf lorenz96 d=40", "lorenz96", {}, 40, "enkf"),
    Row("enkf lorenz96 d=40 localisation=4", "lorenz96", {}, 40, "enkf", {"localisation": 4.0}),
    Row("ienkf lorenz96 d=40", "lorenz96", {}, 40, "ienkf"),
    Row("ukf lorenz96 d=40", "lorenz96", {}, 40, "ukf"),
    Row("gpf lds d=8", "lds", lds(8), 8, "gpf"),
    Row("svgd lds d=8", "lds", lds(8), 8, "svgd"),
    Row("nvgd lds d=8", "lds", lds(8), 8, "nvgd"),
    # small N, where an iterative solver's time is its iterations' fixed cost (Python, the tensor operations'
    # launches): the rows its constants are fitted from (:data:`FITS`, by the iterations each step ran)
    Row("gpf lds d=2 N=16", "lds", lds(2), 2, "gpf", {}, 16, False),
    Row("svgd lds d=2 N=16", "lds", lds(2), 2, "svgd", {}, 16, False),
    Row("nvgd lds d=2 N=16", "lds", lds(2), 2, "nvgd", {}, 16, False),
    # the worst case the price bounds, ``max_iters`` iterations (the solver never converges: tol 0; gpf's stall
    # test may still stop it), and nvgd's outer iterations with 2 Adam steps each (its ITERATION_FLOPS)
    Row("gpf lds d=2 N=16 tol=0", "lds", lds(2), 2, "gpf", {"tol": 0.0}, 16, False),
    Row("svgd lds d=2 N=16 tol=0", "lds", lds(2), 2, "svgd", {"tol": 0.0}, 16, False),
    Row("nvgd lds d=2 N=16 inner_steps=2 tol=0", "lds", lds(2), 2, "nvgd", {"inner_steps": 2, "tol": 0.0}, 16, False),
)


@dataclass
class Stream:
    """A row's stream as the service builds it: its model (in the method's dtype), updater, prior and N."""

    row: Row
    model: ModelFamily
    updater: Updater
    prior: GaussianMixture
    n: int
    #: observations simulated from the prior's mean [1, steps, *obs_shape], and the entries k of one
    ys: torch.Tensor
    k: int


def build(row: Row, settings: Settings, steps: int) -> Stream:
    """The row's stream with ``steps`` observations, at the largest N that its creation and a step fit."""
    updater = get_updater(row.method, **{**settings.method_options.get(row.method, {}), **row.options})
    model = make_model(row.family, row.params, row.d, updater.model_dtype)
    mean = torch.full((1, row.d), 8.0 if row.family == "lorenz96" else 0.0)
    prior = GaussianMixture.gaussian(mean, torch.eye(row.d)[None])
    updater.check_compatible(model, prior)
    _, ys = model.simulate(steps, prior.means[:, 0].to(updater.model_dtype), [generator(1)])
    k = int(ys[0, 0].numel())
    n = row.n or costs.largest(settings, settings.max_particles, lambda m: stream_cost(model, updater, prior, m, k))
    return Stream(row, model, updater, prior, n, ys, k)


def stream_cost(model: ModelFamily, updater: Updater, prior: GaussianMixture, n: int, k: int) -> costs.Cost:
    """The dearer of a stream's creation and a one-step observation of ``k`` entries (each must fit the budgets)."""
    each = [costs.creation_cost(model, updater, prior, n), costs.observations_cost(model, updater, n, [(1.0, k)], 0)]
    return costs.Cost(max(c.flops for c in each), max(c.bytes for c in each))


@dataclass(frozen=True)
class Measured:
    """One work item: its priced flops and its times (``steps``: a forecast's horizons; 1 otherwise)."""

    label: str
    work: str
    n: int
    size: str
    flops: float
    time: Timing
    stream: Stream | None = None
    steps: int = 1
    #: the reference step's priced flops per CPU second, measured just before this row's stream
    rate: float = 0.0
    #: an iterative solver's update: the mean over the repeats of its CPU seconds, of the solver loop's passes (the
    #: iterations it moved the particles in and the pass that found it converged, at most ``max_iters``) and of its
    #: inner steps (``nvgd``'s Adam steps; 0 for the others), and the price of those (:func:`ran_price`) — its
    #: price is that of ``max_iters``, an upper bound
    ran: tuple[float, float, float] | None = None
    ran_flops: float = 0.0


@dataclass(frozen=True)
class Fit:
    """A measured constant of the cost model: ``value()`` its value now, fitted from the row ``label``'s ``work``,
    of which it prices ``terms(m)`` terms."""

    name: str
    value: Callable[[], float]
    label: str
    work: str
    terms: Callable[[Measured], float]
    #: fitted from the iterations the solver ran: the row's mean CPU time against the price of those iterations
    #: (:attr:`Measured.ran`), not the median against the price of ``max_iters``
    ran: bool = False

    def fitted(self, m: Measured, rate: float | None = None) -> float:
        """The constant at which the row's price buys its CPU time at ``rate`` (None: its reference step's), the
        rest of its price as it is: (t · r − (F − terms · value)) / terms."""
        count = self.terms(m)
        t, flops = (m.ran[0], m.ran_flops) if self.ran else (m.time.cpu, m.flops)
        return (t * (rate or m.rate) - (flops - count * self.value())) / count


def _log2(n: int) -> float:
    return math.log2(max(n, 2))


FITS = (
    Fit("base.PARTICLE_STEP_FLOPS", lambda: base.PARTICLE_STEP_FLOPS, "smc lds d=1 qmc off", "update", lambda m: m.n),
    Fit(
        "base.QUANTILE_FLOPS",
        lambda: base.QUANTILE_FLOPS,
        "enkf lorenz96 d=40",
        "forecast",
        lambda m: m.steps * m.n * (m.stream.model.state_dim + m.stream.k) * _log2(m.n),
    ),
    Fit("base.CDF_FLOPS", lambda: base.CDF_FLOPS, "enkf lds d=64", "pit", lambda m: m.n * m.stream.k),
    Fit(
        "mixture_evidence.KERNEL_TERM_FLOPS (backward_simulation's)",
        lambda: mixture_evidence.KERNEL_TERM_FLOPS,
        "mpf lds d=8 evidence mixture N=1024",
        "update",
        lambda m: min(m.n, mixture_evidence.MAX_DRAWS) * min(m.n, mixture_evidence.MAX_COMPONENTS),
    ),
    Fit(
        "marginal.PAIR_FLOPS",
        lambda: marginal.PAIR_FLOPS,
        "mpf sv d=1 marginal",
        "update",
        lambda m: (2.0 + marginal.SHARE_PAIRS) * m.n**2,
    ),
    Fit(
        "enkf.LOCAL_ANALYSIS_FLOPS",
        lambda: enkf.LOCAL_ANALYSIS_FLOPS,
        "enkf lorenz96 d=40 localisation=4",
        "update",
        lambda m: m.n * m.stream.model.state_dim,
    ),
    Fit(
        "kalman.DRAW_FLOPS",
        lambda: kalman.DRAW_FLOPS,
        "kalman lds d=128",
        "pit",
        lambda m: m.n * m.stream.model.state_dim,
    ),
    Fit("base.HORIZON_FLOPS", lambda: base.HORIZON_FLOPS, "nvgd lds d=8", "forecast", lambda m: m.steps),
    Fit("gpf.ITERATION_FLOPS", lambda: gpf.ITERATION_FLOPS, "gpf lds d=2 N=16", "update", lambda m: m.ran[1], True),
    Fit("svgd.ITERATION_FLOPS", lambda: svgd.ITERATION_FLOPS, "svgd lds d=2 N=16", "update", lambda m: m.ran[1], True),
    Fit("nvgd.ADAM_STEP_FLOPS", lambda: nvgd.ADAM_STEP_FLOPS, "nvgd lds d=2 N=16", "update", lambda m: m.ran[2], True),
    Fit(
        "nvgd.ITERATION_FLOPS",
        lambda: nvgd.ITERATION_FLOPS,
        "nvgd lds d=2 N=16 inner_steps=2 tol=0",
        "update",
        lambda m: m.ran[1],
        True,
    ),
)


#: the prices before this audit (2026-11-28), for ``--prices before``: the constants it added at 0 and those it
#: raised at their earlier values (the mixture evidence's pairs were 2 d + 20: 36 at the rows' d = 8)
BEFORE = (
    (base, "PARTICLE_STEP_FLOPS", 0.0),
    (base, "QUANTILE_FLOPS", 20.0),
    (costs, "QUANTILE_FLOPS", 20.0),
    (base, "CDF_FLOPS", 0.0),
    (base, "HORIZON_FLOPS", 0.0),
    (enkf, "PARTICLE_STEP_FLOPS", 0.0),
    (enkf, "LOCAL_ANALYSIS_FLOPS", 0.0),
    (kalman, "CDF_FLOPS", 0.0),
    (kalman, "DRAW_FLOPS", base.RANDN_FLOPS),
    (marginal, "PAIR_FLOPS", 24.0),
    (mixture_evidence, "KERNEL_TERM_FLOPS", 2.0 * 8 + 20.0),
    # the iterative solvers' fixed costs, added after the audit (the small-N rows)
    (gpf, "ITERATION_FLOPS", 0.0),
    (svgd, "ITERATION_FLOPS", 0.0),
    (nvgd, "ITERATION_FLOPS", 0.0),
    (nvgd, "ADAM_STEP_FLOPS", 0.0),
)


def fits(measured: list[Measured]) -> list[dict[str, Any]]:
    """Each :data:`FITS` constant from its row of ``measured`` (those measured)."""
    out = []
    for f in FITS:
        for m in measured:
            if m.label == f.label and m.work == f.work:
                out.append(
                    {
                        "constant": f.name,
                        "now": f.value(),
                        "fitted": f.fitted(m),
                        "reference_gflops_per_s": m.rate / 1e9,
                        "fitted_at_nominal_rate": f.fitted(m, NOMINAL_RATE),
                        "row": f.label,
                    }
                )
    return out


def measure(stream: Stream, settings: Settings, repeats: int) -> list[Measured]:
    """The update (and forecast, and p-values apart) of one ``stream`` (module docstring)."""
    row, model, updater, n, ys, k = stream.row, stream.model, stream.updater, stream.n, stream.ys, stream.k
    state = updater.init(stream.prior, model, n, [3])
    state, _ = updater.update(state, ys[:, 0], model)  # warm: the first step builds what later ones reuse
    box, t, runs = [state], iter(range(1, repeats + 1)), []

    def step() -> None:  # the request's work: the update and its summary (the per-step entry of the answer)
        cpu = time.process_time()
        box[0], info = updater.update(box[0], ys[:, next(t)], model)
        summary(box[0])
        inner = info.extras.get("inner_steps")
        moved = 0.0 if info.iterations is None else float(info.iterations[0])
        iters = min(moved + 1.0, float(updater.options.get("max_iters", 1)))
        runs.append((time.process_time() - cpu, iters, 0.0 if inner is None else float(inner[0])))

    step_flops = costs.observations_cost(model, updater, n, [(1.0, k)], 0).flops
    update = Measured(row.label, "update", n, "1 step", step_flops, seconds(step, repeats), stream)
    if "max_iters" in updater.options:
        ran = tuple(statistics.fmean(r[i] for r in runs) for i in range(3))
        update = dataclasses.replace(update, ran=ran, ran_flops=ran_price(stream, ran[1], ran[2]))
    out = [update]
    obs = ys[:, repeats + 1]
    if not updater.predicts_once():
        pit = seconds(lambda: updater.pit(box[0], obs, model), repeats)
        out.append(Measured(row.label, "pit", n, "1 step", updater.pit_work(model, n, 1.0, k).flops, pit, stream))
    if row.forecast and updater.forecasts:
        steps = costs.largest(settings, FORECAST_STEPS, lambda k: costs.forecast_cost(model, updater, n, k, 1.0, 0))
        if steps >= 1:
            step_model = model.at_step(1.0, None, "")
            gen = generator(5)
            fc = seconds(
                lambda: document("s", 0, 1.0, updater.forecast(box[0], step_model, steps, gen), 0, gen), repeats
            )
            flops = costs.forecast_cost(model, updater, n, steps, 1.0, 0).flops
            out.append(Measured(row.label, "forecast", n, f"{steps} steps", flops, fc, stream, steps))
    return out


def ran_price(stream: Stream, iterations: float, inner: float) -> float:
    """The price of a one-step observation whose solver ran ``iterations`` passes and ``inner`` inner steps in
    all (``nvgd``'s Adam steps): the row's method with ``max_iters`` (and ``inner_steps``) at what it ran."""
    row = stream.row
    options = {**stream.updater.options, "max_iters": max(iterations, 1.0)}
    if "inner_steps" in options:
        options["inner_steps"] = inner / max(iterations, 1.0)
    updater = get_updater(row.method, **options)
    return costs.observations_cost(stream.model, updater, stream.n, [(1.0, stream.k)], 0).flops


def table_rows(measured: list[Measured]) -> list[tuple]:
    return [
        (
            m.label,
            m.work,
            m.n,
            m.size,
            f"{m.time.cpu:.3f}",
            f"{m.flops:.3g}",
            f"{m.rate / 1e9:.1f}",
            f"{m.flops / m.time.cpu / 1e9:.2f}",
            f"{ratio(m):.2f}",
            "UNDERPRICED" if underpriced(m) else "",
        )
        for m in measured
    ]


def ratio(m: Measured) -> float:
    """The row's priced rate over the reference step's: the time its price buys over the time it takes."""
    return m.flops / max(m.time.cpu, 1e-9) / m.rate


def underpriced(m: Measured) -> bool:
    return ratio(m) < 1.0 / UNDERPRICED


def plot(rows: list[dict[str, Any]]) -> Callable:
    """The bar chart of the JSON ``rows``' ratios."""

    def draw(path) -> None:
        names = [f"{r['label']} · {r['work']}" for r in rows]
        values = [r["ratio_to_reference"] for r in rows]
        with report.figure(path, figsize=(9, 0.32 * len(names) + 1.5)) as (fig, ax):
            colours = ["tab:red" if v < 1.0 / UNDERPRICED else "tab:blue" for v in values]
            ax.barh(range(len(names)), values, color=colours)
            ax.set_yticks(range(len(names)), names, fontsize=7)
            ax.invert_yaxis()
            ax.set_xscale("log")
            ax.axvline(1.0, color="black", lw=0.8)
            ax.axvline(1.0 / UNDERPRICED, color="tab:red", lw=0.8, ls="--")
            ax.set_xlabel("priced Gflop/s (CPU) / the reference smc step's (< 1/3: underpriced)")
            fig.tight_layout()

    return draw


def main(argv: list[str] | None = None) -> int:
    p = report.parser("price_audit", __doc__, "one repeat")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--only", nargs="*", default=None, help="rows whose label contains one of these")
    p.add_argument("--prices", choices=("now", "before"), default="now", help="before: the prices this audit changed")
    p.add_argument(
        "--merge",
        action="store_true",
        help="replace the rows (and fits) measured in the existing JSON, keeping the others (with --only)",
    )
    args = p.parse_args(argv)
    with contextlib.ExitStack() as stack:
        if args.prices == "before":
            for module, name, value in BEFORE:
                stack.enter_context(mock.patch.object(module, name, value))
        return audit(args)


def audit(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    load = os.getloadavg()
    repeats = 1 if args.quick else args.repeats
    settings = Settings(redis_url="redis://unused")
    measured = []
    for row in ROWS:
        if args.only and not any(s in row.label for s in args.only):
            continue
        # the reference step just before the row: the other jobs of shared cores change its rate by up to 2x
        # within minutes (16 to 31 Gflop/s CPU on 2026-11-28), and each row is read against its own
        ref_flops, ref = step_rate(STEP_REPEATS * repeats)
        rate = ref_flops / ref.cpu
        measured.append(Measured("reference: smc lds d=64 step", "update", STEP_N, "1 step", ref_flops, ref, rate=rate))
        stream = build(row, settings, repeats + 2)
        measured += [dataclasses.replace(m, rate=rate) for m in measure(stream, settings, repeats)]
        print(report.markdown_table(HEADER, table_rows(measured[-1:])).splitlines()[-1], flush=True)
    rows = [m for m in measured if not m.label.startswith("reference")]
    rates = [m.rate for m in measured if m.label.startswith("reference")]
    print()
    print(report.markdown_table(HEADER, table_rows(rows), "llrlrrrrrl"))
    fitted = fits(rows)
    print()
    print(
        report.markdown_table(
            ("constant", "now", "fitted", "at ref. Gflop/s", f"fitted at {NOMINAL_RATE / 1e9:.0f}", "from the row"),
            [
                (
                    f["constant"],
                    f"{f['now']:.0f}",
                    f"{f['fitted']:.0f}",
                    f"{f['reference_gflops_per_s']:.1f}",
                    f"{f['fitted_at_nominal_rate']:.0f}",
                    f["row"],
                )
                for f in fitted
            ],
            "lrrrrl",
        )
    )
    load_after = os.getloadavg()
    print(
        f"\nreference rate {min(rates) / 1e9:.1f} to {max(rates) / 1e9:.1f} Gflop/s (CPU), median "
        f"{statistics.median(rates) / 1e9:.1f}; load average {load} before, {load_after} after"
    )
    result = {
        "reference": {
            "row": "smc lds d=64, N = 16384: its step and p-values (step_work + pit_work) over its CPU time",
            "gflops_per_s": [r / 1e9 for r in rates],
        },
        "underpriced_below": 1.0 / UNDERPRICED,
        "rows": [
            {
                "label": m.label,
                "work": m.work,
                "num_particles": m.n,
                "size": m.size,
                "priced_flops": m.flops,
                "cpu_seconds": m.time.cpu,
                "seconds": m.time.wall,
                "reference_gflops_per_s": m.rate / 1e9,
                "priced_gflops_per_s": m.flops / m.time.cpu / 1e9,
                "ratio_to_reference": ratio(m),
                "underpriced": underpriced(m),
                **(
                    {
                        "mean_cpu_seconds": m.ran[0],
                        "mean_iterations": m.ran[1],
                        "mean_inner_steps": m.ran[2],
                        "priced_flops_of_iterations_run": m.ran_flops,
                    }
                    if m.ran
                    else {}
                ),
            }
            for m in rows
        ],
        "fits": fitted,
        "meta": report.machine_meta(load),
    }
    result["prices"] = args.prices
    name = "price_audit" if args.prices == "now" else "price_audit-before"
    stem = report.out_stem(args, name)
    if args.merge:
        result = merged(stem.with_name(stem.name + ".json"), result)
    report.write_outputs(result, stem, plot(result["rows"]))
    return 0


def merged(path, new: dict[str, Any]) -> dict[str, Any]:
    """The audit's JSON at ``path`` with ``new``'s rows and fits in place of those of the same row (and work) or
    constant, the others kept as they were measured (each row is read against its own reference step) but the fit
    of a constant that a row measured again no longer fits (``smc2``'s pairs, since priced as a particle filter's
    forecast); the runs' reference rates and load are kept side by side under ``merges``."""
    if not path.exists():
        return new
    old = json.loads(path.read_text())
    rows = {(r["label"], r["work"]): r for r in new["rows"]}
    kept = [rows.pop((r["label"], r["work"]), r) for r in old["rows"]]
    fitted = {f["constant"]: f for f in new["fits"]}
    again = {r["label"] for r in new["rows"]}  # a row measured again that fits a constant no more drops its fit
    fits = [fitted.pop(f["constant"], f) for f in old["fits"] if f["constant"] in fitted or f["row"] not in again]
    merges = [
        *old.get("merges", []),
        {"reference": new["reference"], "meta": new["meta"], "rows": sorted({r["label"] for r in new["rows"]})},
    ]
    return {**old, "rows": kept + list(rows.values()), "fits": fits + list(fitted.values()), "merges": merges}


HEADER = ("row", "work", "N", "size", "s CPU", "priced flops", "ref. Gflop/s", "priced Gflop/s", "/ reference", "")


if __name__ == "__main__":
    raise SystemExit(main())

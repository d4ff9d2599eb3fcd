"""Range-bearing tracking against a long-run reference: a target crossing behind the sensor and a close pass.

``python -m benchmarks.range_bearing [--quick] [--streams S] [--reference-particles M] [--steps T] [--gpf-max-iters K]``

The ``range_bearing`` family (:mod:`mpflow.operators.models.range_bearing`: a constant-velocity target
x = (p_x, p_y, v_x, v_y), one sensor at the origin measuring range and bearing) in two scenarios (``SCENARIOS``):

* ``crossing``: a target from (−10, 4) heading down (v = (0, −1)) across the sensor's back axis, so its bearing
  passes ±π (the family wraps the bearing residual there; a filter that does not would jump by 2π);
* ``close pass``: a target from (−5, 0.6) heading right (v = (1, 0)) past the sensor (closest range 0.75, the
  median over the 64 sequences), seen with range sd 0.2 and bearing sd 0.2 rad: near the sensor the likelihood is
  an arc around it, and the posterior of the position is bent (strongly non-Gaussian).

The output's first table gives, per scenario, the share of sequences whose true bearing crosses ±π and the median
closest range (:func:`geometry`), with the reference's own error.

S held-out sequences (seeds ``DATA_SEED_BASE + s``) from a truth x₀ ~ prior, the same prior for every filter, are
filtered (:func:`benchmarks.equal_compute.run_method`: both compute regimes, one thread) by ``mpf`` at N = 256 (the
trained operators for ``range_bearing`` when shipped, ``equal_compute.benchmarked_operators``; the base flow and its
variants: ``equal_compute.mpf_configurations``), ``ukf``, ``enkf`` (ETKF, N = 256),
``gpf`` (N = 256) and ``smc`` on the ladder ``equal_compute.SMC_LADDER``.

**Reference** (:func:`smc_reference`): the bootstrap particle filter (``smc``) with M = 10⁶ particles (float32, as
the engine keeps particles; moments in float64), run twice per stream with independent seeds; the reference is the
two runs pooled (the moments of their union), and its own error is estimated from their disagreement: the error of
the pooled mean is ≈ ½ the difference of the two runs' means, reported in posterior sd (``ref err``, the floor
under every method's error) and as the relative error of its posterior sd.

**Scores** (per step, averaged over steps and sequences): the mean error sqrt(mean_d ((m_q − μ)/σ)²) in posterior
sd against the reference, the variance ratio C_q,dd / Σ_dd, and the RMSE of the mean to the true state,
sqrt(mean_d (m_q − x)²) (the reference's own RMSE is the best a filter can do). **Equal compute**: every non-``smc``
method against ``smc``'s error interpolated on its ladder at that method's compute (both regimes;
:func:`benchmarks.equal_compute.at_compute`).

``--quick``: 8 streams, the reference at M = 20 000, ``smc`` N = 256 and 1024, ``mpf`` K = 1 and 4 and one
corrected row (~40 s; the full run ~30 min on 2 cores, most of it the reference). Output: markdown tables,
``benchmarks/results/range_bearing.{json,png}`` (``range_bearing-quick.*`` with ``--quick``, git-ignored).
``--gpf-max-iters K`` caps ``gpf``'s iterations: it runs to its 500 on these tracks, three quarters of a tiny run
(the tests' smoke run uses 50; the published figures use gpf's own).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from mpflow.operators.accuracy import mean_error_sd
from mpflow.operators.filtering import run_filter
from mpflow.operators.models import ModelFamily
from mpflow.operators.models.priors import GaussianMixture
from mpflow.operators.updaters import get_updater
from tqdm import tqdm

from benchmarks import equal_compute, report
from benchmarks.equal_compute import (
    CORRECTED,
    MPF_PARTICLES,
    SMC_LADDER,
    Reference,
    Scenario,
    _strict,
    benchmarked_operators,
    equal_compute_rows,
    mpf_configurations,
    plot,
    prior_moments,
    run_method,
    simulate_truth,
    table,
)

F64 = torch.float64
STATE_DIM = 4
SCENARIOS = (
    Scenario(
        "crossing",
        "range_bearing",
        STATE_DIM,
        {"q": 0.05, "range_sd": 0.5, "bearing_sd": 0.05},
        prior_var=(1.0, 1.0, 0.25, 0.25),
        prior_mean=(-10.0, 4.0, 0.0, -1.0),
        steps=20,
    ),
    Scenario(
        "close pass",
        "range_bearing",
        STATE_DIM,
        {"q": 0.01, "range_sd": 0.2, "bearing_sd": 0.2},
        prior_var=(0.25, 0.25, 0.01, 0.01),
        prior_mean=(-5.0, 0.6, 1.0, 0.0),
        steps=12,
    ),
)
#: the reference's particles and the seeds of its two independent runs (stream s: seed + s)
REFERENCE_PARTICLES = 1_000_000
REFERENCE_SEEDS = (1_000_000, 2_000_000)


@dataclass(frozen=True)
class Budget:
    """How much of everything a run spends."""

    streams: int = 64
    reference_particles: int = REFERENCE_PARTICLES
    smc_ladder: tuple[int, ...] = SMC_LADDER
    #: fewer mpf rows (``equal_compute.mpf_configurations``'s quick set)
    quick: bool = False
    #: (N, stages) of the importance-corrected rows
    corrected: tuple[tuple[int, int], ...] = CORRECTED
    #: a cap on gpf's iterations (None: its own 500, which it runs to here — most of a smoke run's time)
    gpf_max_iters: int | None = None


FULL = Budget()
QUICK = Budget(streams=8, reference_particles=20_000, smc_ladder=(256, 1024), quick=True, corrected=CORRECTED[:1])


# ------------------------------------------------------------------------------------------------ reference
def _pooled(ma: torch.Tensor, Ca: torch.Tensor, mb: torch.Tensor, Cb: torch.Tensor):
    """The moments of the union of two equally large clouds: m = (m_a + m_b)/2,
    C = (C_a + C_b)/2 + (m_a − m_b)(m_a − m_b)ᵀ/4."""
    delta = ma - mb
    return (ma + mb) / 2, (Ca + Cb) / 2 + delta[..., :, None] * delta[..., None, :] / 4


def smc_reference(
    sc: Scenario, model: ModelFamily, xs: torch.Tensor, obs: torch.Tensor, particles: int
) -> tuple[Reference, dict[str, float]]:
    """Bootstrap SMC with ``particles`` particles, two independent runs a, b per stream, pooled (module
    docstring) → (the reference, its quality). Its error of the mean ``error_sd`` ≈ mean over streams and steps
    of ½ sqrt(mean_d ((m_a − m_b)/σ)²); of the sd, ``sd_rel_error`` ≈ mean over streams, steps and dimensions of
    ½ |σ_a − σ_b| / σ; ``rmse``: its mean's RMSE to the truth."""
    m0, C0 = prior_moments(sc)
    prior = GaussianMixture.gaussian(m0[None], C0[None])
    runs = []
    for seed in REFERENCE_SEEDS:
        means, covs = [], []
        for s in range(obs.shape[0]):  # one stream at a time: M particles of d = 4 are 16 MB
            res = run_filter(get_updater("smc"), model, prior, obs[s : s + 1], particles, [seed + s])
            means.append(res.means[:, 0])
            covs.append(res.covs[:, 0])
        runs.append((torch.stack(means), torch.stack(covs)))  # [S, T, d], [S, T, d, d]
    (ma, Ca), (mb, Cb) = runs
    means, covs = _pooled(ma, Ca, mb, Cb)
    error = float(mean_error_sd(ma.flatten(0, 1), mb.flatten(0, 1), covs.flatten(0, 1)).mean()) / 2
    sd, sd_a, sd_b = (c.diagonal(dim1=-2, dim2=-1).sqrt() for c in (covs, Ca, Cb))
    quality = {
        "error_sd": error,
        "sd_rel_error": float(((sd_a - sd_b).abs() / sd).mean()) / 2,
        "rmse": float((means - xs.to(F64)).pow(2).mean(-1).sqrt().mean()),
    }
    return Reference(means, covs, f"bootstrap SMC, M = {particles:,} x 2", error, truth=xs), quality


def geometry(model: ModelFamily, xs: torch.Tensor) -> dict[str, float]:
    """What the simulated tracks do: the share of sequences whose true bearing crosses ±π (a jump of more than π
    between steps) and the median over sequences of the closest range to the sensor."""
    rel = xs[..., :2].to(F64) - model.params["sensor"][0].to(F64)
    bearing = torch.atan2(rel[..., 1], rel[..., 0])
    crosses = (bearing.diff(dim=1).abs() > torch.pi).any(1)
    return {
        "bearing_crosses_pi_share": float(crosses.to(F64).mean()),
        "min_range_median": float(rel.norm(dim=-1).amin(1).median()),
    }


# ------------------------------------------------------------------------------------------------ runs
def run_scenario(sc: Scenario, budget: Budget) -> dict[str, Any]:
    """Every method of the module docstring on ``budget.streams`` sequences of ``sc``, scored against the
    reference: the result record ``benchmarks.equal_compute`` writes (``rows`` carry ``rmse``)."""
    model, xs, obs = simulate_truth(sc, budget.streams)
    t0 = time.perf_counter()
    ref, quality = smc_reference(sc, model, xs, obs, budget.reference_particles)
    ref_s = time.perf_counter() - t0
    operators = benchmarked_operators(sc.family, sc.dim)

    def run(method: str, n: int = MPF_PARTICLES, **options: Any):
        return run_method(method, n, model, obs, sc, ref, **options)

    configurations = mpf_configurations(operators, True, budget.quick, budget.corrected)
    mpf = [run("mpf", n, **options) for n, options in configurations]
    gpf = {} if budget.gpf_max_iters is None else {"max_iters": budget.gpf_max_iters}
    baselines = [run("ukf"), run("enkf"), run("gpf", **gpf)]
    smc = [run("smc", n) for n in budget.smc_ladder]
    return {
        "scenario": asdict(sc),
        "operator": operators[-1] if operators else None,
        "operators": operators,
        "streams": budget.streams,
        "geometry": geometry(model, xs),
        "reference": {"kind": ref.kind, "error_sd": ref.error_sd, "seconds": ref_s, **quality},
        "rows": [asdict(r) for r in mpf + baselines + smc],
        "equal_compute": equal_compute_rows(mpf + baselines, smc),
    }


# ------------------------------------------------------------------------------------------------ report
def reference_table(results: list[dict[str, Any]]) -> str:
    """Per scenario: the tracks' geometry and the reference's own error: markdown."""
    rows = [
        (
            res["scenario"]["name"],
            f"{res['geometry']['bearing_crosses_pi_share']:.2f}",
            f"{res['geometry']['min_range_median']:.2f}",
            res["reference"]["kind"],
            f"{res['reference']['seconds']:.0f}",
            f"{res['reference']['error_sd']:.4f}",
            f"{res['reference']['sd_rel_error']:.4f}",
        )
        for res in results
    ]
    header = ("scenario", "bearing crosses ±π", "closest range (median)", "reference", "s", "err of mean (sd)",
              "rel. err of sd")  # fmt: skip
    return report.markdown_table(header, rows, "lrrlrrr")


def rmse_table(results: list[dict[str, Any]]) -> str:
    """RMSE of the mean to the true state, each method beside the reference's: markdown."""
    rows = []
    for res in results:
        name = res["scenario"]["name"]
        rows.append((name, f"reference ({res['reference']['kind']})", "", "", f"{res['reference']['rmse']:.4f}"))
        rows += [
            (name, r["label"], r["particles"], f"{r['ms_batched']:.3f}", f"{r['rmse']:.4f}")
            for r in res["rows"]
            if not r["failed"]
        ]
    return report.markdown_table(("scenario", "method", "N", "ms/stream batched", "RMSE to truth"), rows, "llrrr")


def default_entry(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The service's default for ``range_bearing`` (d = 4) by the rule of
    :func:`benchmarks.equal_compute.default_choice`, each configuration scored by its mean error and batched cost
    averaged over the scenarios (a tracking stream meets both geometries)."""
    pooled: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in results:
        for row in r["rows"]:
            pooled.setdefault((row["label"], row["particles"]), []).append(row)
    rows = []
    for same in pooled.values():
        ok = [row for row in same if not row["failed"]]
        failed = len(ok) < len(results)
        rows.append(
            {
                **same[0],
                "failed": same[0]["failed"] if failed else None,
                "mean_err": statistics.fmean(row["mean_err"] for row in ok) if not failed else None,
                "ms_batched": statistics.fmean(row["ms_batched"] for row in ok) if not failed else None,
            }
        )
    merged = {"scenario": {**results[0]["scenario"], "dim": 4}, "streams": results[0]["streams"], "rows": rows}
    entry = equal_compute.default_choice(merged)
    entry["reason"] += f" (mean over the scenarios {', '.join(r['scenario']['name'] for r in results)})"
    return entry


def main(argv: list[str] | None = None) -> int:
    p = report.parser("range_bearing", __doc__, "8 streams, a 20 000-particle reference, a shorter ladder")
    p.add_argument(
        "--write-defaults",
        action="store_true",
        help="only write the service's default for range_bearing from the stored full run's results",
    )
    p.add_argument("--streams", type=int, default=None, help="sequences per scenario (64; 8 with --quick)")
    p.add_argument("--reference-particles", type=int, default=None, help="the reference's M (10⁶; 20 000 quick)")
    p.add_argument("--steps", type=int, default=None, help="only the first T steps of every scenario")
    p.add_argument("--gpf-max-iters", type=int, default=None, help="cap gpf's iterations (500; a smoke run's cap)")
    args = p.parse_args(argv)
    stem = report.out_stem(args, "range_bearing")
    if args.write_defaults:
        stored = json.loads(stem.with_suffix(".json").read_text())
        if stored["meta"]["quick"]:
            raise SystemExit(f"{stem}.json is a --quick run; the default is taken from a full run")
        equal_compute.write_defaults([default_entry(stored["results"])], stored["meta"])
        return 0
    budget = QUICK if args.quick else FULL
    if args.streams is not None:
        budget = replace(budget, streams=args.streams)
    if args.reference_particles is not None:
        budget = replace(budget, reference_particles=args.reference_particles)
    if args.gpf_max_iters is not None:
        budget = replace(budget, gpf_max_iters=args.gpf_max_iters)
    torch.set_num_threads(1)
    load = os.getloadavg()
    t0 = time.perf_counter()
    scenarios = [replace(sc, steps=min(sc.steps, args.steps or sc.steps)) for sc in SCENARIOS]
    results = [run_scenario(sc, budget) for sc in tqdm(scenarios, desc="scenarios")]
    print(reference_table(results) + "\n")
    print(table(results))
    print("\n" + rmse_table(results))
    meta = {
        "benchmark": "range_bearing",
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "threads": 1,
        "budget": asdict(budget),
        "quick": args.quick,
        "wall_s": round(time.perf_counter() - t0, 1),
        **report.machine_meta(load),
    }
    report.write_outputs(_strict({"meta": meta, "results": results}), stem, lambda path: plot(results, path), indent=1)
    if not args.quick and args.out is None and args.steps is None:
        equal_compute.write_defaults([default_entry(results)], meta)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

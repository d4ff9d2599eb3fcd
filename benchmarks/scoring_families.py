"""The energy-score operator (``mpflow train --loss energy``) on the non-Gaussian families where the base flow is
wrong, against its untrained base flow and against ``smc`` at equal compute.

``python -m benchmarks.scoring_families --operator gmm=DIR --operator range_bearing=DIR --operator lorenz96=DIR
[--quick] [--streams S] [--reference-particles M] [--steps T]``

DIR is an operator folder written by ``mpflow train --loss energy`` (its README has the command). Three cases
(``CASES``), each a scenario of :class:`benchmarks.equal_compute.Scenario` inside the operator's task distribution:

* ``gmm``: the paper's two-mode model (MPF §5.2, s = 1, prior N(0, I)), 30 steps: a multimodal posterior;
  reference: the adaptive tensor grid (:func:`benchmarks.equal_compute.reference`; its error from halving the grid);
* ``range_bearing`` close pass (:data:`benchmarks.range_bearing.SCENARIOS`): a banana-shaped posterior near the
  sensor; reference: bootstrap SMC with M particles run twice (:func:`benchmarks.range_bearing.smc_reference`; its
  error from the two runs' disagreement);
* ``lorenz96`` d = 10 with the ``arctan`` sensor (every variable observed, R = 0.05, Q = 0.05, Δ = 0.05): a bounded
  sensor that saturates away from 0, so the likelihood of a large |x| is flat on one side; the prior centred on a
  state spun up onto the attractor (:func:`lorenz96_prior_mean`); reference: the same two-run bootstrap SMC.

S held-out sequences (seeds ``equal_compute.DATA_SEED_BASE + s``; training draws its tasks from other seeds) are
filtered by (:func:`benchmarks.equal_compute.run_method`, one thread, both compute regimes):

* ``mpf`` with the energy-score operator at N = 256 (``energy op``);
* its untrained base flow — the same architecture's base (its ``linearisation``), no residual — at N = 256, 512
  and 1024 (``base``), and at N = 256 served as an operator is (a low-ESS step re-run in up to
  ``ON_DEMAND_STAGES`` stages: an operator's default ``max_substeps``, the base flow's is 1), so that the base gets
  the operator's compute and serving too (its least error among the rows that cost at most the operator's ms,
  :func:`best_within`);
* the shipped KL-trained operator of the family where there is one (``gmm-d2-v4``, ``range_bearing-d4-v1``): the
  two objectives on one benchmark;
* ``smc`` on the ladder ``equal_compute.SMC_LADDER``, its error interpolated at each method's compute.

Scores per step, averaged over steps and sequences: mean error sqrt(mean_d ((m_q − μ)/σ)²) in posterior sd and the
variance ratio mean_d C_q,dd / Σ_dd (the last step's too). **Verdict** (batched regime, the service's): the operator
*wins* when its error is below both the base's and ``smc``'s at its compute.

Output: markdown tables, ``benchmarks/results/scoring_families.{json,png}`` (``-quick`` with ``--quick``, git-ignored):
per family the error against compute (``smc``'s ladder, the base's ladder, the operators) and the variance ratio
per step of the operator, its base and ``smc`` at about the operator's compute.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from mpflow.operators.accuracy import variance_ratio
from mpflow.operators.filtering import run_filter
from mpflow.operators.models import make_model
from mpflow.operators.registry import resolve
from mpflow.operators.rng import generator
from mpflow.operators.updaters.mpf import ON_DEMAND_STAGES
from tqdm import tqdm

from benchmarks import equal_compute, range_bearing, report
from benchmarks.equal_compute import (
    MPF_PARTICLES,
    SMC_LADDER,
    Reference,
    Run,
    Scenario,
    _batch_model,
    _prior,
    _strict,
    at_compute,
    posterior_moments,
    run_method,
    simulate_truth,
)
from benchmarks.objectives import curve, operator_dir

F64 = torch.float64
#: the base flow's particle ladder (N = 256 is the operator's own N)
BASE_LADDER = (MPF_PARTICLES, 2 * MPF_PARTICLES, 4 * MPF_PARTICLES)
#: the shipped KL-trained operator of a family, benchmarked beside the energy-score one where it exists
KL_OPERATORS = {"gmm": "gmm-d2-v4", "range_bearing": "range_bearing-d4-v1"}
#: the Lorenz-96 arctan scenario's parameters and the seed of its prior's centre
L96_PARAMS = {"arctan": 1, "R": 0.05, "Q": 0.05}
L96_DIM = 10
L96_CENTRE_SEED = 4242
#: the families of ``CASES``, in their order
FAMILIES = ("gmm", "range_bearing", "lorenz96")


def lorenz96_prior_mean(d: int = L96_DIM, seed: int = L96_CENTRE_SEED, spin_up: int = 200) -> tuple[float, ...]:
    """A state on the Lorenz-96 attractor (F = 8): F + N(0, I) carried by ``spin_up`` noise-free steps of Δ = 0.05,
    as the family's meta-training tasks centre their priors
    (:class:`~mpflow.training.family_tasks.lorenz96.Lorenz96Tasks`)."""
    model = make_model("lorenz96", {}, d, F64)
    x = 8.0 + torch.randn(1, 1, d, generator=generator(seed), dtype=F64)
    for _ in range(spin_up):
        x = model.transition_mean(x)
    return tuple(float(v) for v in x.reshape(d))


@dataclass(frozen=True)
class Case:
    """One family's scenario and how its reference is made ("grid": the adaptive tensor grid; "smc": the two-run
    bootstrap SMC of ``reference_particles``)."""

    family: str
    scenario: Scenario
    reference: str
    reference_particles: int = 1_000_000


def cases() -> tuple[Case, ...]:
    close_pass = next(sc for sc in range_bearing.SCENARIOS if sc.name == "close pass")
    l96 = Scenario(
        "lorenz96 d=10 arctan R=0.05 Q=0.05",
        "lorenz96",
        L96_DIM,
        dict(L96_PARAMS),
        prior_var=1.0,
        prior_mean=lorenz96_prior_mean(),
        steps=20,
    )
    return (
        Case("gmm", Scenario("gmm s=1", "gmm", 2, {"s": 1.0}, steps=30), "grid"),
        Case("range_bearing", replace(close_pass, name="range_bearing close pass"), "smc"),
        Case("lorenz96", l96, "smc", reference_particles=200_000),
    )


def make_reference(case: Case, streams: int, quick: bool, reference_particles: int | None):
    """(model, observations, the reference, its quality record)."""
    sc = case.scenario
    model, xs, obs = simulate_truth(sc, streams)
    if case.reference == "grid":
        ref = equal_compute.reference(sc, model, obs, quick)
        return model, obs, replace(ref, truth=xs), {"kind": ref.kind, "error_sd": ref.error_sd}
    m = reference_particles or case.reference_particles
    ref, quality = range_bearing.smc_reference(sc, model, xs, obs, m)
    return model, obs, ref, {"kind": ref.kind, **quality}


def variance_ratio_per_step(method: str, N: int, options: dict[str, Any], model, obs, sc: Scenario, ref: Reference):
    """[T]: the variance ratio mean_d C_q,dd / Σ_dd at every step, averaged over the streams (for the figure)."""
    from mpflow.operators.updaters import get_updater

    updater = get_updater(method, **options)
    S = obs.shape[0]

    def score(step):
        _, cov = posterior_moments(updater, step.state)
        return {"vr": variance_ratio(cov, ref.covs[:, step.t - 1]).mean(-1)}

    out = run_filter(
        updater, _batch_model(model, S), _prior(sc, S), obs, N, list(range(S)), moments=False, on_step=score,
        catch=equal_compute.FAILURES,
    )  # fmt: skip
    if out.error is not None:
        return None
    return [float(v) for v in out.values["vr"].mean(1)]


def best_within(ladder: list[Run], ms: float) -> tuple[float, int, bool]:
    """The least error of ``ladder``'s rows whose batched compute is at most ``ms`` (the base flow's best at the
    operator's compute: its error need not fall with N, so it is not interpolated) → (error, N, whether every row
    of the ladder was within ``ms``); the cheapest row where none is."""
    ok = [r for r in ladder if not r.failed]
    within = [r for r in ok if r.ms_batched <= ms] or [min(ok, key=lambda r: r.ms_batched)]
    best = min(within, key=lambda r: r.mean_err)
    return best.mean_err, best.particles, len(within) == len(ok)


def run_case(case: Case, operator: str, streams: int, quick: bool, reference_particles: int | None) -> dict[str, Any]:
    sc = case.scenario
    t0 = time.perf_counter()
    model, obs, ref, quality = make_reference(case, streams, quick, reference_particles)
    ref_s = time.perf_counter() - t0
    record = resolve(operator)
    linearisation = record.config["architecture"].get("linearisation", "stein")

    def run(label: str, method: str, n: int, **options: Any) -> Run:
        row = run_method(method, n, model, obs, sc, ref, **options)
        row.label = label
        return row

    op = run("energy op", "mpf", MPF_PARTICLES, operator=str(record.path))
    base = [run(f"base ({linearisation})", "mpf", n, linearisation=linearisation) for n in BASE_LADDER]
    # as the operator is served: a low-ESS step re-run in up to ON_DEMAND_STAGES stages (an operator's default)
    base.append(
        run(f"base ({linearisation}), ≤{ON_DEMAND_STAGES} stages on demand", "mpf", MPF_PARTICLES,
            linearisation=linearisation, substeps=1, max_substeps=ON_DEMAND_STAGES)
    )  # fmt: skip
    kl_name = KL_OPERATORS.get(case.family)
    kl = [run(f"KL op {kl_name}", "mpf", MPF_PARTICLES, operator=kl_name)] if kl_name else []
    smc = [run("smc", "smc", n) for n in (SMC_LADDER[:2] if quick else SMC_LADDER)]
    contenders = [op, *kl, base[0]]
    equal = equal_compute.equal_compute_rows(contenders, smc)
    base_err, base_n, base_beyond = best_within(base, op.ms_batched)
    smc_err, smc_n, smc_beyond = at_compute(smc, op.ms_batched, "ms_batched")
    # the figure's variance-ratio curves: the operator, its base, and smc at the ladder N nearest the operator's ms
    near = min((r for r in smc if not r.failed), key=lambda r: abs(r.ms_batched - op.ms_batched), default=None)
    curve_runs = {
        "energy op": ("mpf", MPF_PARTICLES, {"operator": str(record.path)}),
        base[0].label: ("mpf", MPF_PARTICLES, {"linearisation": linearisation}),
    }
    if near is not None:
        curve_runs[f"smc N={near.particles}"] = ("smc", near.particles, {})
    curves = {k: variance_ratio_per_step(m, n, o, model, obs, sc, ref) for k, (m, n, o) in curve_runs.items()}
    verdict = {
        "op_err": op.mean_err,
        "base_err_at_op_compute": base_err,
        "base_particles_at_op_compute": base_n,
        "base_beyond_ladder": base_beyond,
        "smc_err_at_op_compute": smc_err,
        "smc_particles_at_op_compute": smc_n,
        "smc_beyond_ladder": smc_beyond,
        "op_over_base": op.mean_err / base_err,
        "op_over_smc": op.mean_err / smc_err,
        "op_cost_over_base": op.ms_batched / base[0].ms_batched,
        "wins": bool(op.mean_err < base_err and op.mean_err < smc_err),
    }
    return {
        "family": case.family,
        "scenario": asdict(sc),
        "operator": {"name": record.name, "path": str(record.path), "linearisation": linearisation},
        "streams": streams,
        "reference": {**quality, "seconds": ref_s},
        "rows": [asdict(r) for r in [op, *kl, *base, *smc]],
        "equal_compute": equal,
        "verdict": verdict,
        "variance_ratio_per_step": curves,
    }


# ------------------------------------------------------------------------------------------------ report
def rows_table(results: list[dict[str, Any]]) -> str:
    body = []
    for res in results:
        ref = res["reference"]
        for r in res["rows"]:
            cells = (
                (f"failed: {r['failed'][:50]}", "", "", "")
                if r["failed"]
                else (f"{r['ms_batched']:.3f}", f"{r['ms_single']:.2f}", f"{r['mean_err']:.4f}",
                      f"{r['var_ratio']:.2f} ({r['var_ratio_last']:.2f})")
            )  # fmt: skip
            body.append((res["family"], f"{ref['kind']} ({ref['error_sd']:.1e})", r["label"], r["particles"], *cells))
    header = ("family", "reference (its err, sd)", "method", "N", "ms/stream batched", "ms 1 stream", "mean err (sd)",
              "var ratio (last step)")  # fmt: skip
    return report.markdown_table(header, body, "lllrrrrl")


def verdict_table(results: list[dict[str, Any]]) -> str:
    body = []
    for res in results:
        v = res["verdict"]
        base_n = ("≥" if v["base_beyond_ladder"] else "") + f"{v['base_particles_at_op_compute']:.0f}"
        smc_n = ("≥" if v["smc_beyond_ladder"] else "") + f"{v['smc_particles_at_op_compute']:.0f}"
        body.append(
            (
                res["family"],
                f"{v['op_err']:.4f}",
                f"{v['base_err_at_op_compute']:.4f} ({base_n})",
                f"{v['smc_err_at_op_compute']:.4f} ({smc_n})",
                f"{v['op_over_base']:.2f}",
                f"{v['op_over_smc']:.2f}",
                f"{v['op_cost_over_base']:.2f}",
                "wins" if v["wins"] else "misses",
            )
        )
    header = ("family", "energy op err", "base err at its compute (N)", "smc err at its compute (N)", "op / base",
              "op / smc", "op cost / base N=256", "verdict")  # fmt: skip
    return report.markdown_table(header, body, "lrrrrrrl")


def _ladder_base(label: str) -> bool:
    """A row of the base flow's particle ladder (not its on-demand-stages row)."""
    return label.startswith("base") and "on demand" not in label


def plot(results: list[dict[str, Any]], path: Path) -> None:
    """Row 1: error against compute (batched) per family; row 2: the variance ratio per step."""
    n = len(results)
    with report.figure(path, 2, n, squeeze=False, figsize=(4.6 * n, 7.4)) as (fig, grid):
        for j, res in enumerate(results):
            ax = grid[0, j]
            ok = [r for r in res["rows"] if not r["failed"]]
            for label, color, style in (("smc", "C0", ".-"), (None, "C2", "s-")):
                pts = sorted(
                    (r["ms_batched"], r["mean_err"], r["particles"])
                    for r in ok
                    if (r["label"] == label if label else _ladder_base(r["label"]))
                )
                if pts:
                    name = label or next(r["label"] for r in ok if _ladder_base(r["label"]))
                    ns = sorted(n_ for *_, n_ in pts)
                    ax.plot(
                        [p[0] for p in pts],
                        [p[1] for p in pts],
                        style,
                        color=color,
                        label=f"{name}, N {ns[0]}…{ns[-1]}",
                    )
                    for m, e, n_ in pts:
                        ax.annotate(str(n_), (m, e), fontsize=6, xytext=(2, 2), textcoords="offset points")
            for r in ok:
                if r["label"] == "energy op":
                    ax.plot([r["ms_batched"]], [r["mean_err"]], "*", color="C3", ms=12, label="energy op, N 256")
                elif r["label"].startswith("KL op"):
                    ax.plot([r["ms_batched"]], [r["mean_err"]], "P", color="C1", ms=9, label=r["label"] + ", N 256")
                elif "on demand" in r["label"]:
                    ax.plot([r["ms_batched"]], [r["mean_err"]], "D", color="C2", mfc="none", ms=8, label=r["label"])
            ref, floor = res["reference"], min(r["mean_err"] for r in ok) / 5
            if ref["error_sd"] >= floor:  # a grid's 1e-11 would only stretch the axis
                ax.axhline(ref["error_sd"], color="k", lw=0.7, ls=":", label="reference's own error")
            ax.set(
                xscale="log", yscale="log", xlabel="ms per stream update (batched)", ylabel="mean error (posterior sd)"
            )
            v = res["verdict"]
            ax.set_title(f"{res['scenario']['name']}: {'wins' if v['wins'] else 'misses'} "
                         f"(op/base {v['op_over_base']:.2f}, op/smc {v['op_over_smc']:.2f})", fontsize=8)  # fmt: skip
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=6)
            ax = grid[1, j]
            for label, curve in res["variance_ratio_per_step"].items():
                if curve:
                    ax.plot(range(1, len(curve) + 1), curve, label=label)
            ax.axhline(1.0, color="k", lw=0.7)
            ax.set(xlabel="step", ylabel="variance ratio (to the reference)", yscale="log")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=6)
        fig.tight_layout()


def print_tables(results: list[dict[str, Any]]) -> None:
    print(rows_table(results) + "\n")
    equal = [{"scenario": {"name": r["scenario"]["name"]}, "equal_compute": r["equal_compute"]} for r in results]
    print(equal_compute.equal_compute_table(equal) + "\n")
    print(verdict_table(results))


def plot_curves(runs: dict[str, dict[str, Any]], path: Path) -> None:
    """Each run's validation energy score relative to its untrained network's (per cent), by iteration."""
    with report.figure(path, 1, 1, figsize=(7, 4)) as (_, ax):
        for label, r in runs.items():
            base, c = r["val_loss_untrained"], r["curve"]
            its = [0] + [row["iteration"] for row in c if row["val_loss"] is not None]
            vals = [0.0] + [100 * (row["val_loss"] - base) / abs(base) for row in c if row["val_loss"] is not None]
            ax.plot(its, vals, ".-", label=f"{label} (untrained {base:.4g}, best at {r['best_iteration']})")
        ax.axhline(0, color="k", lw=0.8)
        ax.set(xlabel="iteration", ylabel="validation energy score, % from untrained", title="--loss energy")
        ax.set_ylim(-25, 25)
        ax.legend(fontsize=7)


def parse_operators(values: list[str]) -> dict[str, str]:
    """``family=DIR`` pairs → {family: DIR}; each family one of the cases'."""
    known = FAMILIES
    out = {}
    for v in values:
        family, sep, where = v.partition("=")
        if not sep or family not in known:
            raise argparse.ArgumentTypeError(f"--operator: expected FAMILY=DIR, FAMILY one of {known}, got {v!r}")
        out[family] = where
    return out


def main(argv: list[str] | None = None) -> int:
    p = report.parser("scoring_families", __doc__, "4 streams, a 20 000-particle reference, smc N 256 and 1024")
    p.add_argument("--operator", action="append", default=[], help="FAMILY=DIR: the energy-score operator of FAMILY")
    p.add_argument("--streams", type=int, default=None, help="sequences per family (16; 4 with --quick)")
    p.add_argument("--reference-particles", type=int, default=None, help="the SMC reference's M (per case)")
    p.add_argument("--steps", type=int, default=None, help="only the first T steps of every case")
    p.add_argument(
        "--merge",
        nargs="+",
        type=Path,
        default=None,
        help="only join the JSON of earlier runs (one family each, say) into one table, JSON and PNG",
    )
    p.add_argument(
        "--curves",
        nargs="+",
        default=None,
        metavar="LABEL=DIR",
        help="only draw the validation curves of these mpflow train --out folders (one operator each)",
    )
    args = p.parse_args(argv)
    if args.curves:
        runs = {}
        for item in args.curves:
            label, _, where = item.partition("=")
            run_dir = Path(where)
            metrics = json.loads((operator_dir(run_dir) / "metrics.json").read_text())
            runs[label] = {"curve": curve(run_dir), **metrics}
        stem = report.out_stem(args, "scoring_families")
        stem = stem.with_name(stem.name + "-curves")
        report.write_outputs({"training": runs}, stem, lambda path: plot_curves(runs, path), indent=1)
        return 0
    if args.merge:
        runs = [json.loads(path.read_text()) for path in args.merge]
        results = [r for run in runs for r in run["results"]]
        print_tables(results)
        merged = {"meta": {"benchmark": "scoring_families", "runs": [run["meta"] for run in runs]}, "results": results}
        stem = report.out_stem(args, "scoring_families")
        report.write_outputs(merged, stem, lambda path: plot(results, path), indent=1)
        return 0
    try:
        operators = parse_operators(args.operator)
    except argparse.ArgumentTypeError as exc:
        p.error(str(exc))
    if not operators:
        p.error("--operator: give at least one FAMILY=DIR (or --merge JSON ...)")
    torch.set_num_threads(1)
    streams = args.streams or (4 if args.quick else 16)
    ref_m = args.reference_particles or (20_000 if args.quick else None)
    load, t0 = os.getloadavg(), time.perf_counter()
    chosen = [c for c in cases() if c.family in operators]
    if args.steps is not None:
        chosen = [replace(c, scenario=replace(c.scenario, steps=min(c.scenario.steps, args.steps))) for c in chosen]
    results = [run_case(c, operators[c.family], streams, args.quick, ref_m) for c in tqdm(chosen, desc="families")]
    print_tables(results)
    meta = {
        "benchmark": "scoring_families",
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "threads": 1,
        "streams": streams,
        "steps": args.steps,
        "quick": args.quick,
        "wall_s": round(time.perf_counter() - t0, 1),
        **report.machine_meta(load),
    }
    stem = report.out_stem(args, "scoring_families")
    report.write_outputs(_strict({"meta": meta, "results": results}), stem, lambda path: plot(results, path), indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

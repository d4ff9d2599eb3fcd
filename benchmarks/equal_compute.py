"""Equal-compute benchmark: every applicable method against a trustworthy reference, with ``smc``'s particle
count raised until its compute matches ``mpf``'s.

``python -m benchmarks.equal_compute [--quick] [--scenarios NAME ...]``

For each scenario (family × d × parameters; some outside the shipped operators' training settings), S held-out
sequences of T steps are simulated (data seeds ``DATA_SEED_BASE + s``, never used in training) from a truth
x₀ ~ prior, and filtered by

* ``mpf`` at N = 256 with the shipped operator for (family, d) when there is one (as served: one stage, more on
  demand; also one marked ``auto_select: false``) and with its untrained base flow (the exact Daum–Huang flow,
  labelled ``mpf-base``; ``+K moves`` where it runs posterior moves, :mod:`mpflow.operators.mpf.posterior_moves`,
  also without them and with windows of 1 and 3) in one stage and, for non-linear likelihoods, in K = 4 tempered
  stages (``substeps``,
  :mod:`mpflow.operators.models.tempered`), with Stein's fit at the prior in place of the default posterior
  linearisation (``linearisation="stein"``, :mod:`mpflow.operators.mpf.daum_huang`; labelled ``stein``) in
  K = 1 and 16 stages (1 with ``--quick``), and importance-corrected (``correct``,
  :mod:`mpflow.operators.mpf.correction`; ``CORRECTED``: K = 1 at N = 256 and 512, K = 4 at N = 256);
* ``smc`` (bootstrap PF) on a ladder of N (256 … 16384);
* ``kalman`` for linear-Gaussian families, ``gpf`` where it is affordable (``--gpf``).

**References** (each with its own error, reported in the table's ``ref err`` column, posterior-sd units):
exact Kalman for linear-Gaussian families; for a static family with d ≤ 2 a tensor grid with an adaptive box,
for ``stochastic_volatility`` (independent dimensions) a 1-D grid filter per dimension
(:mod:`mpflow.operators.references.grid`; error = the largest change of the mean from halving the grid); for
``logistic`` Hamiltonian Monte Carlo preconditioned at the Laplace approximation
(:mod:`mpflow.operators.references.hmc`; rejected when, at any step, a dimension's ESS < 1000 or its split
R-hat > 1.01; error ≈ 1/√ESS).

**Accuracy**: after every step the cloud's weighted mean and covariance (float64; ``kalman``: its exact
Gaussian) against the reference's: mean error = sqrt(mean_d ((m_q − μ)/σ)²) in posterior sd, averaged over
steps and sequences; variance ratio = mean_d C_q,dd / Σ_dd, averaged and at the last step.

**Compute** (operator compute, as the service's ``mpflow_update_duration_seconds`` measures it;
``torch.set_num_threads(1)`` as in the service's engine) in two regimes from the same run: *1 stream* — the
median wall time of ``updater.update`` on one stream over its first ``SINGLE_STREAM_STEPS`` steps, the least of
``SINGLE_STREAM_REPEATS`` runs (one run's median moved 2× between runs on a shared machine); *batched* — the S
streams in one call (the service's micro-batching), wall time per call / S. **Equal compute**: ``smc``'s error at mpf's
compute is interpolated on its ladder, linear in log N against log ms; if mpf's compute lies beyond the ladder
the end point is used and flagged (``≥``).

Output: a markdown table, ``<out>.json``, ``<out>.png`` (error against compute per scenario, SMC's curve with
mpf's point on it, both regimes) and, from the scenarios marked ``default``, the default-method table the service
reads (``service/engine/default_methods.json``, written only by a full run; see ``docs/DESIGN.md`` "Default method").
``--out`` defaults to ``benchmarks/results/equal_compute`` (``equal_compute-quick`` with ``--quick``, git-ignored).
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from mpflow.operators import gaussian
from mpflow.operators.accuracy import mean_error_sd, variance_ratio
from mpflow.operators.filtering import FilterStep, run_filter
from mpflow.operators.models import ModelFamily, make_model
from mpflow.operators.models.priors import GaussianMixture
from mpflow.operators.references import kalman_filter
from mpflow.operators.references.grid import diagonal_grid_filter, grid_error, static_grid_posterior
from mpflow.operators.references.hmc import hmc_reference
from mpflow.operators.rng import generator
from mpflow.operators.trained_operators import find_operator
from mpflow.operators.updaters import NonFiniteError, get_updater
from tqdm import tqdm

from benchmarks import report

ROOT = Path(__file__).resolve().parents[1]
DEFAULTS_FILE = ROOT / "service" / "engine" / "default_methods.json"
DATA_SEED_BASE = 7_000_003
MPF_PARTICLES = 256
#: up to 16384: a stream's stored state grows with N (64 KiB per dimension at 16384), and the service writes it
#: to Redis on every update
SMC_LADDER = (256, 1024, 4096, 16384)
#: steps timed in the one-stream regime (its accuracy is the batched run's: a stream's result does not depend on
#: the batch it ran in); the median over 20 steps is steadier than over 10 on a shared machine
SINGLE_STREAM_STEPS = 20
#: the one-stream run is repeated (the same computation) and its least median kept: interference from other work
#: on the machine only ever adds time, and one stream's sub-millisecond steps are where it shows most
SINGLE_STREAM_REPEATS = 3
#: (N, stages) of the importance-corrected flow's rows (:mod:`mpflow.operators.mpf.correction`): its error
#: falls with N as well as with the stages, so it gets rows with more particles (one stream's cost grows slowly
#: with N: at d = 5, N = 512 costs 1.1× N = 256)
CORRECTED = ((MPF_PARTICLES, 1), (2 * MPF_PARTICLES, 1), (MPF_PARTICLES, 4))
#: the default method must cost at most this multiple of the budget (mpf's compute at N = 256)
MAX_COST_RATIO = 10.0
#: methods whose posterior is exact in closed form (a Gaussian, not particles): they win a tie on error
CLOSED_FORM = ("kalman",)


@dataclass(frozen=True)
class Scenario:
    name: str
    family: str
    dim: int
    params: dict[str, Any] = field(default_factory=dict)
    #: the prior N(m₀, diag(v)) of x₀ (truth and filters alike): variances v, one number or one per dimension
    prior_var: float | tuple[float, ...] = 1.0
    #: its mean m₀ (default 0)
    prior_mean: tuple[float, ...] | None = None
    steps: int = 20
    #: why the scenario lies outside the shipped operator's training setting (None: inside or no operator)
    outside: str | None = None
    #: its row decides the default method for (family, dim)
    default: bool = False
    quick: bool = False


def _cv_lds(dt_: float = 1.0, q: float = 0.1, r: float = 0.5) -> dict[str, Any]:
    """Constant-velocity 2-D tracking: state (px, py, vx, vy), positions observed."""
    A = [[1, 0, dt_, 0], [0, 1, 0, dt_], [0, 0, 1, 0], [0, 0, 0, 1]]
    Q = (q * torch.tensor([[dt_**3 / 3, 0, dt_**2 / 2, 0], [0, dt_**3 / 3, 0, dt_**2 / 2],
                           [dt_**2 / 2, 0, dt_, 0], [0, dt_**2 / 2, 0, dt_]])).tolist()  # fmt: skip
    return {"A": A, "Q": Q, "B": [[1, 0, 0, 0], [0, 1, 0, 0]], "R": (r * torch.eye(2)).tolist()}


def _eye(d: int, scale: float) -> list[list[float]]:
    return (scale * torch.eye(d)).tolist()


SCENARIOS = (
    Scenario("gmm s=1", "gmm", 2, {"s": 1.0}, steps=30, default=True, quick=True),
    Scenario("gmm s=0.5 prior 4I", "gmm", 2, {"s": 0.5}, prior_var=4.0, steps=30, outside="s = 0.5, prior N(0, 4I)"),
    Scenario("sv d=1", "stochastic_volatility", 1, default=True, quick=True),
    Scenario("sv d=2", "stochastic_volatility", 2, default=True, quick=True),
    Scenario(
        "sv d=2 mu=-1 phi=.98 sigma=.15",
        "stochastic_volatility",
        2,
        {"mu": -1.0, "phi": 0.98, "sigma": 0.15},
        outside="mu = -1, phi = 0.98, sigma = 0.15",
    ),
    Scenario("sv d=5", "stochastic_volatility", 5, default=True),
    Scenario("sv d=10", "stochastic_volatility", 10, default=True),
    Scenario("sv d=20", "stochastic_volatility", 20, default=True),
    Scenario("logistic d=10", "logistic", 10, steps=10, default=True, quick=True),
    Scenario("logistic d=30", "logistic", 30, steps=10, default=True),
    Scenario("linear_gaussian d=2", "linear_gaussian", 2, default=True, quick=True),
    Scenario("linear_gaussian d=10 R=0.3I", "linear_gaussian", 10, {"R": _eye(10, 0.3)}),
    Scenario("linear_gaussian d=10", "linear_gaussian", 10, default=True),
    Scenario("linear_gaussian d=2 R x0.01", "linear_gaussian", 2, {"R": _eye(2, 0.03)}, outside="R scaled by 0.01"),
    Scenario("linear_gaussian d=2 R x100", "linear_gaussian", 2, {"R": _eye(2, 300.0)}, outside="R scaled by 100"),
    Scenario("lds d=4 constant velocity", "lds", 4, _cv_lds(), default=True),
)


# ------------------------------------------------------------------------------------------------ data
def prior_moments(sc: Scenario, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """The scenario's prior of x₀: mean m₀ [d] and covariance diag(v) [d, d]."""
    mean = torch.zeros(sc.dim, dtype=dtype) if sc.prior_mean is None else torch.tensor(sc.prior_mean, dtype=dtype)
    return mean, torch.diag(torch.as_tensor(sc.prior_var, dtype=dtype).expand(sc.dim))


def simulate_truth(sc: Scenario, streams: int) -> tuple[ModelFamily, torch.Tensor, torch.Tensor]:
    """The scenario's model (batch 1), S true state sequences [S, T, d] from x₀ ~ prior and their observation
    sequences [S, T, *obs_shape]."""
    model = make_model(sc.family, sc.params, sc.dim)
    gens = [generator(DATA_SEED_BASE + s) for s in range(streams)]
    m0, C0 = prior_moments(sc)
    x0 = torch.stack([m0 + C0.diagonal().sqrt() * torch.randn(sc.dim, generator=g) for g in gens])
    xs, obs = _batch_model(model, streams).simulate(sc.steps, x0, gens)
    return model, xs, obs


def simulate(sc: Scenario, streams: int) -> tuple[ModelFamily, torch.Tensor]:
    """The scenario's model (batch 1) and S observation sequences [S, T, *obs_shape] from x₀ ~ prior."""
    model, _, obs = simulate_truth(sc, streams)
    return model, obs


@dataclass(frozen=True)
class Reference:
    means: torch.Tensor  # [S, T, d]
    covs: torch.Tensor  # [S, T, d, d]
    kind: str
    error_sd: float  # its own error of the mean, in posterior sd
    #: the simulated states [S, T, d], when the methods are also scored by their mean's RMSE to the truth
    truth: torch.Tensor | None = None


def reference(sc: Scenario, model: ModelFamily, obs: torch.Tensor, quick: bool) -> Reference:
    """The trustworthy reference of the module docstring."""
    S, d = obs.shape[0], sc.dim
    m0, C0 = prior_moments(sc, torch.float64)
    if model.linear_gaussian:
        means, covs, _ = kalman_filter(m0.expand(S, d), C0.expand(S, d, d), model, obs)
        return Reference(means, covs, "kalman (exact)", 0.0)
    if sc.family == "stochastic_volatility":
        (means, covs), err = grid_error(lambda g: diagonal_grid_filter(model, m0, C0.diagonal(), obs, g), 800)
        return Reference(means, covs, "grid filter per dimension, G = 800", err)
    if not model.dynamic and d <= 2:
        points = 128 if quick else 256
        (means, covs), err = grid_error(lambda g: static_grid_posterior(model, m0, C0, obs, g), points)
        return Reference(means, covs, f"adaptive grid, {points}^{d}", err)
    if sc.family == "logistic":
        ref = hmc_reference(model, m0, C0, obs)
        ess, rhat = float(ref.ess.min()), float(ref.rhat.max())
        return Reference(ref.means, ref.covs, f"HMC, min ESS {ess:.0f}, max R-hat {rhat:.3f}", 1 / math.sqrt(ess))
    raise ValueError(f"no reference for {sc.name}")


# ------------------------------------------------------------------------------------------------ runs
@dataclass
class Run:
    method: str
    particles: int
    label: str
    options: dict[str, Any] = field(default_factory=dict)
    ms_single: float = math.nan
    ms_batched: float = math.nan
    mean_err: float = math.nan
    var_ratio: float = math.nan
    var_ratio_last: float = math.nan
    #: sqrt(mean_d (m_q − x)²) against the true state x, averaged over steps and sequences (when the reference
    #: carries the truth)
    rmse: float = math.nan
    failed: str | None = None


def _prior(sc: Scenario, streams: int) -> GaussianMixture:
    m0, C0 = prior_moments(sc)
    return GaussianMixture.gaussian(m0.expand(streams, -1), C0.expand(streams, -1, -1))


def _batch_model(model: ModelFamily, streams: int) -> ModelFamily:
    """The one-stream ``model`` for ``streams`` streams (a family whose batch is set by its observations, such as
    ``logistic``, needs it batched too)."""
    return type(model).stack([model] * streams)


def posterior_moments(updater: Any, state: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The belief's mean and covariance (float64): the method's exact density where it keeps one (``kalman``),
    else the weighted moments of its particles."""
    density = updater.density(state)
    if density is not None:
        return density.to(torch.float64).moments()
    return gaussian.moments(state.particles.double(), state.log_weights.double())


FAILURES = (NonFiniteError, ValueError, torch.linalg.LinAlgError)


def _run(updater: Any, model: ModelFamily, obs: torch.Tensor, sc: Scenario, N: int, ref: Reference):
    """Filter the S streams batched, scored against ``ref`` after every step, and stream 0 alone (its first
    ``SINGLE_STREAM_STEPS`` steps, timed only) — both with :func:`~mpflow.operators.filtering.run_filter` →
    (batched run, the single-stream runs: ``SINGLE_STREAM_REPEATS`` of them)."""
    S = obs.shape[0]

    def score(step: FilterStep) -> dict[str, torch.Tensor]:
        mean, cov = posterior_moments(updater, step.state)
        mu, sigma = ref.means[:, step.t - 1], ref.covs[:, step.t - 1]
        scores = {"mean_err": mean_error_sd(mean, mu, sigma), "var_ratio": variance_ratio(cov, sigma).mean(-1)}
        if ref.truth is not None:
            scores["rmse"] = (mean - ref.truth[:, step.t - 1].to(mean.dtype)).pow(2).mean(-1).sqrt()
        return scores

    batched = run_filter(
        updater, _batch_model(model, S), _prior(sc, S), obs, N, list(range(S)), moments=False, on_step=score,
        catch=FAILURES,
    )  # fmt: skip
    if batched.error is not None:
        return batched, None
    single = [
        run_filter(updater, model, _prior(sc, 1), obs[:1, :SINGLE_STREAM_STEPS], N, [0], moments=False, catch=FAILURES)
        for _ in range(SINGLE_STREAM_REPEATS)
    ]
    return batched, single


def run_method(method: str, N: int, model, obs, sc: Scenario, ref: Reference, **options: Any) -> Run:
    label = method
    if method == "mpf":
        label = f"mpf ({options['operator']})" if options.get("operator") else "mpf-base"
        if options.get("max_substeps", 1) > options.get("substeps", 1):
            label += f" K={options['substeps']}→{options['max_substeps']} on low ESS"
        elif options.get("substeps", 1) > 1:
            label += f" K={options['substeps']}"
        if options.get("linearisation") == "stein":
            label += " stein"
    updater = get_updater(method, **options)
    if method == "mpf":
        if updater.uses_marginal(model):  # the marginal particle filter, which takes precedence over correct
            label += " marginal"
        elif options.get("correct"):
            label += " corrected"
        elif options.get("marginal") is False:
            label += " plain"
    if method == "mpf" and (moves := updater.moves(model)):
        label += f" +{moves} moves" + (f" W={options['window']}" if "window" in options else "")
    row = Run(method, N, label, options)
    batched, single = _run(updater, model, obs, sc, N, ref)
    row.failed = batched.error or next((run.error for run in single or () if run.error), None)
    if row.failed:
        row.failed = row.failed[:200]
        return row
    S = obs.shape[0]
    row.ms_batched = statistics.median(ms / S for ms in batched.ms[1:] or batched.ms)  # the first call warms caches
    row.ms_single = min(statistics.median(run.ms[1:] or run.ms) for run in single)
    errs, ratios = batched.values["mean_err"].mean(1), batched.values["var_ratio"].mean(1)
    row.mean_err, row.var_ratio, row.var_ratio_last = float(errs.mean()), float(ratios.mean()), float(ratios[-1])
    if "rmse" in batched.values:
        row.rmse = float(batched.values["rmse"].mean())
    return row


def at_compute(ladder: list[Run], ms: float, regime: str) -> tuple[float, float, bool]:
    """SMC's (error, N) at compute ``ms`` per stream in ``regime`` (``ms_single`` / ``ms_batched``), linear in
    (log ms, log err) between ladder points; the flag says ms was beyond the ladder (end point used)."""
    pts = sorted((getattr(r, regime), r.mean_err, r.particles) for r in ladder if not r.failed)
    if not pts or not math.isfinite(ms):
        return math.nan, math.nan, True
    if ms <= pts[0][0]:
        return pts[0][1], pts[0][2], ms < pts[0][0]
    if ms >= pts[-1][0]:
        return pts[-1][1], pts[-1][2], ms > pts[-1][0]
    for (m1, e1, n1), (m2, e2, n2) in itertools.pairwise(pts):
        if m1 <= ms <= m2:
            f = (math.log(ms) - math.log(m1)) / max(math.log(m2) - math.log(m1), 1e-12)
            err = math.exp(math.log(e1) + f * (math.log(e2) - math.log(e1)))
            return err, math.exp(math.log(n1) + f * (math.log(n2) - math.log(n1))), False
    raise AssertionError("unreachable")


def run_scenario(sc: Scenario, streams: int, quick: bool, gpf: bool) -> dict[str, Any]:
    model, obs = simulate(sc, streams)
    t0 = time.perf_counter()
    ref = reference(sc, model, obs, quick)
    ref_s = time.perf_counter() - t0
    operators = benchmarked_operators(sc.family, sc.dim)
    updater = get_updater("mpf")
    configurations = mpf_configurations(
        operators,
        not model.linear_gaussian,
        quick,
        moves=updater.moves(model) > 0,
        marginal=updater.uses_marginal(model),
    )
    mpf = [run_method("mpf", n, model, obs, sc, ref, **o) for n, o in configurations]
    smc = [run_method("smc", n, model, obs, sc, ref) for n in SMC_LADDER]
    rows = mpf + smc
    if model.linear_gaussian:
        rows.append(run_method("kalman", MPF_PARTICLES, model, obs, sc, ref))
    if gpf:
        rows.append(run_method("gpf", MPF_PARTICLES, model, obs, sc, ref))
    return {
        "scenario": asdict(sc),
        "operator": operators[-1] if operators else None,
        "operators": operators,
        "streams": streams,
        "reference": {"kind": ref.kind, "error_sd": ref.error_sd, "seconds": ref_s},
        "rows": [asdict(r) for r in rows],
        "equal_compute": equal_compute_rows(mpf, smc),
    }


def benchmarked_operators(family: str, dim: int) -> list[str]:
    """The operators whose ``mpf`` rows a scenario runs: the one a plain ``mpf`` stream of (family, d) selects, and
    the newest one a stream may name (``"auto_select": false``), where they differ."""
    records = (find_operator(family, dim), find_operator(family, dim, include_named_only=True))
    return list(dict.fromkeys(r.name for r in records if r is not None))


def mpf_configurations(
    operators: list[str],
    nonlinear: bool,
    quick: bool,
    corrected: tuple[tuple[int, int], ...] = CORRECTED,
    moves: bool = False,
    marginal: bool = False,
) -> list[tuple[int, dict[str, Any]]]:
    """(N, options) of the ``mpf`` rows: each trained operator of ``operators`` as served; the base flow in one
    stage; where its step is the ``marginal`` particle filter (the default on a one-dimensional or factorised
    non-Gaussian family), also the plain flow (``marginal: false``), the budget's row (:func:`default_choice`);
    where the served step runs posterior ``moves`` (static log-concave families), also without them and with
    windows of 1 and 3 (2 is the default); for a ``nonlinear`` likelihood (else the base flow is exact) also in 4
    stages, with Stein's fit at the prior in 1 and 16 stages (1 when ``quick``), and importance-corrected (PF-PF, no
    moves) at each (N, stages) of ``corrected``."""
    rows = [(MPF_PARTICLES, {"operator": name}) for name in operators]
    rows.append((MPF_PARTICLES, {}))
    if marginal:
        rows.append((MPF_PARTICLES, {"marginal": False}))
    if moves:
        rows += [(MPF_PARTICLES, {"moves": 0})] + [(MPF_PARTICLES, {"window": w}) for w in (1, 3)[: 0 if quick else 2]]
    if not nonlinear:
        return rows
    rows.append((MPF_PARTICLES, {"substeps": 4}))
    rows += [
        (MPF_PARTICLES, {"linearisation": "stein", **({"substeps": k} if k > 1 else {})})
        for k in (1, 16)[: 1 if quick else 2]
    ]
    rows += [(n, {"correct": True, **({"substeps": k} if k > 1 else {})}) for n, k in corrected]
    return rows


def equal_compute_rows(rows: list[Run], smc: list[Run]) -> list[dict[str, Any]]:
    """Each of ``rows`` against ``smc``'s ladder at its compute (:func:`at_compute`), in both regimes (the keys
    say ``mpf`` for the method compared, whichever it is)."""
    equal = []
    for row in rows:
        for regime in ("ms_single", "ms_batched"):
            err, n, beyond = at_compute(smc, getattr(row, regime), regime)
            equal.append(
                {
                    "label": row.label,
                    "particles": row.particles,
                    "regime": regime.removeprefix("ms_"),
                    "mpf_err": row.mean_err,
                    "smc_err": err,
                    "smc_particles": n,
                    "beyond_ladder": beyond,
                    "mpf_over_smc": row.mean_err / err,
                }
            )
    return equal


# ------------------------------------------------------------------------------------------------ defaults
def default_choice(result: dict[str, Any]) -> dict[str, Any]:
    """The most accurate configuration whose batched compute is at most ``MAX_COST_RATIO`` × the default budget
    (the flow's fast path: the shipped operator that a stream of method ``mpf`` selects, or else the base flow in
    one stage at N = 256, without the marginal filter where that is its default): among the mpf rows, kalman, gpf,
    and smc at the largest ladder N within that cap. A tie goes to a closed-form method (``CLOSED_FORM``: its
    posterior is exact, not a cloud), then to the cheaper. The plain flow where the marginal filter applies
    (``marginal: false``) sets the budget but is no candidate: its log-evidence runs low at outliers (the Gaussian
    belief's bias, docs/benchmarks.md "Anomaly scores"), and a default's anomaly score must not."""
    rows = [r for r in result["rows"] if not r["failed"]]
    sc = result["scenario"]
    selected = find_operator(sc["family"], sc["dim"])
    served = selected.name if selected is not None else None
    fast = [r for r in rows if r["method"] == "mpf" and r["options"].get("operator") in (None, served)]
    budget = next((r for r in fast if r["options"].get("marginal") is False), fast[0])["ms_batched"]
    cap = MAX_COST_RATIO * budget
    candidates = [
        r for r in rows if r["method"] != "smc" and r["ms_batched"] <= cap and r["options"].get("marginal") is not False
    ]
    smc_within = [r for r in rows if r["method"] == "smc" and r["ms_batched"] <= cap]
    if smc_within:
        candidates.append(max(smc_within, key=lambda r: r["particles"]))
    best = min(candidates, key=lambda r: (round(r["mean_err"], 4), r["method"] not in CLOSED_FORM, r["ms_batched"]))
    others = sorted(
        (f"{r['label']} N={r['particles']} {r['mean_err']:.3f}" for r in candidates if r is not best), key=str
    )
    return {
        "family": sc["family"],
        "state_dim": sc["dim"],
        "method": best["method"],
        "num_particles": best["particles"],
        "options": best["options"],
        "mean_err_sd": round(best["mean_err"], 4),
        "ms_batched": round(best["ms_batched"], 3),
        "budget_ms": round(budget, 3),
        "reason": (
            f"measured most accurate within {MAX_COST_RATIO:.0f}x mpf's cost at N = 256 ({budget:.2f} ms per update, "
            f"{result['streams']} streams batched): {best['label']} N={best['particles']} "
            f"{best['mean_err']:.3f} sd at {best['ms_batched']:.2f} ms; others {', '.join(others)}"
        ),
    }


def write_defaults(
    entries: list[dict[str, Any]],
    meta: dict[str, Any],
    path: Path = DEFAULTS_FILE,
    key: Callable[[dict[str, Any]], Any] = lambda e: e["family"],
) -> None:
    """Put ``entries`` in the service's table: they replace every entry of the same ``key`` (their family; the
    Lorenz-96 benchmark's: family and setting, so one setting is re-measured alone), the other entries (written by
    another benchmark: ``range_bearing``, ``lorenz96``) stay; ``meta`` is recorded under its benchmark's name and each
    entry names the benchmark that measured it."""
    old = json.loads(path.read_text()) if path.exists() else {}
    families = {e["family"] for e in entries}
    replaced = {key(e) for e in entries}
    kept = [e for e in old.get("defaults", []) if key(e) not in replaced]
    sources = old.get("meta", {})
    if "benchmark" in sources:  # the earlier layout: one benchmark's meta
        sources = {sources["benchmark"]: sources}
    entries = [{**e, "benchmark": meta["benchmark"]} for e in entries]
    table_ = sorted(kept + entries, key=lambda e: (e["family"], e["state_dim"], e.get("setting", "")))
    report.write_json(_strict({"meta": {**sources, meta["benchmark"]: meta}, "defaults": table_}), path, indent=1)
    print(f"wrote {path.relative_to(ROOT)} (the service's default methods: {', '.join(sorted(families))})")


# ------------------------------------------------------------------------------------------------ report
def table(results: list[dict[str, Any]]) -> str:
    """Every row, then the equal-compute comparisons: markdown."""
    runs = []
    for res in results:
        sc, ref = res["scenario"], res["reference"]
        name = sc["name"] + (" (outside)" if sc["outside"] else "")
        for r in res["rows"]:
            if r["failed"]:
                runs.append((name, "", r["label"], r["particles"], f"failed: {r['failed'][:60]}", "", "", ""))
                continue
            runs.append(
                (
                    name,
                    f"{ref['kind'].split(',')[0]} ({ref['error_sd']:.1e})",
                    r["label"],
                    r["particles"],
                    f"{r['ms_single']:.2f}",
                    f"{r['ms_batched']:.3f}",
                    f"{r['mean_err']:.4f}",
                    f"{r['var_ratio']:.2f} ({r['var_ratio_last']:.2f})",
                )
            )
    header = ("scenario", "ref (err)", "method", "N", "ms 1 stream", "ms/stream batched", "mean err (sd)", "var ratio")
    return report.markdown_table(header, runs, "lllrrrrl") + "\n\n" + equal_compute_table(results)


def equal_compute_table(results: list[dict[str, Any]]) -> str:
    """The equal-compute comparisons (:func:`equal_compute_rows`) of every result: markdown."""
    equal = [
        (
            res["scenario"]["name"],
            e["label"],
            e.get("particles", ""),
            e["regime"],
            f"{e['mpf_err']:.4f}",
            f"{e['smc_err']:.4f} ({'≥' if e['beyond_ladder'] else ''}{e['smc_particles']:.0f})",
            f"{e['mpf_over_smc']:.2f}",
        )
        for res in results
        for e in res["equal_compute"]
    ]
    return report.markdown_table(
        ("scenario", "method", "N", "regime", "its err", "smc err at its compute (N)", "it / smc"), equal, "llrlrrr"
    )


def defaults_table(defaults: list[dict[str, Any]]) -> str:
    rows = [
        (d["family"], d["state_dim"], d["method"], d["num_particles"], d["mean_err_sd"], d["reason"]) for d in defaults
    ]
    return report.markdown_table(("family", "d", "default", "N", "err (sd)", "why"), rows, "lrlrrl")


def plot(results: list[dict[str, Any]], path: Path) -> None:
    """Mean error against compute per scenario: SMC's ladder as a curve, the other methods as points (each mpf
    point tagged: ``op`` its trained operator, ``K4`` the base flow in 4 stages, ``sK16`` with Stein's fit in 16,
    ``c1/512`` corrected in 1 stage with N = 512);
    filled markers and solid lines for the batched regime, hollow and dotted for one stream."""
    n = len(results)
    cols = min(4, n)
    rows = (n + cols - 1) // cols
    with report.figure(path, rows, cols, squeeze=False) as (fig, grid):
        _draw(results, list(grid.flat))
        handles = {}
        for ax in grid.flat:
            for h, label in zip(*ax.get_legend_handles_labels(), strict=True):
                handles.setdefault(label, h)
        # the legend below the panels, as many columns as fit their width, and the figure grown by its rows
        ncol = min(6, 2 * cols)
        legend_in = 0.22 * math.ceil(len(handles) / ncol) + 0.1
        height = 3.4 * rows + legend_in
        fig.set_size_inches(4.2 * cols, height)
        fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=ncol, fontsize=8)
        fig.tight_layout(rect=(0, legend_in / height, 1, 1))


def _tag(row: dict[str, Any]) -> str:
    """A short name of an mpf configuration for the plot."""
    options = row["options"]
    if options.get("operator"):
        return "op"
    if options.get("marginal") is False:
        return "plain"
    k, top = options.get("substeps", 1), options.get("max_substeps", 1)
    if options.get("correct"):
        return f"c{k}" + ("" if row["particles"] == MPF_PARTICLES else f"/{row['particles']}")
    stein = "s" if options.get("linearisation") == "stein" else ""
    return f"{k}→{top}" if top > k else f"{stein}K{k}"


def _draw(results: list[dict[str, Any]], axes: list[Any]) -> None:
    marker = {"mpf": "*", "kalman": "s", "gpf": "^", "ukf": "D", "enkf": "P"}
    color = {"mpf": "C3", "kalman": "C2", "gpf": "C1", "ukf": "C4", "enkf": "C5"}
    for ax, res in zip(axes, results, strict=False):
        ok = [r for r in res["rows"] if not r["failed"]]
        for regime, style in (("ms_batched", "-"), ("ms_single", ":")):
            which = regime.removeprefix("ms_")
            smc = sorted((r[regime], r["mean_err"], r["particles"]) for r in ok if r["method"] == "smc")
            if smc:
                ns = sorted(n for *_, n in smc)
                ax.plot([m for m, *_ in smc], [e for _, e, _ in smc], style, color="C0", marker=".",
                        label=f"smc, N {ns[0]}…{ns[-1]} ({which})")  # fmt: skip
            for r in (r for r in ok if r["method"] != "smc"):
                m, c, err = r["method"], color[r["method"]], max(r["mean_err"], 1e-6)
                ax.plot([r[regime]], [err], marker[m], color=c, mfc=c if which == "batched" else "none", ms=8,
                        label=f"{m} ({which})")  # fmt: skip
                if m == "mpf":
                    ax.annotate(_tag(r), (r[regime], err), fontsize=5, xytext=(3, 2), textcoords="offset points")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(res["scenario"]["name"] + (" (outside)" if res["scenario"]["outside"] else ""), fontsize=9)
        ax.set_xlabel("ms per stream update")
        ax.set_ylabel("mean error (posterior sd)")
        ax.grid(alpha=0.3, which="both")
    for ax in axes[len(results) :]:
        ax.axis("off")


def _strict(value: Any) -> Any:
    """``value`` with NaN floats as None (strict JSON)."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_strict(v) for v in value]
    return value


def main(argv: list[str] | None = None) -> int:
    p = report.parser("equal_compute", __doc__, "the quick scenarios, 16 streams, a shorter ladder")
    p.add_argument("--streams", type=int, default=None, help="sequences per scenario (64; 16 with --quick)")
    p.add_argument("--scenarios", nargs="*", help="run only these scenario names (default: all, or the quick set)")
    p.add_argument("--gpf", action="store_true", help="also run gpf (slow at d ≥ 5)")
    p.add_argument(
        "--replot",
        action="store_true",
        help="only redraw the PNG from the JSON of an earlier run, and for a full run choose its defaults again "
        "(after an operator's auto_select changed)",
    )
    args = p.parse_args(argv)
    # a run of chosen scenarios is partial: like --quick, it writes the git-ignored equal_compute-quick.*
    stem = report.out_stem(argparse.Namespace(out=args.out, quick=args.quick or bool(args.scenarios)), "equal_compute")
    if args.replot:
        json_path = stem.with_name(stem.name + ".json")
        earlier = json.loads(json_path.read_text())
        plot(earlier["results"], stem.with_name(stem.name + ".png"))
        print(f"redrew {stem.name}.png from {json_path}")
        if not earlier["meta"]["quick"] and earlier["defaults"] and args.out is None:
            earlier["defaults"] = [default_choice(r) for r in earlier["results"] if r["scenario"]["default"]]
            print(defaults_table(earlier["defaults"]))
            report.write_json(_strict(earlier), json_path, indent=1)
            write_defaults(earlier["defaults"], earlier["meta"])
        return 0
    torch.set_num_threads(1)
    streams = args.streams or (16 if args.quick else 64)
    chosen = [s for s in SCENARIOS if (s.name in args.scenarios if args.scenarios else (s.quick or not args.quick))]
    if args.scenarios and len(chosen) != len(args.scenarios):
        p.error(f"--scenarios: unknown name(s); choose from {[s.name for s in SCENARIOS]}")
    load = os.getloadavg()
    t0 = time.perf_counter()
    results = [run_scenario(sc, streams, args.quick, args.gpf) for sc in tqdm(chosen, desc="scenarios")]
    print(table(results))
    defaults = [default_choice(r) for r in results if r["scenario"]["default"]]
    print("\n" + defaults_table(defaults))
    meta = {
        "benchmark": "equal_compute",
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "threads": 1,
        "streams": streams,
        "quick": args.quick,
        "wall_s": round(time.perf_counter() - t0, 1),
        **report.machine_meta(load),
    }
    report.write_outputs(
        _strict({"meta": meta, "results": results, "defaults": defaults}),
        stem,
        lambda path: plot(results, path),
        indent=1,
    )
    if not args.quick and not args.scenarios and args.out is None:
        write_defaults(defaults, meta)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

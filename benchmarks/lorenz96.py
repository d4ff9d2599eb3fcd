"""Lorenz-96 twin experiments at published settings: ``enkf`` against Sakov & Oke 2008, ``smc`` against Bocquet 2010.

``python -m benchmarks.lorenz96 [--quick] [--steps T] [--streams B] [--seed S] [--only SETTING] [--ring PATH]
[--methods M,…] [--merge JSON…]``

Three settings of DAPPER (``dapper/mods/Lorenz96``), all with F = 8 and a perfect model (no model noise); the first
two observe every Δ = 0.05 time units, one RK4 step of 0.05 between observations:

* ``sakov2008``: d = 40, every variable observed, R = I. Published analysis RMSE of a tuned ensemble square-root
  filter at N = 40: 0.18 (Sakov & Oke 2008, Table 1; DAPPER: ``EnKF('Sqrt', N=24, infl=1.013)`` 0.18,
  ``EnKF('PertObs', N=40, infl=1.06)`` 0.22). Run: ``enkf`` (ETKF) at N = 40 over a few inflations ρ (the tuned
  number is the best of them), the perturbed-observation ``enkf`` at ρ = 1.06, and ``ukf``.
* ``bocquet2010``: d = 10, every other variable observed, R = 1.5 I (DAPPER's ``Obs['noise'] = 1.5``, a variance).
  Published bootstrap particle filter RMSE at N = 800: 0.29 (Bocquet, Pires & Wu 2010, Fig. 1; DAPPER's regularised
  ``PartFilt(N=800, NER=0.2, reg=0.8)`` 0.25). Run: ``smc`` at N = 800, resampling below ESS 0.2 N
  (``ess_threshold``) with Liu–West jitter after each resampling (``rejuvenate="always"``, over a few shrinkages a;
  the kernel's jitter sd is √(1 − a²) of the cloud's, DAPPER's ``reg`` a bandwidth of the same kind), the plain SIR
  filter that resamples at every step, and ``enkf``.

* ``spantini2019``: d = 40, Δ = 0.4 (RK4 steps of 0.02), every second variable observed, R = 0.5 (DAPPER's
  ``Obs['noise'] = .5``). Published rmse.a (DAPPER's suggested tuning): ``EnKF('Sqrt', N=40, infl=1.10)`` 2.2,
  N = 100 0.97; ``LETKF(N=40, infl=1.10, loc_rad=4)`` 1.0, N = 100 0.84; ``iEnKS('Sqrt', N=40, Lag=2)`` 0.52. Run:
  the ETKF and the LETKF (``localisation``) at N = 20 … 100, ``ukf``, ``mpf`` at N = 48 and 100, ``smc`` at N = 2000.
  An experiment is lost above RMSE 2.0 here (:data:`SPANTINI_LOST`).

``mpf`` runs every setting (its predictive: the mapped cloud's Gaussian fit, ``ModelFamily.propagate``): the base flow
at N = 48 (it needs N > d), at N = 48 and 64 with enkf's inflation ρ = 1.01 of the predictive's anomalies (with a
linear observation the base flow is an exact Gaussian update, an ensemble square-root filter), the same with the
trained operator for (lorenz96, d) when one is shipped
(:func:`operator_runs`), and on ``bocquet2010`` the importance-corrected flow with Liu–West moves after each
resampling (a perfect model never separates copies) and the corrected flow with a share γ = ``flow_fraction`` of the
likelihood weighted (:mod:`mpflow.operators.mpf.kalman_particle`, the ensemble Kalman particle filter: its kernel
separates the copies). Each ``mpf`` row is compared at equal compute with the
setting's reference method (``enkf``, ``smc``: the lowest RMSE among its rows costing no more per step that kept the
truth on every experiment, :func:`lost_threshold`; the cheaper rows that lost it are listed). ``gpf``,
``kalman`` (and ``svgd``, ``nvgd``) cannot run Lorenz-96 — they push Gaussian moments through an affine transition —
and are reported as refused, with the refusal's message. A full run writes the service's default for ``lorenz96``
of each setting (:func:`default_entry`: at d = 40 in two regimes, keyed by Δ and ``obs_every``) into
``service/engine/default_methods.json``; ``--only SETTING`` replaces that setting's entry alone.

``--ring PATH`` adds rows of the LETKF followed by a trained ring flow (:mod:`mpflow.operators.mpf.ring`, a
``ring.pt`` of :mod:`mpflow.training.ring_train`) on ``RING_PARTICLES``; ``--correction NAME`` adds ``ienkf`` with that
registered learned correction (``method_options.correction``) and its base ``ienkf`` at ``CORRECTION_PARTICLES``
(:func:`learned_runs`; ``ienkf:N:1`` picks the corrected rows); ``--relock NAME`` adds ``ienkf`` re-locking by that
registered ring observer (``method_options.relock``, :mod:`mpflow.operators.updaters.relock`) likewise
(``ienkf+relock`` picks its rows); ``--methods`` runs only the rows named by
method, method:N or method:N:inflation (``enkf:40``, ``enkf:40:1.05``); ``--merge`` joins runs that split one
setting's rows between processes (same twins) into one table — and, for a full-length run, the defaults.

Each setting runs B independent twin experiments as one batch of streams (B = 4, and 64 on ``bocquet2010``, whose
filters lose the truth on a few per cent of long runs; 2 with ``--quick``; ``--seed`` draws another set): a truth
spun up for 1000 steps onto the attractor, its observations, and a prior N(x₀ + ξ, I), ξ ~ N(0, I). The analysis RMSE
of a step is √(mean_i (x̂_i − x_i)²) with x̂ the (weighted) posterior mean; a run's RMSE is its mean over the steps after
the burn-in (DAPPER's ``rmse.a``), and the table gives the mean and spread over the B streams, the published number,
and the ratio to it. Steps: T = 2000 after a burn-in of 200 (``--quick``: 400 after 100). Wall time per step is one
thread, the whole batch. Each row also gives the ensemble spread √(mean_i var_i), averaged the same way (DAPPER's
``spread.a``). Writes ``benchmarks/results/lorenz96.{json,png}`` (``lorenz96-quick.*`` with ``--quick``;
``lorenz96-SETTING.*`` with ``--only``).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from mpflow.operators.models import make_model
from mpflow.operators.models.base import ModelFamily
from mpflow.operators.models.priors import GaussianMixture
from mpflow.operators.mpf.ring import RingLETKF
from mpflow.operators.rng import generator
from mpflow.operators.trained_operators import find_operator
from mpflow.operators.updaters import UPDATERS, get_updater
from mpflow.operators.updaters.ienkf import lorenz96_inflation
from mpflow.service.engine.default_methods import REGIME_KEYS
from mpflow.training.ring_train import load_flow

from benchmarks import report
from benchmarks.equal_compute import MAX_COST_RATIO, write_defaults

SPIN_UP = 1000


@dataclass
class Setting:
    name: str
    d: int
    params: dict[str, Any]
    #: (method, N, options, published RMSE or None, where it is published)
    runs: list[tuple[str, int, dict[str, Any], float | None, str]] = field(default_factory=list)
    #: twin experiments, run as one batch of streams
    streams: int = 4
    #: the per-stream analysis RMSE above which an experiment lost the truth (None: the observation noise's sd,
    #: :func:`lost_threshold`)
    lost_rmse: float | None = None


#: the particle filter's options on ``bocquet2010`` (a shrinkage a is added per row)
BOCQUET_SMC = {"ess_threshold": 0.2, "rejuvenate": "always"}
#: the corrected flow with its share chosen per step on ``bocquet2010``: weights carried, resampled below ESS 0.3 N
#: with smc's Liu–West moves
BOCQUET_AUTO = {
    "correct": True,
    "flow_fraction": "auto",
    "ess_threshold": 0.3,
    "rejuvenate": "always",
    "shrinkage": 0.85,
}

#: DAPPER's ``Lorenz96/spantini2019`` (Spantini, Baptista & Marzouk 2022, Fig. 9): observations Δ = 0.4 apart, RK4
#: steps of 0.02, every second variable observed with R = 0.5 (DAPPER's ``Obs['noise'] = .5``, a variance)
SPANTINI_PARAMS = {"delta": 0.4, "rk4_step": 0.02, "obs_every": 2, "R": 0.5}
#: (N, published rmse.a) of DAPPER's tuned ``EnKF('Sqrt', N, infl=1.10)``
SPANTINI_ETKF = ((20, None), (40, 2.2), (100, 0.97))
#: DAPPER's Gaspari–Cohn half-width per unit of its ``loc_rad`` (``dapper/tools/localization.py``: R = radius · 1.82,
#: √(10/3), so that the taper is exp(−½) at the radius); ``localisation`` here is the half-width itself
DAPPER_GC = 1.82
#: (N, ρ, Gaspari–Cohn half-width, published rmse.a) of the LETKF rows; DAPPER's ``LETKF(N, infl, loc_rad=4)``
#: (half-width 7.28) gets 1.0 (N = 40, ρ = 1.10), 0.89 (N = 60, ρ = 1.02), 0.84 (N = 100, ρ = 1.02)
SPANTINI_LETKF = (
    (20, 1.1, 4, None),
    (40, 1.1, 4, 1.0),
    (40, 1.05, 4, 1.0),
    (40, 1.1, 2, 1.0),
    (60, 1.05, 4, 0.89),
    (100, 1.02, 4, 0.84),
    (100, 1.05, 4, 0.84),
    *((n, rho, 4 * DAPPER_GC, pub) for n, rho, pub in ((40, 1.1, 1.0), (60, 1.02, 0.89), (100, 1.02, 0.84))),
)
#: spantini2019's lost-the-truth line: half the attractor's spread (climatology's rmse.a is 3.6); reading the
#: observed half off the observations gives √0.5 there, but the tuned LETKF at N = 40 is itself at 1.0, and a filter
#: that lost the truth sits near 3.6 (DAPPER's 3D-Var and optimal interpolation: 2.3, 2.5)
SPANTINI_LOST = 2.0
#: (N, ρ, options, published rmse.a) of the iterative EnKF rows (``ienkf``, lag 1); DAPPER's ``iEnKS('Sqrt', N,
#: infl=1.10, Lag=2)``, 10 Gauss–Newton iterations over a window of two observations (21 ensemble forecasts a cycle),
#: gets 0.52 at N = 40 and 0.47 at N = 60
SPANTINI_IENKF = (
    (20, 1.2, {"iterations": 4}, None),
    (20, 1.25, {"iterations": 4}, None),
    (40, 1.2, {"iterations": 4}, 0.52),
    (40, 1.25, {"iterations": 4}, 0.52),
    (60, 1.1, {"iterations": 4}, 0.47),
    (60, 1.25, {"iterations": 4}, 0.47),
)
#: (ρ, options) of the ``ienkf`` rows on sakov2008 (N = 40): Δ = 0.05 is nearly linear, two iterations suffice
SAKOV_IENKF = ((1.02, {}), (1.05, {}), (1.02, {"iterations": 2}))

SETTINGS = [
    Setting(
        "sakov2008",
        40,
        {"R": 1.0, "obs_every": 1},
        [
            *[("enkf", 40, {"inflation": rho}, 0.18, "Sakov & Oke 2008 Table 1") for rho in (1.005, 1.01, 1.02)],
            ("enkf", 40, {"variant": "perturbed", "inflation": 1.06}, 0.22, "DAPPER sakov2008 PertObs"),
            # the LETKF that the ring flow / correction (--ring) follows: their base here
            ("enkf", 40, {"inflation": 1.05, "localisation": 4}, 0.18, "Sakov & Oke 2008 Table 1"),
            ("enkf", 80, {"inflation": 1.01}, 0.18, "Sakov & Oke 2008 Table 1"),
            ("ukf", 40, {}, None, ""),
            ("mpf", 48, {}, 0.18, "Sakov & Oke 2008 Table 1"),
            *[("mpf", n, {"inflation": 1.01}, 0.18, "Sakov & Oke 2008 Table 1") for n in (48, 64)],
            *[("ienkf", 40, {"inflation": rho, **opts}, 0.18, "Sakov & Oke 2008 Table 1") for rho, opts in SAKOV_IENKF],
        ],
    ),
    Setting(
        "bocquet2010",
        10,
        {"R": 1.5, "obs_every": 2},
        [
            *[
                (
                    "smc",
                    800,
                    {**BOCQUET_SMC, "shrinkage": a},
                    0.29,
                    "Bocquet 2010 Fig. 1; DAPPER's regularised PartFilt: 0.25",
                )
                for a in (0.7, 0.75, 0.8, 0.85, 0.9)
            ],
            ("smc", 400, {**BOCQUET_SMC, "shrinkage": 0.8}, 0.29, ""),
            # the plain SIR filter: resampling at every step (ESS ≤ N < 2N)
            ("smc", 800, {**BOCQUET_SMC, "ess_threshold": 2.0, "shrinkage": 0.8}, 0.29, "Bocquet 2010 Fig. 1"),
            # at about the cost of mpf's automatic share at N = 800 (its step costs ~1.3× smc's at the same N)
            *[("smc", 1000, {**BOCQUET_SMC, "shrinkage": a}, 0.29, "") for a in (0.7, 0.8)],
            *[("smc", n, {**BOCQUET_SMC, "shrinkage": 0.85}, 0.29, "") for n in (1600, 3200)],
            ("enkf", 10, {"inflation": 1.04}, None, ""),
            ("mpf", 64, {}, 0.29, ""),
            *[("mpf", n, {"correct": True, "rejuvenate": "always", "shrinkage": 0.9}, 0.29, "") for n in (256, 800)],
            *[
                ("mpf", n, {"correct": True, "flow_fraction": g}, 0.29, "")
                for n, g in ((400, 0.5), (800, 0.5), (800, 0.3))
            ],
            *[("mpf", n, BOCQUET_AUTO, 0.29, "") for n in (400, 800)],
        ],
        streams=64,
    ),
    Setting(
        "spantini2019",
        40,
        SPANTINI_PARAMS,
        [
            *[("enkf", n, {"inflation": 1.1}, pub, "DAPPER spantini2019 EnKF Sqrt") for n, pub in SPANTINI_ETKF],
            *[
                ("enkf", n, {"inflation": rho, "localisation": c}, pub, "DAPPER spantini2019 LETKF")
                for n, rho, c, pub in SPANTINI_LETKF
            ],
            ("ukf", 40, {}, None, ""),
            *[("mpf", n, {}, None, "") for n in (48, 100)],
            *[("mpf", n, {"inflation": rho}, None, "") for n, rho in ((48, 1.05), (100, 1.05), (100, 1.1))],
            ("smc", 2000, {"ess_threshold": 0.2, "rejuvenate": "always", "shrinkage": 0.8}, None, ""),
            *[
                ("ienkf", n, {"inflation": rho, **opts}, pub, "DAPPER spantini2019 iEnKS lag 2")
                for n, rho, opts, pub in SPANTINI_IENKF
            ],
        ],
        lost_rmse=SPANTINI_LOST,
    ),
]
#: the methods that refuse a nonlinear transition, reported with their message
REFUSED = ("gpf", "kalman")
#: the rows compared with the reference method at equal compute (:func:`equal_compute`)
COMPARED = ("mpf", "ring", "ienkf")
#: the methods an ``mpf`` row is compared with at equal compute, per setting (the one with a published number)
REFERENCE_METHOD = {"sakov2008": "enkf", "bocquet2010": "smc", "spantini2019": "enkf"}


def twin(setting: Setting, streams: int, steps: int, seed: int) -> tuple[ModelFamily, torch.Tensor, torch.Tensor, Any]:
    """(model of B streams, truths [B, T, d], observations [B, T, k], prior): B twin experiments."""
    one = make_model("lorenz96", setting.params, setting.d, torch.float64)
    model = type(one).stack([one] * streams)
    gens = [generator(seed + b) for b in range(streams)]
    x = 8.0 + torch.stack([torch.randn(setting.d, generator=g, dtype=torch.float64) for g in gens])
    for _ in range(SPIN_UP):
        x = model.transition_mean(x[:, None])[:, 0]
    xs, obs = model.simulate(steps, x, gens)
    shift = torch.stack([torch.randn(setting.d, generator=g, dtype=torch.float64) for g in gens])
    prior = GaussianMixture.gaussian(x + shift, torch.eye(setting.d, dtype=torch.float64).expand(streams, -1, -1))
    return model.to(torch.float32), xs, obs.to(torch.float32), prior


def lost_threshold(model: ModelFamily) -> float:
    """The analysis RMSE above which an experiment has lost the truth: the observation noise's sd, the error of
    reading the observed variables off the observations themselves (a filter that tracks is several times below
    it; one that lost the truth sits at the attractor's spread, about 3.6 at F = 8)."""
    return float(model.observation_sd().max())


def filter_rmse(
    method: str, n: int, options: dict[str, Any], model, xs, obs, prior, burn_in: int, lost_rmse: float | None = None
) -> dict[str, Any]:
    """Run the method over every step: per-stream mean analysis RMSE after ``burn_in`` (their mean, spread and
    median, and the mean over the streams that kept the truth), the ensemble spread √(mean_i var_i) averaged the same
    way (DAPPER's ``spread.a``: a calibrated filter's is close to its RMSE), how many streams lost the truth (RMSE
    above ``lost_rmse``, default :func:`lost_threshold`), the RMSE curve (mean over streams), the wall time per
    step and, for ``ienkf`` with ``relock``, each stream's re-locks over the run."""
    u = make_updater(method, options)
    B, T, _ = xs.shape
    state = u.init(prior, model, n, seed=[100 + b for b in range(B)])
    curve, spreads, diverged, relocks = [], [], None, torch.zeros(B, dtype=torch.int64)
    t0 = time.perf_counter()
    for m in range(T):
        try:
            state, info = u.update(state, obs[:, m], model)
        except (ValueError, ArithmeticError) as exc:  # a cloud gone non-finite or degenerate: the filter diverged
            diverged = {"step": m, "error": f"{type(exc).__name__}: {exc}"[:200]}
            break
        if "relocked" in info.extras:
            relocks += info.extras["relocked"].long()
        w = torch.softmax(state.log_weights.double(), -1)
        x = state.particles.double()
        mean = (w[..., None] * x).sum(1)
        curve.append((mean - xs[:, m]).pow(2).mean(-1).sqrt())
        spreads.append((w[..., None] * (x - mean[:, None]).pow(2)).sum(1).mean(-1).sqrt())
    ms = 1000 * (time.perf_counter() - t0) / max(len(curve), 1)
    if diverged is not None:  # every stream counts as lost; the RMSE is that of the steps it ran
        curve = curve or [torch.full((B,), float("inf"), dtype=torch.float64)]
        spreads = spreads or [torch.zeros(B, dtype=torch.float64)]
    start = burn_in if len(curve) > burn_in else 0
    rmse = torch.stack(curve, 1).nan_to_num(1e6, 1e6, 1e6)  # [B, T]
    per_stream = rmse[:, start:].mean(1)
    spread = torch.stack(spreads, 1)[:, start:].mean(1).nan_to_num(1e6, 1e6, 1e6)
    lost = per_stream > (lost_threshold(model) if lost_rmse is None else lost_rmse)
    if diverged is not None:
        lost[:] = True
    return {
        "diverged": diverged,
        "spread": float(spread.mean()),
        "rmse": float(per_stream.mean()),
        "rmse_sd_over_streams": float(per_stream.std()) if B > 1 else 0.0,
        "rmse_median": float(per_stream.median()),
        "rmse_kept": float(per_stream[~lost].mean()) if not bool(lost.all()) else None,
        "rmse_per_stream": [round(float(v), 4) for v in per_stream],
        "streams_lost": int(lost.sum()),
        "ms_per_step": round(ms, 2),
        "curve": [round(float(v), 4) for v in rmse.mean(0)],
        **({"relocks_per_stream": relocks.tolist()} if "relock" in options else {}),
    }


#: ``--ring PATH``: the trained flow after the LETKF (:mod:`mpflow.operators.mpf.ring`), rows ``ring`` per setting
RING_PARTICLES = {"sakov2008": (40,), "spantini2019": (40, 100)}


def ring_runs(setting: Setting, path: str | None) -> list[tuple[str, int, dict[str, Any], float | None, str]]:
    """Rows of the LETKF + ring flow trained in ``path`` (a ``ring.pt`` of :mod:`mpflow.training.ring_train`), with
    the LETKF options it was trained after, at the setting's ``RING_PARTICLES``."""
    if path is None or setting.name not in RING_PARTICLES:
        return []
    _, base = load_flow(path)
    return [("ring", n, {**base, "flow": str(path)}, None, "") for n in RING_PARTICLES[setting.name]]


#: ``--correction NAME`` / ``--relock NAME``: the ienkf + learned correction (or re-lock) rows and its base ienkf (ρ by
#: ``lorenz96_inflation`` of the setting's Δ, at most 4 iterations) at these N — the base also at the larger N that
#: cost what the correction adds
CORRECTION_PARTICLES = {"sakov2008": ((40,), (40,)), "spantini2019": ((40,), (40, 44, 48))}


def learned_runs(setting: Setting, name: str | None, option: str = "correction") -> list[tuple]:
    """Rows of ``ienkf`` with the registered operator ``name`` as its ``option`` (``correction``: ρ by its rule;
    ``relock``: ρ the rule's, given) and of its base ``ienkf`` alone."""
    if name is None or setting.name not in CORRECTION_PARTICLES:
        return []
    rho = round(float(lorenz96_inflation(setting.params.get("delta", 0.05))), 4)
    learned, base = CORRECTION_PARTICLES[setting.name]
    have = [run[:3] for run in setting.runs]
    given = {} if option == "correction" else {"inflation": rho}
    return [
        *[("ienkf", n, {**given, "iterations": 4, option: name}, None, "") for n in learned],
        *[
            ("ienkf", n, {"inflation": rho, "iterations": 4}, None, "")
            for n in base
            if ("ienkf", n, {"inflation": rho, "iterations": 4}) not in have
        ],
    ]


def make_updater(method: str, options: dict[str, Any]):
    """The registered method with ``options``, or (``ring``) the LETKF + trained ring flow of ``options["flow"]``."""
    if method != "ring":
        return get_updater(method, **options)
    flow, _ = load_flow(options["flow"])
    return RingLETKF(flow, **{k: v for k, v in options.items() if k != "flow"})


def operator_runs(setting: Setting) -> list[tuple[str, int, dict[str, Any], float | None, str]]:
    """The setting's ``mpf`` base-flow rows again with the trained operator for (lorenz96, d), when one is shipped
    (or found in ``$MPFLOW_OPERATOR_DIRS``): the learned residual on top of the same flow, at the same N."""
    record = find_operator("lorenz96", setting.d, include_named_only=True)
    if record is None:
        return []
    return [
        (method, n, {**options, "operator": record.name}, published, source)
        for method, n, options, published, source in setting.runs
        if method == "mpf" and not set(options) - {"inflation"}
    ]


def row_names(run: tuple) -> set[str]:
    """The names ``--methods`` picks a row by: method, method:N and method:N:ρ (its ``inflation``, 1 unless given);
    a row with a ``relock`` also by method+relock and method+relock:N."""
    method, n, options = run[:3]
    if "relock" in options:
        return {f"{method}+relock", f"{method}+relock:{n}"}
    return {method, f"{method}:{n}", f"{method}:{n}:{options.get('inflation', 1.0):g}"}


def run_setting(
    setting: Setting,
    streams: int,
    steps: int,
    burn_in: int,
    seed: int = 0,
    ring: str | None = None,
    rows: set[str] | None = None,
    correction: str | None = None,
    relock: str | None = None,
) -> dict[str, Any]:
    """Every row of ``setting`` on the same ``streams`` twin experiments (one batch; ``seed``: their truths'), and the
    ring flow's rows with ``ring``; ``rows``: only the rows named there (:func:`row_names`)."""
    model, xs, obs, prior = twin(setting, streams, steps + burn_in, seed=seed)
    out_rows = []
    runs = [*setting.runs, *operator_runs(setting), *ring_runs(setting, ring), *learned_runs(setting, correction)]
    runs += learned_runs(setting, relock, "relock")
    for method, n, options, published, source in (r for r in runs if rows is None or row_names(r) & rows):
        out = filter_rmse(method, n, options, model, xs, obs, prior, burn_in, setting.lost_rmse)
        ratio = out["rmse"] / published if published else None
        out_rows.append(
            {
                "method": method,
                "N": n,
                "options": options,
                "published": published,
                "source": source,
                "ratio_to_published": ratio,
                **out,
            }
        )
        print(
            f"  {setting.name} {method} N={n} {options}: RMSE {out['rmse']:.3f}, spread {out['spread']:.3f} "
            f"({out['streams_lost']} lost; {out['ms_per_step']} ms/step)",
            flush=True,
        )
    refused = {method: UPDATERS[method].refusal(type(model)) for method in REFUSED}
    result = {
        "setting": setting.name,
        "d": setting.d,
        "params": setting.params,
        "streams": streams,
        "seed": seed,
        "rows": out_rows,
        "refused": refused,
    }
    result["equal_compute"] = equal_compute(result)
    return result


def equal_compute(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Each ``mpf`` row against the setting's reference method (``REFERENCE_METHOD``) given at most the same
    compute: the reference's lowest RMSE among its rows that cost no more per step and kept the truth on every
    experiment (None when there is none). The cheaper reference rows that lost it on some experiment are listed
    (``reference_lost``: the reference fails at that budget — a ratio against its RMSE would compare with a filter
    that diverged, not one that was beaten). ``mpf_streams_lost``: the ``mpf`` row's own lost experiments."""
    ref = REFERENCE_METHOD[result["setting"]]
    out = []
    for row in (r for r in result["rows"] if r["method"] in COMPARED):
        within = [r for r in result["rows"] if r["method"] == ref and r["ms_per_step"] <= row["ms_per_step"]]
        held = [r for r in within if not r["streams_lost"]]
        best = min(held, key=lambda r: r["rmse"]) if held else None
        out.append(
            {
                "mpf": f"{row['method']} N={row['N']} " + (_options(row) or "base flow"),
                "mpf_rmse": row["rmse"],
                "mpf_ms": row["ms_per_step"],
                "mpf_streams_lost": row["streams_lost"],
                "reference": ref,
                "reference_rmse": best["rmse"] if best else None,
                "reference_N": best["N"] if best else None,
                "reference_ms": best["ms_per_step"] if best else None,
                "mpf_over_reference": row["rmse"] / best["rmse"] if best else None,
                "reference_lost": [_lost(r) for r in within if r["streams_lost"]],
            }
        )
    return out


def _options(row: dict[str, Any]) -> str:
    """A row's options in words (a ring flow's file by its name)."""
    opts = {k: (os.path.basename(v) if k == "flow" else v) for k, v in row["options"].items()}
    return ", ".join(f"{k}={v}" for k, v in opts.items())


def _lost(row: dict[str, Any]) -> str:
    """A row that lost the truth on some experiments, in words: ``smc N=400 (a=0.8): 2 of 4 lost``."""
    a = row["options"].get("shrinkage")
    every_step = row["options"].get("ess_threshold", 0) >= 1  # resampling at every step: the SIR filter
    shrinkage = f" (a={a}{', SIR' if every_step else ''})" if a else ""
    return f"{row['method']} N={row['N']}{shrinkage}: {row['streams_lost']} of {len(row['rmse_per_stream'])} lost"


def default_entry(result: dict[str, Any], streams: int) -> dict[str, Any]:
    """The service's default for ``lorenz96`` at the setting's d, by the rule of the other families
    (:func:`benchmarks.equal_compute.default_choice`): the lowest analysis RMSE (to the published precision, two
    decimals; the cheaper wins a tie) among the rows costing at most ``MAX_COST_RATIO`` × the cheapest ``mpf`` row,
    per update (a step of the batch over its streams), and keeping the truth on every experiment."""
    per_update = {id(r): r["ms_per_step"] / streams for r in result["rows"]}
    budget = min(per_update[id(r)] for r in result["rows"] if r["method"] == "mpf")
    cap = MAX_COST_RATIO * budget
    candidates = [r for r in result["rows"] if per_update[id(r)] <= cap and not r["streams_lost"]]
    best = min(candidates, key=lambda r: (round(r["rmse"], 2), r["ms_per_step"]))

    def named(r: dict[str, Any]) -> str:  # a learned operator a row runs (ienkf's relock) is named in the reason
        options = UPDATERS[r["method"]].learned_options if r["method"] in UPDATERS else ()
        learned = "".join(f" {k}={r['options'][k]}" for k in options if k in r["options"])
        return f"{r['method']} N={r['N']}{learned}"

    others = sorted(f"{named(r)} {r['rmse']:.3f}" for r in candidates if r is not best)
    model = make_model("lorenz96", result["params"], result["d"], torch.float64)
    return {
        "family": "lorenz96",
        "state_dim": result["d"],
        "setting": result["setting"],
        "params": result["params"],
        # the model parameters a stream's default is matched on (:mod:`mpflow.service.engine.default_methods`)
        "regime": {k: float(model.params[k][0]) for k in REGIME_KEYS},
        "method": best["method"],
        "num_particles": best["N"],
        "options": best["options"],
        "analysis_rmse": round(best["rmse"], 4),
        "ms_batched": round(per_update[id(best)], 3),
        "budget_ms": round(budget, 3),
        "reason": (
            f"measured most accurate within {MAX_COST_RATIO:.0f}x mpf's cost ({budget:.2f} ms per update, "
            f"{streams} streams batched) on Lorenz-96 {result['setting']} (params {result['params']}): "
            f"{named(best)} analysis RMSE {best['rmse']:.3f}; others {', '.join(others)}"
        ),
    }


def equal_compute_table(results: list[dict[str, Any]]) -> str:
    body = [
        [
            r["setting"],
            e["mpf"],
            f"{e['mpf_rmse']:.3f}",
            e["mpf_ms"],
            f"{e['reference']} N={e['reference_N']}" if e["reference_N"] else f"{e['reference']}: none as cheap",
            "—" if e["reference_rmse"] is None else f"{e['reference_rmse']:.3f}",
            "—" if e["reference_ms"] is None else e["reference_ms"],
            "—" if e["mpf_over_reference"] is None else f"{e['mpf_over_reference']:.2f}",
            "; ".join(e["reference_lost"]) or "—",
        ]
        for r in results
        for e in r["equal_compute"]
    ]
    header = [
        "setting",
        "mpf",
        "RMSE",
        "ms/step",
        "reference at ≤ its compute, every experiment kept",
        "RMSE",
        "ms/step",
        "mpf / ref",
        "cheaper reference rows that lost the truth",
    ]
    return report.markdown_table(header, body, "llrrlrrrl")


def table(results: list[dict[str, Any]]) -> str:
    def fmt(v: float | None, spec: str = ".3f") -> str:
        return "—" if v is None else format(v, spec)

    body = []
    for r in results:
        for row in r["rows"]:
            opts = _options(row) or "defaults"
            body.append(
                [
                    r["setting"],
                    row["method"],
                    row["N"],
                    opts,
                    f"{row['rmse']:.3f} ± {row['rmse_sd_over_streams']:.3f}" + _lost_note(row),
                    f"{row['rmse_median']:.3f}",
                    fmt(row["published"], ".2f") + (f" ({row['source']})" if row["source"] else ""),
                    fmt(row["ratio_to_published"], ".2f"),
                    row["ms_per_step"],
                ]
            )
        for method in r["refused"]:
            body.append([r["setting"], method, "—", "refused (nonlinear transition; message in the JSON)", *["—"] * 5])
    header = ["setting", "method", "N", "options", "analysis RMSE", "median", "published", "ratio", "ms/step"]
    return report.markdown_table(header, body, "llrllrrrr")


def _lost_note(row: dict[str, Any]) -> str:
    """`` (2 lost; the rest 0.241)`` for a row that lost the truth on some experiments, else empty."""
    if row.get("diverged"):
        return f" (diverged at step {row['diverged']['step']})"
    if not row["streams_lost"]:
        return ""
    rest = "—" if row["rmse_kept"] is None else f"{row['rmse_kept']:.3f}"
    return f" ({row['streams_lost']} lost; the rest {rest})"


def _label(row: dict[str, Any]) -> str:
    opts = ",".join(f"{k}={v}" for k, v in row["options"].items() if k not in ("rejuvenate", "ess_threshold"))
    return f"{row['method']} N={row['N']} {opts}".strip()


#: a colour per method in the accuracy-against-cost panel (grey for any other)
METHOD_COLOURS = {"mpf": "C0", "smc": "C3", "enkf": "C2", "ukf": "C1", "ring": "C4", "ienkf": "C5"}


def plot(results: list[dict[str, Any]], burn_in: int, path) -> None:
    """Top: each row's analysis RMSE over the steps (a 50-step running mean); bottom: accuracy against cost, one
    point per row (the equal-compute picture: lower and further left is better)."""
    with report.figure(path, 2, len(results), figsize=(7 * len(results), 9), squeeze=False) as (_, axes):
        for col, r in enumerate(results):
            top, bottom = axes[0][col], axes[1][col]
            published = next((row["published"] for row in r["rows"] if row["published"]), None)
            for row in r["rows"]:
                curve = torch.tensor(row["curve"])
                smooth = curve.unfold(0, 50, 1).mean(-1) if curve.numel() >= 50 else curve
                top.plot(smooth, lw=0.8, label=f"{_label(row)}: {row['rmse']:.3f}")
                colour = METHOD_COLOURS.get(row["method"], "C7")
                rmse = min(row["rmse"], 2.0)
                bottom.scatter(row["ms_per_step"], rmse, color=colour, marker="^" if row["streams_lost"] else "o")
                bottom.annotate(
                    _label(row), (row["ms_per_step"], rmse), fontsize=6, xytext=(3, 2), textcoords="offset points"
                )
            for ax in (top, bottom):
                if published:
                    ax.axhline(published, color="k", ls="--", lw=1, label=f"published {published}")
                ax.set_yscale("log")
            top.axvline(burn_in, color="grey", ls=":", lw=1)
            top.set(
                title=f"Lorenz-96 {r['setting']} (d = {r['d']})", xlabel="step", ylabel="analysis RMSE (50-step mean)"
            )
            top.legend(fontsize=6, ncol=2)
            bottom.set(
                title="accuracy against cost (triangle: an experiment lost)",
                xlabel=f"ms per step ({r['streams']} streams batched, one thread)",
                ylabel="analysis RMSE (above 2 drawn at 2)",
            )


def merged(paths: list[str]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(results, meta) of runs that split one benchmark's rows between processes (``--methods``): the rows of each
    setting concatenated, its equal-compute table recomputed. The runs must share the twins (seed, streams, steps,
    burn-in); the meta is the first run's, with each part's wall time and machine load."""
    parts = [json.loads(Path(p).read_text()) for p in paths]
    first = parts[0]["meta"]
    twins = ("steps", "burn_in", "quick", "streams")
    for part in parts[1:]:
        if any(part["meta"][k] != first[k] for k in twins):
            raise SystemExit(f"--merge: the runs differ in {[k for k in twins if part['meta'][k] != first[k]]}")
    results: dict[str, dict[str, Any]] = {}
    for part in parts:
        for r in part["results"]:
            if r["setting"] in results:
                if r["seed"] != results[r["setting"]]["seed"]:
                    raise SystemExit(f"--merge: {r['setting']} was run with seeds {r['seed']} and another")
                results[r["setting"]]["rows"] += r["rows"]
            else:
                results[r["setting"]] = dict(r)
    for r in results.values():
        r["equal_compute"] = equal_compute(r)
    meta = {**first, "parts": [{k: part["meta"].get(k) for k in ("wall_s", "load_average_after")} for part in parts]}
    return list(results.values()), meta


def main(argv: list[str] | None = None) -> int:
    p = report.parser("lorenz96", __doc__, "400 steps after a burn-in of 100, 2 streams")
    p.add_argument("--steps", type=int, default=None, help="steps after the burn-in (2000; 400 with --quick)")
    p.add_argument(
        "--streams", type=int, default=None, help="twin experiments per setting (4, 64 for bocquet2010; 2 with --quick)"
    )
    p.add_argument("--seed", type=int, default=0, help="the twin experiments' seed (0)")
    p.add_argument("--only", choices=[s.name for s in SETTINGS], default=None, help="run one setting")
    p.add_argument("--ring", default=None, help="a ring.pt (mpflow.training.ring_train): add its LETKF + flow rows")
    p.add_argument("--correction", default=None, help="a registered ring correction: add ienkf + it and its base")
    p.add_argument("--relock", default=None, help="a registered ring observer: add ienkf re-locking by it and its base")
    p.add_argument(
        "--methods",
        default=None,
        help="comma-separated: run only these rows, by method, method:N or method:N:inflation (enkf:40:1.05, ring)",
    )
    p.add_argument(
        "--merge",
        nargs="+",
        default=None,
        help="JSON results of runs that split the rows (--methods) on the same twins: one table, and the defaults "
        "of a full-length run",
    )
    args = p.parse_args(argv)
    rows = None if args.methods is None else set(args.methods.split(","))
    torch.set_num_threads(1)
    steps = args.steps or (400 if args.quick else 2000)
    burn_in = 100 if args.quick else 200
    load = os.getloadavg()
    t0 = time.perf_counter()
    if args.merge:
        results, meta = merged(args.merge)
        steps, burn_in = meta["steps"], meta["burn_in"]
        standard = (steps, meta["quick"], args.seed) == (2000, False, 0) and all(r["seed"] == 0 for r in results)
    else:
        settings = [s for s in SETTINGS if args.only in (None, s.name)]
        results = [
            run_setting(
                s,
                args.streams or (2 if args.quick else s.streams),
                steps,
                burn_in,
                args.seed,
                args.ring,
                rows,
                args.correction,
                args.relock,
            )
            for s in settings
        ]
        meta = {
            "benchmark": "lorenz96" if args.only is None else f"lorenz96-{args.only}",
            "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "threads": 1,
            "streams": {r["setting"]: r["streams"] for r in results},
            "steps": steps,
            "burn_in": burn_in,
            "quick": args.quick,
            "wall_s": round(time.perf_counter() - t0, 1),
            **report.machine_meta(load),
        }
        standard = (args.steps, args.streams, args.seed, args.ring, args.methods, args.correction, args.relock) == (
            (None, None, 0, None, None, None, None)
        )
        standard = standard and not args.quick
    print(table(results))
    print("\n" + equal_compute_table(results))
    defaults = [default_entry(r, r["streams"]) for r in results if any(row["method"] == "mpf" for row in r["rows"])]
    report.write_outputs(
        {"meta": meta, "results": results, "defaults": defaults},
        report.out_stem(args, meta["benchmark"]),
        lambda path: plot(results, burn_in, path),
        indent=1,
    )
    if args.out is None and standard:  # --only replaces that setting's entry alone
        write_defaults(defaults, meta, key=lambda e: (e["family"], e.get("setting")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

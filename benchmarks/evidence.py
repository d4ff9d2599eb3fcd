"""The anomaly scores against exact and long-run references: per-step log-evidence increments and predictive
p-values (PIT) of every method.

1. Real data. The GBP/USD daily log-returns of 1997–98 (``examples/datasets/gbp_usd_daily.csv``, 750 days) under
   the stochastic-volatility model with Pitt & Shephard's parameters and its stationary prior
   (:mod:`benchmarks.evidence_reference`). Reference: a 1000-point grid filter (exact to grid error, reported as the
   difference from a 500-point one), checked against ``particles``' bootstrap filter (N = 10⁵, run live when the
   package is importable, else its stored figures, ``benchmarks/results/evidence_reference.json``). Per method
   (the default — no method, no N —, every ``mpf`` variant that serves as a default somewhere at N = 256, ``smc`` at
   4096, the others beside; ``mpf`` runs the marginal particle filter here unless ``marginal: false`` asks for the
   plain flow): the total log-evidence error, the worst step's error, the error on day 144 (return
   +2.17) and the worst error at the 1 % most surprising steps (lowest reference increment).
2. Families. Simulated streams of ``lds``, ``linear_gaussian`` (Kalman exact), ``stochastic_volatility`` d = 1 and
   d = 5 (the grid per dimension; at d = 5 ``smc`` one filter per dimension, its default, against joint weights)
   and ``gmm`` (static grid): per method the mean and worst |increment error| and the worst at the 1 % most
   surprising steps.
3. Calibration. 2000 steps simulated from SV (d = 1 and 5) and ``lds``, the default method: the Kolmogorov–Smirnov
   p-value of the pit values against U(0, 1) and the fraction flagged at a 1 % two-sided level (expected 1 %).

4. Bias (``--only bias``, not in the default run). The real-data run's per-step error averaged over ``--seeds``
   seeds (32 by default) of ``mpf`` (the marginal filter, its default here), the plain flow (``marginal: false``)
   and ``smc`` (SQMC) at N = 256: the bias b_t =
   mean_s (log Ẑ_t,s − log Z_t) with its standard error, the largest |b_t|, the steps where |b_t| > 0.1 (issue 39's
   bound on a flow's bias at N = 256) and by more than two standard errors, and, per seed, whether the total is within
   0.2 and every step within 0.1 — which separates an estimator's bias from the spread of a 256-point cloud.
   Each row also gives the filtered posterior's error against the grid's (the mean's error in the grid's posterior
   sd, and the ratio of the sds, averaged over seeds and days) and its wall time; ``--operator NAME`` (repeatable)
   adds ``mpf`` with that trained operator (found on ``MPFLOW_OPERATOR_DIRS`` like any other). A row whose steps
   report ``log_evidence_sd`` (the marginal filter) also gives how that standard error stands against its errors
   (:func:`sd_calibration`).

Writes ``benchmarks/results/evidence.json`` and ``evidence.png`` (the GBP/USD run: returns, the filtered
volatility band, flagged days; ``--out``: the JSON elsewhere). ``--quick`` runs fewer seeds and steps; ``--seeds``
sets the real data's seeds per method row (default 4), run as one batch of streams (stream b seeded 1000 b, as it
would be alone).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import scipy.stats
import torch
from mpflow.operators.models import make_model
from mpflow.operators.models.priors import GaussianMixture
from mpflow.operators.references import kalman_filter
from mpflow.operators.references.grid import diagonal_grid_evidence, static_grid_evidence
from mpflow.operators.rng import generator
from mpflow.operators.updaters import get_updater
from mpflow.service.engine import default_methods
from mpflow.service.engine.default_methods import default_method

from benchmarks import evidence_reference

RESULTS = Path(__file__).resolve().parent / "results"
F64 = torch.float64
#: the two-sided level of the flag
ALPHA = 0.01
#: day 144 (index 143): return +2.17, the largest surprise of the series
OUTLIER = 143


#: the plain flow's options: without the marginal particle filter that ``mpf`` runs on this family by default
PLAIN = {"marginal": False}


def sv_model(d: int = 1, params: dict | None = None, dtype=torch.float32):
    return make_model("stochastic_volatility", params or evidence_reference.PARAMS, d, dtype)


def stationary_prior(d: int, mu: float, phi: float, sigma: float) -> GaussianMixture:
    var = sigma**2 / (1 - phi**2)
    return GaussianMixture.gaussian(torch.full((1, d), mu, dtype=F64), torch.eye(d, dtype=F64)[None] * var)


def run(method: str, options: dict, n: int, seed: int, model, prior, obs: torch.Tensor) -> dict[str, np.ndarray]:
    """Filter obs [B, T, *shape] → increments [B, T], pit [B, T, k] (NaN if none), filtered mean and sd [B, T, d]."""
    up = get_updater(method, **options)
    B = obs.shape[0]
    prior_b = GaussianMixture(*(t.expand(B, *t.shape[1:]) for t in (prior.weights, prior.means, prior.covs)))
    state = up.init(prior_b, model, n, [seed + 1000 * b for b in range(B)])
    inc, pit, mean, sd, inc_sd = [], [], [], [], []
    start = time.perf_counter()
    for t in range(obs.shape[1]):
        state, info = up.update(state, obs[:, t], model)
        inc.append(info.log_evidence_increment.numpy())
        inc_sd.append(info.extras.get("log_evidence_sd"))
        p = info.extras.get("pit")
        pit.append(np.full((B, 1), np.nan) if p is None else p.numpy())
        w = torch.softmax(state.log_weights.double(), -1)[..., None]
        m = (w * state.particles.double()).sum(1)
        mean.append(m.numpy())
        sd.append(((w * (state.particles.double() - m[:, None]) ** 2).sum(1)).sqrt().numpy())
    wall = time.perf_counter() - start
    return {
        "inc": np.stack(inc, 1),
        "pit": np.stack(pit, 1),
        "mean": np.stack(mean, 1),
        "sd": np.stack(sd, 1),
        "sd_inc": None if any(v is None for v in inc_sd) else torch.stack(inc_sd, 1).numpy(),
        "wall_s": wall,
    }


def default_mpf_variants() -> list[tuple[str, dict]]:
    """(label, options) of every ``mpf`` configuration that serves as a default somewhere (the options of the
    default-method table, ``service/engine/default_methods.json``), each once."""
    seen, out = set(), []
    for entry in default_methods.table():
        if entry["method"] != "mpf":
            continue
        key = json.dumps(entry["options"], sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append((" ".join(f"{k}={v}" for k, v in entry["options"].items()), entry["options"]))
    return out


def errors(inc: np.ndarray, ref: np.ndarray) -> dict[str, float]:
    """Increment errors against the reference (both [B, T]): total (mean over streams), mean and worst |error|, the
    worst |error| at the 1 % steps with the lowest reference increment (the most surprising)."""
    e = inc - ref
    k = max(1, round(0.01 * ref.size))
    surprising = np.argsort(ref.reshape(-1))[:k]
    return {
        "total_error": float(e.sum(1).mean()),
        "mean_abs_error": float(np.abs(e).mean()),
        "worst_error": float(e.reshape(-1)[np.argmax(np.abs(e))]),
        "worst_at_surprising": float(e.reshape(-1)[surprising][np.argmax(np.abs(e.reshape(-1)[surprising]))]),
    }


# ---------------------------------------------------------------------------------------------------- 1. real data
def particles_reference(stored: Path) -> dict:
    """``particles``' bootstrap filter: run live when importable (3 runs of N = 10⁵), else the stored figures."""
    try:
        import particles  # noqa: F401
    except ImportError:
        data = json.loads(stored.read_text())
        data["source"] = f"stored: {stored.name}"
        return data
    data = evidence_reference.returns()
    runs = [evidence_reference.run(data, 100_000, seed) for seed in range(3)]
    inc = np.stack([r[0] for r in runs])
    return {
        "source": "live",
        "log_evidence": float(inc.sum(1).mean()),
        "log_evidence_sd": float(inc.sum(1).std(ddof=1)),
        "increments": inc.mean(0).tolist(),
        "increment_sd": inc.std(0, ddof=1).tolist(),
    }


def real_data(quick: bool, seeds: int) -> dict:
    y = torch.tensor(evidence_reference.returns())
    p = evidence_reference.PARAMS
    model = sv_model()
    prior = stationary_prior(1, p["mu"], p["phi"], p["sigma"])
    obs = y.reshape(1, -1, 1).float()
    grid = {}
    for points in (500, 1000):
        _, _, lz = diagonal_grid_evidence(
            sv_model(dtype=F64), prior.means[0, 0], prior.covs[0, 0].diagonal(), y.reshape(1, -1, 1), points, 10.0
        )
        grid[points] = lz[0].numpy()
    ref = grid[1000]
    pref = particles_reference(RESULTS / "evidence_reference.json")
    p_inc = np.array(pref["increments"])
    default = default_method("stochastic_volatility", 1, False)
    rows = [("default", default.method, default.options, default.num_particles or 256, seeds)]
    variants = default_mpf_variants()
    rows += [(f"mpf {label}".strip(), "mpf", options, 256, seeds) for label, options in variants]
    rows += [("mpf", "mpf", {}, 256, seeds)] if {} not in [options for _, options in variants] else []
    rows += [  # the plain flow and its other estimates (the marginal filter, the default here, takes precedence)
        ("mpf marginal=False", "mpf", PLAIN, 256, seeds),
        ("mpf mixture marginal=False", "mpf", {"evidence": "mixture", **PLAIN}, 256, seeds),
        ("mpf correct marginal=False", "mpf", {"correct": True, **PLAIN}, 256, seeds),
        ("mpf correct mixture marginal=False", "mpf", {"correct": True, "evidence": "mixture", **PLAIN}, 256, seeds),
        ("smc", "smc", {}, 4096, seeds),
        ("smc qmc=False", "smc", {"qmc": False}, 4096, seeds),
        ("smc", "smc", {}, 256, seeds),
        ("smc qmc=False", "smc", {"qmc": False}, 256, seeds),
        ("gpf", "gpf", {}, 256, 1 if quick else 2),
        ("svgd", "svgd", {}, 256, 0 if quick else 1),
        ("nvgd", "nvgd", {}, 256, 0 if quick else 1),
    ]
    out, keep = [], None
    for label, method, options, n, count in rows:
        if count == 0:
            continue
        try:  # the seeds of a row as one batch of streams (stream b: seed 1000 b, as a stream alone)
            batch = run(method, options, n, 0, model, prior, obs.expand(count, -1, -1))
        except ValueError as exc:  # a default elsewhere that this model refuses (a linear-observation option)
            out.append({"label": label, "method": method, "options": options, "particles": n, "refused": str(exc)})
            print(f"  {label:12s} N={n:5d}: refused ({exc})", flush=True)
            continue
        for seed in range(count):
            res = {k: v[seed : seed + 1] if isinstance(v, np.ndarray) else v for k, v in batch.items()}
            res["wall_s"] = batch["wall_s"] / count
            err = errors(res["inc"], ref[None])
            err.update(
                {
                    "label": label,
                    "method": method,
                    "options": options,
                    "particles": n,
                    "seed": 1000 * seed,
                    "wall_s": round(res["wall_s"], 2),
                    "error_day_144": float(res["inc"][0, OUTLIER] - ref[OUTLIER]),
                    "log_evidence": float(res["inc"].sum()),
                    "flagged_days": int((np.abs(res["pit"][0, :, 0] - 0.5) > 0.5 - ALPHA / 2).sum()),
                }
            )
            sd = res["sd_inc"]
            if sd is not None:
                err["mean_reported_sd"] = float(sd.mean())
                err["reported_sd_day_144"] = float(sd[0, OUTLIER])
            out.append(err)
            print(
                f"  {label:12s} N={n:5d} seed {seed}: total {err['total_error']:+.3f}  worst {err['worst_error']:+.3f}"
                f"  day 144 {err['error_day_144']:+.3f}  ({res['wall_s']:.1f} s)",
                flush=True,
            )
            if label == "default" and seed == 0:
                keep = res
    return {
        "reference": {
            "grid_log_evidence": float(ref.sum()),
            "grid_error": float(np.abs(grid[1000] - grid[500]).max()),
            "grid_increment_day_144": float(ref[OUTLIER]),
            "particles": {k: pref[k] for k in ("source", "log_evidence", "log_evidence_sd")}
            | {
                "largest_increment_sd": float(np.max(pref["increment_sd"])),
                "max_abs_difference_from_grid": float(np.abs(p_inc - ref).max()),
            },
        },
        "default": {"method": default.method, "options": default.options, "particles": default.num_particles},
        "runs": out,
        "plot": {
            "returns": y.tolist(),
            "mean": keep["mean"][0, :, 0].tolist(),
            "sd": keep["sd"][0, :, 0].tolist(),
            "pit": keep["pit"][0, :, 0].tolist(),
        },
    }


# ------------------------------------------------------------------------------------------------------ 2. families
LDS = {
    "A": [[0.9, 0.1], [0.0, 0.8]],
    "Q": [[0.3, 0.0], [0.0, 0.2]],
    "B": [[1.0, 0.0], [0.0, 1.0]],
    "R": [[0.5, 0.0], [0.0, 0.4]],
}
SV1 = {"mu": -1.0, "phi": 0.95, "sigma": 0.3}


def family_cases(steps: int, streams: int) -> list[dict]:
    """(family, model, prior, observations [B, T, …], the exact increments [B, T], methods) per family."""
    cases = []
    g = [generator(100 + b) for b in range(streams)]
    gauss2 = GaussianMixture.gaussian(torch.zeros(1, 2, dtype=F64), torch.eye(2, dtype=F64)[None])
    for name, params in (("lds", LDS), ("linear_gaussian", {})):
        model = make_model(name, params, 2)
        x0 = torch.randn(streams, 2, generator=g[0], dtype=torch.float32)
        _, obs = model.simulate(steps if name == "lds" else steps // 5, x0, g)
        _, _, lz = kalman_filter(
            gauss2.means[:, 0].expand(streams, -1),
            gauss2.covs[:, 0].expand(streams, -1, -1),
            make_model(name, params, 2, F64),
            obs.double(),
        )
        methods = [
            ("kalman", {}, 256),
            ("smc", {}, 4096),
            ("mpf", {}, 256),
            ("mpf correct", {"correct": True}, 256),
            ("mpf mixture", {"evidence": "mixture"}, 256),
            ("gpf", {}, 256),
            ("enkf", {}, 256),
            ("ukf", {}, 256),
        ]
        cases.append(
            {"family": name, "model": model, "prior": gauss2, "obs": obs, "ref": lz.numpy(), "methods": methods}
        )
    sv_methods = {
        1: [
            ("smc", {}, 4096),
            ("mpf", {}, 256),
            ("mpf marginal=False", PLAIN, 256),
            ("mpf correct marginal=False", {"correct": True, **PLAIN}, 256),
            ("mpf mixture marginal=False", {"evidence": "mixture", **PLAIN}, 256),
            ("gpf", {}, 256),
            ("svgd", {}, 256),
        ],
        # one filter per dimension (smc's factorise, the default) against joint weights, and the flows
        5: [
            ("smc", {}, 4096),
            ("smc joint", {"factorise": False}, 4096),
            ("mpf", {}, 256),
            ("mpf marginal=False", PLAIN, 256),
        ],
    }
    for d, methods in sv_methods.items():
        model = sv_model(d, SV1)
        prior = stationary_prior(d, **SV1)
        x0 = SV1["mu"] + math.sqrt(0.09 / (1 - 0.95**2)) * torch.randn(streams, d, generator=g[1])
        _, obs = model.simulate(steps, x0, g)
        _, _, lz = diagonal_grid_evidence(
            sv_model(d, SV1, F64), prior.means[0, 0], prior.covs[0, 0].diagonal(), obs.double(), 1000, 10.0
        )
        family = "stochastic_volatility" if d == 1 else f"stochastic_volatility d={d}"
        cases.append(
            {"family": family, "model": model, "prior": prior, "obs": obs, "ref": lz.numpy(), "methods": methods}
        )
    model = make_model("gmm", {"s": 1.0}, 2)
    x = torch.tensor([[1.0, -2.0]]).expand(streams, -1)
    _, obs = model.simulate(30, x, g)
    lz = static_grid_evidence(
        make_model("gmm", {"s": 1.0}, 2, F64), gauss2.means[0, 0], gauss2.covs[0, 0], obs.double(), 400, 8.0
    )
    methods = [("smc", {}, 16384), ("mpf", {}, 256), ("gpf", {}, 256), ("svgd", {}, 256)]
    cases.append({"family": "gmm", "model": model, "prior": gauss2, "obs": obs, "ref": lz.numpy(), "methods": methods})
    return cases


def families(quick: bool) -> list[dict]:
    out = []
    for case in family_cases(100 if quick else 250, 4):
        for label, options, n in case["methods"]:
            method = label.split()[0]
            res = run(method, options, n, 0, case["model"], case["prior"], case["obs"])
            err = errors(res["inc"], case["ref"])
            err.update(
                {
                    "family": case["family"],
                    "method": label,
                    "particles": n,
                    "steps": int(case["ref"].size),
                    "wall_s": round(res["wall_s"], 2),
                }
            )
            out.append(err)
            print(
                f"  {case['family']:22s} {label:12s} N={n:5d}: mean {err['mean_abs_error']:.4f}  worst "
                f"{err['worst_error']:+.3f}  at surprising {err['worst_at_surprising']:+.3f}",
                flush=True,
            )
    return out


# --------------------------------------------------------------------------------------------------- 3. calibration
def calibration(quick: bool) -> list[dict]:
    steps = 500 if quick else 2000
    out = []
    cases = [("stochastic_volatility", 1, SV1), ("stochastic_volatility", 5, SV1), ("lds", 2, LDS)]
    for family, d, params in cases:
        model = make_model(family, params, d)
        g = [generator(7)]
        if family == "lds":
            prior = GaussianMixture.gaussian(torch.zeros(1, d, dtype=F64), torch.eye(d, dtype=F64)[None])
        else:
            prior = stationary_prior(d, **params)
        x0 = prior.sample(1, g)[:, 0].float()
        _, obs = model.simulate(steps, x0, g)
        choice = default_method(family, d, model.linear_gaussian)
        res = run(choice.method, choice.options, choice.num_particles or 256, 0, model, prior, obs)
        pit = res["pit"].reshape(-1)
        pit = pit[~np.isnan(pit)]
        out.append(
            {
                "family": family,
                "state_dim": d,
                "method": choice.method,
                "options": choice.options,
                "particles": choice.num_particles,
                "steps": steps,
                "values": int(pit.size),
                "ks_p_value": float(scipy.stats.kstest(pit, "uniform").pvalue),
                "flagged_fraction": float((np.abs(pit - 0.5) > 0.5 - ALPHA / 2).mean()),
            }
        )
        r = out[-1]
        print(
            f"  {family} d={d} {choice.method}: KS p = {r['ks_p_value']:.3f}, flagged {r['flagged_fraction']:.4f}",
            flush=True,
        )
    return out


# ---------------------------------------------------------------------------------------------------------- report
#: the rows of :func:`bias`: (label, method, options) at :data:`BIAS_PARTICLES`
BIAS_ROWS = (("mpf", "mpf", {}), ("mpf marginal=False", "mpf", PLAIN), ("smc (SQMC)", "smc", {}))
BIAS_PARTICLES = 256
#: issue 39's bounds: a flow's bias at every step, a run's total and its every step
BIAS_BOUND, TOTAL_BOUND = 0.1, 0.2


def bias_row(err: np.ndarray) -> dict:
    """The bias statistics of one row's errors ``err`` [S seeds, T steps] (module docstring, 4)."""
    seeds = err.shape[0]
    b = err.mean(0)
    se = err.std(0, ddof=1) / math.sqrt(seeds)
    worst = int(np.argmax(np.abs(b)))
    total = err.sum(1)
    return {
        "seeds": seeds,
        "max_abs_bias": float(np.abs(b[worst])),
        "max_abs_bias_day": worst + 1,
        "max_abs_bias_se": float(se[worst]),
        "bias_day_144": float(b[OUTLIER]),
        "bias_day_144_se": float(se[OUTLIER]),
        "steps_bias_over_bound": int((np.abs(b) > BIAS_BOUND).sum()),
        "steps_bias_over_bound_by_2se": int((np.abs(b) - 2 * se > BIAS_BOUND).sum()),
        "total_mean": float(total.mean()),
        "total_sd": float(total.std(ddof=1)),
        "seeds_total_within": int((np.abs(total) <= TOTAL_BOUND).sum()),
        "seeds_every_step_within": int((np.abs(err).max(1) <= BIAS_BOUND).sum()),
        "worst_step_any_seed": float(np.abs(err).max()),
    }


#: a reported standard error "flags" a step when it is at least half the bias bound
FLAG_SD = BIAS_BOUND / 2


def sd_calibration(err: np.ndarray, sd: np.ndarray) -> dict:
    """How a row's reported ``log_evidence_sd`` [S, T] stands against its errors ``err`` [S, T]: the errors' sd in
    units of it (1 for a calibrated standard error, below 1 for an upper estimate), the same at day 144 with the
    reported sd's median there, and the (seed, step) errors beyond :data:`BIAS_BOUND` with how many of them
    reported at least :data:`FLAG_SD`; per seed, whether every step is within max(0.1, 3 sd)."""
    big = np.abs(err) > BIAS_BOUND
    return {
        "error_in_reported_sd": float((err / sd).std()),
        "day_144_error_sd": float(err[:, OUTLIER].std(ddof=1)),
        "day_144_reported_sd_median": float(np.median(sd[:, OUTLIER])),
        "steps_error_over_bound": int(big.sum()),
        "of_them_reported_sd_over_flag": int((big & (sd >= FLAG_SD)).sum()),
        "seeds_every_step_within_3sd": int((np.abs(err) <= np.maximum(BIAS_BOUND, 3 * sd)).all(1).sum()),
    }


def bias(seeds: int, operators: tuple[str, ...] = ()) -> list[dict]:
    """Module docstring, 4: each of :data:`BIAS_ROWS` (and ``mpf`` with each trained operator of ``operators``) over
    ``seeds`` seeds (one batch of streams) on GBP/USD against the 1000-point grid."""
    y = torch.tensor(evidence_reference.returns())
    p = evidence_reference.PARAMS
    prior = stationary_prior(1, p["mu"], p["phi"], p["sigma"])
    obs = y.reshape(1, -1, 1).float()
    grid_mean, grid_cov, lz = diagonal_grid_evidence(
        sv_model(dtype=F64), prior.means[0, 0], prior.covs[0, 0].diagonal(), y.reshape(1, -1, 1), 1000, 10.0
    )
    ref = lz[0].numpy()
    grid_sd = grid_cov[0].diagonal(dim1=-2, dim2=-1).sqrt().numpy()
    out = []
    rows = (*BIAS_ROWS, *((f"mpf {name}", "mpf", {"operator": name}) for name in operators))
    for label, method, options in rows:
        batch = run(method, options, BIAS_PARTICLES, 0, sv_model(), prior, obs.expand(seeds, -1, -1))
        row = {"label": label, "method": method, "options": options, "particles": BIAS_PARTICLES}
        row.update(bias_row(batch["inc"] - ref[None]))
        row["mean_error_sd"] = float((np.abs(batch["mean"] - grid_mean[0].numpy()[None]) / grid_sd[None]).mean())
        row["sd_ratio"] = float((batch["sd"] / grid_sd[None]).mean())
        row["wall_s"] = round(batch["wall_s"], 1)
        if batch["sd_inc"] is not None:
            row["reported_sd"] = sd_calibration(batch["inc"] - ref[None], batch["sd_inc"])
        out.append(row)
        print(
            f"  {label:14s} max |bias| {row['max_abs_bias']:.3f} ± {row['max_abs_bias_se']:.3f} (day "
            f"{row['max_abs_bias_day']}), steps over {BIAS_BOUND}: {row['steps_bias_over_bound']}; total "
            f"{row['total_mean']:+.3f} ± {row['total_sd']:.3f} sd, within {TOTAL_BOUND}: {row['seeds_total_within']}"
            f"/{seeds}, every step within {BIAS_BOUND}: {row['seeds_every_step_within']}/{seeds}; mean error "
            f"{row['mean_error_sd']:.3f} sd, sd ratio {row['sd_ratio']:.3f}, {row['wall_s']} s",
            flush=True,
        )
        if "reported_sd" in row:
            c = row["reported_sd"]
            print(
                f"  {'':14s} log_evidence_sd: errors {c['error_in_reported_sd']:.2f} of it; day 144 error sd "
                f"{c['day_144_error_sd']:.3f}, reported {c['day_144_reported_sd_median']:.3f} (median); errors over "
                f"{BIAS_BOUND}: {c['steps_error_over_bound']}, {c['of_them_reported_sd_over_flag']} reporting ≥ "
                f"{FLAG_SD}; seeds within max({BIAS_BOUND}, 3 sd): {c['seeds_every_step_within_3sd']}/{seeds}",
                flush=True,
            )
    return out


def plot(real: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = real["plot"]
    y, m, s, pit = (np.array(p[k], dtype=float) for k in ("returns", "mean", "sd", "pit"))
    t = np.arange(1, len(y) + 1)
    flagged = np.abs(pit - 0.5) > 0.5 - ALPHA / 2
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    ax1.plot(t, y, lw=0.6, color="0.4", label="log-return (%)")
    band_lo, band_hi = np.exp(0.5 * (m - 2 * s)), np.exp(0.5 * (m + 2 * s))
    ax1.fill_between(t, 2 * band_lo, 2 * band_hi, color="tab:blue", alpha=0.3, label="±2 e^{x/2}, x in its 95 % band")
    ax1.fill_between(t, -2 * band_hi, -2 * band_lo, color="tab:blue", alpha=0.3)
    ax1.scatter(
        t[flagged], y[flagged], color="tab:red", s=18, zorder=3, label=f"flagged (|pit − ½| > {0.5 - ALPHA / 2})"
    )
    ax1.set_ylabel("return (%)")
    ax1.legend(loc="upper right", fontsize=8)
    ax2.plot(t, pit, ".", ms=2, color="0.3")
    ax2.axhline(ALPHA / 2, color="tab:red", lw=0.8)
    ax2.axhline(1 - ALPHA / 2, color="tab:red", lw=0.8)
    ax2.set_ylabel("pit")
    ax2.set_xlabel("trading day (1997–98)")
    fig.suptitle(f"GBP/USD, stochastic volatility, default method ({real['default']['method']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", choices=("real", "families", "calibration", "bias"), default=None)
    parser.add_argument(
        "--seeds", type=int, default=None, help="seeds per method row on the real data (4; --quick 2; bias 32)"
    )
    parser.add_argument("--out", type=Path, default=None, help="the JSON (benchmarks/results/evidence[-ONLY].json)")
    parser.add_argument(
        "--operator", action="append", default=[], help="--only bias: add mpf with this trained operator (repeatable)"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    start = time.perf_counter()
    result: dict = {"benchmark": "evidence", "quick": args.quick, "alpha": ALPHA}
    if args.only in (None, "real"):
        print("real data: GBP/USD 1997–98, stochastic volatility (Pitt & Shephard)")
        result["real_data"] = real_data(args.quick, args.seeds or (2 if args.quick else 4))
        plot(result["real_data"], RESULTS / "evidence.png")
    if args.only in (None, "families"):
        print("families: increment errors against exact references")
        result["families"] = families(args.quick)
    if args.only in (None, "calibration"):
        print("calibration: pit of the default method on simulated data")
        result["calibration"] = calibration(args.quick)
    if args.only == "bias":
        print(f"bias: the real data's per-step error over seeds at N = {BIAS_PARTICLES}")
        result["bias"] = bias(args.seeds or 32, tuple(args.operator))
    result["wall_s"] = round(time.perf_counter() - start, 1)
    name = "evidence" if args.only is None else f"evidence-{args.only}"
    out = args.out or RESULTS / f"{name}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

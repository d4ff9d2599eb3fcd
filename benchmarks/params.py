"""Unknown static parameters: ``smc2``'s bounded rejuvenation (nested-filter jittering) against the unbounded SMC²
(PMMH moves re-running every filter from the first observation) and against grid posteriors.

``python -m benchmarks.params [--quick] [--seeds S] [--steps T]``

Two short streams (T = 200 by default), each with S simulated data sets (seeds 0..S−1):

* ``lds R``: x_m = 0.9 x_{m−1} + N(0, 1), o_m = x_m + N(0, R), R = 2 unknown, prior log R ~ N(0, 1), x_0 ~ N(0, 1):
  ``smc2`` with an exact Kalman filter per θ-particle. Reference: the posterior of R on a grid of 4000 log-spaced
  points in [0.02, 50] from exact Kalman likelihoods, in plain numpy (:func:`lds_grid`);
* ``sv φ σ``: x_m = φ x_{m−1} + σ N(0, 1), o_m ~ N(0, e^{x_m}), φ = 0.95 and σ = 0.3 unknown (μ = 0 known), priors
  φ ~ U(0.5, 0.995), log σ ~ N(log 0.3, 0.5²), x_0 ~ N(0, 1): ``smc2`` with a bootstrap particle filter per
  θ-particle (M = N_x = 64). Reference: the posterior on a 48 × 48 grid of (φ, σ) over the region holding the
  prior-weighted likelihood, each likelihood from a point-mass filter of x on 200 points in [−7, 7] (:func:`sv_grid`,
  numpy); its own error is the difference to the same grid with 140 points (``ref err``).

Contenders per stream, at the same θ-particle count M unless named: ``jitter h`` (``smc2``'s nested-filter jitter
u' = u + h M^{−1/2} s_u ξ, h ∈ {0.5, 1, 2}), ``liu_west`` (the Liu–West kernel, a = 0.98, instead of the jitter),
``pmmh`` (the unbounded SMC², :func:`mpflow.operators.references.smc2_pmmh.smc2_pmmh`) and ``jitter 1, 4M`` (four times
the θ-particles, about the unbounded one's time on these short streams). Scores at the checkpoints
t ∈ {50, 100, 200}: |posterior mean − grid mean| / grid sd and posterior sd / grid sd per parameter, averaged over
seeds; wall time, and the cost of the last tenth of the steps over the first tenth (bounded: ≈ 1; unbounded: grows
with t).

Output: a markdown table, ``benchmarks/results/params.{json,png}`` (``params-quick.*`` with ``--quick``: 2 seeds,
T = 100).

``python -m benchmarks.params --flat [--steps T]``: a stream lives for ever, so ``smc2``'s step must cost the same at
step 10⁶ as at step 10. For each case's default stream (lds R: M = N = 1024 Kalman filters; SV: M = N_x = 64,
N = 4096) it runs T steps (default 2000) of the simulated data, then sets the state's step counter to 10⁶ and runs
W = T/10 more; it reports the median per-step time of the first W steps, the last W before the jump and the W
after it, and the state's bytes (the store's ``state_bytes``) at each, in ``benchmarks/results/params-flat.json``.

``--reference [--seeds S]``: the SV reference's own error — its 48 × 48 (φ, σ) grid against a 96 × 96 one over a
wider σ range (:data:`SV_FINE_GRID`) and its 200 x-points against 140 (``params-reference.json``).
``--mh [--seeds S] [--steps T]``: the ``mh`` kernel (issue 55) against jitter and Liu–West on the
lds with Q and R unknown, against a 2-D grid at t = 100 and T = 1000 (:func:`mh_accuracy`; ``params-mh.json``).
``--mh-timing [--steps T] [--mh-only]``: ms per step amortised at t = 10², …, 10⁶ (≤ T, default 10⁴) of an M = 1024
stream: jitter, mh and mh with the observer, or mh alone for a long run (:func:`mh_timing`; ``params-mh-timing.json``).

Issue 55's "must show" runs (the mh kernel: H = 1000, 3 moves, M = 256; ``--observer`` adds every mh row again with
the learned parameter observer as its independence proposal, method option ``observer: "auto"``; ``--quick`` writes
``params-<name>-quick.json``):

* ``--well-specified [--seeds S] [--steps T] [--observer]``: lds Q and R unknown (:func:`lds_qr_case`), S = 8 seeds
  (``--quick``: 2), T = 10⁴ steps (``--quick``: 1000), against the 2-D grid (:func:`lds_qr_grid`, zoomed where the
  posterior is narrow) at t = 100, 1000, 10⁴: |mean − grid mean| / grid sd and sd / grid sd per parameter, mean
  and worst over seeds, pass when every seed is within 1 grid sd and ±30 % of its sd at every checkpoint
  (:func:`well_specified`; ``params-well-specified.json``).
* ``--conflict [--steps T] [--observer]``: the prior wrong both ways, log R ~ N(3, 0.3²) and N(−3, 0.3²), truth
  R = 2, T = 1500 (``--quick``: 500), pass at the last checkpoint within 1 grid sd and the sd within a factor 2
  (:func:`conflict`; ``params-conflict.json``, a key per direction).
* ``--real [--nab PATH] [--steps T] [--observer]``: a series with a run of identical readings followed by a jump —
  the simulated :func:`aws_like_series` and, with ``--nab`` (a checkout of numenta/NAB, or the CSV),
  ``data/realAWSCloudwatch/ec2_cpu_utilization_24ae8d.csv`` — standardised by its first 15 %, under a local level
  model with lognormal priors on Q and R (:data:`REAL_PRIORS`); mh and jitter 0.5 at the service's default
  M = 1024 (:data:`REAL_M`) against a 2-D grid over
  [1e-6, 1e2]² and the grid-fitted (MAP) Kalman filter: the total log evidence's gap (bar 1 %), no collapse (each
  relative sd ≥ 0.1 × the grid's at 15 % and at the end) and the first step :func:`cloud_health` calls degenerate
  (:func:`real`; ``params-real.json``; ``--quick``: T = 1000).
* ``--sv [--seeds S] [--steps T] [--observer]``: the SV case (φ and σ unknown, M = N_x = 64), S = 8 seeds, T = 1000
  (``--quick``: 2, 300): the default jitter and the mh kernel (a particle filter's replays of at most 200
  observations, :data:`SV_MH`) against the (φ, σ) grid at t = 100 and 1000, the same bar
  (:func:`sv_well_specified`; ``params-sv.json``).
* ``--ks [--seeds S] [--steps T] [--observer]``: the predictive p-values (:meth:`SMC2Updater.pit` before each update)
  of jitter 0.5 and mh on lds R and lds Q R, T = 2000 after 50 burn-in, S = 4 seeds (``--quick``: 1 seed,
  T = 500), against U(0, 1) by Kolmogorov–Smirnov (:func:`ks`; ``params-ks.json``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from typing import Any

import numpy as np
import torch
from mpflow.operators.models import make_model
from mpflow.operators.models.priors import GaussianMixture
from mpflow.operators.references.smc2_pmmh import smc2_pmmh
from mpflow.operators.updaters import get_updater
from mpflow.operators.updaters.smc2 import SMC2Updater

RESULTS = os.path.join(os.path.dirname(__file__), "results")
CHECKPOINTS = (50, 100, 200)
JITTERS = (0.5, 1.0, 2.0)


# ------------------------------------------------------------------ the two cases
def lds_case(seed: int, T: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    x, ys = 0.0, []
    for _ in range(T):
        x = 0.9 * x + rng.standard_normal()
        ys.append(x + math.sqrt(2.0) * rng.standard_normal())
    params = {"A": [[0.9]], "B": [[1.0]], "Q": [[1.0]], "R": {"prior": {"type": "lognormal", "mean": 0.0, "sd": 1.0}}}
    return {"family": "lds", "params": params, "obs": np.array(ys)[:, None], "M": 256, "Nx": 1}


def sv_case(seed: int, T: int) -> dict[str, Any]:
    rng = np.random.default_rng(1000 + seed)
    x, ys = rng.standard_normal(), []
    for _ in range(T):
        x = 0.95 * x + 0.3 * rng.standard_normal()
        ys.append(math.exp(x / 2) * rng.standard_normal())
    params = {
        "mu": 0.0,
        "phi": {"prior": {"type": "uniform", "low": 0.5, "high": 0.995}},
        "sigma": {"prior": {"type": "lognormal", "mean": math.log(0.3), "sd": 0.5}},
    }
    return {"family": "stochastic_volatility", "params": params, "obs": np.array(ys)[:, None], "M": 64, "Nx": 64}


# ------------------------------------------------------------------ grid references (plain numpy)
def kalman_loglik(
    ys: np.ndarray, a: float, q: Any, r: Any, checkpoints: list[int], m0: float = 0.0, p0: float = 1.0
) -> dict[int, np.ndarray]:
    """log p(o_1:t | q, r) at each checkpoint t of the scalar lds x_m = a x_{m−1} + N(0, q), o_m = x_m + N(0, r),
    x_0 ~ N(m0, p0), for every (q, r) of the arrays ``q`` and ``r`` (broadcast): the exact Kalman filter, vectorised
    over a grid (a 160 × 160 grid: ≈ 0.2 ms a step)."""
    q, r = np.broadcast_arrays(np.asarray(q, dtype=float), np.asarray(r, dtype=float))
    m, P, ll = np.full(q.shape, m0), np.full(q.shape, p0), np.zeros(q.shape)
    want, out = set(checkpoints), {}
    for t, y in enumerate(np.ravel(ys)[: max(checkpoints)], 1):
        m, P = a * m, a * a * P + q
        S = P + r
        ll += -0.5 * (np.log(2 * np.pi * S) + (y - m) ** 2 / S)
        m, P = m + P / S * (y - m), (1 - P / S) * P
        if t in want:
            out[t] = ll.copy()
    return out


def _grid_at(ys, a, priors, fixed, axes, checkpoints, m0, p0) -> dict[int, dict[str, Any]]:
    """The posterior on the grid of log θ ``axes`` (name → log-spaced values) at each checkpoint (:func:`log_grid`)."""
    names = sorted(axes)
    us = dict(zip(names, (u.ravel() for u in np.meshgrid(*(axes[k] for k in names), indexing="ij")), strict=True))
    theta = {**{k: float(v) for k, v in fixed.items()}, **{k: np.exp(u) for k, u in us.items()}}
    lls = kalman_loglik(ys, a, theta["Q"], theta["R"], checkpoints, m0, p0)
    # the lognormal density of θ times the log grid's measure dθ ∝ θ: the normal density of u = log θ
    log_prior = sum(
        -0.5 * ((us[k] - mu) / sd) ** 2 - math.log(sd * math.sqrt(2 * math.pi)) for k, (mu, sd) in priors.items()
    )
    log_cell = sum(math.log(axes[k][1] - axes[k][0]) for k in names)
    out = {}
    for t, ll in lls.items():
        lp = ll + log_prior
        w = np.exp(lp - lp.max())
        z = w.sum()
        w /= z
        cell: dict[str, Any] = {"moments": {}, "log_moments": {}}
        for k in names:
            for key, v in (("moments", theta[k]), ("log_moments", us[k])):
                mean = float((w * v).sum())
                cell[key][k] = (mean, float(math.sqrt((w * (v - mean) ** 2).sum())))
        i = int(np.argmax(lp))
        cell["map"] = {k: float(theta[k][i]) for k in names}
        cell["map_loglik"] = float(ll[i])  # the Kalman filter at the MAP θ: its sum of log predictive densities
        cell["log_evidence"] = float(lp.max() + math.log(z) + log_cell)  # log ∫ p(o_1:t | θ) p(θ) dθ
        out[t] = cell
    return out


def log_grid(
    ys: np.ndarray,
    a: float,
    priors: dict[str, tuple[float, float]],
    fixed: dict[str, float],
    checkpoints: list[int],
    box: tuple[float, float],
    n: int,
    m0: float = 0.0,
    p0: float = 1.0,
    refine: bool = True,
) -> dict[int, dict[str, Any]]:
    """The posterior of the scalar lds's unknown Q and/or R (``priors``: name → (μ, s) of log θ ~ N(μ, s²); the other
    of the two in ``fixed``) on a grid of n log-spaced values per parameter in ``box``, exact Kalman likelihoods
    (:func:`kalman_loglik`). Per checkpoint: the posterior mean and sd of θ (``moments``) and of log θ, the MAP θ,
    the log-likelihood there (the grid-fitted Kalman filter's log evidence) and the log evidence ∫ p(o | θ) p(θ) dθ.
    ``refine``: where some log θ's posterior sd is under 4 grid spacings (a long stream's narrow posterior), that
    checkpoint is recomputed on n values per parameter over its mean ± 8 sd of log θ (at most three times)."""
    axes = {k: np.linspace(math.log(box[0]), math.log(box[1]), n) for k in priors}
    out = _grid_at(ys, a, priors, fixed, axes, checkpoints, m0, p0)
    for t in checkpoints if refine else ():
        for _ in range(3):
            lm = out[t]["log_moments"]
            h = {k: u[1] - u[0] for k, u in axes.items()}
            if all(lm[k][1] >= 4 * h[k] for k in priors):
                break
            axes = {
                k: np.linspace(lm[k][0] - 8 * max(lm[k][1], h[k]), lm[k][0] + 8 * max(lm[k][1], h[k]), n)
                for k in priors
            }
            out[t] = _grid_at(ys, a, priors, fixed, axes, [t], m0, p0)[t]
        axes = {k: np.linspace(math.log(box[0]), math.log(box[1]), n) for k in priors}
    return out


def lds_grid(ys: np.ndarray, checkpoints: list[int]) -> dict[int, dict[str, tuple[float, float]]]:
    """Posterior mean and sd of R at each checkpoint: exact Kalman log-likelihoods on 4000 log-spaced values in
    [0.02, 50], times the lognormal(0, 1) prior, with the grid's measure dR ∝ R (:func:`log_grid`)."""
    grid = log_grid(ys, 0.9, {"R": (0.0, 1.0)}, {"Q": 1.0}, checkpoints, (0.02, 50.0), 4000, refine=False)
    return {t: grid[t]["moments"] for t in checkpoints}


def _sv_loglik(ys, phi, sigma, points, checkpoints):
    """log p(o_1:t | φ, σ) at the checkpoints for each (φ, σ) pair (arrays [P]): a point-mass filter on ``points``."""
    dx = points[1] - points[0]
    p = np.exp(-0.5 * points**2) * dx / math.sqrt(2 * math.pi)  # x_0 ~ N(0, 1)
    p = np.broadcast_to(p / p.sum(), (len(phi), len(points))).copy()
    diff = points[None, :, None] - phi[:, None, None] * points[None, None, :]  # [P, x', x]
    kernel = np.exp(-0.5 * (diff / sigma[:, None, None]) ** 2)
    kernel /= kernel.sum(1, keepdims=True)  # each column a distribution over x' (the grid's discretisation)
    ll, out = np.zeros(len(phi)), {}
    for t, y in enumerate(ys[:, 0], 1):
        p = (kernel @ p[:, :, None])[:, :, 0]  # each x' from every x: a batched product
        lik = np.exp(-0.5 * (np.log(2 * np.pi) + points + y**2 * np.exp(-points)))
        z = p @ lik
        ll += np.log(z)
        p = p * lik[None] / z[:, None]
        if t in checkpoints:
            out[t] = ll.copy()
    return out


#: the reference's (φ, σ) grid: 48 φ in [0.5, 0.995] (the prior's support) × 48 σ log-spaced in [0.05, 1.2]
SV_GRID = (48, 48, 0.05, 1.2)
#: the finer, wider grid its own θ-grid error is measured against (``--reference``)
SV_FINE_GRID = (96, 96, 0.02, 2.5)


def sv_grid(
    ys: np.ndarray, checkpoints: list[int], n_points: int = 200, grid: tuple[int, int, float, float] = SV_GRID
) -> dict[int, dict[str, tuple[float, float]]]:
    """Posterior mean and sd of φ and σ at each checkpoint on a (φ, σ) ``grid`` (module docstring)."""
    n_phi, n_sigma, s_lo, s_hi = grid
    phis = np.linspace(0.5, 0.995, n_phi)
    sigmas = np.exp(np.linspace(math.log(s_lo), math.log(s_hi), n_sigma))
    PH, SG = (a.ravel() for a in np.meshgrid(phis, sigmas, indexing="ij"))
    points = np.linspace(-7.0, 7.0, n_points)
    lls: dict[int, list[np.ndarray]] = {t: [] for t in checkpoints}
    for chunk in range(0, len(PH), 256):
        part = _sv_loglik(ys, PH[chunk : chunk + 256], SG[chunk : chunk + 256], points, checkpoints)
        for t in checkpoints:
            lls[t].append(part[t])
    log_prior = -0.5 * ((np.log(SG) - math.log(0.3)) / 0.5) ** 2  # lognormal density × the log grid's dσ ∝ σ
    out = {}
    for t in checkpoints:
        lp = np.concatenate(lls[t]) + log_prior
        w = np.exp(lp - lp.max())
        w /= w.sum()
        out[t] = {}
        for name, v in (("phi", PH), ("sigma", SG)):
            mean = float((w * v).sum())
            out[t][name] = (mean, float(math.sqrt((w * (v - mean) ** 2).sum())))
    return out


# ------------------------------------------------------------------ contenders
def run_jitter(
    case,
    h: float,
    M: int,
    seed: int,
    kernel: str = "jitter",
    *,
    pit: bool = False,
    health: bool = False,
    **options: Any,
) -> dict[str, Any]:
    """One ``smc2`` stream over the case's observations: the weighted θ mean and sd after each step (``mean``,
    ``sd``), the seconds of each update (``times``) and its log-evidence increment (``log_evidence``); with ``pit``
    the predictive p-value of each observation before its update (``pit``, :meth:`SMC2Updater.pit`, outside the
    timed update), with ``health`` whether :func:`cloud_health` calls the θ-cloud degenerate after each step
    (``degenerate``)."""
    from mpflow.operators.updaters.smc2 import cloud_health

    model = make_model(case["family"], case["params"], 1)
    prior = GaussianMixture.gaussian(torch.zeros(1, 1), torch.eye(1)[None])
    updater = get_updater("smc2", jitter=h, theta_particles=M, kernel=kernel, **options)
    state = updater.init(prior, model, M * case["Nx"], seed)
    names = sorted(model.unknown)
    mean, sd, times = {k: [] for k in names}, {k: [] for k in names}, []
    evidence, pits, degenerate = [], [], []
    for y in case["obs"]:
        obs = torch.tensor(y[None], dtype=torch.float32)
        if pit:
            pits.append(float(updater.pit(state, obs, model)[0, 0]))
        t0 = time.perf_counter()
        state, info = updater.update(state, obs, model)
        times.append(time.perf_counter() - t0)
        evidence.append(float(info.log_evidence_increment[0]))
        if health:
            degenerate.append(bool(cloud_health(state.extras).degenerate[0]))
        w = torch.softmax(state.extras["param_log_weights"][0], -1)
        for k in names:
            th = state.extras["param." + k][0]
            m = float((w * th).sum())
            mean[k].append(m)
            sd[k].append(float((w * (th - m) ** 2).sum().sqrt()))
    out = {"mean": mean, "sd": sd, "times": times, "log_evidence": evidence}
    return out | ({"pit": pits} if pit else {}) | ({"degenerate": degenerate} if health else {})


def run_pmmh(case, M: int, seed: int) -> dict[str, Any]:
    model = make_model(case["family"], case["params"], 1)
    prior = GaussianMixture.gaussian(torch.zeros(1, 1), torch.eye(1)[None])
    obs = torch.tensor(case["obs"], dtype=torch.float32)
    out = smc2_pmmh(model, prior, obs, M, case["Nx"], seed)
    return {
        "mean": out.mean,
        "sd": out.sd,
        "times": out.seconds,
        "moved_at": out.moved_at,
        "acceptance": [a for a in out.acceptance if not math.isnan(a)],
    }


def growth(times: list[float]) -> float:
    k = max(1, len(times) // 10)
    return sum(times[-k:]) / max(sum(times[:k]), 1e-12)


def score(run, ref, checkpoints) -> dict[str, Any]:
    rows = {}
    for t in checkpoints:
        for k, (m, s) in ref[t].items():
            rows[f"{k}@{t}"] = {"err_sd": abs(run["mean"][k][t - 1] - m) / s, "sd_ratio": run["sd"][k][t - 1] / s}
    return rows


def state_bytes(state) -> int:
    """The store's ``state_bytes`` of a state (service.creation.state_size: every tensor's bytes)."""
    return sum(t.numel() * t.element_size() for t in state.fields().values())


def flat_run(case, n: int, T: int, far: int = 10**6) -> dict[str, Any]:
    """Per-step seconds and state bytes of a default ``smc2`` stream over T steps, then W = T/10 steps from step
    ``far`` (module docstring)."""
    model = make_model(case["family"], case["params"], 1)
    prior = GaussianMixture.gaussian(torch.zeros(1, 1), torch.eye(1)[None])
    updater = get_updater("smc2")
    state = updater.init(prior, model, n, 0)
    W = max(1, T // 10)
    obs = [torch.tensor(y[None], dtype=torch.float32) for y in case["obs"]]
    times, sizes = [], {}
    for t in range(T + W):
        if t == T:
            sizes[T] = state_bytes(state)
            state = state.replace(step=torch.full_like(state.step, far))
        t0 = time.perf_counter()
        state, _ = updater.update(state, obs[t % len(obs)], model)
        times.append(time.perf_counter() - t0)
        if t + 1 == W:
            sizes[W] = state_bytes(state)
    sizes[far + W] = state_bytes(state)
    windows = {
        f"steps 1-{W}": times[:W],
        f"steps {T - W + 1}-{T}": times[T - W : T],
        f"steps {far + 1}-{far + W}": times[T:],
    }
    return {
        "N": n,
        "M": updater.options["theta_particles"] or None,
        "step": int(state.step[0]),
        "median_ms": {k: 1e3 * float(np.median(v)) for k, v in windows.items()},
        "state_bytes": {str(k): v for k, v in sizes.items()},
    }


def flat(T: int) -> None:
    """``--flat``: the per-step cost and state size of default smc2 streams at step 10⁶ (module docstring)."""
    torch.set_num_threads(1)
    from mpflow.operators.updaters.smc2 import SMC2Updater

    out = {}
    for name, make, kind in (("lds R", lds_case, "kalman"), ("sv phi sigma", sv_case, "particles")):
        out[name] = flat_run(make(0, T), SMC2Updater.DEFAULT_PARTICLES[kind], T)
        print(name, out[name], flush=True)
    print("\n| case | N | " + " | ".join(next(iter(out.values()))["median_ms"]) + " | state bytes |")
    print("|---|---|---|---|---|---|")
    for name, r in out.items():
        cells = " | ".join(f"{v:.2f} ms" for v in r["median_ms"].values())
        sizes = sorted(set(r["state_bytes"].values()))
        print(f"| {name} | {r['N']} | {cells} | {', '.join(str(v) for v in sizes)} |")
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "params-flat.json"), "w") as f:
        json.dump({"T": T, "cases": out}, f, indent=1)


def reference_error(seeds: int, T: int) -> None:
    """``--reference``: the SV grid reference against a finer, wider one (:data:`SV_FINE_GRID`, 200 x-points both)
    and against 140 x-points: |Δ mean| / sd and |Δ sd| / sd per parameter and checkpoint, the max over seeds."""
    checkpoints = [t for t in CHECKPOINTS if t <= T]
    rows: dict[str, dict[str, float]] = {}
    for seed in range(seeds):
        ys = sv_case(seed, T)["obs"]
        ref = sv_grid(ys, checkpoints)
        for label, other in (
            ("theta grid 96 x 96", sv_grid(ys, checkpoints, grid=SV_FINE_GRID)),
            ("x grid 140 points", sv_grid(ys, checkpoints, 140)),
        ):
            for t in checkpoints:
                for k, (m, sd) in ref[t].items():
                    cell = rows.setdefault(f"{label}: {k}@{t}", {"mean": 0.0, "sd": 0.0})
                    cell["mean"] = max(cell["mean"], abs(other[t][k][0] - m) / other[t][k][1])
                    cell["sd"] = max(cell["sd"], abs(sd / other[t][k][1] - 1))
        print(f"seed {seed} done", flush=True)
    print(f"\n| against (max of {seeds} seeds) | Δ mean / sd | Δ sd / sd |\n|---|---|---|")
    for key, cell in rows.items():
        print(f"| {key} | {cell['mean']:.2e} | {cell['sd']:.2e} |")
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "params-reference.json"), "w") as f:
        json.dump({"T": T, "seeds": seeds, "grid": SV_GRID, "fine_grid": SV_FINE_GRID, "rows": rows}, f, indent=1)


#: ``--conflict``'s two priors of log R ~ N(μ, 0.3²), truth R = 2: R ≈ 20 (7.7 prior sd above) and R ≈ 0.05 (12.3
#: prior sd below)
CONFLICT_PRIORS = {"prior high: log R ~ N(3, 0.3^2)": 3.0, "prior low: log R ~ N(-3, 0.3^2)": -3.0}


def conflict_runs(observer: bool) -> list[tuple[str, str, float, int, dict[str, Any]]]:
    """``--conflict``'s contenders (name, kernel, h, M, options)."""
    runs = [
        ("jitter 0.5, M = 64", "jitter", 0.5, 64, {}),
        ("jitter 0.5, M = 256", "jitter", 0.5, 256, {}),
        ("jitter 0.5, M = 1024", "jitter", 0.5, 1024, {}),
        ("jitter 2, M = 256", "jitter", 2.0, 256, {}),
        ("liu_west, M = 256", "liu_west", 0.5, 256, {}),
    ]
    return runs + [(f"{name}, M = 256", kernel, 0.5, 256, options) for name, kernel, options in mh_runs(observer)]


def conflict(T: int, observer: bool = False, stem: str = "params-conflict") -> None:
    """``--conflict``: the lds R case (seed 0, T steps) with a prior far from the truth in either direction
    (:data:`CONFLICT_PRIORS`), against the grid posterior under that prior (6000 log-spaced R in [0.005, 60],
    :func:`log_grid`) — does the θ-cloud, once its ESS has collapsed onto the prior's edge, ever reach the
    posterior? Every kernel at M = 256, the default jitter at M = 64 and 1024 (:func:`conflict_runs`); the issue's
    bar at the last checkpoint (t = 1500): the mean within 1 grid sd and the sd within a factor 2 of the grid's;
    ``benchmarks/results/params-conflict.json`` (a key per direction)."""
    torch.set_num_threads(1)
    checkpoints = [t for t in (100, 300, 1000, 1500) if t <= T] or [T]
    last = checkpoints[-1]
    out: dict[str, Any] = {
        "T": T,
        "truth": {"R": 2.0},
        "bar": "at t = last: |mean - grid| <= 1 grid sd, sd ratio in [0.5, 2]",
    }
    out["directions"] = {}
    for direction, mu in CONFLICT_PRIORS.items():
        case = lds_case(0, T)
        case["params"] = {**case["params"], "R": {"prior": {"type": "lognormal", "mean": mu, "sd": 0.3}}}
        grid = log_grid(case["obs"], 0.9, {"R": (mu, 0.3)}, {"Q": 1.0}, checkpoints, (0.005, 60.0), 6000)
        ref = {t: grid[t]["moments"]["R"] for t in checkpoints}
        rows: dict[str, Any] = {"grid": {t: ref[t] for t in checkpoints}}
        verdicts: dict[str, Any] = {}
        for name, kernel, h, M, options in conflict_runs(observer):
            run = run_jitter(case, h, M, 0, kernel, **options)
            rows[name] = {t: (run["mean"]["R"][t - 1], run["sd"]["R"][t - 1]) for t in checkpoints}
            err = abs(rows[name][last][0] - ref[last][0]) / ref[last][1]
            ratio = rows[name][last][1] / ref[last][1]
            verdicts[name] = {"err_sd": err, "sd_ratio": ratio, "pass": bool(err <= 1 and 0.5 <= ratio <= 2)}
            print(direction, name, verdicts[name], flush=True)
        out["directions"][direction] = {"prior_log_mean": mu, "prior_log_sd": 0.3, "rows": rows, "verdict": verdicts}
    for direction, d in out["directions"].items():
        print(f"\n### {direction} (truth R = 2, seed 0): R posterior mean ± sd; bar at t = {last}\n")
        print("| method | " + " | ".join(f"t = {t}" for t in checkpoints) + f" | err/sd, sd ratio @ {last} | pass |")
        print("|---|" + "---|" * (len(checkpoints) + 2))
        for name, row in d["rows"].items():
            cells = " | ".join(f"{row[t][0]:.3g} ± {row[t][1]:.3g}" for t in checkpoints)
            v = d["verdict"].get(name)
            tail = f"{v['err_sd']:.2f}, {v['sd_ratio']:.2f} | {'pass' if v['pass'] else 'FAIL'}" if v else "| "
            print(f"| {name} | {cells} | {tail} |")
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, stem + ".json"), "w") as f:
        json.dump(out, f, indent=1)


# ------------------------------------------------------------------ the mh kernel (issue 55)
def lds_qr_case(seed: int, T: int) -> dict[str, Any]:
    """``lds Q R``: the lds R case's model and data-generating process (Q = 1, R = 2), both Q and R unknown with
    log Q, log R ~ N(0, 1)."""
    case = lds_case(seed, T)
    ln = {"prior": {"type": "lognormal", "mean": 0.0, "sd": 1.0}}
    case["params"] = {**case["params"], "Q": ln, "R": ln}
    return case


def lds_qr_grid(ys: np.ndarray, checkpoints: list[int], n: int = 160) -> dict[int, dict[str, tuple[float, float]]]:
    """Posterior mean and sd of Q and R at each checkpoint: exact Kalman log-likelihoods on an n × n grid of
    log-spaced (Q, R) in [0.05, 20]², times the lognormal(0, 1) priors, the measure dQ dR ∝ Q R; a checkpoint whose
    posterior is narrower than 4 grid spacings is recomputed on a zoomed grid (:func:`log_grid`: t ≳ 1000)."""
    grid = log_grid(ys, 0.9, {"Q": (0.0, 1.0), "R": (0.0, 1.0)}, {}, checkpoints, (0.05, 20.0), n)
    return {t: grid[t]["moments"] for t in checkpoints}


#: the mh kernel's options in every run here (issue 55): a window of 1000 observations, 3 moves per rejuvenation
MH = {"history": 1000, "mh_moves": 3, "observer": "none"}
#: the learned parameter observer as the mh moves' independence proposal (``--observer``; the service's default)
OBSERVER = {"observer": "lds-d1-v1"}


def mh_runs(observer: bool) -> list[tuple[str, str, dict[str, Any]]]:
    """The mh kernel's runs (name, kernel, options): mh, and with ``observer`` mh with the observer proposal too."""
    runs = [("mh (H = 1000, 3 moves)", "mh", MH)]
    return runs + ([("mh + observer", "mh", {**MH, **OBSERVER})] if observer else [])


MH_RUNS = (
    ("jitter 0.5", "jitter", {}),
    ("liu_west", "liu_west", {}),
    ("mh (H = 1000, 3 moves)", "mh", MH),
)


def qr_accuracy(
    seeds: int, T: int, checkpoints: list[int], runs, make=None, grid=None
) -> dict[str, list[dict[str, Any]]]:
    """Each of ``runs`` (name, kernel, options; the case's M, h = 0.5) on the case ``make`` (default the lds Q R
    case, :func:`lds_qr_case`) of seeds 0..S−1, T steps, scored against ``grid`` (default the 2-D grid,
    :func:`lds_qr_grid`) at the checkpoints: name → a row {wall_s, scores, grid} per seed."""
    make, grid = make or lds_qr_case, grid or lds_qr_grid
    per: dict[str, list] = {}
    for seed in range(seeds):
        case = make(seed, T)
        t0 = time.perf_counter()
        ref = grid(case["obs"], checkpoints)
        grid_s = time.perf_counter() - t0
        for name, kernel, options in runs:
            t0 = time.perf_counter()
            run = run_jitter(case, 0.5, case["M"], seed, kernel, **options)
            per.setdefault(name, []).append(
                {"wall_s": time.perf_counter() - t0, "scores": score(run, ref, checkpoints), "grid": ref}
            )
        print(f"seed {seed} done (grid {grid_s:.1f} s)", flush=True)
    return per


def summarise(per: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per method: the mean wall seconds and, per score, [mean, max, min] over seeds, and each seed's scores."""
    summary = {}
    for name, rows in per.items():
        keys = rows[0]["scores"].keys()
        summary[name] = {
            "wall_s": float(np.mean([r["wall_s"] for r in rows])),
            "scores": {
                k: {
                    m: [float(f([r["scores"][k][m] for r in rows])) for f in (np.mean, np.max, np.min)]
                    for m in ("err_sd", "sd_ratio")
                }
                for k in keys
            },
            "per_seed": [r["scores"] for r in rows],
        }
    return summary


def mh_accuracy(seeds: int, T: int) -> None:
    """``--mh``: the well-specified lds with Q and R unknown, every kernel at M = 256, against the 2-D grid at
    t = 100 and T; ``benchmarks/results/params-mh.json``."""
    torch.set_num_threads(1)
    checkpoints = [t for t in (100, 1000) if t <= T] or [T]
    summary = summarise(qr_accuracy(seeds, T, checkpoints, MH_RUNS))
    keys = list(next(iter(summary.values()))["scores"])
    print(f"\n### lds Q R (M = 256, {seeds} seeds): |mean − grid| / grid sd, sd / grid sd (mean over seeds)\n")
    print("| method | wall s | " + " | ".join(keys) + " |")
    print("|---|---|" + "---|" * len(keys))
    for name, srow in summary.items():
        cells = " | ".join(
            f"{srow['scores'][k]['err_sd'][0]:.2f}, {srow['scores'][k]['sd_ratio'][0]:.2f}" for k in keys
        )
        print(f"| {name} | {srow['wall_s']:.1f} | {cells} |")
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "params-mh.json"), "w") as f:
        json.dump({"T": T, "seeds": seeds, "M": 256, "summary": summary}, f, indent=1)


#: issue 55's bar on the well-specified stream: |mean − grid| ≤ 1 grid sd and sd within ±30 % of the grid's
WELL_SPECIFIED_BAR = (1.0, 0.7, 1.3)


def within(scores: dict[str, dict[str, float]], bar: tuple[float, float, float]) -> bool:
    """Whether every parameter at every checkpoint of one run's :func:`score` meets ``bar`` (err ≤, sd ratio in)."""
    err, lo, hi = bar
    return all(c["err_sd"] <= err and lo <= c["sd_ratio"] <= hi for c in scores.values())


def print_bar_table(per: dict[str, list[dict[str, Any]]], summary: dict[str, Any], title: str) -> None:
    """Mark each method of ``summary`` (:func:`summarise` of ``per``) with the seeds meeting
    :data:`WELL_SPECIFIED_BAR` (``seeds_passing``, ``pass``) and print its table under ``title``."""
    seeds = len(next(iter(per.values())))
    for name, rows in per.items():
        passed = [within(r["scores"], WELL_SPECIFIED_BAR) for r in rows]
        summary[name]["seeds_passing"], summary[name]["pass"] = int(sum(passed)), all(passed)
    keys = list(next(iter(summary.values()))["scores"])
    print(f"\n### {title}\n")
    print("| method | wall s | " + " | ".join(keys) + " | pass (seeds) |")
    print("|---|---|" + "---|" * (len(keys) + 1))
    for name, srow in summary.items():
        sc = srow["scores"]
        cells = " | ".join(
            f"{sc[k]['err_sd'][0]:.2f} ({sc[k]['err_sd'][1]:.2f}); "
            f"{sc[k]['sd_ratio'][0]:.2f} [{sc[k]['sd_ratio'][2]:.2f}, {sc[k]['sd_ratio'][1]:.2f}]"
            for k in keys
        )
        verdict = "pass" if srow["pass"] else "FAIL"
        print(f"| {name} | {srow['wall_s']:.1f} | {cells} | {verdict} ({srow['seeds_passing']}/{seeds}) |")


def well_specified(seeds: int, T: int, observer: bool = False, stem: str = "params-well-specified") -> None:
    """``--well-specified``: the lds Q R case (:func:`lds_qr_case`), seeds 0..S−1 and T steps, the mh kernel
    (H = 1000, 3 moves; with ``observer`` also with the observer proposal) at M = 256 against the 2-D grid
    (:func:`lds_qr_grid`, zoomed where narrow) at t = 100, 1000, 10⁴; issue 55's bar (:data:`WELL_SPECIFIED_BAR`) on
    every seed, parameter and checkpoint; ``benchmarks/results/params-well-specified.json``."""
    torch.set_num_threads(1)
    checkpoints = [t for t in (100, 1000, 10000) if t <= T] or [T]
    per = qr_accuracy(seeds, T, checkpoints, mh_runs(observer))
    summary = summarise(per)
    grids = [{str(t): g for t, g in r["grid"].items()} for r in next(iter(per.values()))]
    print_bar_table(
        per,
        summary,
        f"lds Q R, well specified (M = 256, {seeds} seeds, T = {T}): |mean − grid| / grid sd mean (worst) over "
        "seeds; sd / grid sd mean [min, max]; bar: ≤ 1 and within ±30 % at every checkpoint, every seed",
    )
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, stem + ".json"), "w") as f:
        json.dump(
            {"T": T, "seeds": seeds, "M": 256, "bar": WELL_SPECIFIED_BAR, "summary": summary, "grid": grids},
            f,
            indent=1,
        )


#: the SV stream's mh kernel: a particle filter per θ-particle replays at most 200 observations a move (the price
#: of a move grows with N·H: at M = N_x = 64 and H = 1000 a step is priced at about four budgets)
SV_MH = {"history": 200, "mh_moves": 3, "observer": "none"}
#: the SV observer, named (it does not serve by default)
SV_OBSERVER = "stochastic_volatility-d1-v2"


def sv_well_specified(seeds: int, T: int, observer: bool = False, stem: str = "params-sv") -> None:
    """``--sv``: the SV case (:func:`sv_case`: φ and σ unknown, M = N_x = 64), seeds 0..S−1 and T steps, the default
    jitter and the mh kernel (:data:`SV_MH`, a particle filter's replays; with ``observer`` also with the SV
    observer's proposals) against the (φ, σ) grid (:func:`sv_grid`) at t = 100, 1000 (≤ T); issue 55's bar
    (:data:`WELL_SPECIFIED_BAR`) on every seed; ``benchmarks/results/params-sv.json``."""
    torch.set_num_threads(1)
    checkpoints = [t for t in (100, 1000) if t <= T] or [T]
    runs = [("jitter 0.5", "jitter", {}), ("mh (H = 200, 3 moves)", "mh", SV_MH)]
    if observer:
        runs.append(("mh + observer", "mh", {**SV_MH, "observer": SV_OBSERVER}))
    per = qr_accuracy(seeds, T, checkpoints, runs, sv_case, sv_grid)
    summary = summarise(per)
    print_bar_table(
        per,
        summary,
        f"SV φ σ (M = N_x = 64, {seeds} seeds, T = {T}): |mean − grid| / grid sd mean (worst); sd / grid sd "
        "mean [min, max]; the same bar",
    )
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, stem + ".json"), "w") as f:
        json.dump({"T": T, "seeds": seeds, "M": 64, "Nx": 64, "bar": WELL_SPECIFIED_BAR, "summary": summary}, f,
                  indent=1)  # fmt: skip


def mh_timing(T: int, mh_only: bool = False) -> None:
    """``--mh-timing [--mh-only]``: ms per step, amortised (total time / t) at t = 10², …, 10⁶ (≤ T), of a
    default-size stream (M = N = 1024) of the lds Q R case: jitter, mh without and with the observer (``mh_only``:
    mh alone), one process, one thread, in turn; ``benchmarks/results/params-mh-timing.json``
    (``params-mh-timing-<T>.json`` with ``mh_only``)."""
    torch.set_num_threads(1)
    case = lds_qr_case(0, T)
    checkpoints = [t for t in (100, 1000, 10000, 100000, 1000000) if t <= T]
    rows = {}
    for name, kernel, options in mh_runs(False) if mh_only else [MH_RUNS[0], *mh_runs(True)]:
        run = run_jitter(case, 0.5, 1024, 0, kernel, **options)
        cum = np.cumsum(run["times"])
        rows[name] = {
            "ms_per_step": {t: 1e3 * float(cum[t - 1]) / t for t in checkpoints},
            "slowest_step_s": float(np.max(run["times"])),
            "steps_over_50ms": int(np.sum(np.array(run["times"]) > 0.05)),
        }
        print(name, rows[name], flush=True)
    print("\n| method (M = 1024) | " + " | ".join(f"ms/step t = {t}" for t in checkpoints) + " | slowest step s |")
    print("|---|" + "---|" * (len(checkpoints) + 1))
    for name, r in rows.items():
        cells = " | ".join(f"{r['ms_per_step'][t]:.2f}" for t in checkpoints)
        print(f"| {name} | {cells} | {r['slowest_step_s']:.2f} |")
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, f"params-mh-timing-{T}.json" if mh_only else "params-mh-timing.json"), "w") as f:
        json.dump({"T": T, "rows": rows}, f, indent=1)


# ------------------------------------------------------------------ a real series (issue 55)
#: the NAB file of ``--real --nab PATH`` (an AWS CloudWatch CPU metric of 4032 five-minute readings), in a checkout
NAB_FILE = os.path.join("data", "realAWSCloudwatch", "ec2_cpu_utilization_24ae8d.csv")
#: ``--real``'s priors, in the series' standardised units: log Q ~ N(log 0.01, 2²) (the level drifts by ~0.1 of the
#: early spread a step), log R ~ N(log 0.1, 2²) (the readings' noise ~0.3 of it); each 95 % interval spans ~3.5
#: orders of magnitude
REAL_PRIORS = {"Q": (math.log(0.01), 2.0), "R": (math.log(0.1), 2.0)}
#: the θ-particles of ``--real``'s streams: the service's default for ``smc2`` with a Kalman filter per θ-particle
REAL_M = SMC2Updater.DEFAULT_PARTICLES["kalman"]
#: the part of a series whose mean and sd standardise it (NAB's rules let a detector learn from its first 15 %)
PROBATION = 0.15


def aws_like_series(seed: int = 0, T: int = 4032) -> np.ndarray:
    """A series written to mimic an AWS CPU-utilisation metric (:data:`NAB_FILE`: 4032 five-minute readings, 3
    decimals): F = 7.5 % of T identical readings 0.134 (an idle instance reporting one quantised value; half the
    standardising :data:`PROBATION`, 302 of 4032), a jump of +0.5 at step F, then a level doing a random walk of
    step sd 0.005 read with noise of sd 0.03, each reading rounded to 0.002 (CloudWatch's quantisation) and floored
    at 0; numpy's generator seeded ``seed``."""
    rng = np.random.default_rng(seed)
    F = int(PROBATION / 2 * T)
    level = 0.634 + np.cumsum(0.005 * rng.standard_normal(T - F))
    noisy = np.maximum(np.round((level + 0.03 * rng.standard_normal(T - F)) / 0.002) * 0.002, 0.0)
    return np.concatenate([np.full(F, 0.134), noisy])


def nab_series(path: str) -> np.ndarray:
    """The ``value`` column of :data:`NAB_FILE` under a NAB checkout ``path`` (or of the CSV ``path`` itself)."""
    if os.path.isdir(path):
        path = os.path.join(path, NAB_FILE)
    with open(path) as f:
        return np.array([float(line.split(",")[1]) for line in f.read().splitlines()[1:] if line.strip()])


def real_case(values: np.ndarray) -> dict[str, Any]:
    """The local level model of a series standardised by the mean and sd of its first :data:`PROBATION`:
    x_m = x_{m−1} + N(0, Q), o_m = x_m + N(0, R), Q and R unknown with the lognormal :data:`REAL_PRIORS`,
    x_0 ~ N(0, 1) (:func:`run_jitter`'s prior)."""
    head = values[: max(2, int(PROBATION * len(values)))]
    ys = (values - head.mean()) / head.std()
    params = {"A": [[1.0]], "B": [[1.0]]}
    for k, (mu, sd) in REAL_PRIORS.items():
        params[k] = {"prior": {"type": "lognormal", "mean": mu, "sd": sd}}
    return {"family": "lds", "params": params, "obs": ys[:, None], "M": REAL_M, "Nx": 1}


def real(nab: str | None, T: int | None, observer: bool = False, stem: str = "params-real") -> None:
    """``--real [--nab PATH]``: a series with a run of identical readings followed by a jump — the simulated
    :func:`aws_like_series` (T readings with ``--steps``, else 4032) and, with ``--nab``, NAB's :data:`NAB_FILE`
    (its first T readings with ``--steps``) — under the local level model of :func:`real_case`: ``smc2`` mh at
    M = 256 (with ``observer`` also with the observer proposal) and jitter 0.5 at M = 256. Reference: the (Q, R)
    posterior on a 160 × 160 grid log-spaced in [1e-6, 1e2]² (zoomed where narrow, :func:`log_grid`) and the
    grid-fitted Kalman filter (the grid's MAP (Q, R) on the whole series). Issue 55's bars: smc2's total log
    evidence (the sum of its increments) within 1 % of the grid-fitted Kalman filter's sum of log predictive
    densities, and no collapse — at the end of the first 15 % and at the end, each parameter's relative sd
    (sd / mean) ≥ 0.1 × the grid posterior's. Also the first step (if any) at which :func:`cloud_health` calls the
    θ-cloud degenerate; ``benchmarks/results/params-real.json``."""
    torch.set_num_threads(1)
    series = {"simulated AWS-like (seed 0)": aws_like_series(0, T or 4032)}
    if nab:
        series["NAB ec2_cpu_utilization_24ae8d"] = nab_series(nab)[:T]
    runs = [(name, kernel, 0.5, options) for name, kernel, options in mh_runs(observer)]
    runs.append(("jitter 0.5", "jitter", 0.5, {}))
    out: dict[str, Any] = {"priors": REAL_PRIORS, "M": REAL_M, "series": {}}
    for label, values in series.items():
        case = real_case(values)
        n = len(case["obs"])
        early = int(PROBATION * n)
        t0 = time.perf_counter()
        grid = log_grid(case["obs"], 1.0, REAL_PRIORS, {}, [early, n], (1e-6, 1e2), 160)
        kf = grid[n]["map_loglik"]
        entry: dict[str, Any] = {
            "steps": n,
            "grid_s": time.perf_counter() - t0,
            "grid": {str(t): {k: v for k, v in grid[t].items() if k != "log_moments"} for t in (early, n)},
            "kalman_map_log_evidence": kf,
            "grid_log_evidence": grid[n]["log_evidence"],
            "runs": {},
        }
        for name, kernel, h, options in runs:
            t0 = time.perf_counter()
            run = run_jitter(case, h, REAL_M, 0, kernel, health=True, **options)
            ev = float(np.sum(run["log_evidence"]))
            collapse = {}
            for t in (early, n):
                for k, (gm, gs) in grid[t]["moments"].items():
                    rel = run["sd"][k][t - 1] / run["mean"][k][t - 1]
                    collapse[f"{k}@{t}"] = {"rel_sd": rel, "grid_rel_sd": gs / gm, "ratio": rel / (gs / gm)}
            degenerate = [t + 1 for t, d in enumerate(run["degenerate"]) if d]
            entry["runs"][name] = {
                "wall_s": time.perf_counter() - t0,
                "log_evidence": ev,
                "gap_pct": 100 * (kf - ev) / abs(kf),
                "gap_to_grid_evidence_pct": 100 * (grid[n]["log_evidence"] - ev) / abs(grid[n]["log_evidence"]),
                "collapse": collapse,
                "no_collapse": all(c["ratio"] >= 0.1 for c in collapse.values()),
                "first_degenerate_step": degenerate[0] if degenerate else None,
                "degenerate_steps": len(degenerate),
                "mean": {k: {str(t): run["mean"][k][t - 1] for t in (early, n)} for k in run["mean"]},
                "sd": {k: {str(t): run["sd"][k][t - 1] for t in (early, n)} for k in run["sd"]},
                "worst_increments": sorted(
                    ((float(v), t + 1) for t, v in enumerate(run["log_evidence"])), key=lambda p: p[0]
                )[:5],
            }
            print(label, name, {k: v for k, v in entry["runs"][name].items() if k in ("log_evidence", "gap_pct")})
        out["series"][label] = entry
    for label, e in out["series"].items():
        n, early = e["steps"], int(PROBATION * e["steps"])
        g = e["grid"]
        print(
            f"\n### {label}: {n} steps, local level, M = {REAL_M}. Grid-fitted Kalman filter (MAP Q = "
            f"{g[str(n)]['map']['Q']:.3g}, R = {g[str(n)]['map']['R']:.3g}): "
            f"log evidence {e['kalman_map_log_evidence']:.1f};"
            f" grid log evidence ∫p(o|θ)p(θ)dθ {e['grid_log_evidence']:.1f}\n"
        )
        keys = list(next(iter(e["runs"].values()))["collapse"])
        print(
            "| method | log evidence | gap to KF % (bar ≤ 1) | gap to grid evidence % | "
            + " | ".join(f"rel sd / grid's {k}" for k in keys)
            + " | no collapse (≥ 0.1) | first degenerate step (count) |"
        )
        print("|---|---|---|---|" + "---|" * len(keys) + "---|---|")
        for name, r in e["runs"].items():
            cells = " | ".join(f"{r['collapse'][k]['ratio']:.2f}" for k in keys)
            verdict = "pass" if r["no_collapse"] else "FAIL"
            ok = "pass" if abs(r["gap_pct"]) <= 1 else "FAIL"
            deg = f"{r['first_degenerate_step']} ({r['degenerate_steps']})" if r["first_degenerate_step"] else "never"
            print(
                f"| {name} | {r['log_evidence']:.1f} | {r['gap_pct']:.2f} {ok} | {r['gap_to_grid_evidence_pct']:.2f} "
                f"| {cells} | {verdict} | {deg} |"
            )
        print(
            "\n| grid posterior | "
            + " | ".join(f"{k} mean ± sd @ {t}" for t in (early, n) for k in ("Q", "R"))
            + " |\n|---|"
            + "---|" * 4
        )
        print(
            "| grid | "
            + " | ".join(
                f"{g[str(t)]['moments'][k][0]:.3g} ± {g[str(t)]['moments'][k][1]:.2g}" for t in (early, n) for k in "QR"
            )
            + " |"
        )
        for name, r in e["runs"].items():
            print(
                f"| {name} | "
                + " | ".join(f"{r['mean'][k][str(t)]:.3g} ± {r['sd'][k][str(t)]:.2g}" for t in (early, n) for k in "QR")
                + " |"
            )
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, stem + ".json"), "w") as f:
        json.dump(out, f, indent=1)


# ------------------------------------------------------------------ predictive p-values (issue 55)
def ks(seeds: int, T: int, burn: int = 50, observer: bool = False, stem: str = "params-ks") -> None:
    """``--ks``: ``smc2``'s predictive p-values (:meth:`SMC2Updater.pit`, before each update) on the well-specified
    lds R and lds Q R cases (seeds 0..S−1, ``burn`` + T steps, M = 256), kernels jitter 0.5 and mh (with
    ``observer`` also mh with the observer proposal): the Kolmogorov–Smirnov statistic and p-value of the last T
    p-values against U(0, 1) (scipy.stats.kstest; under a calibrated predictive the p-value is itself uniform);
    ``benchmarks/results/params-ks.json``."""
    from scipy.stats import kstest

    torch.set_num_threads(1)
    kernels = [("jitter 0.5", "jitter", {}), *mh_runs(observer)]
    rows: dict[str, list[dict[str, float]]] = {}
    for seed in range(seeds):
        for case_name, make in (("lds R", lds_case), ("lds Q R", lds_qr_case)):
            case = make(seed, burn + T)
            for name, kernel, options in kernels:
                run = run_jitter(case, 0.5, 256, seed, kernel, pit=True, **options)
                test = kstest(np.array(run["pit"][burn:]), "uniform")
                row = {"seed": seed, "ks": float(test.statistic), "p": float(test.pvalue)}
                rows.setdefault(f"{case_name} | {name}", []).append(row)
                print(case_name, name, row, flush=True)
    print(f"\n### predictive p-values against U(0, 1): T = {T} after {burn} burn-in, M = 256, {seeds} seeds\n")
    print("| case | method | KS statistic per seed | KS p-value per seed | p < 0.01 |")
    print("|---|---|---|---|---|")
    for key, rs in rows.items():
        stats = ", ".join(f"{r['ks']:.3f}" for r in rs)
        ps = ", ".join(f"{r['p']:.3g}" for r in rs)
        print(f"| {key} | {stats} | {ps} | {sum(r['p'] < 0.01 for r in rs)}/{len(rs)} |")
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, stem + ".json"), "w") as f:
        json.dump({"T": T, "burn": burn, "seeds": seeds, "M": 256, "rows": rows}, f, indent=1)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seeds", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--flat", action="store_true", help="per-step cost and state size at step 10⁶ only")
    ap.add_argument("--reference", action="store_true", help="the SV grid reference's own error only")
    ap.add_argument("--conflict", action="store_true", help="a prior far from the truth: does the θ-cloud recover")
    ap.add_argument("--mh", action="store_true", help="the mh kernel on lds Q and R against a 2-D grid")
    ap.add_argument("--mh-timing", action="store_true", help="ms per step of the mh kernel, amortised")
    ap.add_argument("--mh-only", action="store_true", help="with --mh-timing: the mh kernel alone (long runs)")
    ap.add_argument("--well-specified", action="store_true", help="issue 55: mh on lds Q R against the grid, to 10⁴")
    ap.add_argument("--real", action="store_true", help="issue 55: a series with a run of identical readings, a jump")
    ap.add_argument("--nab", metavar="PATH", help="with --real: a checkout of numenta/NAB (or the CSV itself)")
    ap.add_argument("--ks", action="store_true", help="issue 55: the predictive p-values against U(0, 1)")
    ap.add_argument("--observer", action="store_true", help="also the mh kernel with the observer proposal")
    ap.add_argument("--sv", action="store_true", help="issue 55: SV φ σ, jitter and mh against the grid")
    args = ap.parse_args(argv)
    quick = "-quick" if args.quick else ""
    if args.well_specified:
        S, T = args.seeds or (2 if args.quick else 8), args.steps or (1000 if args.quick else 10000)
        well_specified(S, T, args.observer, "params-well-specified" + quick)
        return
    if args.sv:
        S, T = args.seeds or (2 if args.quick else 8), args.steps or (300 if args.quick else 1000)
        sv_well_specified(S, T, args.observer, "params-sv" + quick)
        return
    if args.real:
        real(args.nab, args.steps or (1000 if args.quick else None), args.observer, "params-real" + quick)
        return
    if args.ks:
        S, T = args.seeds or (1 if args.quick else 4), args.steps or (500 if args.quick else 2000)
        ks(S, T, 50, args.observer, "params-ks" + quick)
        return
    if args.mh:
        mh_accuracy(args.seeds or 4, args.steps or 1000)
        return
    if args.mh_timing:
        mh_timing(args.steps or 10000, args.mh_only)
        return
    if args.flat:
        flat(args.steps or 2000)
        return
    if args.conflict:
        conflict(args.steps or (500 if args.quick else 1500), args.observer, "params-conflict" + quick)
        return
    if args.reference:
        reference_error(args.seeds or 4, args.steps or 200)
        return
    T = args.steps or (100 if args.quick else 200)
    S = args.seeds or (2 if args.quick else 4)
    checkpoints = [t for t in CHECKPOINTS if t <= T]
    torch.set_num_threads(1)
    results: dict[str, Any] = {"T": T, "seeds": S, "checkpoints": checkpoints, "cases": {}}
    for case_name, make, grid in (("lds R", lds_case, lds_grid), ("sv phi sigma", sv_case, sv_grid)):
        per: dict[str, list] = {}
        traces: dict[str, Any] = {}
        ref_err = []
        for seed in range(S):
            case = make(seed, T)
            t0 = time.perf_counter()
            ref = grid(case["obs"], checkpoints)
            ref_time = time.perf_counter() - t0
            if grid is sv_grid:  # the reference's own error: a coarser x grid
                coarse = sv_grid(case["obs"], checkpoints, 140)
                ref_err.append(max(abs(coarse[t][k][0] - ref[t][k][0]) / ref[t][k][1] for t in ref for k in ref[t]))
            M = case["M"]
            runs = [(f"jitter {h:g}", "jitter", h, M) for h in JITTERS]
            runs += [("jitter 1, 4M", "jitter", 1.0, 4 * M), ("liu_west", "liu_west", 1.0, M), ("pmmh", "pmmh", 0, M)]
            for name, kernel, h, m in runs:
                t0 = time.perf_counter()
                run = run_pmmh(case, m, seed) if kernel == "pmmh" else run_jitter(case, h, m, seed, kernel)
                wall = time.perf_counter() - t0
                per.setdefault(name, []).append(
                    {"wall_s": wall, "growth": growth(run["times"]), "scores": score(run, ref, checkpoints)}
                )
                if seed == 0:
                    traces[name] = {"mean": run["mean"], "sd": run["sd"]}
            if seed == 0:
                traces["grid"] = {t: ref[t] for t in checkpoints}
            print(f"{case_name} seed {seed}: grid {ref_time:.1f} s", flush=True)
        summary = {}
        for name, rows in per.items():
            keys = rows[0]["scores"].keys()
            summary[name] = {
                "wall_s": float(np.mean([r["wall_s"] for r in rows])),
                "growth": float(np.mean([r["growth"] for r in rows])),
                "scores": {
                    k: {m: float(np.mean([r["scores"][k][m] for r in rows])) for m in ("err_sd", "sd_ratio")}
                    for k in keys
                },
            }
        results["cases"][case_name] = {
            "summary": summary,
            "trace": traces,
            "ref_err_sd": float(max(ref_err)) if ref_err else 0.0,
        }
    print_tables(results)
    write(results, "params-quick" if args.quick else "params")


def print_tables(results: dict[str, Any]) -> None:
    for case_name, case in results["cases"].items():
        keys = list(next(iter(case["summary"].values()))["scores"])
        print(
            f"\n### {case_name} (T = {results['T']}, {results['seeds']} seeds; reference error "
            f"{case['ref_err_sd']:.3f} sd)\n"
        )
        print("| method | wall s | last/first tenth | " + " | ".join(f"{k} err/sd, sd ratio" for k in keys) + " |")
        print("|---|---|---|" + "---|" * len(keys))
        for name, s in case["summary"].items():
            cells = " | ".join(f"{s['scores'][k]['err_sd']:.3f}, {s['scores'][k]['sd_ratio']:.2f}" for k in keys)
            print(f"| {name} | {s['wall_s']:.1f} | {s['growth']:.2f} | {cells} |")


def write(results: dict[str, Any], stem: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, stem + ".json"), "w") as f:
        json.dump(results, f, indent=1)
    panels = [(c, k) for c, case in results["cases"].items() for k in case["trace"]["jitter 1"]["mean"]]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6))
    for ax, (case_name, k) in zip(np.atleast_1d(axes), panels, strict=True):
        trace = results["cases"][case_name]["trace"]
        for name in ("jitter 1", "jitter 1, 4M", "pmmh"):
            m, s = np.array(trace[name]["mean"][k]), np.array(trace[name]["sd"][k])
            t = np.arange(1, len(m) + 1)
            ax.plot(t, m, label=name)
            ax.fill_between(t, m - s, m + s, alpha=0.15)
        for t, ref in trace["grid"].items():
            m, s = ref[k]
            ax.errorbar(
                [int(t)], [m], yerr=[s], fmt="ko", capsize=3, label="grid" if t == results["checkpoints"][0] else None
            )
        ax.set_title(f"{case_name}: {k} (seed 0)")
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(RESULTS, stem + ".png"), dpi=110)
    print(f"wrote {os.path.join(RESULTS, stem)}.json and .png")


if __name__ == "__main__":
    main()

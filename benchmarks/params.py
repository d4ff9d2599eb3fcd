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
``--conflict``: a prior far from the truth (:func:`conflict`; ``params-conflict.json``), the ``mh`` kernel among
the contenders. ``--mh [--seeds S] [--steps T]``: the ``mh`` kernel (issue 55) against jitter and Liu–West on the
lds with Q and R unknown, against a 2-D grid at t = 100 and T = 1000 (:func:`mh_accuracy`; ``params-mh.json``).
``--mh-timing [--steps T]``: ms per step amortised at t = 100, 1000, 10000 of an M = 1024 stream, jitter against
mh (:func:`mh_timing`; ``params-mh-timing.json``).
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
def lds_grid(ys: np.ndarray, checkpoints: list[int]) -> dict[int, dict[str, tuple[float, float]]]:
    """Posterior mean and sd of R at each checkpoint: exact Kalman log-likelihoods on a log-spaced grid, times the
    lognormal(0, 1) prior, with the grid's measure dR ∝ R."""
    r = np.exp(np.linspace(math.log(0.02), math.log(50.0), 4000))
    m, P, ll = np.zeros_like(r), np.ones_like(r), np.zeros_like(r)
    log_prior = -0.5 * np.log(r) ** 2 - np.log(r)
    out = {}
    for t, y in enumerate(ys[:, 0], 1):
        m, P = 0.9 * m, 0.81 * P + 1.0
        S = P + r
        ll += -0.5 * (np.log(2 * np.pi * S) + (y - m) ** 2 / S)
        K = P / S
        m, P = m + K * (y - m), (1 - K) * P
        if t in checkpoints:
            lp = ll + log_prior + np.log(r)
            w = np.exp(lp - lp.max())
            w /= w.sum()
            mean = float((w * r).sum())
            out[t] = {"R": (mean, float(math.sqrt((w * (r - mean) ** 2).sum())))}
    return out


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
def run_jitter(case, h: float, M: int, seed: int, kernel: str = "jitter", **options: Any) -> dict[str, Any]:
    model = make_model(case["family"], case["params"], 1)
    prior = GaussianMixture.gaussian(torch.zeros(1, 1), torch.eye(1)[None])
    updater = get_updater("smc2", jitter=h, theta_particles=M, kernel=kernel, **options)
    state = updater.init(prior, model, M * case["Nx"], seed)
    names = sorted(model.unknown)
    mean, sd, times = {k: [] for k in names}, {k: [] for k in names}, []
    for y in case["obs"]:
        t0 = time.perf_counter()
        state, _ = updater.update(state, torch.tensor(y[None], dtype=torch.float32), model)
        times.append(time.perf_counter() - t0)
        w = torch.softmax(state.extras["param_log_weights"][0], -1)
        for k in names:
            th = state.extras["param." + k][0]
            m = float((w * th).sum())
            mean[k].append(m)
            sd[k].append(float((w * (th - m) ** 2).sum().sqrt()))
    return {"mean": mean, "sd": sd, "times": times}


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


def conflict(T: int) -> None:
    """``--conflict``: the lds R case with a prior far from the truth (log R ~ N(3, 0.3²): R ≈ 20, truth R = 2, 7.7
    prior sd away), T steps, against the grid posterior under that prior — does the θ-cloud, once its ESS has
    collapsed onto the prior's edge, ever reach the posterior? Every kernel at M = 256, the default jitter at M = 64
    and 1024; ``benchmarks/results/params-conflict.json``."""
    torch.set_num_threads(1)
    case = lds_case(0, T)
    case["params"] = {**case["params"], "R": {"prior": {"type": "lognormal", "mean": 3.0, "sd": 0.3}}}
    checkpoints = [t for t in (100, 300, 1000, 1500) if t <= T]
    r = np.exp(np.linspace(math.log(0.2), math.log(60.0), 6000))
    m, P, ll, ref = np.zeros_like(r), np.ones_like(r), np.zeros_like(r), {}
    for t, y in enumerate(case["obs"][:, 0], 1):  # the grid posterior under this prior (as lds_grid)
        m, P = 0.9 * m, 0.81 * P + 1.0
        S = P + r
        ll += -0.5 * (np.log(2 * np.pi * S) + (y - m) ** 2 / S)
        m, P = m + P / S * (y - m), (1 - P / S) * P
        if t in checkpoints:
            lp = ll - 0.5 * ((np.log(r) - 3.0) / 0.3) ** 2
            w = np.exp(lp - lp.max())
            w /= w.sum()
            mean = float((w * r).sum())
            ref[t] = (mean, float(math.sqrt((w * (r - mean) ** 2).sum())))
    rows = {"grid": {t: ref[t] for t in checkpoints}}
    for name, kernel, h, M in (
        ("jitter 0.5, M = 64", "jitter", 0.5, 64),
        ("jitter 0.5, M = 256", "jitter", 0.5, 256),
        ("jitter 0.5, M = 1024", "jitter", 0.5, 1024),
        ("jitter 2, M = 256", "jitter", 2.0, 256),
        ("liu_west, M = 256", "liu_west", 0.5, 256),
        ("mh (H = 1000, 3 moves), M = 256", "mh", 0.5, 256),
    ):
        run = run_jitter(case, h, M, 0, kernel, **({"history": 1000, "mh_moves": 3} if kernel == "mh" else {}))
        rows[name] = {t: (run["mean"]["R"][t - 1], run["sd"]["R"][t - 1]) for t in checkpoints}
        print(name, flush=True)
    print("\n| R posterior mean ± sd | " + " | ".join(f"t = {t}" for t in checkpoints) + " |")
    print("|---|" + "---|" * len(checkpoints))
    for name, row in rows.items():
        print(f"| {name} | " + " | ".join(f"{row[t][0]:.2f} ± {row[t][1]:.3f}" for t in checkpoints) + " |")
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "params-conflict.json"), "w") as f:
        json.dump({"T": T, "rows": rows}, f, indent=1)


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
    log-spaced (Q, R) in [0.05, 20]², times the lognormal(0, 1) priors, the measure dQ dR ∝ Q R."""
    g = np.exp(np.linspace(math.log(0.05), math.log(20.0), n))
    q, r = (a.ravel() for a in np.meshgrid(g, g, indexing="ij"))
    m, P, ll = np.zeros_like(q), np.ones_like(q), np.zeros_like(q)
    log_prior = -0.5 * np.log(q) ** 2 - 0.5 * np.log(r) ** 2  # the densities' 1/θ cancel the measure's θ
    out = {}
    for t, y in enumerate(ys[:, 0], 1):
        m, P = 0.9 * m, 0.81 * P + q
        S = P + r
        ll += -0.5 * (np.log(2 * np.pi * S) + (y - m) ** 2 / S)
        m, P = m + P / S * (y - m), (1 - P / S) * P
        if t in checkpoints:
            lp = ll + log_prior
            w = np.exp(lp - lp.max())
            w /= w.sum()
            out[t] = {}
            for k, v in (("Q", q), ("R", r)):
                mean = float((w * v).sum())
                out[t][k] = (mean, float(math.sqrt((w * (v - mean) ** 2).sum())))
    return out


MH_RUNS = (
    ("jitter 0.5", "jitter", {}),
    ("liu_west", "liu_west", {}),
    ("mh (H = 1000, 3 moves)", "mh", {"history": 1000, "mh_moves": 3}),
)


def mh_accuracy(seeds: int, T: int) -> None:
    """``--mh``: the well-specified lds with Q and R unknown, every kernel at M = 256, against the 2-D grid at
    t = 100 and T; ``benchmarks/results/params-mh.json``."""
    torch.set_num_threads(1)
    checkpoints = [t for t in (100, 1000) if t <= T] or [T]
    per: dict[str, list] = {}
    for seed in range(seeds):
        case = lds_qr_case(seed, T)
        ref = lds_qr_grid(case["obs"], checkpoints)
        for name, kernel, options in MH_RUNS:
            t0 = time.perf_counter()
            run = run_jitter(case, 0.5, 256, seed, kernel, **options)
            per.setdefault(name, []).append(
                {"wall_s": time.perf_counter() - t0, "scores": score(run, ref, checkpoints)}
            )
        print(f"seed {seed} done", flush=True)
    summary = {}
    for name, rows in per.items():
        keys = rows[0]["scores"].keys()
        summary[name] = {
            "wall_s": float(np.mean([r["wall_s"] for r in rows])),
            "scores": {
                k: {
                    m: [
                        float(np.mean([r["scores"][k][m] for r in rows])),
                        float(np.max([r["scores"][k][m] for r in rows])),
                    ]
                    for m in ("err_sd", "sd_ratio")
                }
                for k in keys
            },
            "per_seed": [r["scores"] for r in rows],
        }
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


def mh_timing(T: int) -> None:
    """``--mh-timing``: ms per step, amortised (total time / t) at t = 100, 1000, 10000, of a default-size stream
    (M = N = 1024) of the lds Q R case, jitter against mh; ``benchmarks/results/params-mh-timing.json``."""
    torch.set_num_threads(1)
    case = lds_qr_case(0, T)
    checkpoints = [t for t in (100, 1000, 10000) if t <= T]
    rows = {}
    for name, kernel, options in MH_RUNS[::2]:
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
    with open(os.path.join(RESULTS, "params-mh-timing.json"), "w") as f:
        json.dump({"T": T, "rows": rows}, f, indent=1)


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
    args = ap.parse_args(argv)
    if args.mh:
        mh_accuracy(args.seeds or 4, args.steps or 1000)
        return
    if args.mh_timing:
        mh_timing(args.steps or 10000)
        return
    if args.flat:
        flat(args.steps or 2000)
        return
    if args.conflict:
        conflict(args.steps or 1500)
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

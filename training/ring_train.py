"""Train a :class:`~mpflow.operators.mpf.ring.RingFlow` after the LETKF by the energy score on simulated Lorenz-96
twins: ``python -m mpflow.training.ring_train --out DIR [--minutes M] [--device cuda]``.

The task distribution covers the regimes users run: per twin F ~ U[7, 9], Δ log-uniform on [0.05, 0.5] (RK4 steps
of at most ``RK4_STEP``), R log-uniform on [0.25, 2.5] (a decade), and every ``obs_every`` ∈ {1, 2, 4} (one pool of
``batch`` twins per stride, visited in turn: a batch shares its observed indices). Each pool is a set of running twin
experiments — truth, observations and an ensemble of N members filtered by LETKF + flow — carried from iteration to
iteration (the flow is trained on the clouds it produces itself). An iteration advances one pool by one cycle:

    forecast (the truth and the members, no model noise) → observe → LETKF analysis (no gradient) → the flow,
    loss = mean over twins of the fair energy score of the flowed ensemble against the truth
    (:func:`mpflow.training.scores.energy_score`), Adam step; the ensemble is carried on detached (truncation
    after every cycle: the gradient of a step's score reaches that step's flow only).

A twin is restarted (a new regime, a truth spun up onto the attractor, members around it) when its analysis RMSE
exceeds ``LOST_RMSE`` (it lost the truth) or after ``MAX_AGE`` cycles (to keep drawing regimes), in batches every
``restart_every`` cycles of its pool; until then a lost twin's score is left out of the loss. Validation: every
``val_every`` iterations the mean energy score and RMSE of fixed validation pools (spantini2019 and sakov2008
twins, run ``val_cycles`` cycles from their own warm state) — the best θ by the spantini2019 validation RMSE is kept.

``--arch correction`` trains the one-evaluation local correction of
:mod:`mpflow.operators.mpf.ring_correction` in place of the flow, on the same task and loss. ``--base ienkf`` puts the
iterative EnKF (:data:`IENKF_BASE`: N = 40 for d = 40, at most 4 Gauss–Newton iterations, ρ per twin by
:func:`~mpflow.operators.updaters.ienkf.lorenz96_inflation` of its Δ) in place of the LETKF (the default, ``letkf``):
it analyses the previous ensemble itself, and the network reads its first iterate's forecast. A twin whose IEnKF
iterate overflows is carried unchanged, counted lost and restarted; a batch with no twin left takes no step.

Options of this round (issue 35; docs/benchmarks.md "A learned correction after ``ienkf``"):

* ``--gate H`` — the correction scaled by a learned gate γ(z) of the regime (H hidden units,
  :mod:`mpflow.operators.mpf.ring_correction`), zero at initialisation: θ = 0 is the base exactly; ``--gate-l2 λ``
  adds λ ‖W_γ‖² of the gate's last layer to the loss (a pull toward the base where the correction does not pay).
* ``--mean-only`` — the correction shifts the mean alone and keeps the base's anomalies (a correction that changes
  the spread learned to narrow it: its one-cycle score improves while the filter degrades over the cycles).
* ``--loss log-ratio`` — each twin's loss is log(ES(X') / ES(X^a)), its energy score over the base's on the same twin
  state: 0 at the base, and every regime weighs the same (the gradient is ∇ES / ES), so the high-error regimes
  (Δ 0.5, every fourth variable observed) no longer dominate the near-linear ones; ``energy`` (the default) is the
  mean energy score.
* ``--forecast-weight w`` — a second term through the model: w · log ES(f(x̄' + ρ (X' − x̄')), x_{m+1}), the energy
  score of the corrected ensemble's forecast (inflated by the base's ρ, as the next IEnKF's first iterate sees it)
  against the next truth, with the gradient through the RK4 forecast (the next cycle's base analysis itself stays
  ``no_grad``: two cycles' worth of signal, not back-propagation through the IEnKF).
* ``--val-sakov-twins``/``--val-sakov-cycles`` size the sakov2008 validation apart from spantini2019's, and
  ``--sakov-tolerance t`` keeps a new best θ only if its sakov2008 validation RMSE is at most (1 + t) × the base's
  (iteration 0): the kept θ improves spantini2019 without making sakov2008 worse.

Options of the fourth round (docs/benchmarks.md "Gradients through the IEnKF over several cycles"):

* ``--window k`` (``--base ienkf``, no ``--forecast-weight``) — an iteration advances its pool by k cycles with the
  gradient through all of them (:func:`window_step`): the corrected ensemble X'_j is the next cycle's previous
  ensemble with its graph, the IEnKF's Gauss–Newton iterations and RK4 forecasts differentiable in float64
  (:func:`~mpflow.operators.updaters.ienkf.gauss_newton_frozen`: Δw by a Cholesky solve, the transform T, T⁻¹ held
  constant — the gradient goes through w, the sensitivities and the forecasts, not through the thin SVD), and the
  loss Σ_j mean_twins log(ES(X'_j) / ES(X^a_j)) (``--loss log-ratio``) summed over the window; the ensemble is
  detached after it. A step whose gradient is not finite (a blown twin's NaN through a batched layer) is skipped and
  counted (``skipped_steps``).
* ``--select paired`` — the validation runs θ and the base (the IEnKF alone, θ₀) from the same warm states with the
  same observation noise (:func:`paired_validate`) and keeps θ by the mean over twins of RMSE_θ − RMSE_base on
  spantini2019 (lowest yet; θ₀'s is 0), where sakov2008's is at most ``--sakov-tolerance`` × the base's RMSE there
  (0 if not given); each row logs both differences with their standard errors. The base's runs are made once.

Writes ``DIR/ring.pt`` (the network's arch, config and θ; at every new best, so a run cut short keeps one),
``DIR/ring_final.pt`` (θ at the end of training, whether or not it is the best), ``DIR/ring_log.jsonl`` (one line per
validation) and
``DIR/ring_curve.png``.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from mpflow.operators.models.lorenz96 import Lorenz96
from mpflow.operators.mpf.ring import RingFlow
from mpflow.operators.mpf.ring_correction import RingCorrection
from mpflow.operators.updaters.enkf import EnKFUpdater
from mpflow.operators.updaters.ienkf import IEnKFUpdater, lorenz96_inflation
from mpflow.training.scores import energy_score
from mpflow.training.task_distribution import stack_params

F_RANGE = (7.0, 9.0)
DELTA_RANGE = (0.05, 0.5)
R_RANGE = (0.25, 2.5)
STRIDES = (1, 2, 4)
RK4_STEP = 0.05
LOST_RMSE = 3.0
MAX_AGE = 400
SPIN_UP_TIME = 10.0
#: the LETKF the flow follows: Gaspari–Cohn half-width and inflation (spantini2019's tuned LETKF, DAPPER loc_rad 4)
BASE = {"localisation": 4.0, "inflation": 1.05}
#: ``--base ienkf``: the iterative EnKF (N = 40 for d = 40: global, it needs N near d) with at most 4 Gauss–Newton
#: iterations and ρ following each twin's Δ by :func:`mpflow.operators.updaters.ienkf.lorenz96_inflation`
IENKF_BASE = {"method": "ienkf", "iterations": 4, "inflation": "lorenz96_inflation(delta)"}
#: validation regimes (benchmarks.lorenz96's settings)
VALIDATION = {
    "spantini2019": {"delta": 0.4, "obs_every": 2, "R": 0.5, "F": 8.0},
    "sakov2008": {"delta": 0.05, "obs_every": 1, "R": 1.0, "F": 8.0},
}


@dataclass
class Pool:
    """B running twin experiments with one observation stride: model (per-twin F, Δ, R), truths [B, d], ensembles
    [B, N, d] and their ages (cycles since the last restart)."""

    model: Lorenz96
    truth: torch.Tensor
    members: torch.Tensor
    age: torch.Tensor
    #: the twins that kept the truth at the last cycle (the loss averages over them alone)
    held: torch.Tensor | None = None
    #: the last cycle's base-analysis energy score [B] (no gradient) and corrected ensemble [B, N, d] (with its graph
    #: when the cycle ran with ``grad``; the loss of :func:`training_loss` reads both)
    base_score: torch.Tensor | None = None
    corrected: torch.Tensor | None = None


def task_domain() -> dict[str, list[float]]:
    """The task distribution as a registered network's ``domain`` (config.json; what ``operator_domain`` reads)."""
    return {
        "F": list(F_RANGE),
        "delta": list(DELTA_RANGE),
        "R": list(R_RANGE),
        "obs_every": [min(STRIDES), max(STRIDES)],
    }


def _uniform(gen: torch.Generator, n: int, lo: float, hi: float, log: bool = False) -> torch.Tensor:
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    if log:
        return torch.exp(math.log(lo) + u * (math.log(hi) - math.log(lo)))
    return lo + u * (hi - lo)


def regime_params(gen: torch.Generator, n: int, stride: int) -> list[dict[str, float]]:
    """n draws of the task distribution's regime (module docstring) with observation stride ``stride``."""
    F = _uniform(gen, n, *F_RANGE)
    delta = _uniform(gen, n, *DELTA_RANGE, log=True)
    R = _uniform(gen, n, *R_RANGE, log=True)
    return [
        {"F": float(f), "delta": float(t), "R": float(r), "obs_every": stride, "rk4_step": RK4_STEP}
        for f, t, r in zip(F, delta, R, strict=True)
    ]


def spun_up(model: Lorenz96, gen: torch.Generator, device) -> torch.Tensor:
    """Truths [B, d] carried ``SPIN_UP_TIME`` time units from F + N(0, I) onto the attractor."""
    B, d = model.params["R"].shape[0], model.state_dim
    x = model.params["F"].reshape(B, 1) + torch.randn(B, d, generator=gen, dtype=torch.float64).to(device)
    steps = math.ceil(SPIN_UP_TIME / float(model.params["delta"].min()))
    for _ in range(steps):  # every twin at least SPIN_UP_TIME (more for a longer Δ: still on the attractor)
        x = model.transition_mean(x[:, None])[:, 0]
    return x


def new_pool(params: list[dict[str, Any]], d: int, N: int, gen: torch.Generator, device) -> Pool:
    model = stack_params(Lorenz96, params, d, torch.float64)
    model = type(model)({k: v.to(device) for k, v in model.params.items()}, d)
    truth = spun_up(model, gen, device)
    members = truth[:, None] + torch.randn(len(params), N, d, generator=gen, dtype=torch.float64).to(device)
    return Pool(model, truth, members, torch.zeros(len(params), dtype=torch.long, device=device))


def base_analysis(
    updater: EnKFUpdater | IEnKFUpdater,
    previous: torch.Tensor,
    obs: torch.Tensor,
    model: Lorenz96,
    grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(forecast, base analysis) [B, N, d] from the previous analysis ensemble, no gradient. The LETKF analyses the
    forecast f(previous); the IEnKF analyses ``previous`` itself, inflated about its mean by ρ(Δ) of each twin
    (:func:`lorenz96_inflation`, passed as :meth:`IEnKFUpdater.iterate`'s per-stream ``inflation``, as a served
    stream's correction takes it), and its forecast is that of the inflated ensemble. ``grad`` (``--window``, the
    IEnKF only): with the gradient through the iterations (T, T⁻¹ held constant: ``frozen_transform``)."""
    if grad and not isinstance(updater, IEnKFUpdater):
        raise ValueError("a gradient through the base analysis needs --base ienkf")
    with torch.set_grad_enabled(grad):
        if isinstance(updater, IEnKFUpdater):
            rho = lorenz96_inflation(model.params["delta"]).to(previous)[:, None, None]
            xa, _, _, forecast = updater.iterate(previous, obs, model, rho, strict=False, frozen_transform=grad)
            return forecast, xa
        forecast = model.transition_mean(previous)
        return forecast, updater.analysis(forecast, obs, model, None)[0]


def make_base(name: str) -> EnKFUpdater | IEnKFUpdater:
    """``--base``: the LETKF of :data:`BASE` or the IEnKF of :data:`IENKF_BASE` (ρ applied by :func:`base_analysis`)."""
    if name == "ienkf":
        return IEnKFUpdater(inflation=1.0, iterations=IENKF_BASE["iterations"])
    return EnKFUpdater(**BASE)


def cycle(
    pool: Pool,
    flow: RingFlow | RingCorrection | None,
    letkf: EnKFUpdater | IEnKFUpdater,
    gen: torch.Generator,
    grad: bool,
    through: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One forecast–analysis cycle of every twin of the pool, in place → (energy score [B] (with its graph when
    ``grad``), analysis RMSE [B]). ``flow`` None: the base analysis alone (float64; the paired validation's base).
    ``through`` (``--window``): the base analysis with its gradient, and the corrected ensemble carried on *with* its
    graph as the next cycle's previous ensemble (the caller detaches it after the window)."""
    model = pool.model
    pool.truth = model.transition_mean(pool.truth[:, None])[:, 0]
    noise = torch.randn(pool.truth.shape[0], model.params["obs_index"].shape[-1], generator=gen, dtype=torch.float64)
    obs = model.observed_mean(pool.truth[:, None])[:, 0] + model.observation_sd() * noise.to(pool.truth.device)
    forecast, base = base_analysis(letkf, pool.members, obs, model, grad=through)
    # a twin whose base analysis blew up (the IEnKF's iterate left the attractor): carried as it was, then restarted
    blown = ~(torch.isfinite(base).all((1, 2)) & torch.isfinite(forecast).all((1, 2)))
    if bool(blown.any()):
        base, forecast = base.clone(), forecast.clone()
        base[blown], forecast[blown] = pool.members[blown], pool.members[blown]
    weight = next(flow.parameters()) if flow is not None else base
    dev, dtype = weight.device, weight.dtype
    flow_model = type(model)({k: v.to(dev, dtype) for k, v in model.params.items()}, model.state_dim)
    with torch.set_grad_enabled(grad):
        out = (
            base if flow is None else flow(forecast.to(dev, dtype), base.to(dev, dtype), obs.to(dev, dtype), flow_model)
        )
        score = energy_score(out, pool.truth.to(dev, dtype))
    with torch.no_grad():
        pool.base_score = energy_score(base.to(dev, dtype), pool.truth.to(dev, dtype))
    pool.corrected = out if grad else None
    members = (out if through else out.detach()).to(pool.truth.device, torch.float64)
    bad = ~torch.isfinite(members.detach()).all((1, 2))  # a huge ensemble overflowed the network's float32
    if bool(bad.any()):  # that twin carried as it was (finite), its score left out, counted lost below
        members = torch.where(bad[:, None, None], pool.members, members)
        score = torch.where(bad.to(score.device), torch.nan, score)
        blown = blown | bad
    pool.members = members
    pool.age += 1
    rmse = (pool.members.detach().mean(1) - pool.truth).square().mean(-1).sqrt()
    rmse[blown] = math.inf
    pool.held = (rmse <= LOST_RMSE) & torch.isfinite(rmse)
    return score, rmse


def log_ratio(score: torch.Tensor, base_score: torch.Tensor) -> torch.Tensor:
    """``--loss log-ratio`` per twin: log(ES(X') / ES(X^a)) [B] (0 where the correction is the base)."""
    return torch.log(score.clamp_min(1e-12)) - torch.log(base_score.clamp_min(1e-12))


def next_forecast_score(pool: Pool, base_name: str) -> torch.Tensor:
    """``--forecast-weight``'s score [B]: the energy score of the forecast of the last corrected ensemble X' (with its
    graph), inflated about its mean by the base's ρ (:func:`lorenz96_inflation` of each twin's Δ for ``ienkf``, 1 for
    the LETKF, which inflates after its forecast), against the truth one interval on (computed here, not stored)."""
    x = pool.corrected
    model = type(pool.model)({k: v.to(x.device, x.dtype) for k, v in pool.model.params.items()}, pool.model.state_dim)
    rho = lorenz96_inflation(model.params["delta"]).to(x)[:, None, None] if base_name == "ienkf" else 1.0
    mean = x.mean(1, keepdim=True)
    ahead = model.transition_mean(mean + rho * (x - mean))
    with torch.no_grad():
        truth = pool.model.transition_mean(pool.truth[:, None])[:, 0]
    return energy_score(ahead, truth.to(x))


def cycle_loss(score: torch.Tensor, base_score: torch.Tensor, keep: torch.Tensor, loss: str) -> torch.Tensor:
    """One cycle's term of the loss over the kept twins: the mean over them of log(ES(X') / ES(X^a)) (``log-ratio``)
    or of ES(X') (``energy``)."""
    per = log_ratio(score, base_score) if loss == "log-ratio" else score
    return per[keep].mean()


def gate_pull(flow, args: argparse.Namespace) -> torch.Tensor | float:
    """``--gate-l2``'s λ ‖W_γ‖² of the gate's last layer (0 without a gate)."""
    gate = getattr(flow, "gate", None)
    return args.gate_l2 * gate[-1].weight.square().sum() if gate is not None and args.gate_l2 > 0 else 0.0


def training_loss(pool: Pool, score: torch.Tensor, keep: torch.Tensor, args: argparse.Namespace, flow) -> torch.Tensor:
    """The loss of one iteration over the kept twins (module docstring: ``--loss``, ``--forecast-weight``,
    ``--gate-l2``)."""
    loss = cycle_loss(score, pool.base_score, keep, args.loss)
    if args.forecast_weight > 0:
        ahead = next_forecast_score(pool, args.base)
        if args.loss == "log-ratio":  # normalised by the base analysis' score (a constant: ∇ log ES = ∇ES / ES)
            ahead = log_ratio(ahead, pool.base_score)
        loss = loss + args.forecast_weight * ahead[keep & torch.isfinite(ahead.detach())].mean()
    return loss + gate_pull(flow, args)


def window_step(
    pool: Pool, flow, base: IEnKFUpdater, gen: torch.Generator, args: argparse.Namespace
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``--window k``: k consecutive cycles of the pool with the gradient through all of them → (the loss, or None
    when no twin was kept at any cycle; the last cycle's RMSE [B]). Cycle j's corrected ensemble X'_j is the
    previous ensemble of cycle j + 1's IEnKF, with its graph (:func:`cycle` ``through``), so

        L = Σ_{j=1..k} mean_{twins kept at j} log(ES(X'_j) / ES(X^a_j)) + λ ‖W_γ‖²

    (``--loss log-ratio``; X^a_j the IEnKF's analysis of the corrected path at j, its score a constant) reaches θ
    through every later cycle's IEnKF iterations and forecasts. A twin counts at cycle j while it held the truth at
    j − 1 and its score is finite. The pool's ensemble is detached after the window (truncation every k cycles)."""
    terms = []
    rmse = None
    for _ in range(args.window):
        held = pool.held
        score, rmse = cycle(pool, flow, base, gen, grad=True, through=True)
        keep = torch.isfinite(score.detach()) & (held.to(score.device) if held is not None else True)
        if bool(keep.any()):
            terms.append(cycle_loss(score, pool.base_score, keep, args.loss))
    pool.members = pool.members.detach()
    pool.corrected = None
    if not terms:
        return None, rmse
    return sum(terms) + gate_pull(flow, args), rmse


def restart_lost(pool: Pool, rmse: torch.Tensor, stride: int, N: int, gen: torch.Generator) -> int:
    """Restart the twins that lost the truth or are older than ``MAX_AGE`` with a fresh regime → how many."""
    bad = (rmse > LOST_RMSE) | ~torch.isfinite(rmse) | (pool.age >= MAX_AGE)
    idx = bad.nonzero().flatten().tolist()
    if not idx:
        return 0
    fresh = new_pool(regime_params(gen, len(idx), stride), pool.model.state_dim, N, gen, pool.truth.device)
    for key, value in fresh.model.params.items():
        if key in pool.model.params and pool.model.params[key].shape[0] == rmse.shape[0]:
            pool.model.params[key][idx] = value
    pool.truth[idx], pool.members[idx], pool.age[idx] = fresh.truth, fresh.members, 0
    return len(idx)


def rollout(
    pool: Pool, flow, base: EnKFUpdater | IEnKFUpdater, gen: torch.Generator, cycles: int
) -> tuple[float, torch.Tensor, float]:
    """``cycles`` cycles of a copy of ``pool`` (the pool itself untouched) → (the mean energy score, each twin's mean
    analysis RMSE [twins] — a lost or blown twin's counted at ``LOST_RMSE``, a blown IEnKF twin's being infinite —,
    the mean ensemble spread)."""
    p = copy.deepcopy(pool)
    score, spread = 0.0, 0.0
    rmse = torch.zeros(p.truth.shape[0], dtype=torch.float64)
    for _ in range(cycles):
        s, r = cycle(p, flow, base, gen, grad=False)
        score += float(s.mean())
        rmse += r.detach().cpu().double().nan_to_num(LOST_RMSE, LOST_RMSE).clamp_max(LOST_RMSE)
        spread += float(p.members.std(1).square().mean(-1).sqrt().mean())
    return score / cycles, rmse / cycles, spread / cycles


def validate(
    flow: RingFlow, letkf: EnKFUpdater, pools: dict[str, Pool], cycles: int | dict[str, int], seed: int
) -> dict[str, float]:
    """Mean energy score and RMSE over ``cycles`` cycles (one number, or one per pool) of copies of the validation
    pools (same start every time; :func:`rollout`)."""
    out = {}
    gen = torch.Generator().manual_seed(seed)
    for name, pool in pools.items():
        score, rmse, spread = rollout(pool, flow, letkf, gen, cycles[name] if isinstance(cycles, dict) else cycles)
        out[f"{name}_score"] = score
        out[f"{name}_rmse"] = float(rmse.mean())
        out[f"{name}_spread"] = spread
    return out


def closed_gate(flow) -> bool:
    """Whether ``flow`` is a gated correction whose gate's last layer is zero: γ = 0, the base analysis exactly."""
    gate = getattr(flow, "gate", None)
    return gate is not None and all(not bool(p.detach().abs().sum()) for p in gate[-1].parameters())


def paired_validate(
    flow,
    base: EnKFUpdater | IEnKFUpdater,
    pools: dict[str, Pool],
    cycles: dict[str, int],
    seed: int,
    reference: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    """``--select paired``: θ and the base (``flow`` None: the IEnKF alone, θ₀ of a gated correction) run from the
    same warm states with the same observation noise (one generator seeded alike; the truths are deterministic),
    so per twin i the difference D_i = RMSE_θ,i − RMSE_base,i (each the mean over the cycles of the analysis RMSE,
    a lost or blown twin's counted at ``LOST_RMSE``) has the chaotic path's common part removed. Per regime:

        diff = mean_i D_i,   diff_se = sd_i(D_i) / √n    (n twins),

    with the base's per-twin RMSEs from ``reference`` (filled here on the first call: the base does not change).
    ``flow`` None: θ is the base (a closed gate, :func:`closed_gate`): its row is the base's, every D_i = 0."""
    out: dict[str, Any] = {}
    runs = {}
    for name, pool in pools.items():
        for who, net in (("base", None), ("theta", flow)):
            if (who == "base" and name in reference) or (who == "theta" and flow is None):
                continue
            _, rmse, spread = rollout(pool, net, base, torch.Generator().manual_seed(seed), cycles[name])
            row = {"rmse": rmse, "spread": spread}
            if who == "base":
                reference[name] = row
            runs[name] = row
        ref = reference[name]
        theta = ref if flow is None else runs[name]
        D = theta["rmse"] - ref["rmse"]
        out[f"{name}_rmse"] = float(theta["rmse"].mean())
        out[f"{name}_spread"] = theta["spread"]
        out[f"{name}_base_rmse"] = float(ref["rmse"].mean())
        out[f"{name}_base_spread"] = ref["spread"]
        out[f"{name}_diff"] = float(D.mean())
        out[f"{name}_diff_se"] = float(D.std() / math.sqrt(len(D))) if len(D) > 1 else math.nan
    return out


def faster_base_device(letkf: EnKFUpdater, args: argparse.Namespace, gen: torch.Generator) -> str:
    """ "cuda" or "cpu", whichever runs a batch's forecast and LETKF analysis faster (the LETKF's many small
    SVDs may be faster on the CPU's cores than on a GPU)."""
    times = {}
    for name in ("cpu", "cuda"):
        pool = new_pool(regime_params(gen, args.batch, 2), args.dim, args.particles, gen, torch.device(name))
        obs = pool.model.observed_mean(pool.truth[:, None])[:, 0]
        for k in range(4):  # the first is a warm-up
            if k == 1:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
            base_analysis(letkf, pool.members, obs, pool.model)
        torch.cuda.synchronize()
        times[name] = time.perf_counter() - t0
    print(f"forecast + LETKF of {args.batch} twins, 3 cycles: {times}", flush=True)
    return min(times, key=times.get)


def train(args: argparse.Namespace) -> dict[str, Any]:
    if args.window > 1 and (args.base != "ienkf" or args.forecast_weight > 0):
        raise ValueError("--window k > 1: through the IEnKF (--base ienkf), with no --forecast-weight")
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    config = {"hidden": args.hidden, "layers": args.layers, "kernel": args.kernel, "steps": args.ode_steps}
    if args.arch == "correction":
        config.update(embed=args.embed, gate=args.gate, mean_only=int(args.mean_only))
    flow = build(args.arch, **config).to(device)
    letkf = make_base(args.base)
    if args.base_device == "auto":
        args.base_device = faster_base_device(letkf, args, gen) if device.type == "cuda" else "cpu"
        print(f"LETKF and forecasts on {args.base_device}", flush=True)
    device = torch.device(args.base_device)  # the twins' device (the flow stays where it is)
    opt = torch.optim.Adam(flow.parameters(), lr=args.lr)
    pools = {k: new_pool(regime_params(gen, args.batch, k), args.dim, args.particles, gen, device) for k in STRIDES}
    val_gen = torch.Generator().manual_seed(10_000 + args.seed)
    sizes = {"spantini2019": args.val_twins, "sakov2008": args.val_sakov_twins or args.val_twins}
    val_pools = {
        name: new_pool([{**p, "rk4_step": RK4_STEP}] * sizes[name], args.dim, args.particles, val_gen, device)
        for name, p in VALIDATION.items()
    }
    val_cycles = {"spantini2019": args.val_cycles, "sakov2008": args.val_sakov_cycles or args.val_cycles}
    for pool in [*pools.values(), *val_pools.values()]:  # warm up under the LETKF (the untrained flow)
        for _ in range(args.warm_up):
            cycle(pool, flow, letkf, gen, grad=False)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    log = open(out_dir / "ring_log.jsonl", "w", encoding="utf-8")  # noqa: SIM115
    history, t0, it, restarts = [], time.perf_counter(), 0, 0
    best, best_state, sakov_bar = math.inf, copy.deepcopy(flow.state_dict()), math.inf
    reference: dict[str, dict[str, Any]] = {}  # --select paired: the base's per-twin validation RMSEs
    skipped = 0
    train_scores: list[float] = []
    try:
        while True:
            elapsed = time.perf_counter() - t0
            if it % args.val_every == 0 or elapsed > 60 * args.minutes or it >= args.iterations:
                row = {"iteration": it, "seconds": round(elapsed, 1), "restarts": restarts}
                row["train_score"] = sum(train_scores) / len(train_scores) if train_scores else None
                row["skipped_steps"] = skipped
                if args.select == "paired":
                    theta = None if closed_gate(flow) else flow  # θ₀: the base exactly, not run twice
                    row.update(paired_validate(theta, letkf, val_pools, val_cycles, args.seed, reference))
                    row["validation_seconds"] = round(time.perf_counter() - t0 - elapsed, 1)
                    # the paired differences: θ kept where spantini2019's is the lowest yet (θ₀'s is 0) and
                    # sakov2008's is at most t × the base's RMSE there (t = --sakov-tolerance, 0 if not given)
                    score_now = row["spantini2019_diff"]
                    sakov_ok = row["sakov2008_diff"] <= (args.sakov_tolerance or 0.0) * row["sakov2008_base_rmse"]
                else:
                    row.update(validate(flow, letkf, val_pools, val_cycles, args.seed))
                    if it == 0 and args.sakov_tolerance is not None:  # the base's sakov2008 RMSE: the bar a θ keeps
                        sakov_bar = row["sakov2008_rmse"] * (1 + args.sakov_tolerance)
                    score_now, sakov_ok = row["spantini2019_rmse"], row["sakov2008_rmse"] <= sakov_bar
                train_scores = []
                history.append(row)
                log.write(json.dumps(row) + "\n")
                log.flush()
                print(json.dumps(row), flush=True)
                if score_now < best and sakov_ok:
                    best, best_state = score_now, copy.deepcopy(flow.state_dict())
                    save(out_dir / "ring.pt", args, flow.config, best_state, it, best)  # a run cut short keeps it
                if elapsed > 60 * args.minutes or it >= args.iterations:
                    break
            stride = STRIDES[it % len(STRIDES)]
            pool = pools[stride]
            if args.window > 1:
                loss, rmse = window_step(pool, flow, letkf, gen, args)
            else:
                held = pool.held
                score, rmse = cycle(pool, flow, letkf, gen, grad=True)
                keep = torch.isfinite(score.detach()) & (held.to(score.device) if held is not None else True)
                loss = training_loss(pool, score, keep, args, flow) if bool(keep.any()) else None
            if loss is not None:  # else every twin of the batch is lost: no step, the restarts below renew them
                opt.zero_grad(set_to_none=True)
                loss.backward()
                norm = torch.nn.utils.clip_grad_norm_(flow.parameters(), args.clip)
                if bool(torch.isfinite(norm)):
                    for group in opt.param_groups:  # cosine over the time budget
                        group["lr"] = args.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, elapsed / (60 * args.minutes))))
                    opt.step()
                    train_scores.append(float(loss.detach()))
                else:  # a blown twin's NaN reached θ through a batched layer (0 · ∞ in its backward): no step
                    skipped += 1
            if (it // len(STRIDES)) % args.restart_every == 0:  # restarts in batches: a spin-up costs as one
                restarts += restart_lost(pool, rmse, stride, args.particles, gen)
            it += 1
    finally:
        log.close()
    save(out_dir / "ring_final.pt", args, flow.config, flow.state_dict(), it, best)  # θ at the end, for comparison
    flow.load_state_dict(best_state)
    save(out_dir / "ring.pt", args, flow.config, best_state, it, best)
    plot(history, out_dir / "ring_curve.png", args.arch, args.base)
    return {"history": history, "best": best, "iterations": it}


def save(path: Path, args: argparse.Namespace, config: dict, state: dict, iterations: int, best: float) -> None:
    """Write a ``ring.pt``: the network's arch, config and θ, the LETKF options it follows, how it was trained."""
    payload = {
        "arch": args.arch,
        "config": config,
        "base": BASE if args.base == "letkf" else IENKF_BASE,
        "state": {k: v.detach().cpu() for k, v in state.items()},
        "training": {**vars(args), "iterations_done": iterations, "best_spantini_val_rmse": best},
    }
    torch.save(payload, path)


#: ``--arch``: what follows the LETKF — a learned flow over pseudo-time or a one-evaluation local correction
ARCHS = {"flow": RingFlow, "correction": RingCorrection}


def build(arch: str, **config: Any) -> RingFlow | RingCorrection:
    """A fresh ``arch`` network (``ARCHS``) with the entries of ``config`` its constructor takes."""
    cls = ARCHS[arch]
    names = cls.__init__.__code__.co_varnames[1 : cls.__init__.__code__.co_argcount]
    return cls(**{k: v for k, v in config.items() if k in names})


def load_flow(path: str | Path) -> tuple[RingFlow | RingCorrection, dict[str, Any]]:
    """(the trained network on CPU in eval mode, its LETKF options) from a ``ring.pt``."""
    payload = torch.load(path, map_location="cpu", weights_only=True)  # tensors, numbers, strings only
    flow = build(payload.get("arch", "flow"), **payload["config"])
    flow.load_state_dict(payload["state"])
    return flow.eval(), dict(payload["base"])


def plot(history: list[dict[str, Any]], path: Path, arch: str = "flow", base: str = "letkf") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    its = [h["iteration"] for h in history]
    for name in VALIDATION:
        axes[0].plot(its, [h[f"{name}_rmse"] for h in history], label=f"{name} rmse")
        axes[0].plot(its, [h[f"{name}_spread"] for h in history], ls="--", label=f"{name} spread")
        if f"{name}_diff" in history[0]:  # --select paired: θ − base per twin, mean ± standard error
            se = [h[f"{name}_diff_se"] for h in history]
            axes[1].errorbar(its, [h[f"{name}_diff"] for h in history], yerr=se, capsize=3, label=f"{name} θ − base")
        else:
            axes[1].plot(its, [h[f"{name}_score"] for h in history], label=f"{name} energy score")
    axes[0].set(xlabel="iteration", ylabel="validation analysis RMSE (solid), spread (dashed)", yscale="log")
    if "spantini2019_diff" in history[0]:
        axes[1].axhline(0.0, color="black", lw=0.5)
        axes[1].set(xlabel="iteration", ylabel="paired validation RMSE difference θ − base (± se)")
        train = axes[1].twinx()
        train.plot(its, [h["train_score"] for h in history], color="grey", ls=":", label="training loss")
        train.set_ylabel("training loss (grey, dotted)")
    else:
        axes[1].plot(its, [h["train_score"] for h in history], label="training pools (mixed regimes)", color="grey")
        axes[1].set(xlabel="iteration", ylabel="energy score", yscale="log")
    for ax in axes:
        ax.legend(fontsize=7)
    what = "ring flow" if arch == "flow" else "local correction"
    name = {"letkf": "LETKF", "ienkf": "IEnKF"}[base]
    fig.suptitle(f"{name} + learned {what}, energy-score training (iteration 0: the {name} alone)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for ring.pt, ring_log.jsonl and ring_curve.png")
    p.add_argument("--arch", choices=sorted(ARCHS), default="flow", help="a flow over pseudo-time or a correction")
    p.add_argument("--base", choices=("letkf", "ienkf"), default="letkf", help="the analysis the network corrects")
    p.add_argument("--dim", type=int, default=40, help="Lorenz-96 state dimension d")
    p.add_argument("--particles", type=int, default=40, help="ensemble size N")
    p.add_argument("--batch", type=int, default=64, help="twins per observation stride")
    p.add_argument("--hidden", type=int, default=32, help="channels of the hidden convolutions")
    p.add_argument("--layers", type=int, default=4, help="convolutions (the first and the last included)")
    p.add_argument("--kernel", type=int, default=5, help="odd kernel width along the ring")
    p.add_argument("--embed", type=int, default=16, help="--arch correction: member-embedding channels")
    p.add_argument("--gate", type=int, default=0, help="--arch correction: hidden units of a regime gate (0: none)")
    p.add_argument("--mean-only", action="store_true", help="--arch correction: the mean shift alone, no spread change")
    p.add_argument("--gate-l2", type=float, default=0.0, help="λ of the gate's last-layer L2 pull toward the base")
    p.add_argument("--loss", choices=("energy", "log-ratio"), default="energy", help="energy score, or its log ratio")
    p.add_argument("--forecast-weight", type=float, default=0.0, help="weight of the next forecast's score")
    p.add_argument("--ode-steps", type=int, default=1, help="RK4 steps over the pseudo-time [0, 1]")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam's step size, cosine-annealed over --minutes")
    p.add_argument("--clip", type=float, default=1.0, help="gradient-norm clipping")
    p.add_argument("--minutes", type=float, default=5.0, help="training time (validates, then stops)")
    p.add_argument("--iterations", type=int, default=10**9, help="at most this many iterations")
    p.add_argument("--warm-up", type=int, default=30, help="cycles under the untrained flow before training")
    p.add_argument("--val-every", type=int, default=100, help="validate every this many iterations")
    p.add_argument("--restart-every", type=int, default=20, help="a pool's restarts, every this many of its cycles")
    p.add_argument("--val-twins", type=int, default=16, help="twins per validation regime")
    p.add_argument("--val-cycles", type=int, default=40, help="cycles per validation")
    p.add_argument("--val-sakov-twins", type=int, default=0, help="sakov2008 validation twins (0: --val-twins)")
    p.add_argument("--val-sakov-cycles", type=int, default=0, help="sakov2008 validation cycles (0: --val-cycles)")
    p.add_argument(
        "--sakov-tolerance", type=float, default=None, help="keep θ only if sakov2008 RMSE ≤ (1 + t) × the base's"
    )
    p.add_argument("--window", type=int, default=1, help="cycles per gradient, through the IEnKF (--base ienkf)")
    p.add_argument(
        "--select", choices=("rmse", "paired"), default="rmse", help="keep θ by its RMSE, or by θ − base per twin"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the twins and the initial weights")
    p.add_argument("--device", default="auto", help="the flow's device (auto: CUDA when present)")
    p.add_argument("--base-device", default="auto", help="the twins' (forecasts, LETKF): auto times cpu and cuda")
    return p


def main(argv: list[str] | None = None) -> int:
    out = train(parser().parse_args(argv))
    print(json.dumps({"best_spantini_val_rmse": out["best"], "iterations": out["iterations"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``smc2``'s exact rejuvenation (``kernel: "mh"``): SMC²'s resample-move (Chopin, Jacob & Papaspiliopoulos 2013)
with Metropolis–Hastings moves whose acceptance is the exact Kalman likelihood of the stream's kept observations.

For a linear-Gaussian family with an exact Kalman filter per θ-particle, the stream keeps its last H observations
(``history``, at most :data:`MAX_HISTORY`; a step without a measurement or with a part of one is kept with a mask
of what was observed) and the Gaussian N(s, S) of the state just before the first of them (the prior's
moments while fewer than H steps were taken). When the θ-ESS falls under the threshold the θ-particles are
resampled by weight, then moved ``mh_moves`` times by a Gaussian random walk in the unconstrained coordinates u
(:mod:`mpflow.operators.models.param_priors`)

    u' = u + (2.38 / √p) L ξ,   L Lᵀ the resampled cloud's covariance of u,  ξ ~ N(0, I_p),

accepted with probability min(1, π(u') / π(u)), π(u) = p(θ(u)) |dθ/du| p(o_window | x_s ~ N(s, S), θ(u)), the
likelihood from M Kalman filters run over the window at once (float64, vectorised over the θ-particles). The
replay's final filter is each moved particle's new filter. While the stream has taken at most H steps the
window is the whole stream and the move leaves the exact posterior p(θ | o_1:t) invariant (SMC²'s move with an
exact likelihood); afterwards (``windowed``) each step that leaves the window conditions N(s, S) on its observation
under the cloud's mean θ̄, and the move's target is the posterior of θ given the last H observations and that
Gaussian of the state at the window's start: the information older observations held about θ is forgotten
(wider, not overconfident), documented in docs/methods.md "smc2".

State (extras, ``kernel: "mh"`` only): ``mh_history`` [B, H, k] (float64, 0 where not observed: a state's tensors
are finite), ``mh_observed`` [B, H, k] (1 observed, 0 not), ``mh_length`` [B]
(float64, the observations kept, ≤ H), ``mh_start_mean`` [B, d] and ``mh_start_cov`` [B, d, d].
"""

from __future__ import annotations

import math

import torch
from mpflow.operators import gaussian
from mpflow.operators.models.base import ModelFamily
from mpflow.operators.models.param_priors import from_unconstrained, to_unconstrained
from mpflow.operators.references.conjugate import conjugate_update
from mpflow.operators.rng import rand, randn

HISTORY = "mh_history"
OBSERVED = "mh_observed"
LENGTH = "mh_length"
START_MEAN = "mh_start_mean"
START_COV = "mh_start_cov"
#: the most observations a stream keeps for the move (``history``)
MAX_HISTORY = 10000
#: the most MH moves per rejuvenation (``mh_moves``)
MAX_MOVES = 50
#: the random walk's scale over the cloud's sd (Roberts, Gelman & Gilks 1997: 2.38 / √p)
RW_SCALE = 2.38


def init_extras(B: int, H: int, k: int, mean: torch.Tensor, cov: torch.Tensor) -> dict[str, torch.Tensor]:
    """A new stream's history: empty, the state's prior N(mean, cov) at its start."""
    return {
        HISTORY: torch.zeros((B, H, k), dtype=torch.float64),
        OBSERVED: torch.zeros((B, H, k), dtype=torch.float64),
        LENGTH: torch.zeros(B, dtype=torch.float64),
        START_MEAN: mean.to(torch.float64).clone(),
        START_COV: cov.to(torch.float64).clone(),
    }


def _condition(m, P, model: ModelFamily, obs: torch.Tensor):
    """One Kalman predict and update of N(m, P) [R, d] under ``model`` (R rows) with obs [R, k] (NaN: not
    observed): ((m, P), log p(o_S | o_<))."""
    F, c, Q = (t.to(torch.float64) for t in model.transition_affine()) if model.dynamic else (None, None, None)
    if F is not None:
        m, P = gaussian.affine_push(m, P, F, c, Q)
    if bool(torch.isnan(obs).any()):
        model, obs = model.observed_part(obs)
    H, R = (t.to(torch.float64) for t in model.observation_affine())
    m, P, lp = conjugate_update(m, P, H.expand(len(m), *H.shape[1:]), R.expand(len(m), *R.shape[1:]), obs)
    return (m, P), lp + model.observation_log_offset().to(torch.float64)


def append(
    extras: dict[str, torch.Tensor], obs: torch.Tensor | None, model: ModelFamily, theta_mean: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The history after a step with observation ``obs`` [B, ...] (None: no measurement): the oldest observation
    of a full window leaves it, conditioning the start's Gaussian under the cloud's mean θ̄ (``theta_mean``:
    name → [B])."""
    hist, seen, length = extras[HISTORY], extras[OBSERVED], extras[LENGTH]
    B, H, k = hist.shape
    row = torch.full((B, k), math.nan, dtype=torch.float64) if obs is None else obs.reshape(B, k).to(torch.float64)
    full = length >= H
    out = dict(extras)
    if bool(full.any()):
        at_mean = model.at_values({n: v.to(torch.float64) for n, v in theta_mean.items()}, B)
        (m, P), _ = _condition(extras[START_MEAN], extras[START_COV], at_mean, _with_gaps(hist[:, 0], seen[:, 0]))
        out[START_MEAN] = torch.where(full[:, None], m, extras[START_MEAN])
        out[START_COV] = torch.where(full[:, None, None], P, extras[START_COV])
    observed = (~torch.isnan(row)).to(torch.float64)
    out[HISTORY] = torch.cat([hist[:, 1:], row.nan_to_num(0.0)[:, None]], 1)
    out[OBSERVED] = torch.cat([seen[:, 1:], observed[:, None]], 1)
    out[LENGTH] = torch.clamp(length + 1, max=float(H))
    return out


def _with_gaps(values: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """Kept observations with NaN where nothing was observed."""
    return torch.where(seen > 0, values, math.nan)


def replay(model: ModelFamily, names, theta, hist, length, start_mean, start_cov, seen=None):
    """M Kalman filters per stream over its kept window: θ [R, M, p], history [R, H, k] (``seen``: its mask, None
    all observed; NaN in ``hist`` counts as not observed too), length [R], start N(s [R, d], S [R, d, d]) →
    (log p(o_window | θ) [R, M], filter mean [R, M, d], cov [R, M, d, d]), float64."""
    if seen is not None:
        hist = _with_gaps(hist, seen)
    R, M, p = theta.shape
    H = hist.shape[1]
    d = start_mean.shape[-1]
    per = model.at_values({n: theta[..., i].reshape(R * M) for i, n in enumerate(names)}, R * M)
    dyn = per.dynamic
    if dyn:
        F, c, Q = (t.to(torch.float64) for t in per.transition_affine())
    Hm, Rm = (t.to(torch.float64) for t in per.observation_affine())
    Hm, Rm = Hm.expand(R * M, *Hm.shape[1:]), Rm.expand(R * M, *Rm.shape[1:])
    offset = per.observation_log_offset().to(torch.float64)
    m = start_mean[:, None].expand(R, M, d).reshape(R * M, d)
    P = start_cov[:, None].expand(R, M, d, d).reshape(R * M, d, d)
    ll = torch.zeros(R * M, dtype=torch.float64)
    first = H - int(length.max().item())
    starts = (H - length).repeat_interleave(M)  # [R·M]
    obs_all = hist.repeat_interleave(M, 0)  # [R·M, H, k]
    scalar = d == 1 and Hm.shape[-2] == 1
    if scalar:  # d = k = 1: the same algebra on [R·M] numbers, a few elementwise operations a step
        f, cc, q = (F[:, 0, 0], c[:, 0], Q[:, 0, 0]) if dyn else (None, None, None)
        f2 = f * f if dyn else None
        h, r = Hm[:, 0, 0], Rm[:, 0, 0]
        h2 = h * h
        const = offset - 0.5 * math.log(2 * math.pi)
        ms, Ps = m[:, 0].clone(), P[:, 0, 0].clone()
        nan_steps = torch.isnan(obs_all[:, :, 0]).any(0).tolist()
        obs_t = obs_all[:, :, 0].t().contiguous()  # [H, R·M]
        every = H - int(length.min().item())  # from here on every stream's window has begun
    for t in range(first, H):
        o = obs_all[:, t]
        if scalar and not nan_steps[t]:
            mp, Pp = (f * ms + cc, f2 * Ps + q) if dyn else (ms, Ps)
            S = h2 * Pp + r
            v = obs_t[t] - h * mp
            K = Pp * h / S
            lp = const - 0.5 * (v * v / S + S.log())
            mn, Pn = mp + K * v, Pp - K * h * Pp
            if t >= every:
                ms, Ps, ll = mn, Pn, ll + lp
            else:
                active = starts <= t
                ms, Ps = torch.where(active, mn, ms), torch.where(active, Pn, Ps)
                ll = ll + torch.where(active, lp, torch.zeros_like(lp))
            continue
        if scalar:
            m, P = ms[:, None], Ps[:, None, None]
        if dyn:
            mp, Pp = (F @ m[..., None])[..., 0] + c, F @ P @ F.transpose(-1, -2) + Q
        else:
            mp, Pp = m, P
        if bool(torch.isnan(o).any()):
            part, o_f = per.observed_part(o)
            Ht, Rt = (x.to(torch.float64) for x in part.observation_affine())
            mn, Pn, lp = _update(mp, Pp, Ht.expand_as(Hm), Rt.expand_as(Rm), o_f)
            lp = lp + part.observation_log_offset().to(torch.float64)
        else:
            mn, Pn, lp = _update(mp, Pp, Hm, Rm, o)
            lp = lp + offset
        active = starts <= t
        if bool(active.all()):
            m, P, ll = mn, Pn, ll + lp
        else:
            m = torch.where(active[:, None], mn, m)
            P = torch.where(active[:, None, None], Pn, P)
            ll = ll + torch.where(active, lp, torch.zeros_like(lp))
        if scalar:
            ms, Ps = m[:, 0], P[:, 0, 0]
    if scalar:
        m, P = ms[:, None], Ps[:, None, None]
    ll = torch.nan_to_num(ll, nan=-math.inf)
    return ll.reshape(R, M), m.reshape(R, M, d), P.reshape(R, M, d, d)


def _update(m, P, H, R, o):
    """A Kalman update of N(m [n, d], P) by o [n, k] = H x + N(0, R), in few operations (the replay's inner loop):
    (m', P', log N(o; H m, H P Hᵀ + R))."""
    PHt = P @ H.transpose(-1, -2)  # [n, d, k]
    L = torch.linalg.cholesky(H @ PHt + R)
    v = o - (H @ m[..., None])[..., 0]
    a = torch.linalg.solve_triangular(L, v[..., None], upper=False)[..., 0]
    k = o.shape[-1]
    lp = -0.5 * (a * a).sum(-1) - torch.log(torch.diagonal(L, 0, -2, -1)).sum(-1) - 0.5 * k * math.log(2 * math.pi)
    Kt = torch.cholesky_solve(PHt.transpose(-1, -2), L)  # S⁻¹ H P [n, k, d]
    m = m + (Kt.transpose(-1, -2) @ v[..., None])[..., 0]
    P = P - PHt @ Kt
    return m, 0.5 * (P + P.transpose(-1, -2)), lp


def log_jacobian(u: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """log |dθ/du| of :func:`from_unconstrained` (lo, hi broadcasting with u)."""
    lower, upper = torch.isfinite(lo), torch.isfinite(hi)
    span = torch.where(upper & lower, hi - lo, 1.0)
    bounded = torch.log(span) + torch.nn.functional.logsigmoid(u) + torch.nn.functional.logsigmoid(-u)
    return torch.where(upper & lower, bounded, torch.where(lower, u, torch.zeros_like(u)))


def mh_move(model: ModelFamily, names, priors, supports, theta, extras_rows, gens, moves: int):
    """``moves`` random-walk MH moves of the resampled θ-particles θ [R, M, p] of R streams (module docstring);
    ``supports``: per name (lo [R], hi [R]); ``extras_rows``: the streams' history extras; ``gens`` their
    generators. Returns (θ [R, M, p], filter mean [R, M, d], cov [R, M, d, d], acceptance rate [R])."""
    R, M, p = theta.shape
    los = torch.stack([supports[n][0] for n in names], -1)[:, None]  # [R, 1, p]
    his = torch.stack([supports[n][1] for n in names], -1)[:, None]
    u = to_unconstrained(theta, los, his)
    hist, seen, length = extras_rows[HISTORY], extras_rows[OBSERVED], extras_rows[LENGTH]
    s, S = extras_rows[START_MEAN], extras_rows[START_COV]

    def log_target(u):
        th = from_unconstrained(u, los, his)
        lp = log_jacobian(u, los, his).sum(-1)
        for i, n in enumerate(names):
            lp = lp + priors[n].log_density(th[..., i])
        ll, m, P = replay(model, names, th, hist, length, s, S, seen)
        return torch.nan_to_num(lp + ll, nan=-math.inf), th, m, P

    target, th, m, P = log_target(u)
    centred = u - u.mean(1, keepdim=True)
    cov = centred.transpose(1, 2) @ centred / max(M - 1, 1)
    cov = cov + 1e-10 * torch.eye(p, dtype=torch.float64) * (1.0 + torch.diagonal(cov, 0, 1, 2).mean(-1))[:, None, None]
    L = torch.linalg.cholesky(cov)
    scale = RW_SCALE / math.sqrt(p)
    accepted = torch.zeros(R, dtype=torch.float64)
    for _ in range(moves):
        xi = randn(gens, [M, p], torch.float64)
        u_new = u + scale * xi @ L.transpose(-1, -2)
        t_new, th_new, m_new, P_new = log_target(u_new)
        log_a = torch.log(rand(gens, [M], torch.float64).clamp_min(1e-300))
        ok = log_a < t_new - target
        u = torch.where(ok[..., None], u_new, u)
        th = torch.where(ok[..., None], th_new, th)
        m = torch.where(ok[..., None], m_new, m)
        P = torch.where(ok[..., None, None], P_new, P)
        target = torch.where(ok, t_new, target)
        accepted = accepted + ok.to(torch.float64).mean(-1)
    return th, m, P, accepted / max(moves, 1)


def windowed(extras: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """[B] bool: whether a stream's move already targets the windowed posterior (more steps than ``history``
    taken); None for a stream without the MH kernel."""
    if START_MEAN not in extras:
        return None
    return extras[LENGTH] >= extras[HISTORY].shape[1]


#: the price of one replayed step of the M filters (:meth:`SMC2Updater.step_work`), beyond their flops: the
#: replay's inner loop is a dozen (d = k = 1) to a few dozen small tensor operations a step, whose fixed cost
#: dominates at small d. One replay of H = 1000 steps (d = k = 1, one thread, the loaded 2-core development
#: machine, 2026-12-07) took 0.062 s at M = 256 and 0.10 s at M = 1024 on the scalar path, 0.30 s and 0.56 s on the
#: matrix one: priced at 25 Gflop/s as (REPLAY_STEP_FLOPS, scalar or not) a step plus REPLAY_FACTOR (scalar or
#: not) × :func:`replay_flops` per θ-particle a step
REPLAY_STEP_FLOPS = {True: 1.5e6, False: 6.0e6}
REPLAY_FACTOR = {True: 25.0, False: 150.0}


def replay_flops(d: int, k: int) -> float:
    """One θ-particle's Kalman predict and update of a replayed step (counted as :meth:`SMC2Updater.step_work`)."""
    return 30.0 * d**3 + 20.0 * d * d * k + 10.0 * k**3


__all__ = ["HISTORY", "LENGTH", "MAX_HISTORY", "MAX_MOVES", "append", "mh_move", "replay", "windowed"]

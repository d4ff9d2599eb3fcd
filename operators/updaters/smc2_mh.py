"""``smc2``'s exact rejuvenation (``kernel: "mh"``): SMC²'s resample-move (Chopin, Jacob & Papaspiliopoulos 2013)
with Metropolis–Hastings moves whose acceptance is the exact Kalman likelihood of the stream's kept observations.

For a linear-Gaussian family with an exact Kalman filter per θ-particle, the stream keeps the observations of its
current *block* (at most H = ``history``, :data:`MAX_HISTORY`; a step without a measurement or with a part of one
is kept with a mask of what was observed) and the Gaussian N(s, S) of the state just before the block's first
observation (the prior's moments for the first block). When the θ-ESS falls under the threshold the θ-particles
are resampled by weight, then moved ``mh_moves`` times in the unconstrained coordinates u
(:mod:`mpflow.operators.models.param_priors`), each move accepted with probability

    min(1, π(u') q(u) / (π(u) q(u'))),   π(u) = p_c(u) · p(o_block | x_c ~ N(s, S), θ(u))            (M1)

the likelihood from M Kalman filters run over the block at once (float64, vectorised over the θ-particles;
:func:`replay`), p_c the block's prior in u (below). The proposals alternate, when the stream has a learned
parameter observer (:mod:`mpflow.operators.updaters.smc2_proposal`): an *independence* move u' ~ q(· | the last
observations kept), q the observer's answer (neural posterior estimation), then a random walk

    u' = u + (2.38 / √p) L ξ,   L Lᵀ the resampled cloud's covariance of u,  ξ ~ N(0, I_p),              (M2)

(q symmetric, it cancels); without one, every move is (M2). Either leaves π invariant: the observer changes how fast
the cloud travels, never what it targets. The replay's final filter is each moved particle's new filter.

**Defensive θ-particles.** After the moves, the last K = round(``defensive`` · M) θ-particles of the cloud give
way to K draws u_k from the stream's prior q(u) = p(θ(u)) |dθ/du|, and every θ-particle is weighted as a draw from
the mixture of π / Z (what the moves sample) and q (multiple importance sampling's balance heuristic, Veach &
Guibas 1995; defensive importance sampling, Hesterberg 1995):

    ω_j ∝ π(u_j) / ((1 − ε) π(u_j) / Ẑ + ε q(u_j)),   ε = K / M,                                          (M3)

Ẑ = exp(the sum of the block's evidence increments so far), the stream's own estimate of ∫ π. A moved particle
keeps a weight near Ẑ / (1 − ε); a prior draw where π is small gets π / (ε q), its share of π's mass — the tail the
moved cloud does not reach. Under a run of identical readings the exact posterior of a noise variance concentrates
at values a later jump makes impossible by thousands of nats; a cloud of moved particles alone reports that
impossibility as the step's evidence, where π's own tail, which the prior's draws carry with their true weight,
costs tens (the grid's own increment, ``tests/unit/test_smc2_mh.py``).

**Blocks.** The first block's prior is the stream's: p_1(u) = p(θ(u)) |dθ/du|, so while the stream has taken at
most H steps the move leaves the exact posterior p(θ | o_1:t) invariant (SMC²'s move with an exact likelihood;
``params_rejuvenation: "exact"``). When the block is full, the next step starts a new one (a *checkpoint*): its
prior p_c is the Gaussian N(u; ū, C + ε I) of the cloud (weighted mean and covariance of u; ε =
:data:`CHECKPOINT_FLOOR`, so a cloud that collapsed cannot freeze the stream) and its start N(s, S) the moments of
the mixture Σ_j ω_j N(m_j, P_j) of the θ-particles' filters — the posterior of the observations before the block
summarised as a Gaussian (assumed density filtering over θ, ``"checkpointed"``): the information they held is kept,
its shape beyond the second moment is not (docs/methods.md "smc2"). A move costs one replay of at most H steps, so
an amortised step is bounded whatever the stream's age.

State (extras, ``kernel: "mh"`` only): ``mh_history`` [B, H, k] (float64, 0 where not observed: a state's tensors
are finite; the last H observations, the block's the newest ``mh_length`` of them), ``mh_observed`` [B, H, k]
(1 observed, 0 not), ``mh_length`` [B] (float64, the block's observations, ≤ H), ``mh_kept`` [B] (the observations
the buffer holds, ≤ H: what the observer reads), ``mh_start_mean`` [B, d], ``mh_start_cov`` [B, d, d],
``mh_blocks`` [B] (checkpoints taken), ``mh_block_evidence`` [B] (the block's log-evidence so far: log Ẑ),
``mh_block_mean`` [B, p] and ``mh_block_cov`` [B, p, p] (p_c, once a checkpoint was taken).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
from mpflow.operators import gaussian
from mpflow.operators.models.base import ModelFamily
from mpflow.operators.models.param_priors import from_unconstrained, to_unconstrained
from mpflow.operators.rng import rand, randn

HISTORY = "mh_history"
OBSERVED = "mh_observed"
LENGTH = "mh_length"
KEPT = "mh_kept"
START_MEAN = "mh_start_mean"
START_COV = "mh_start_cov"
BLOCKS = "mh_blocks"
BLOCK_EVIDENCE = "mh_block_evidence"
BLOCK_MEAN = "mh_block_mean"
BLOCK_COV = "mh_block_cov"
#: the most observations a stream keeps for the move (``history``)
MAX_HISTORY = 10000
#: the most MH moves per rejuvenation (``mh_moves``)
MAX_MOVES = 50
#: the random walk's scale over the cloud's sd (Roberts, Gelman & Gilks 1997: 2.38 / √p)
RW_SCALE = 2.38
#: ε of a checkpoint's prior N(ū, C + ε I) in u (module docstring): a sd of 0.001 in each coordinate (0.1 % of a
#: scale parameter), added once per block
CHECKPOINT_FLOOR = 1e-6


class Checkpoint(NamedTuple):
    """What a checkpoint keeps of a batch's streams [B, ...] (module docstring): the cloud's Gaussian in u (mean
    [B, p], covariance [B, p, p]) and the state's moments (mean [B, d], covariance [B, d, d]), float64."""

    u_mean: torch.Tensor
    u_cov: torch.Tensor
    x_mean: torch.Tensor
    x_cov: torch.Tensor


def init_extras(B: int, H: int, k: int, mean: torch.Tensor, cov: torch.Tensor, p: int) -> dict[str, torch.Tensor]:
    """A new stream's history: empty, the state's prior N(mean, cov) at its start, no checkpoint (p parameters)."""
    return {
        HISTORY: torch.zeros((B, H, k), dtype=torch.float64),
        OBSERVED: torch.zeros((B, H, k), dtype=torch.float64),
        LENGTH: torch.zeros(B, dtype=torch.float64),
        KEPT: torch.zeros(B, dtype=torch.float64),
        START_MEAN: mean.to(torch.float64).expand(B, -1).clone(),
        START_COV: cov.to(torch.float64).expand(B, -1, -1).clone(),
        **_first_block(B, p),
    }


def _first_block(B: int, p: int) -> dict[str, torch.Tensor]:
    """The block extras of B streams in their first block (no checkpoint yet) learning p parameters."""
    return {
        BLOCKS: torch.zeros(B, dtype=torch.float64),
        BLOCK_EVIDENCE: torch.zeros(B, dtype=torch.float64),
        BLOCK_MEAN: torch.zeros((B, p), dtype=torch.float64),
        BLOCK_COV: torch.eye(p, dtype=torch.float64).expand(B, p, p).clone(),
    }


def upgraded(extras: dict[str, torch.Tensor], p: int) -> dict[str, torch.Tensor]:
    """A state's history as this version keeps it: a state stored before blocks (a sliding window without
    ``mh_kept``, ``mh_blocks``, ``mh_block_evidence``, ``mh_block_mean``, ``mh_block_cov``) reads as a first block
    of its window (the stream's prior, no checkpoint yet, the window's evidence unknown: 0), so a stream created by
    an earlier version steps on; a current state is returned as it is."""
    if HISTORY not in extras or BLOCKS in extras:
        return extras
    return {**extras, KEPT: extras[LENGTH].clone(), **_first_block(extras[LENGTH].shape[0], p)}


def cloud_checkpoint(u: torch.Tensor, log_weights: torch.Tensor, means: torch.Tensor, covs: torch.Tensor) -> Checkpoint:
    """The checkpoint of θ-clouds u [B, M, p] (log-weights [B, M]) whose θ-particles carry Gaussian filters
    N(means [B, M, d], covs [B, M, d, d]): the cloud's weighted mean and covariance of u, plus
    :data:`CHECKPOINT_FLOOR` I, and the moments of the filters' mixture Σ_j ω_j N(m_j, P_j)."""
    lw = log_weights.to(torch.float64)
    u_mean, u_cov = gaussian.moments(u, lw)
    u_cov = u_cov + CHECKPOINT_FLOOR * torch.eye(u.shape[-1], dtype=torch.float64)
    x_mean, spread = gaussian.moments(means.to(torch.float64), lw)
    x_cov = spread + torch.einsum("bm,bmij->bij", torch.softmax(lw, -1), covs.to(torch.float64))
    return Checkpoint(u_mean, u_cov, x_mean, x_cov)


def append(
    extras: dict[str, torch.Tensor], obs: torch.Tensor | None, checkpoint: Callable[[], Checkpoint]
) -> dict[str, torch.Tensor]:
    """The history after a step with observation ``obs`` [B, ...] (None: no measurement). A stream whose block is
    full starts a new one first (module docstring): ``checkpoint()`` gives every stream's cloud as it was before
    this step; only the full streams take it."""
    hist, seen, length = extras[HISTORY], extras[OBSERVED], extras[LENGTH]
    B, H, k = hist.shape
    row = torch.full((B, k), math.nan, dtype=torch.float64) if obs is None else obs.reshape(B, k).to(torch.float64)
    full = length >= H
    out = dict(extras)
    if bool(full.any()):
        c = checkpoint()
        for key, value in ((START_MEAN, c.x_mean), (START_COV, c.x_cov), (BLOCK_MEAN, c.u_mean), (BLOCK_COV, c.u_cov)):
            out[key] = torch.where(full.reshape(B, *[1] * (value.dim() - 1)), value, extras[key])
        out[BLOCKS] = extras[BLOCKS] + full.to(torch.float64)
        out[BLOCK_EVIDENCE] = torch.where(full, 0.0, extras[BLOCK_EVIDENCE])
        length = torch.where(full, torch.zeros_like(length), length)
    observed = (~torch.isnan(row)).to(torch.float64)
    out[HISTORY] = torch.cat([hist[:, 1:], row.nan_to_num(0.0)[:, None]], 1)
    out[OBSERVED] = torch.cat([seen[:, 1:], observed[:, None]], 1)
    out[LENGTH] = torch.clamp(length + 1, max=float(H))
    out[KEPT] = torch.clamp(extras[KEPT] + 1, max=float(H))
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


def stream_log_prior(u: torch.Tensor, th: torch.Tensor, names, priors, los, his) -> torch.Tensor:
    """log p(θ(u)) |dθ/du| [R, M]: the stream's prior in the coordinates u (θ = θ(u): ``th``)."""
    lp = log_jacobian(u, los, his).sum(-1)
    for i, n in enumerate(names):
        lp = lp + priors[n].log_density(th[..., i])
    return lp


def block_log_prior(u: torch.Tensor, th: torch.Tensor, names, priors, los, his, extras_rows) -> torch.Tensor:
    """log p_c(u) [R, M] of eq. M1 for u [R, M, p] (θ = θ(u): ``th``): the stream's prior p(θ) |dθ/du| in its
    first block, the checkpoint's Gaussian N(u; ū, C) after (module docstring)."""
    lp = stream_log_prior(u, th, names, priors, los, his)
    if not bool((extras_rows[BLOCKS] > 0).any()):
        return lp
    chol = torch.linalg.cholesky(extras_rows[BLOCK_COV])
    block = gaussian.log_prob(u, extras_rows[BLOCK_MEAN], chol)
    return torch.where((extras_rows[BLOCKS] > 0)[:, None], block, lp)


def block_target(likelihood, names, priors, los, his, extras_rows):
    """π of eq. M1 for R streams: u [R, M, p] → (log π(u) [R, M], (θ [R, M, p], *the replay's filters)), where
    ``likelihood`` θ → (log p(o_block | θ) [R, M], *each θ-particle's filter after the block). ``los``, ``his``: the
    supports' bounds [R, 1, p]; ``extras_rows``: the streams' history extras."""

    def log_target(u):
        th = from_unconstrained(u, los, his)
        lp = block_log_prior(u, th, names, priors, los, his, extras_rows)
        ll, *filters = likelihood(th)
        return torch.nan_to_num(lp + ll, nan=-math.inf), (th, *filters)

    return log_target


def kalman_target(model: ModelFamily, names, priors, los, his, extras_rows):
    """:func:`block_target` with an exact Kalman filter per θ-particle (:func:`replay`: the filters' mean
    [R, M, d] and cov [R, M, d, d])."""
    hist, seen, length = extras_rows[HISTORY], extras_rows[OBSERVED], extras_rows[LENGTH]
    s, S = extras_rows[START_MEAN], extras_rows[START_COV]
    return block_target(
        lambda th: replay(model, names, th, hist, length, s, S, seen), names, priors, los, his, extras_rows
    )


class Proposal(NamedTuple):
    """An independence proposal q(u) of R streams' θ-particles (:mod:`~mpflow.operators.updaters.smc2_proposal`):
    ``sample(gens, M)`` → u [R, M, p], ``log_prob(u)`` → [R, M]."""

    sample: Callable[[list, int], torch.Tensor]
    log_prob: Callable[[torch.Tensor], torch.Tensor]


def mh_move(u: torch.Tensor, log_target, gens, moves: int, proposal: Proposal | None = None):
    """``moves`` MH moves (eq. M1) of the resampled θ-particles u [R, M, p] (unconstrained) of R streams under
    ``log_target`` (u → (log π [R, M], carry: tensors [R, M, ...] of each particle, e.g. its filter)): random walks
    (eq. M2), alternating with independence moves from ``proposal`` (the first move one) when given. ``gens``: the
    streams' generators. Returns (u, carry, acceptance rate [R], log π(u) [R, M])."""
    R, M, p = u.shape
    target, carry = log_target(u)
    centred = u - u.mean(1, keepdim=True)
    cov = centred.transpose(1, 2) @ centred / max(M - 1, 1)
    cov = cov + 1e-10 * torch.eye(p, dtype=torch.float64) * (1.0 + torch.diagonal(cov, 0, 1, 2).mean(-1))[:, None, None]
    L = torch.linalg.cholesky(cov)
    scale = RW_SCALE / math.sqrt(p)
    accepted = torch.zeros(R, dtype=torch.float64)
    for i in range(moves):
        if proposal is not None and i % 2 == 0:
            u_new = proposal.sample(gens, M)
            log_q = proposal.log_prob(u) - proposal.log_prob(u_new)
        else:
            u_new = u + scale * randn(gens, [M, p], torch.float64) @ L.transpose(-1, -2)
            log_q = 0.0
        t_new, carry_new = log_target(u_new)
        log_a = torch.log(rand(gens, [M], torch.float64).clamp_min(1e-300))
        ok = log_a < t_new - target + log_q
        u = torch.where(ok[..., None], u_new, u)
        carry = tuple(
            torch.where(ok.reshape(R, M, *[1] * (c.dim() - 2)), n, c) for n, c in zip(carry_new, carry, strict=True)
        )
        target = torch.where(ok, t_new, target)
        accepted = accepted + ok.to(torch.float64).mean(-1)
    return u, carry, accepted / max(moves, 1), target


def defensive_draws(log_target, names, priors, los, his, gens, K: int):
    """K θ-particles per stream drawn from the stream's prior q(u) = p(θ(u)) |dθ/du| — the defensive component of
    a rejuvenated cloud (eq. M3; Hesterberg 1995): (u [R, K, p], ``log_target``'s carry, log π(u) [R, K])."""
    z = randn(gens, [K, len(names)], torch.float64)
    th = torch.stack([priors[n].from_normal(z[..., i]) for i, n in enumerate(names)], -1)
    u = to_unconstrained(th, los, his)
    target, carry = log_target(u)
    return u, carry, target


def defensive_log_weights(log_pi, log_q, log_z, share: float) -> torch.Tensor:
    """The normalised log-weights [R, M] of eq. M3 for a cloud of moved θ-particles and the prior's draws together:
    log π(u_j) − log((1 − ε) π(u_j) / Ẑ + ε q(u_j)) for every j, ε = ``share``, log Ẑ [R] = ``log_z``; −inf where
    π is 0 (all −inf: uniform)."""
    log_pi = torch.nan_to_num(log_pi, nan=-math.inf)
    mix = torch.logaddexp(math.log1p(-share) + log_pi - log_z[:, None], math.log(share) + log_q)
    log_w = torch.where(torch.isfinite(log_pi), log_pi - mix, -math.inf)
    norm = torch.logsumexp(log_w, -1, keepdim=True)
    uniform = torch.full_like(log_w, -math.log(log_w.shape[-1]))
    return torch.where(torch.isfinite(norm), log_w - norm, uniform)


def checkpointed(extras: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """[B] bool: whether a stream's moves target a checkpoint's Gaussian summary of its older observations (it took
    more than ``history`` steps; module docstring); None for a stream without the MH kernel."""
    if BLOCKS not in extras:
        return None
    return extras[BLOCKS] > 0


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


__all__ = [
    "HISTORY",
    "LENGTH",
    "MAX_HISTORY",
    "MAX_MOVES",
    "Checkpoint",
    "Proposal",
    "append",
    "checkpointed",
    "cloud_checkpoint",
    "kalman_target",
    "mh_move",
    "replay",
]

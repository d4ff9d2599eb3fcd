"""SMC² with its PMMH rejuvenation (Chopin, Jacob & Papaspiliopoulos 2013, §3.2): the *unbounded* scheme that
``smc2``'s jittering (:mod:`mpflow.operators.updaters.smc2`) is measured against on short streams
(``benchmarks/params.py``).

The θ-particles and their filters step as in ``smc2`` (the same per-θ Kalman or particle filters, eq. P2–P4); when the
θ-ESS falls under M/2 they are resampled and each is moved by one particle-marginal Metropolis–Hastings step
(Andrieu, Doucet & Holenstein 2010): a random walk u' = u + (2.38/√p) s_u ξ in the unconstrained coordinate u of θ,
accepted with probability

    min(1, p̂(o_1:t | θ') p(θ') |dθ'/du'| / (p̂(o_1:t | θ) p(θ) |dθ/du|)),

where p̂(o_1:t | θ') comes from a fresh filter run from the *first* observation to the current one. A move at step t
costs O(t): the cost that makes it unusable on a stream that lives for ever, and the reason ``smc2`` jitters.

Per-θ log-likelihoods come from the updater's θ-weights: with no rejuvenation inside the updater (its
``ess_threshold`` 0), ω_j ← ω_j p̂_j / Σ_k ω_k p̂_k, so log p̂_j = log ω_j' − log ω_j + (the step's evidence increment).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
from mpflow.operators.models.base import ModelFamily
from mpflow.operators.models.param_priors import from_unconstrained, to_unconstrained
from mpflow.operators.models.priors import Prior
from mpflow.operators.rng import generator
from mpflow.operators.state import ParticleState, ess, systematic_resample
from mpflow.operators.updaters.smc2 import PARAM, PARAM_LOG_WEIGHTS, SUPPORT, SMC2Updater, param_names, support_bounds


@dataclass
class PMMHRun:
    """Per step t = 1..T: the posterior mean and sd of each parameter ({name: [T]}), the moves' acceptance rate
    (NaN where none ran), the step's seconds (its move included) and the steps at which a move ran."""

    mean: dict[str, list[float]]
    sd: dict[str, list[float]]
    acceptance: list[float]
    seconds: list[float]
    moved_at: list[int]


def _blocks(state: ParticleState, idx: torch.Tensor, M: int) -> ParticleState:
    """The state with its θ-particles (and their filters) taken in the order ``idx`` [M] (one stream)."""
    N = state.num_particles
    Nx = N // M
    pairs = (idx[:, None] * Nx + torch.arange(Nx)).reshape(N)
    extras = {}
    for k, v in state.extras.items():
        extras[k] = v[:, idx] if v.dim() >= 2 and v.shape[1] == M and not k.startswith(SUPPORT) else v
    return state.replace(particles=state.particles[:, pairs], log_weights=state.log_weights[:, pairs], extras=extras)


def _with_rows(state: ParticleState, other: ParticleState, take: torch.Tensor, M: int) -> ParticleState:
    """``state`` with the θ-particles ``take`` [M] (bool) replaced by ``other``'s."""
    Nx = state.num_particles // M
    pairs = take.repeat_interleave(Nx)
    extras = {}
    for k, v in state.extras.items():
        if v.dim() >= 2 and v.shape[1] == M and not k.startswith(SUPPORT) and k != PARAM_LOG_WEIGHTS:
            mask = take.reshape(1, M, *[1] * (v.dim() - 2))
            extras[k] = torch.where(mask, other.extras[k], v)
        else:
            extras[k] = v
    particles = torch.where(pairs[None, :, None], other.particles, state.particles)
    log_weights = torch.where(pairs[None], other.log_weights, state.log_weights)
    return state.replace(particles=particles, log_weights=log_weights, extras=extras)


def _log_likelihoods(
    updater: SMC2Updater, prior: Prior, model: ModelFamily, n: int, theta: dict[str, torch.Tensor], obs, seed
):
    """(state after o_1..o_t, log p̂(o_1:t | θ_j) [M]) of fresh filters for the θ-particles ``theta``."""
    state = updater.init(prior, model, n, seed)
    state = state.replace(extras={**state.extras, **{PARAM + k: v[None].clone() for k, v in theta.items()}})
    ll = torch.zeros(next(iter(theta.values())).shape[0], dtype=torch.float64)
    for o in obs:
        state, ll = _step(updater, state, o, model, ll)
    return state, ll


def _step(updater, state, o, model, ll):
    before = state.extras[PARAM_LOG_WEIGHTS][0]
    state, info = updater.update(state, o[None], model)
    after = state.extras[PARAM_LOG_WEIGHTS][0]
    return state, ll + (after - before + info.log_evidence_increment[0])


def smc2_pmmh(
    model: ModelFamily,
    prior: Prior,
    observations: torch.Tensor,
    theta_particles: int,
    x_particles: int,
    seed: int = 0,
) -> PMMHRun:
    """SMC² with PMMH moves re-running every filter from o_1 (module docstring) on one stream's ``observations``
    [T, *obs_shape]; ``model`` carries the priors (``model.unknown``)."""
    M, n = theta_particles, theta_particles * x_particles
    updater = SMC2Updater(theta_particles=M, ess_threshold=0.0, jitter=0.0)
    gen = generator(seed + 7919)
    state = updater.init(prior, model, n, seed)
    names = param_names(state.extras)
    p = len(names)
    ll = torch.zeros(M, dtype=torch.float64)
    out = PMMHRun({k: [] for k in names}, {k: [] for k in names}, [], [], [])
    for t in range(observations.shape[0]):
        start = time.perf_counter()
        state, ll = _step(updater, state, observations[t], model, ll)
        lw = state.extras[PARAM_LOG_WEIGHTS][0]
        rate = math.nan
        if float(ess(lw[None])[0]) < 0.5 * M:
            idx = systematic_resample(lw[None], torch.rand(1, generator=gen, dtype=torch.float64))[0]
            state, ll = _blocks(state, idx, M), ll[idx]
            bounds = {k: [b[:, None] for b in support_bounds(state.extras[SUPPORT + k])] for k in names}
            u = {k: to_unconstrained(state.extras[PARAM + k][0], *(b[0] for b in bounds[k])) for k in names}
            proposal = {}
            for k in names:
                step = 2.38 / math.sqrt(p) * float(u[k].std().clamp_min(1e-6))
                proposal[k] = u[k] + step * torch.randn(M, generator=gen, dtype=torch.float64)
            theta_new = {k: from_unconstrained(proposal[k], *(b[0] for b in bounds[k])) for k in names}
            fresh, ll_new = _log_likelihoods(
                updater, prior, model, n, theta_new, observations[: t + 1], seed + 1000 * (t + 1)
            )
            log_alpha = ll_new - ll
            for k in names:
                prior_k = model.unknown[k]
                old = state.extras[PARAM + k][0]
                log_alpha += prior_k.log_density(theta_new[k]) - prior_k.log_density(old)
                log_alpha += _log_jacobian(proposal[k], *(b[0] for b in bounds[k]))
                log_alpha -= _log_jacobian(u[k], *(b[0] for b in bounds[k]))
            take = torch.log(torch.rand(M, generator=gen, dtype=torch.float64)) < log_alpha
            state = _with_rows(state, fresh, take, M)
            ll = torch.where(take, ll_new, ll)
            uniform = torch.full((1, M), -math.log(M), dtype=torch.float64)
            state = state.replace(extras={**state.extras, PARAM_LOG_WEIGHTS: uniform})
            rate = float(take.double().mean())
            out.moved_at.append(t + 1)
        out.seconds.append(time.perf_counter() - start)
        w = torch.softmax(state.extras[PARAM_LOG_WEIGHTS][0], -1)
        for k in names:
            th = state.extras[PARAM + k][0]
            m = float((w * th).sum())
            out.mean[k].append(m)
            out.sd[k].append(float((w * (th - m) ** 2).sum().sqrt()))
        out.acceptance.append(rate)
    return out


def _log_jacobian(u: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """log |dθ/du| of :func:`~mpflow.operators.models.param_priors.from_unconstrained`."""
    lower, upper = bool(torch.isfinite(lo).all()), bool(torch.isfinite(hi).all())
    if lower and upper:
        return torch.log(hi - lo) + torch.nn.functional.logsigmoid(u) + torch.nn.functional.logsigmoid(-u)
    if lower:
        return u
    return torch.zeros_like(u)


__all__ = ["PMMHRun", "smc2_pmmh"]

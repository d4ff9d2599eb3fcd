"""``smc2``'s replay of a kept observation window by a particle filter per θ-particle: the likelihood estimate of
SMC²'s particle Metropolis–Hastings move (Chopin, Jacob & Papaspiliopoulos 2013, after Andrieu, Doucet & Holenstein
2010) for the families without an exact Kalman filter (:mod:`mpflow.operators.updaters.smc2_mh` replays those).

For each of R streams and each of its M θ-particles θ_j, a bootstrap particle filter (Gordon, Salmond & Smith 1993)
of N_x particles runs over the stream's last ℓ kept observations o_1:ℓ (the window, right-aligned in the history;
ℓ the stream's ``length``), started at the window's start from the Gaussian N(s, S) the window keeps:

    x_{0,i} ~ N(s, S),  w_{0,i} = 1 / N_x,                              i = 1 … N_x,
    x_{t,i} ~ p(x_t | x_{t-1,i}, θ_j)                                   (predict: the family's transition),
    p̂(o_t | o_<t, θ_j) = Σ_i w_{t-1,i} p(o_t | x_{t,i}, θ_j),           (an observed step)
    w_{t,i} ∝ w_{t-1,i} p(o_t | x_{t,i}, θ_j),
    resampled (systematic) to w = 1 / N_x when ESS = 1 / Σ_i w_{t,i}² < N_x / 2,

and log p̂(o_1:ℓ | θ_j) = Σ_t log p̂(o_t | o_<t, θ_j) over the observed steps. Its exponential is an unbiased
estimate of p(o_1:ℓ | x_0 ~ N(s, S), θ_j) (Del Moral 2004; adaptive resampling keeps it unbiased), so an
MH move on θ that accepts by prior(θ') p̂(o | θ') / prior(θ) p̂(o | θ), each θ carrying its own estimate, leaves the
window's posterior of θ invariant whatever N_x (particle marginal MH, the move of SMC²): N_x sets only how often
the move is accepted. A step the window does not observe (``seen`` 0 everywhere) is a predict only; a
partial observation weights by the density of its observed entries (the family's
:meth:`~mpflow.operators.models.base.ModelFamily.observed_part`, as :func:`smc2_mh.replay` conditions).

Every stream's window runs in one vectorised pass over its R·M·N_x particles (float64), one loop over the H steps:
a stream whose window has not begun yet (t < H − ℓ) is left as it is and draws nothing, so each stream's numbers come
from its own generator alone, the same whichever streams share the batch and however long their windows are (start
draws and transition noise: one draw [M, N_x, d] per stream and step; resampling: a uniform per resampled θ-filter
from its stream's generator, the rows of :func:`mpflow.operators.updaters.smc2._theta_rows`).
"""

from __future__ import annotations

import math

import torch
from mpflow.operators import gaussian
from mpflow.operators.models.base import ModelFamily
from mpflow.operators.rng import Generators, randn
from mpflow.operators.state import ess
from mpflow.operators.updaters.base import RANDN_FLOPS
from mpflow.operators.updaters.smc import resample_low_ess

#: resample a θ-particle's filter when its ESS falls under this fraction of N_x
RESAMPLE_FRACTION = 0.5


def _float64(model: ModelFamily) -> ModelFamily:
    """``model`` with its floating-point parameters in float64 (θ then enters :meth:`ModelFamily.at_values` in float64
    too, where a float32 unit would round it)."""
    params = {k: v.to(torch.float64) if v.is_floating_point() else v for k, v in model.params.items()}
    return type(model)(params, model.state_dim)


def _streams(gens: Generators) -> list:
    return list(iter(gens)) if not isinstance(gens, list | tuple) else list(gens)


def replay_particles(
    model: ModelFamily,
    names,
    theta: torch.Tensor,
    hist: torch.Tensor,
    length: torch.Tensor,
    start_mean: torch.Tensor,
    start_cov: torch.Tensor,
    seen: torch.Tensor | None,
    Nx: int,
    gens: Generators,
    *,
    shrinkage: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """M bootstrap particle filters of ``Nx`` particles per stream over its kept window (module docstring): θ
    [R, M, p] (``names[i]`` its column i), history [R, H, k] (``seen``: its mask [R, H, k], 1 observed, None all
    observed; NaN in ``hist`` counts as not observed too), length [R] (the window: positions H − ℓ … H − 1), start
    N(s [R, d], S [R, d, d]) at the window's start, ``gens`` the R streams' generators →
    (log p̂(o_window | θ) [R, M] float64, the particles x [R, M, Nx, d] float64 at the window's end, their within-θ
    log-weights [R, M, Nx] normalised). A filter for which every particle is impossible at some step gets −inf and
    keeps its weights, as does a θ that is not finite or whose transition noise is not a covariance (a proposal
    the move must reject). ``shrinkage``: Liu–West moves of a resampled static state's copies (as ``smc2`` makes them;
    the estimate is then no longer unbiased), None none."""
    gens = _streams(gens)
    if seen is not None:
        hist = torch.where(seen > 0, hist.to(torch.float64), math.nan)
    hist = hist.to(torch.float64)
    R, M, p = theta.shape
    H = hist.shape[1]
    d = start_mean.shape[-1]
    RM = R * M
    if RM == 0:
        z = torch.zeros(R, M, dtype=torch.float64)
        return z, torch.zeros(R, M, Nx, d, dtype=torch.float64), z[..., None].expand(R, M, Nx).clone()
    per = _float64(model).at_values({n: theta[..., i].reshape(RM).to(torch.float64) for i, n in enumerate(names)}, RM)
    row_gens = [g for g in gens for _ in range(M)]  # θ-filter r·M + j: stream r's generator
    broken = ~torch.isfinite(theta.reshape(RM, p)).all(-1)  # a proposal outside every support: impossible
    L = gaussian.cholesky(start_cov.to(torch.float64))  # [R, d, d]
    xi = randn(gens, [M, Nx, d], torch.float64)
    x = (start_mean.to(torch.float64)[:, None, None] + xi @ L[:, None].transpose(-1, -2)).reshape(RM, Nx, d)
    lwx = torch.full((RM, Nx), -math.log(Nx), dtype=torch.float64)
    ll = torch.zeros(RM, dtype=torch.float64)
    length = length.to(torch.float64).round().clamp(0, H)
    starts = H - length  # [R]
    first = H - int(length.max().item())
    begun_at = starts.tolist()
    if per.dynamic and per.affine_transition:  # x' = F x + c + L z, the factors taken once
        F, c, Q = (t.to(torch.float64) for t in per.transition_affine())
        chol, info = torch.linalg.cholesky_ex(Q)
        broken = broken | (info != 0)  # a θ whose noise is not a covariance (σ underflowed): impossible
        chol = torch.where(broken[:, None, None], 0.0, chol.nan_to_num(0.0))
        Ft, c, Lt = F.transpose(-1, -2), c[:, None], chol.transpose(-1, -2)

        def move(x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
            """F x + c + L z, elementwise at d = 1 (the same numbers)."""
            return x * Ft + c + z * Lt if d == 1 else x @ Ft + c + z @ Lt

    else:
        move = per.transition_from_noise
    obs_all = hist.repeat_interleave(M, 0).transpose(0, 1).contiguous()  # [H, R·M, k]
    gaps = torch.isnan(obs_all)
    partial = gaps.any(-1).any(-1).tolist()  # [H]: a gap somewhere at the step
    observed = ~gaps.all(-1)  # [H, R·M]: something observed at the step
    shrink = shrinkage if not per.dynamic else None
    for t in range(first, H):
        active = [r for r in range(R) if begun_at[r] <= t]
        every = len(active) == R
        mask = None if every else torch.tensor(begun_at, dtype=torch.float64).le(t).repeat_interleave(M)
        if per.dynamic:
            z = randn([gens[r] for r in active], [M, Nx, d], torch.float64)
            if every:
                x = move(x, z.reshape(RM, Nx, d))
            else:
                rows = torch.tensor([r * M + j for r in active for j in range(M)], dtype=torch.int64)
                full = torch.zeros_like(x).index_copy(0, rows, z.reshape(len(rows), Nx, d))
                x = torch.where(mask[:, None, None], move(x, full), x)
        weigh = observed[t] if every else observed[t] & mask
        if not bool(weigh.any()):
            continue  # a predict only
        at, o = (per.observed_part(obs_all[t])) if partial[t] else (per, obs_all[t])
        lik = torch.nan_to_num(at.log_likelihood(o, x).to(torch.float64), nan=-math.inf)
        log_pred = torch.logsumexp(lwx + lik, -1)
        ok = weigh & torch.isfinite(log_pred)
        lwx = torch.where(ok[:, None], torch.log_softmax(lwx + lik, -1), lwx)
        ll = ll + torch.where(weigh, log_pred, torch.zeros_like(log_pred))
        low = ok & (ess(lwx) < RESAMPLE_FRACTION * Nx)
        x, lwx = resample_low_ess(x, lwx, low, row_gens, shrink)
    ll = torch.where(broken, -math.inf, torch.nan_to_num(ll, nan=-math.inf))
    return ll.reshape(R, M), x.reshape(R, M, Nx, d), lwx.reshape(R, M, Nx)


#: the price of one replayed step of one stream (:func:`particle_replay_work`), beyond its particles' flops: the loop's
#: few dozen tensor operations and the stream's one normal draw, whose fixed cost dominates at small N; plus, per
#: θ-filter, its resampling's uniform from its own seeded generator when it resamples (most steps at N_x ≤ 128).
#: One replay of H = 1000 steps of ``stochastic_volatility`` d = 1 (φ, σ unknown, θ near the simulating (0.95, 0.3),
#: start N(0, 1)), one thread, on the loaded 2-core development machine (2026-12-07; medians of 4 interleaved runs at
#: load averages 2.2 to 2.7, then 4.1) took 0.90 and 0.93 s at M = 64, N_x = 64 and 0.80 and 0.84 s at M = 32,
#: N_x = 128 (0.46 to 0.63 s and 0.46 to 0.54 s in quieter moments); 0.42 and 0.46 s at M = 8, N_x = 64, 0.61 and
#: 0.69 s at M = 64, N_x = 8, 0.74 and 0.78 s at M = 16, N_x = 256, 2.1 and 2.3 s at M = 256, N_x = 64: about 0.4 ms
#: a step, 3.3 µs a θ-filter and 40 to 80 ns a particle. Priced at 25 Gflop/s
#: (:data:`mpflow.service.engine.lanes.PRICED_FLOPS_PER_SECOND`) as REPLAY_STEP_FLOPS a step, REPLAY_THETA_FLOPS a
#: θ-filter a step and REPLAY_FACTOR × :func:`particle_flops` (46 for this family) a particle a step: 1.00, 0.87,
#: 0.47, 0.70, 0.80 and 2.8 s for those six
REPLAY_STEP_FLOPS = 1.0e7
REPLAY_THETA_FLOPS = 1.0e5
REPLAY_FACTOR = 45.0


def particle_target(model: ModelFamily, names, priors, los, his, extras_rows, Nx: int, gens):
    """π of :mod:`smc2_mh`'s eq. M1 for R streams with a particle filter of ``Nx`` particles per θ-particle: u [R, M,
    p] → (log p_c(u) + log p̂(o_block | θ(u)) [R, M], (θ [R, M, p], the replay's particles [R, M, Nx, d] and their
    within-θ log-weights [R, M, Nx])). The current θ-particles' estimates are replayed afresh when a move begins
    (Monte Carlo within Metropolis, O'Neill et al. 2000: an approximation of the particle marginal move, whose
    error falls as N_x grows; each proposal's estimate is kept while it is current)."""
    from mpflow.operators.updaters import smc2_mh

    hist, seen, length = extras_rows[smc2_mh.HISTORY], extras_rows[smc2_mh.OBSERVED], extras_rows[smc2_mh.LENGTH]
    s, S = extras_rows[smc2_mh.START_MEAN], extras_rows[smc2_mh.START_COV]
    return smc2_mh.block_target(
        lambda th: replay_particles(model, names, th, hist, length, s, S, seen, Nx, gens),
        names, priors, los, his, extras_rows,
    )  # fmt: skip


def particle_flops(model: ModelFamily, k: int | None = None) -> float:
    """One particle's share of a replayed step, counted as :meth:`Updater.step_work` counts a particle filter's:
    its transition and likelihood (:meth:`ModelFamily.particle_flops`) and its d normal draws
    (:data:`~mpflow.operators.updaters.base.RANDN_FLOPS` each)."""
    return model.particle_flops(1.0, k) + RANDN_FLOPS * model.state_dim


def particle_replay_work(
    model: ModelFamily, n_particles_total: int, H: int, theta_particles: int = 0, k: int | None = None
) -> float:
    """The flops of one :func:`replay_particles` of one stream over ``H`` steps with ``n_particles_total`` = M·N_x
    particles: H × (:data:`REPLAY_STEP_FLOPS` + M × :data:`REPLAY_THETA_FLOPS` + n × :data:`REPLAY_FACTOR` ×
    :func:`particle_flops`), M = ``theta_particles`` (0: ``smc2``'s automatic count for particle filters,
    :func:`~mpflow.operators.updaters.smc2.theta_count`); ``k``: the observed entries (None: the family's)."""
    from mpflow.operators.updaters.smc2 import theta_count  # smc2 imports this module

    n = int(n_particles_total)
    M = theta_particles or theta_count(n, False, 0)
    return float(H) * (REPLAY_STEP_FLOPS + M * REPLAY_THETA_FLOPS + n * REPLAY_FACTOR * particle_flops(model, k))


__all__ = [
    "REPLAY_FACTOR",
    "REPLAY_STEP_FLOPS",
    "REPLAY_THETA_FLOPS",
    "particle_flops",
    "particle_replay_work",
    "particle_target",
    "replay_particles",
]

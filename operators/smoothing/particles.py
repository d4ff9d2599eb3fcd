"""The particle smoother of ``smc``: forward filtering, backward smoothing of the marginals (FFBSm: Doucet, Godsill
& Andrieu 2000, *On sequential Monte Carlo sampling methods for Bayesian filtering*, eq. 32; Doucet & Johansen
2011, *A tutorial on particle filtering and smoothing*, §5.2 eq. 49) for small clouds, backward simulation (FFBSi
by rejection, :mod:`.backward_simulation`) for larger ones, and the filter's genealogy (§5.1) on the links where the
transition has no density.

The smoothed marginal at step s is the filter's cloud {x^i_s} at s reweighted, p(x_s | o_1:t) ≈ Σ_i w^i_{s|t}
δ(x_s − x^i_s), from w_{t|t} = w_t backwards:

* FFBSm, for a transition x_{s+1} = f(x_s) + N(0, Q) with Q positive definite (density K_ij = N(x^j_{s+1}; f(x^i_s),
  Q)) and N ≤ :data:`FFBSM_MAX_PARTICLES`::

      w^i_{s|t} = w^i_s Σ_j w^j_{s+1|t} K_ij / Σ_k w^k_s K_kj

  — the exact backward reweighting, N² per step (chunked; the cost model prices it);
* FFBSi, the same transition and N above :data:`FFBSM_MAX_PARTICLES`: w^i_{s|t} = (the share of N trajectories
  drawn backwards by rejection sampling that pass through x^i_s) — the same marginals with the sampling error of N
  draws added, at O(N) per step (:mod:`.backward_simulation`: Douc, Garivier, Moulines & Olsson 2011, Alg. 1, with
  bounded fall-backs). At N = 4096, L = 100 it is ~10³ times faster than FFBSm (docs/benchmarks.md);
* the genealogy, where Q is singular (a perfect model) or the family is static: the weight of each particle of step
  s + 1 goes to its parent, w^i_{s|t} = Σ_{j : A_{s+1}[j] = i} w^j_{s+1|t} (A: the resampling's ancestor indices;
  j itself at a step that did not resample). Its lineages coalesce a few resamplings back, so it is the coarser
  estimate.

The window keeps per step s: the particles x_s [N, d] and log-weights [N] after it (the state's dtype), its
ancestor indices [N] (int64), f_s(x_{s−1}) [N, d] of the previous step's particles under this step's model (its
duration and inputs), and the Cholesky factor of its Q [d, d] (zero: no density; float64). A step computed by
another method (a fall-back) has no ancestry: its particles are taken as their own predecessors' successors.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from mpflow.operators import gaussian
from mpflow.operators.kept import Bound, Cloud, Fixed, Kept
from mpflow.operators.rng import generators_from_state, side_streams
from mpflow.operators.smoothing import FixedLagSmoother, Smoothed, field_name, valid_rows
from mpflow.operators.smoothing.backward_simulation import (
    KERNEL_TERM_FLOPS,
    TRAJECTORIES_PER_PARTICLE,
    Sampler,
    backward_step,
    categorical,
    counts_log_weights,
    trajectory_flops,
)
from mpflow.operators.state import ParticleState, StepInfo

if TYPE_CHECKING:
    from mpflow.operators.models.base import ModelFamily
    from mpflow.operators.updaters.base import Updater

F64 = torch.float64
#: the log-weight a zero-weight particle is kept with (finite, as every stored number must be; exp of it is 0)
ZERO_WEIGHT_LOG = -1e30
#: the largest N smoothed by FFBSm (N² kernel evaluations per step); above it, backward simulation (O(N) per step):
#: measured at the benchmark's lds (one core), 10 steps: N = 256 FFBSm 0.014 s, FFBSi 0.046; 512: 0.086, 0.061;
#: 1024: 0.41, 0.12 — FFBSm is kept to 512, where it costs about as much and has no sampling error of its own.
#: At L = 100 (``benchmarks/smoothing_price.py``, CPU, six runs on 2026-11-28): FFBSm at 512 0.24 to 0.37 s, FFBSi
#: at 513 0.17 to 0.23 s as it runs and 0.44 to 0.59 s in its worst case — priced 8.6e9 and 7.3e9. Measured again
#: with the kernel in blocks of :data:`CHUNK` = 128 (``python -m benchmarks.smoothing --reads``, 2026-11-29, one
#: thread): N = 512, L = 100, FFBSm 0.30 s, FFBSi 0.17 s as it runs and 0.39 s at worst; N = 256 0.17 and 0.09, 0.25
#: — FFBSm stays below backward simulation's worst case, the price's, so the switch stays at 512
FFBSM_MAX_PARTICLES = 512
#: the tag of the side stream of the stream's generator that a read's backward simulation draws from
SIDE_STREAM_TAG = 0x5A00_7401
#: particles of step s + 1 whose kernel rows are computed at once (the N × CHUNK matrix bounds the memory). 128 keeps
#: a block and its temporaries in the core's cache: an FFBSm read at N = 512, L = 100 took 0.34 s CPU with 128 and
#: 64, 0.79 with 256 and 0.88 with 512 (one thread, 2026-11-29, ``python -m benchmarks.smoothing --reads``'s state;
#: 0.70 to 0.83 s in its three runs at 512) — at 512 its time was up to 2.4 times what its price buys; at N = 256
#: all four took 0.08 to 0.10 s
CHUNK = 128
#: floating-point operations' worth of one particle's link in the genealogy's walk (a scatter-add of its weight to
#: its parent, the softmax and log around it) and of its share of the step's weighted moments beyond their 4 d²
#: counted. Measured, not counted: ``benchmarks/smoothing_price.py`` times a read of a static family's ``smc``
#: stream (``linear_gaussian``, N = 4096, L = 100, d = 2: 0.03 s; its work does not depend on the data) in an
#: ``smc`` step's operations — 1745, 1395, 1025, 1885, 1314 and 638 in six runs on 2026-11-28 (0.02 to 0.03 s CPU),
#: the largest rounded up. Such a read was priced as backward simulation's worst case, about 60 times this
GENEALOGY_FLOPS = 1900.0


def noise_factor(model: ModelFamily, d: int, batch: int) -> torch.Tensor:
    """The Cholesky factor [B, d, d] of the step's transition noise Q, zero where Q is not positive definite (no
    transition density) or the family is static."""
    if not model.dynamic:
        return torch.zeros(batch, d, d, dtype=F64)
    Q = model.transition_noise().to(F64).expand(batch, d, d)
    L, info = torch.linalg.cholesky_ex(Q)
    return torch.where((info == 0)[:, None, None], L, torch.zeros_like(L))


def transition_density(model: ModelFamily) -> bool:
    """Whether ``model``'s steps have a transition density (dynamic, Q positive definite): smoothed by FFBSm or
    FFBSi, else by the genealogy (module docstring) — the test :meth:`ParticleSmoother.smooth` applies to the
    window's :func:`noise_factor`, so the price follows the path a read takes."""
    factor = noise_factor(model, model.state_dim, 1)[0]
    return bool(torch.diagonal(factor).gt(0).all())


def stored_log_weights(log_weights: torch.Tensor) -> torch.Tensor:
    """The log-weights [B, N] a window row keeps of a step's: normalised (float64), a zero weight (−inf) as
    :data:`ZERO_WEIGHT_LOG`, the most negative float32 order of magnitude — every stored number is finite."""
    return torch.log_softmax(log_weights.to(F64), -1).clamp_min(ZERO_WEIGHT_LOG)


def backward_weights(
    lw_s: torch.Tensor, fx: torch.Tensor, x_next: torch.Tensor, chol: torch.Tensor, lw_next: torch.Tensor
) -> torch.Tensor:
    """FFBSm's log w_{s|t} [N] from the filter's log-weights ``lw_s`` [N] at s, f(x_s) [N, d], the particles
    ``x_next`` [N, d] and smoothed log-weights ``lw_next`` [N] at s + 1, and Q's factor ``chol`` (module docstring)."""
    a = torch.linalg.solve_triangular(chol, x_next.T, upper=False).T  # L⁻¹ x_{s+1}^j
    b = torch.linalg.solve_triangular(chol, fx.T, upper=False).T  # L⁻¹ f(x_s^i)
    b2 = 0.5 * (b * b).sum(-1)
    terms = []
    for start in range(0, a.shape[0], CHUNK):
        aj = a[start : start + CHUNK]
        log_k = b @ aj.T - b2[:, None] - 0.5 * (aj * aj).sum(-1)[None]  # log K_ij up to a constant, [N, chunk]
        denominator = torch.logsumexp(lw_s[:, None] + log_k, 0)  # [chunk]
        terms.append(lw_next[start : start + CHUNK][None] + log_k - denominator[None])
    return torch.log_softmax(lw_s + torch.logsumexp(torch.cat(terms, 1), 1), 0)


def genealogy_weights(ancestors: torch.Tensor, lw_next: torch.Tensor) -> torch.Tensor:
    """The genealogy's log w_{s|t} [N]: each particle's weight at s + 1 given to its parent (module docstring)."""
    w = torch.zeros_like(lw_next).index_add_(0, ancestors, torch.softmax(lw_next, 0))
    return w.log()


def ffbsm(n: int) -> bool:
    """Whether a cloud of ``n`` particles is smoothed by FFBSm (else by backward simulation, where the transition
    has a density)."""
    return n <= FFBSM_MAX_PARTICLES


class ParticleSmoother(FixedLagSmoother):
    """FFBSm or FFBSi, with genealogy links (module docstring)."""

    name = "ffbsm"

    def empty(self, state: ParticleState, lag: int) -> dict[str, torch.Tensor]:
        B, N, d = state.particles.shape
        dtype = state.particles.dtype
        return {
            "particles": torch.zeros(B, lag, N, d, dtype=dtype),
            "log_weights": torch.zeros(B, lag, N, dtype=dtype),
            "ancestors": torch.zeros(B, lag, N, dtype=torch.int64),
            "mapped": torch.zeros(B, lag, N, d, dtype=dtype),
            "noise_factor": torch.zeros(B, lag, d, d, dtype=F64),
        }

    def entry(
        self, updater: Updater, before: ParticleState, after: ParticleState, info: StepInfo | None, model: ModelFamily
    ) -> dict[str, torch.Tensor]:
        B, N, d = after.particles.shape
        ancestors = info.ancestors if info is not None and info.ancestors is not None else None
        factor = noise_factor(model, d, B)
        mapped = before.particles
        if bool(factor.abs().sum() > 0):
            mapped = model.to(F64).transition_mean(before.particles.to(F64))
        return {
            "particles": after.particles,
            "log_weights": stored_log_weights(after.log_weights),
            "ancestors": ancestors if ancestors is not None else torch.arange(N).expand(B, N),
            "mapped": mapped,
            "noise_factor": factor,
        }

    def smooth(self, updater: Updater, window: dict[str, torch.Tensor], state: ParticleState) -> Smoothed:
        t = int(state.step[0])
        n = valid_rows(window, t)
        rows = {k: v[0] for k, v in window.items()}
        lag = rows["particles"].shape[0]
        lw = torch.log_softmax(state.log_weights[0].to(F64), -1)
        N = lw.shape[0]
        simulate = not ffbsm(N)
        gen = side_streams(generators_from_state(state.rng[:1]), SIDE_STREAM_TAG)[0] if simulate else None
        paths = None  # FFBSi: the M trajectories' indices at the current row
        means, covs = [], []
        for row in range(lag - 1, lag - n - 1, -1):
            if row < lag - 1:
                nxt = row + 1
                chol = rows["noise_factor"][nxt]
                lw_s = rows["log_weights"][row].to(F64)
                if not bool(torch.diagonal(chol).gt(0).all()):
                    paths = None if paths is None else rows["ancestors"][nxt][paths]
                    lw = genealogy_weights(rows["ancestors"][nxt], lw)
                elif simulate:
                    if paths is None:  # the trajectories start from the smoothed weights of step s + 1
                        paths = categorical(lw, TRAJECTORIES_PER_PARTICLE * N, gen)
                    x_next, fx = rows["particles"][nxt].to(F64), rows["mapped"][nxt].to(F64)
                    paths = backward_step(Sampler(lw_s, fx, x_next, chol, gen), paths, rows["ancestors"][nxt])
                    lw = counts_log_weights(paths, N)
                else:
                    x_next = rows["particles"][nxt].to(F64)
                    lw = backward_weights(lw_s, rows["mapped"][nxt].to(F64), x_next, chol, lw)
            mean, cov = gaussian.moments(rows["particles"][row][None].to(F64), lw[None])
            means.insert(0, mean[0])
            covs.insert(0, cov[0])
        return Smoothed(torch.arange(t - n + 1, t + 1), torch.stack(means), torch.stack(covs))

    def window_bytes(self, lag: int, n: int, d: int) -> float:
        return lag * (n * (4.0 * (2 * d + 1) + 8.0) + 8.0 * d * d)

    def smooth_flops(self, model: ModelFamily, lag: int, n: int) -> float:
        """Per step: FFBSm's N² kernel terms (:data:`KERNEL_TERM_FLOPS` each), backward simulation's worst case
        (:func:`trajectory_flops`) or, where ``model``'s transition has no density, the genealogy's N links
        (:data:`GENEALOGY_FLOPS` each); and the step's weighted moments (4 N d²)."""
        d = model.state_dim
        if not transition_density(model):
            backward = n * GENEALOGY_FLOPS
        elif ffbsm(n):
            backward = n * n * KERNEL_TERM_FLOPS
        else:
            backward = trajectory_flops(TRAJECTORIES_PER_PARTICLE * n, n, d)
        return lag * (backward + 4.0 * n * d * d)

    def kept(self, updater: Updater, window: dict[str, torch.Tensor], state: ParticleState) -> Kept:
        """Besides the idle rows' zeros: each valid row's cloud (its particles and normalised log-weights), the
        ancestor indices within 0 … N − 1, each Q factor lower-triangular with a non-negative diagonal (zero: no
        density), and the newest row the state's own cloud (:meth:`entry` wrote it from the state)."""
        kept = super().kept(updater, window, state)
        n = valid_rows(window, int(state.step[0]))
        if n == 0:
            return kept
        rows = {k: v[:, v.shape[1] - n :] for k, v in window.items()}
        particles, log_weights = field_name("particles"), field_name("log_weights")
        kept.clouds.append(Cloud(particles, rows["particles"], log_weights, rows["log_weights"]))
        factor = rows["noise_factor"]
        kept.bounds += [
            Bound(field_name("ancestors"), rows["ancestors"], 0, state.particles.shape[1] - 1),
            Bound(field_name("noise_factor"), torch.diagonal(factor, dim1=-2, dim2=-1), 0.0, math.inf),
        ]
        lw = stored_log_weights(state.log_weights).to(rows["log_weights"].dtype)
        kept.fixed += [
            Fixed(field_name("noise_factor"), factor.triu(1), factor.new_zeros(()), "lower-triangular (Q's factor)"),
            Fixed(particles, rows["particles"][:, -1], state.particles, "its newest row the state's particles"),
            Fixed(log_weights, rows["log_weights"][:, -1], lw, "its newest row the state's normalised log-weights"),
        ]
        return kept


__all__ = [
    "FFBSM_MAX_PARTICLES",
    "GENEALOGY_FLOPS",
    "ParticleSmoother",
    "backward_weights",
    "ffbsm",
    "genealogy_weights",
    "noise_factor",
    "stored_log_weights",
    "transition_density",
]

"""Backward simulation (FFBSi) for ``smc``'s larger clouds: M smoothed trajectories drawn backwards through the
window at an expected O(M) cost per step, where FFBSm's reweighting costs N² (:mod:`.particles`).

Given the filter's weighted clouds {x^i_s, w^i_s}, a trajectory is drawn from the newest step back (Godsill, Doucet &
West 2004, *Monte Carlo smoothing for nonlinear time series*, JASA 99, Alg. 1): J_t ~ w_t, then for s = t − 1 … t − L
+ 1 the backward kernel

    P(J_s = i | J_{s+1} = j) = w^i_s K_ij / Σ_k w^k_s K_kj,   K_ij = N(x^j_{s+1}; f(x^i_s), Q).

Sampling it exactly costs N per trajectory (N² per step for M = N). With a Gaussian transition K_ij ≤ K̄ =
N(0; 0, Q), so the kernel is sampled by rejection (Douc, Garivier, Moulines & Olsson 2011, *Sequential Monte Carlo
smoothing for general state space hidden Markov models*, Ann. Appl. Probab. 21(6), Algorithm 1): propose I ~ w_s,
accept with probability K_Ij / K̄ = exp(−½ ‖L⁻¹(x^j_{s+1} − f(x^I_s))‖²) (Q = L Lᵀ) — exact draws, at an expected
K̄ / p̂_s(x^j_{s+1}) proposals each, p̂_s(x) = Σ_i w^i_s K(x | x^i_s) the filter's predictive density (the paper's
Theorem 5 bounds the total by O(M) where that density is bounded below). The trajectories still pending are
proposed for together, :data:`PROPOSALS_PER_ROUND` proposals each in one vectorised round.

A trajectory still rejected after :data:`REJECTION_TRIALS` proposals (a predictive far wider than Q: a large d, an
outlier) falls back, so that the worst case is bounded too:

* the first :data:`EXACT_FALLBACKS` of a step get an exact draw from the backward weights (N kernel terms each) —
  and so do the last ones pending once no more than :data:`EXACT_FALLBACKS` are (a vectorised round costs more than
  their exact draws: at the benchmark's lds about 15 % of the proposals are accepted, and a few trajectories whose
  x_{s+1} lies in the predictive's tail would hold the rounds for tens of trials);
* the rest — only when rejection fails wholesale — get :data:`MH_MOVES` independent Metropolis–Hastings moves
  targeting the same backward kernel (proposal w_s, acceptance min(1, K_I'j / K_Ij)), started from the particle's
  genealogy ancestor A_{s+1}[j] (Dau & Chopin 2023, *On backward smoothing algorithms*, Ann. Statist. 51(5),
  §3.2–3.3: the hybrid rejection sampler and the MCMC backward kernel started at the ancestor, both keep the
  smoother consistent; a bootstrap filter's ancestor is itself a draw of the backward kernel at a step that
  resampled).

So a step costs at most M (:data:`REJECTION_TRIALS` + :data:`MH_MOVES`) proposals plus :data:`EXACT_FALLBACKS` · N
kernel terms: O(M + N) per step, whatever the data (:func:`trajectory_flops` prices it, each proposal at the time
it was measured to take, :data:`PROPOSAL_FLOPS`). The smoothed marginal at s
is the trajectories' empirical law {x^{J^m_s}_s}: as log-weights on step s's cloud, log(count_i / M).

The random numbers come from a side stream of the stream's generator (:func:`~mpflow.operators.rng.side_streams`):
a read is reproducible and leaves the stream's own draws as they were.
"""

from __future__ import annotations

import torch

F64 = torch.float64
#: proposals per trajectory and step before the fall-backs (at the benchmark's lds about 0.15 are accepted)
REJECTION_TRIALS = 32
#: proposals per pending trajectory drawn in one vectorised round (the first accepted one is kept: the same draw as
#: one proposal at a time, for an eighth of the rounds' fixed costs)
PROPOSALS_PER_ROUND = 8
#: trajectories per particle, M / N: measured over the benchmark's 16 runs at N = 4096 (one run of each), M = N, 2 N
#: and 4 N gave the same error (worst window 0.112, 0.123, 0.126 sd; mean 0.066, 0.066, 0.067; FFBSm 0.125 and
#: 0.065), the filter's error dominating, at 3.4, 4.2 and 8.2 s for one L = 100 read
TRAJECTORIES_PER_PARTICLE = 1
#: trajectories per step that exhaust the trials and are drawn from the exact backward weights (N terms each)
EXACT_FALLBACKS = 64
#: Metropolis–Hastings moves for the trajectories past :data:`EXACT_FALLBACKS`
MH_MOVES = 16
#: floating-point operations' worth of one proposal in d dimensions besides its 3 d of distance — the categorical
#: draw (a binary search of the cumulative weights), a uniform, the comparison, the gathers and its share of each
#: round's fixed costs. Measured, not counted (about 60 are counted): the work is memory-bound, so a proposal is
#: priced at the time it takes in an ``smc`` step's operations. ``benchmarks/smoothing_price.py`` (one thread, the
#: worst case of a read at N = 4096, L = 100: every proposal rejected) fitted 1836 to 3470 against the step's rate
#: of the moment in six runs of 2026-11-28 (then 2500, kept), and over a longer series the same day (``--repeats 5``,
#: the step timed 25 times) 3283, 4194 and 6712: the read's CPU time went from 3.05 to 4.83 s and the step's rate
#: from 14.7 to 52 Gflop/s (CPU) with the other jobs of the shared cores. At 25 Gflop/s, the rate the cost model's
#: measured constants are set at (:data:`~mpflow.operators.updaters.base.PARTICLE_STEP_FLOPS`), the five reads
#: give 3435, 4078, 4151, 5647 and 5696: the largest, rounded up. The largest window the defaults then accept at
#: L = 100 is N = 847 (1767 at 2500, whose worst-case read took 1.3 to 2.8 times the time its budget buys)
PROPOSAL_FLOPS = 5700.0
#: floating-point operations' worth of one kernel term log K_ij of an exact backward reweighting (FFBSm's N² per
#: step, an exact fall-back's N per draw) with its share of the log-sum-exps and sums over it. Measured, not counted
#: (about 2 d + 20 are counted; the rest is memory traffic over the N × 512 blocks), like :data:`PROPOSAL_FLOPS`:
#: ``benchmarks/smoothing_price.py`` times an FFBSm read at N = 512, L = 100, d = 2 (its work does not depend on
#: the data: as it runs is its worst case) in an ``smc`` step's operations — 286, 323, 124, 272, 172 and 144 in six
#: runs on 2026-11-28 (load 1.2 to 2.4; the spread is the step's, 0.06 to 0.11 s CPU, the read's 0.24 to 0.34 s),
#: the largest rounded up. It was priced 2 d + 20, a twelfth of its time or less
KERNEL_TERM_FLOPS = 330.0


def categorical(log_weights: torch.Tensor, count: int, gen: torch.Generator) -> torch.Tensor:
    """``count`` indices drawn from the normalised ``log_weights`` [N]."""
    return inverse_cdf(torch.cumsum(torch.softmax(log_weights, 0), 0), count, gen)


def inverse_cdf(cdf: torch.Tensor, count: int, gen: torch.Generator) -> torch.Tensor:
    """``count`` indices drawn by inverse transform from cumulative weights ``cdf`` [N] (a binary search each)."""
    u = torch.rand(count, generator=gen, dtype=F64) * cdf[-1]
    return torch.searchsorted(cdf, u, right=True).clamp_max(cdf.shape[0] - 1)  # right: never a zero weight


class Sampler:
    """Categorical draws from step s's filter weights and the kernel's log-ratio log K_ij / K̄ for one step.

    ``lw_s`` [N]: log w_s; ``fx`` [N, d]: f(x^i_s); ``x_next`` [N, d]: x^j_{s+1}; ``chol``: Q's Cholesky factor;
    ``gen``: the read's generator."""

    def __init__(
        self, lw_s: torch.Tensor, fx: torch.Tensor, x_next: torch.Tensor, chol: torch.Tensor, gen: torch.Generator
    ):
        self.lw_s = lw_s
        self.cdf = torch.cumsum(torch.softmax(lw_s, 0), 0)
        self.a = torch.linalg.solve_triangular(chol, x_next.T, upper=False).T  # L⁻¹ x^j_{s+1}
        self.b = torch.linalg.solve_triangular(chol, fx.T, upper=False).T  # L⁻¹ f(x^i_s)
        self.gen = gen

    def draw(self, count: int) -> torch.Tensor:
        """``count`` indices I ~ w_s."""
        return inverse_cdf(self.cdf, count, self.gen)

    def uniform_log(self, count: int) -> torch.Tensor:
        return torch.rand(count, generator=self.gen, dtype=F64).log()

    def log_ratio(self, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        """log K_ij / K̄ = −½ ‖L⁻¹ x^j_{s+1} − L⁻¹ f(x^i_s)‖² for index pairs (i, j)."""
        diff = self.a[j] - self.b[i]
        return -0.5 * (diff * diff).sum(-1)

    def exact(self, j: torch.Tensor) -> torch.Tensor:
        """One exact draw of the backward kernel per index in ``j`` (N kernel terms each)."""
        aj = self.a[j]
        log_k = self.b @ aj.T - 0.5 * (self.b * self.b).sum(-1)[:, None] - 0.5 * (aj * aj).sum(-1)[None]  # [N, |j|]
        cdf = torch.cumsum(torch.softmax(self.lw_s[:, None] + log_k, 0).T, 1)  # [|j|, N]
        u = torch.rand(j.shape[0], 1, generator=self.gen, dtype=F64) * cdf[:, -1:]
        return torch.searchsorted(cdf, u, right=True)[:, 0].clamp_max(cdf.shape[1] - 1)


def backward_step(sampler: Sampler, j: torch.Tensor, ancestors: torch.Tensor) -> torch.Tensor:
    """The indices J_s [M] at step s of M trajectories at indices ``j`` = J_{s+1} [M] of step s + 1: rejection,
    then the exact and the Metropolis–Hastings fall-backs (module docstring). ``ancestors`` [N]: A_{s+1}."""
    out = torch.empty_like(j)
    pending = torch.arange(j.shape[0])
    for _ in range(REJECTION_TRIALS // PROPOSALS_PER_ROUND):
        if pending.numel() <= EXACT_FALLBACKS:  # the tail: its exact draws cost less than more rounds
            break
        count = pending.numel()
        candidate = sampler.draw(count * PROPOSALS_PER_ROUND).view(count, PROPOSALS_PER_ROUND)
        target = j[pending][:, None].expand(count, PROPOSALS_PER_ROUND)
        accept = sampler.uniform_log(candidate.numel()).view_as(candidate) <= sampler.log_ratio(candidate, target)
        done = accept.any(1)
        first = accept.to(torch.uint8).argmax(1, keepdim=True)  # the first accepted of the round's proposals
        out[pending[done]] = candidate.gather(1, first)[:, 0][done]
        pending = pending[~done]
    exact, rest = pending[:EXACT_FALLBACKS], pending[EXACT_FALLBACKS:]
    if exact.numel():
        out[exact] = sampler.exact(j[exact])
    if rest.numel():
        target = j[rest]
        current = ancestors[target]
        current_log = sampler.log_ratio(current, target)
        for _ in range(MH_MOVES):
            proposal = sampler.draw(rest.numel())
            proposal_log = sampler.log_ratio(proposal, target)
            move = sampler.uniform_log(rest.numel()) <= proposal_log - current_log
            current = torch.where(move, proposal, current)
            current_log = torch.where(move, proposal_log, current_log)
        out[rest] = current
    return out


def counts_log_weights(indices: torch.Tensor, n: int) -> torch.Tensor:
    """The trajectories' empirical law at a step as log-weights [n] of its cloud: log(count_i / M)."""
    counts = torch.bincount(indices, minlength=n).to(F64)
    return (counts / indices.shape[0]).log()


def trajectory_flops(trajectories: int, n: int, d: int) -> float:
    """The most floating-point operations of one :func:`backward_step` (with its :class:`Sampler`): the whitening
    of both clouds (2 n d²), the cumulative weights, every trajectory's proposals (rejection and MH moves: 3 d +
    :data:`PROPOSAL_FLOPS` each) and the exact fall-backs' kernel rows (n :data:`KERNEL_TERM_FLOPS` each) — the
    last two measured in an ``smc`` step's operations."""
    proposals = trajectories * (REJECTION_TRIALS + MH_MOVES) * (3.0 * d + PROPOSAL_FLOPS)
    return 2.0 * n * d * d + 10.0 * n + proposals + EXACT_FALLBACKS * n * KERNEL_TERM_FLOPS


__all__ = [
    "EXACT_FALLBACKS",
    "KERNEL_TERM_FLOPS",
    "MH_MOVES",
    "PROPOSALS_PER_ROUND",
    "REJECTION_TRIALS",
    "TRAJECTORIES_PER_PARTICLE",
    "Sampler",
    "backward_step",
    "categorical",
    "counts_log_weights",
    "inverse_cdf",
    "trajectory_flops",
]

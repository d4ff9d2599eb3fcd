"""A particle cloud weighted and carried per dimension, for families whose transition and likelihood factorise over
the state's dimensions (:meth:`~mpflow.operators.models.base.ModelFamily.per_dimension`: p(x' | x) = Π_j p(x'_j | x_j),
p(o | x) = Π_j p(o_j | x_j), as ``stochastic_volatility``'s).

With a factorised prior the filtering posterior is then the product of d one-dimensional posteriors, and so is
every predictive: p(o_m | o_<m) = Π_j p(o_mj | o_<m,j). A particle method can therefore weight and resample each
dimension on its own — d one-dimensional particle filters, whose weights do not degenerate with d as joint
weights Π_j p(o_j | x_ij) do — and its log-evidence increment is the sum of the d one-dimensional ones. Each
dimension's weighted points {x_ij, w_ij} are carried to the next step (:func:`carry`), whose predict resamples
and moves them by sequential quasi-Monte Carlo, one dimension at a time (:func:`prediction`; Gerber & Chopin 2015,
Alg. 2, :mod:`mpflow.operators.sqmc`); the stream's particles are a uniformly weighted copy for reads, each
dimension resampled on its own (:func:`read_copy`) — a sample of the product posterior.

Used by ``smc`` on such families (option ``factorise``) and by ``mpf``'s marginal particle filter
(:mod:`~mpflow.operators.mpf.marginal`), whose points carry the flow's importance weights.
"""

from __future__ import annotations

import math

import torch
from mpflow.operators import sqmc
from mpflow.operators.kept import Cloud, Kept
from mpflow.operators.models.base import ModelFamily
from mpflow.operators.mpf.correction import from_dimensions, to_dimensions
from mpflow.operators.rng import Generators, rand
from mpflow.operators.state import ParticleState
from mpflow.operators.updaters.base import Prediction

F64 = torch.float64
#: the state's extras holding the weighted cloud {x_ij, w_ij} of the last step: points [B, N, d] and normalised
#: log-weights [B, d, N] (float64); the stream's particles are its resampled copy, for reads
POINTS, LOG_WEIGHTS = "marginal.points", "marginal.log_weights"


def carried(state: ParticleState) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The weighted cloud the last step left, per dimension: (points [B·d, N, 1], normalised log-weights
    [B·d, N] float64), or None when the state carries none (a state another method made)."""
    if POINTS not in state.extras or state.extras[POINTS].shape != state.particles.shape:
        return None
    B, N, d = state.particles.shape
    return to_dimensions(state.extras[POINTS]), state.extras[LOG_WEIGHTS].reshape(B * d, N).to(F64)


def kept(state: ParticleState) -> Kept:
    """What the carried cloud holds (:mod:`mpflow.operators.kept`), where the state carries one: per dimension j a
    weighted cloud {x_ij, w_ij} — the points' column j with the normalised log-weights of row j."""
    if POINTS not in state.extras:
        return Kept()
    points = state.extras[POINTS].transpose(-1, -2)[..., None]  # [B, d, N, 1]
    return Kept(clouds=[Cloud(f"extras.{POINTS}", points, f"extras.{LOG_WEIGHTS}", state.extras[LOG_WEIGHTS])])


def carry(state: ParticleState, points: torch.Tensor, log_weights: torch.Tensor | None = None) -> ParticleState:
    """``state`` carrying the weighted cloud ``points`` [B, N, d] with per-dimension ``log_weights`` [B·d, N]
    (None: uniform) to the next step (:func:`carried`)."""
    B, N, d = points.shape
    if log_weights is None:
        log_weights = torch.full((B * d, N), -math.log(N), dtype=F64)
    lw = torch.log_softmax(log_weights.to(F64), -1).reshape(B, d, N)
    return state.replace(extras={**state.extras, POINTS: points, LOG_WEIGHTS: lw})


def adopted(state: ParticleState, carries: bool = False) -> ParticleState:
    """``state`` whose particles and weights another method set (a fall-back's step): its carried cloud, where it
    holds one or where the stream's method ``carries`` one (a fall-back's shared-form result holds none), becomes
    these particles with their weights — so the state has the form a step of the stream's own method leaves."""
    if POINTS not in state.extras and not carries:
        return state
    return carry(state, state.particles, state.log_weights.repeat_interleave(state.dim, 0))


def prediction(state: ParticleState, split: ModelFamily, gens: Generators, replicates: int = 1) -> Prediction:
    """The step's predict by sequential quasi-Monte Carlo (:func:`mpflow.operators.sqmc.resample_move`), one
    dimension at a time under ``split`` (the model itself for d = 1, else its
    :meth:`~mpflow.operators.models.base.ModelFamily.per_dimension`): from the weighted cloud the last step carried
    (:func:`carried`), else from the stream's particles with their weights. Uniformly weighted moved particles
    [B, N, d], their ancestors (d = 1) and the predictive's moments per dimension (the dimensions are independent:
    a diagonal covariance). ``replicates``: the points as that many independent blocks
    (:func:`mpflow.operators.sqmc.replicated_points`)."""
    B, N, d = state.particles.shape
    x_prev, log_w = carried(state) or (to_dimensions(state.particles), state.log_weights.repeat_interleave(d, 0))
    mean, var = split.predicted_moments(x_prev, log_w)
    u = sqmc.replicated_points(gens, N, d, replicates)
    x, ancestors = sqmc.resample_move(x_prev, log_w, u, split.transition_from_noise)
    uniform = torch.full((B, N), -math.log(N), dtype=state.log_weights.dtype)
    cov = torch.diag_embed(var.reshape(B, d))
    return Prediction(from_dimensions(x, d), mean.reshape(B, d), cov, uniform, ancestors if d == 1 else None)


def read_copy(points: torch.Tensor, log_weights: torch.Tensor, gens: Generators, d: int) -> torch.Tensor:
    """The stream's particles [B, N, d]: each dimension's weighted points (``points`` [B·d, N, 1], ``log_weights``
    [B·d, N]) resampled on its own, systematically over the sorted cloud (:func:`mpflow.operators.sqmc.
    sorted_systematic`), one uniform per stream and dimension."""
    v = rand(gens, [d], F64).reshape(-1)
    return from_dimensions(sqmc.sorted_systematic(points, log_weights, v), d)

"""``smc``: the bootstrap particle filter (Gordon, Salmond & Smith 1993) — the baseline every other
method is compared with.

Per step m, for each stream:
  1. propagate   x_i ← x_i' ~ p(x_m | x_{m-1} = x_i)            (dynamic families)
  2. weight      log w_i ← log w_i + log p(o_m | x_i)            (log domain; never NaN)
  3. evidence    log p(o_m | o_<m) ≈ log Σ_i w̄_i p(o_m | x_i)   with w̄ the normalised previous weights
  4. resample    systematic, when ESS = 1/Σ w_i² < ``ess_threshold``·N
  5. rejuvenate  (static families, ``rejuvenate="auto"``) after resampling, move each copy with the
     Liu–West shrinkage kernel x ← a x + (1 − a) m + √(1 − a²) L ξ, LLᵀ = C: it keeps the cloud's mean and
     covariance while breaking ties — the "one-pass SMC with KDE rejuvenation" baseline of the MPF code.
"""

from __future__ import annotations

import math

import torch
from mpflow.operators import evidence, gaussian
from mpflow.operators.models.base import ModelFamily
from mpflow.operators.rng import Generators, rand, randn
from mpflow.operators.smoothing.particles import ParticleSmoother
from mpflow.operators.state import ParticleState, StepInfo, ess, systematic_resample
from mpflow.operators.updaters.base import Prediction, Updater


def liu_west_moves(
    resampled: torch.Tensor, cloud: torch.Tensor, log_weights: torch.Tensor | None, gens: Generators, a: float
) -> torch.Tensor:
    """The resampled copies [B, N, d] moved apart by the Liu–West kernel with shrinkage ``a``, about the mean and
    covariance of ``cloud`` (weighted by ``log_weights``; None: uniform), which the moves keep
    (:func:`mpflow.operators.gaussian.liu_west`)."""
    mean, cov = gaussian.moments(cloud.to(torch.float64), log_weights)
    L = gaussian.cholesky(cov).to(cloud.dtype)
    xi = randn(gens, list(resampled.shape[1:]), cloud.dtype)
    return gaussian.liu_west(resampled, mean.to(cloud.dtype), L, a, xi)


def resample_low_ess(
    x: torch.Tensor, log_weights: torch.Tensor, rows: torch.Tensor, gens: Generators, shrinkage: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`resampled` without the ancestor indices."""
    x, log_weights, _ = resampled(x, log_weights, rows, gens, shrinkage)
    return x, log_weights


def resampled(
    x: torch.Tensor, log_weights: torch.Tensor, rows: torch.Tensor, gens: Generators, shrinkage: float | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The weighted cloud x [B, N, d], ``log_weights`` [B, N] with the streams ``rows`` [B] (bool) resampled
    (systematic) to uniform weights, their copies moved apart by the Liu–West kernel with ``shrinkage`` a (None: no
    moves), and the ancestor indices [B, N] (each particle's index before resampling; i for i on the other rows).
    Only the resampling streams draw, from their own generators, so a stream's random sequence does not depend on
    whether other streams of its batch resample."""
    B, N, d = x.shape
    ancestors = torch.arange(N).expand(B, N)
    if not bool(rows.any()):
        return x, log_weights, ancestors
    rs = rows.nonzero().flatten()
    sub_gens = [gens[b] for b in rs.tolist()]
    x_rs, lw_rs = x[rs], log_weights[rs]
    idx = systematic_resample(lw_rs, rand(sub_gens, [1], torch.float64)[:, 0])
    xr = torch.gather(x_rs, 1, idx[..., None].expand(len(rs), N, d))
    if shrinkage is not None:
        xr = liu_west_moves(xr, x_rs, lw_rs, sub_gens, shrinkage)
    lw = log_weights.index_copy(0, rs, torch.full_like(lw_rs, -math.log(N)))
    return x.index_copy(0, rs, xr), lw, ancestors.index_copy(0, rs, idx)


REJUVENATE_MODES = ("auto", "always", "never")


def check_rejuvenation(options: dict) -> None:
    """ValueError unless ``options`` has a valid ``rejuvenate`` mode and Liu–West ``shrinkage``."""
    if options["rejuvenate"] not in REJUVENATE_MODES:
        raise ValueError(f"options.rejuvenate: expected auto, always or never, got {options['rejuvenate']!r}")
    a = options["shrinkage"]
    if not isinstance(a, int | float) or isinstance(a, bool) or not 0 < a <= 1:
        raise ValueError(f"options.shrinkage: a Liu–West shrinkage a in (0, 1], got {a!r}")


def rejuvenates(mode: str, model: ModelFamily) -> bool:
    """Whether resampled copies get Liu–West moves: ``always``, or ``auto`` for a static family (its copies would
    otherwise stay copies forever); a dynamic family's transition noise moves them apart by itself, except a
    perfect model (``lorenz96`` with Q = 0), which asks for ``always``."""
    if mode not in REJUVENATE_MODES:
        raise ValueError(f"options.rejuvenate: expected auto, always or never, got {mode!r}")
    return mode == "always" or (mode == "auto" and not model.dynamic)


class SMCUpdater(Updater):
    name = "smc"
    shares_prediction = True
    weighted = True
    nonlinear_transition = True
    stream_options = frozenset({"ess_threshold", "rejuvenate", "shrinkage"})
    defaults = {"ess_threshold": 0.5, "rejuvenate": "auto", "shrinkage": gaussian.LIU_WEST_SHRINKAGE}
    #: resample at every step (ESS ≤ N < 2N), so the particles come back uniformly weighted
    uniform_weight_options = {"ess_threshold": 2.0}
    #: fixed-lag smoothing: FFBSm, with the genealogy (ancestor indices kept for L steps) where Q is singular
    smoother = ParticleSmoother()
    #: FFBSm's means were within 0.1 sd of the exact smoother in every run at N = 4096 (max 0.093 over 16 runs),
    #: not at 2048 (0.11) or 256 (0.63): ``benchmarks/smoothing.py``
    smoothing_particles = 4096

    def __init__(self, **options):
        super().__init__(**options)
        o = self.options
        if (
            not isinstance(o["ess_threshold"], int | float)
            or isinstance(o["ess_threshold"], bool)
            or o["ess_threshold"] < 0
        ):
            raise ValueError(f"options.ess_threshold: a non-negative fraction of N, got {o['ess_threshold']!r}")
        check_rejuvenation(o)

    def _update(
        self,
        state: ParticleState,
        obs: torch.Tensor,
        model: ModelFamily,
        gens: Generators,
        prediction: Prediction | None = None,
    ):
        B, N, d = state.particles.shape
        x = model.transition(state.particles, gens) if prediction is None else prediction.particles
        prev_lw = torch.log_softmax(state.log_weights, -1)
        ll = model.log_likelihood(obs, x)
        ll = torch.nan_to_num(ll, nan=-math.inf)
        log_pred = evidence.predictive(ll, prev_lw)
        lw = torch.log_softmax(prev_lw + ll, -1)
        # every particle impossible (−inf likelihood everywhere): keep the previous weights
        lw = torch.where(torch.isfinite(log_pred)[:, None], lw, prev_lw)
        log_pred = torch.where(torch.isfinite(log_pred), log_pred, torch.full_like(log_pred, -1e30))
        ess_now = ess(lw)
        a = float(self.options["shrinkage"]) if rejuvenates(self.options["rejuvenate"], model) else None
        x, lw, ancestors = resampled(x, lw, ess_now < self.options["ess_threshold"] * N, gens, a)
        info = StepInfo(log_pred, ess_now.to(torch.float64), ancestors=ancestors)
        return state.replace(particles=x, log_weights=lw), info

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

Sequential quasi-Monte Carlo (option ``qmc``; Gerber & Chopin 2015, :mod:`mpflow.operators.sqmc`). On a dynamic
family with a one-dimensional state and a transition density (Q > 0), steps 4 and 1 become one: the step does not
resample at its end (its ESS is reported, its weights kept), and the next step's predict resamples the sorted
weighted cloud at the first coordinates of N randomised quasi-random points and moves each copy with the
second coordinate's Φ⁻¹ as the transition noise — every step, whatever ``ess_threshold``. Its total log-evidence's
sd over 8 seeds on the GBP/USD stochastic-volatility run is 0.008 nat at N = 4096 against 0.15 for the bootstrap
filter, at 2.1 × its wall time (docs/benchmarks.md "Anomaly scores"). ``qmc``: ``"auto"`` (the default: wherever
it applies), ``true`` (refused naming ``options.qmc`` where it does not apply: a static family, d > 1, Q = 0),
``false`` (the bootstrap filter).
A step without a measurement propagates by plain draws and keeps the weights.
"""

from __future__ import annotations

import math

import torch
from mpflow.operators import evidence, gaussian, sqmc
from mpflow.operators.models.base import ModelFamily
from mpflow.operators.mpf.correction import from_dimensions, to_dimensions
from mpflow.operators.rng import Generators, rand, randn
from mpflow.operators.smoothing.particles import ParticleSmoother
from mpflow.operators.state import ParticleState, StepInfo, ess, systematic_resample
from mpflow.operators.updaters.base import Prediction, StepWork, Updater


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


def sqmc_refusal(model: ModelFamily) -> str | None:
    """Why sequential quasi-Monte Carlo (:mod:`mpflow.operators.sqmc`) cannot run ``model``, or None when it can: it
    needs a dynamic family with a one-dimensional state and a transition density (Q > 0)."""
    if not model.dynamic:
        return f"the {model.name} family is static: there is no transition to drive with quasi-random points"
    if model.state_dim != 1:
        return f"it runs one-dimensional states, and this stream's has {model.state_dim} dimensions"
    if not bool((model.transition_noise() > 0).all()):
        return "it needs transition noise Q > 0 (a transition density)"
    return None


def quasi_random_prediction(
    state: ParticleState, model: ModelFamily, split: ModelFamily, gens: Generators, replicates: int = 1
) -> Prediction:
    """The step's predict by sequential quasi-Monte Carlo (:func:`mpflow.operators.sqmc.resample_move`) of the
    cloud [B, N, d] run as d one-dimensional problems under ``split`` (``model`` itself for d = 1, else
    :meth:`~mpflow.operators.models.base.ModelFamily.per_dimension`; each dimension with the cloud's weights):
    uniformly weighted moved particles, their ancestors (d = 1) and the predictive's moments of the weighted
    cloud they came from. ``replicates``: the points as that many independent blocks
    (:func:`mpflow.operators.sqmc.replicated_points`)."""
    B, N, d = state.particles.shape
    mean, cov = model.predicted_moments(state.particles, state.log_weights)
    u = sqmc.replicated_points(gens, N, d, replicates)
    lw = state.log_weights.repeat_interleave(d, 0)
    x, ancestors = sqmc.resample_move(to_dimensions(state.particles), lw, u, split.transition_from_noise)
    uniform = torch.full((B, N), -math.log(N), dtype=state.log_weights.dtype)
    return Prediction(from_dimensions(x, d), mean, cov, uniform, ancestors if d == 1 else None)


class SMCUpdater(Updater):
    name = "smc"
    shares_prediction = True
    weighted = True
    nonlinear_transition = True
    stream_options = frozenset({"ess_threshold", "rejuvenate", "shrinkage", "qmc"})
    defaults = {"ess_threshold": 0.5, "rejuvenate": "auto", "shrinkage": gaussian.LIU_WEST_SHRINKAGE, "qmc": "auto"}
    #: resample at the end of every step (ESS ≤ N < 2N), so the particles come back uniformly weighted (sequential
    #: quasi-Monte Carlo resamples at the start of the next step instead: off)
    uniform_weight_options = {"ess_threshold": 2.0, "qmc": False}
    #: fixed-lag smoothing: FFBSm, with the genealogy (ancestor indices kept for L steps) where Q is singular
    smoother = ParticleSmoother()
    #: the smoothed means' worst of 16 runs at N = 4096 (backward simulation) was 0.112 sd from the exact smoother's,
    #: mean 0.066; 0.260 at 1024 and 0.626 at 256 (``benchmarks/smoothing.py``, docs/benchmarks.md); lowered where
    #: the stream's requests would be over the cost budgets (at the defaults, d = 2: 847 at L = 100; a static family's,
    #: smoothed by its genealogy, keeps 4096)
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
        if not (o["qmc"] is True or o["qmc"] is False or o["qmc"] == "auto"):
            raise ValueError(f'options.qmc: expected "auto", true or false, got {o["qmc"]!r}')

    def check_compatible(self, model: ModelFamily, prior=None) -> None:
        """:meth:`Updater.check_compatible`, and ``qmc: true`` only where sequential quasi-Monte Carlo applies."""
        super().check_compatible(model, prior)
        reason = sqmc_refusal(model) if self.options["qmc"] is True else None
        if reason is not None:
            raise ValueError(f'options.qmc: sequential quasi-Monte Carlo does not apply: {reason}; use "auto"')

    def uses_qmc(self, model: ModelFamily) -> bool:
        """Whether the steps of ``model`` run sequential quasi-Monte Carlo (module docstring)."""
        return self.options["qmc"] is not False and sqmc_refusal(model) is None

    def _prediction(self, state: ParticleState, model: ModelFamily, gens: Generators) -> Prediction | None:
        """The step's predict; with sequential quasi-Monte Carlo (:meth:`uses_qmc`) the weighted cloud resampled and
        moved by N randomised quasi-random points (:func:`mpflow.operators.sqmc.resample_move`), uniformly
        weighted, with the predictive's moments of the weighted cloud it came from."""
        if not self.uses_qmc(model):
            return super()._prediction(state, model, gens)
        return quasi_random_prediction(state, model, model, gens)

    def step_work(self, model: ModelFamily, n: int, dt: float = 1.0, k: int | None = None) -> StepWork:
        """:meth:`Updater.step_work`, plus, where the steps run sequential quasi-Monte Carlo (:meth:`uses_qmc`: not
        with ``qmc: false``, a static family, d > 1 or Q = 0), its sorts of the cloud and the points (about
        20 n log₂ n each) and its n × 2 points."""
        base = super().step_work(model, n, dt, k)
        if not self.uses_qmc(model):
            return base
        return StepWork(base.flops + 40.0 * n * math.log2(max(n, 2)), base.bytes + 8.0 * 6 * n)

    def _update(
        self,
        state: ParticleState,
        obs: torch.Tensor,
        model: ModelFamily,
        gens: Generators,
        prediction: Prediction | None = None,
    ):
        B, N, d = state.particles.shape
        if prediction is None and model.dynamic:
            prediction = self._prediction(state, model, gens)
        x = state.particles if prediction is None else prediction.particles
        qmc = prediction is not None and prediction.log_weights is not None  # resampled by the predict
        prev_lw = torch.log_softmax(prediction.log_weights if qmc else state.log_weights, -1)
        ll = model.log_likelihood(obs, x)
        ll = torch.nan_to_num(ll, nan=-math.inf)
        log_pred = evidence.predictive(ll, prev_lw)
        lw = torch.log_softmax(prev_lw + ll, -1)
        # every particle impossible (−inf likelihood everywhere): keep the previous weights
        lw = torch.where(torch.isfinite(log_pred)[:, None], lw, prev_lw)
        log_pred = torch.where(torch.isfinite(log_pred), log_pred, torch.full_like(log_pred, -1e30))
        ess_now = ess(lw)
        a = float(self.options["shrinkage"]) if rejuvenates(self.options["rejuvenate"], model) else None
        if qmc:
            ancestors = prediction.ancestors
        else:
            x, lw, ancestors = resampled(x, lw, ess_now < self.options["ess_threshold"] * N, gens, a)
        info = StepInfo(log_pred, ess_now.to(torch.float64), ancestors=ancestors)
        return state.replace(particles=x, log_weights=lw), info

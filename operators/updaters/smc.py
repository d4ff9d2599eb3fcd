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

One filter per dimension (option ``factorise``; :mod:`~mpflow.operators.updaters.factorised`). Where the family's
transition and likelihood factorise over the dimensions (``ModelFamily.per_dimension``: ``stochastic_volatility``),
the posterior is the product of d one-dimensional ones, and steps 1–4 run per dimension j: the SQMC predict of
dimension j's carried weighted cloud, the weights log w_ij = log p(o_j | x_ij) (1 for an unobserved entry), the
increment Σ_j log (1/N) Σ_i p(o_j | x_ij), and the weighted points carried to the next step; the stream's particles
are each dimension resampled on its own. Joint weights Π_j p(o_j | x_ij) degenerate as d grows; these do not.
``factorise``: ``"auto"`` (the default: wherever it applies, with ``qmc`` not false), ``true`` (refused naming
``options.factorise`` where it does not apply: d = 1, a family that does not factorise, Q = 0, ``qmc`` false),
``false`` (one filter of the joint state). A step without a measurement moves the carried cloud by the
quasi-random predict.
"""

from __future__ import annotations

import math

import torch
from mpflow.operators import evidence, gaussian
from mpflow.operators.kept import Kept
from mpflow.operators.models.base import ModelFamily
from mpflow.operators.mpf.correction import to_dimensions
from mpflow.operators.rng import Generators, rand, randn
from mpflow.operators.smoothing.particles import ParticleSmoother
from mpflow.operators.state import ParticleState, StepInfo, ess, systematic_resample
from mpflow.operators.updaters import factorised
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


def factorise_refusal(model: ModelFamily) -> str | None:
    """Why ``smc`` cannot filter ``model`` one dimension at a time (:mod:`~mpflow.operators.updaters.factorised`), or
    None when it can: it needs d > 1, a family that factorises over the dimensions, and sequential quasi-Monte
    Carlo on each (:func:`sqmc_refusal`)."""
    if model.state_dim == 1:
        return "the state is one-dimensional"
    split = model.per_dimension(model.batch_size)
    if split is None:
        return f"the {model.name} family does not factorise over the state's {model.state_dim} dimensions"
    return sqmc_refusal(split)


def weighted(prev_log_weights: torch.Tensor, log_likelihood: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 2–3 of the module docstring for R filters: the normalised previous log-weights [R, N] and the
    particles' log-likelihoods [R, N] (NaN: impossible) → (the new normalised log-weights [R, N], the increment
    log Σ_i w̄_i p(o | x_i) [R], float64). A filter whose every particle is impossible (−inf likelihood everywhere)
    keeps its previous weights, and its increment is −1e30 rather than −inf."""
    ll = torch.nan_to_num(log_likelihood, nan=-math.inf)
    log_pred = evidence.predictive(ll, prev_log_weights)
    lw = torch.log_softmax(prev_log_weights + ll, -1)
    lw = torch.where(torch.isfinite(log_pred)[:, None], lw, prev_log_weights)
    log_pred = torch.where(torch.isfinite(log_pred), log_pred, torch.full_like(log_pred, -1e30))
    return lw, log_pred


class SMCUpdater(Updater):
    name = "smc"
    shares_prediction = True
    weighted = True
    nonlinear_transition = True
    stream_options = frozenset({"ess_threshold", "rejuvenate", "shrinkage", "qmc", "factorise"})
    defaults = {
        "ess_threshold": 0.5,
        "rejuvenate": "auto",
        "shrinkage": gaussian.LIU_WEST_SHRINKAGE,
        "qmc": "auto",
        # one particle filter per dimension where the family factorises (module docstring): auto = wherever it
        # applies (with qmc not false)
        "factorise": "auto",
    }
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
        if not (o["factorise"] is True or o["factorise"] is False or o["factorise"] == "auto"):
            raise ValueError(f'options.factorise: expected "auto", true or false, got {o["factorise"]!r}')
        if o["factorise"] is True and o["qmc"] is False:
            raise ValueError(
                "options.factorise: the per-dimension filters run sequential quasi-Monte Carlo: not with qmc false"
            )

    def check_compatible(self, model: ModelFamily, prior=None) -> None:
        """:meth:`Updater.check_compatible`, and ``qmc: true`` only where sequential quasi-Monte Carlo applies."""
        super().check_compatible(model, prior)
        reason = sqmc_refusal(model) if self.options["qmc"] is True and not self.factorises(model) else None
        if reason is not None:
            raise ValueError(f'options.qmc: sequential quasi-Monte Carlo does not apply: {reason}; use "auto"')
        reason = factorise_refusal(model) if self.options["factorise"] is True else None
        if reason is not None:
            raise ValueError(f'options.factorise: one filter per dimension does not apply: {reason}; use "auto"')

    def uses_qmc(self, model: ModelFamily) -> bool:
        """Whether the steps of ``model`` run sequential quasi-Monte Carlo (module docstring): on a one-dimensional
        state, or on each dimension of a factorised one (:meth:`factorises`)."""
        return self.options["qmc"] is not False and (sqmc_refusal(model) is None or self.factorises(model))

    def factorises(self, model: ModelFamily) -> bool:
        """Whether the steps of ``model`` run one particle filter per dimension (option ``factorise``,
        :mod:`~mpflow.operators.updaters.factorised`)."""
        o = self.options
        return o["factorise"] is not False and o["qmc"] is not False and factorise_refusal(model) is None

    def _prediction(self, state: ParticleState, model: ModelFamily, gens: Generators) -> Prediction | None:
        """The step's predict; with sequential quasi-Monte Carlo (:meth:`uses_qmc`) the weighted cloud resampled and
        moved by N randomised quasi-random points (:func:`mpflow.operators.sqmc.resample_move`), uniformly
        weighted, with the predictive's moments of the weighted cloud it came from."""
        if not self.uses_qmc(model):
            return super()._prediction(state, model, gens)
        split = model.per_dimension(state.batch_size) if self.factorises(model) else model
        return factorised.prediction(state, split, gens)

    def step_work(self, model: ModelFamily, n: int, dt: float = 1.0, k: int | None = None) -> StepWork:
        """:meth:`Updater.step_work`, plus, where the steps run sequential quasi-Monte Carlo (:meth:`uses_qmc`: not
        with ``qmc: false``, a static family or Q = 0, nor d > 1 unless the filter :meth:`factorises`), its sorts of
        the cloud and the points (about 20 n log₂ n each) and its n × 2 points, per dimension; one filter per
        dimension also sorts and gathers for the read copy (:func:`factorised.read_copy`)."""
        base = super().step_work(model, n, dt, k)
        if not self.uses_qmc(model):
            return base
        d, sorts = model.state_dim, 60.0 if self.factorises(model) else 40.0
        return StepWork(base.flops + sorts * d * n * math.log2(max(n, 2)), base.bytes + 8.0 * 6 * n * d)

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
        if self.factorises(model):
            return self._factorised_update(state, obs, model, gens, prediction)
        x = state.particles if prediction is None else prediction.particles
        qmc = prediction is not None and prediction.log_weights is not None  # resampled by the predict
        prev_lw = torch.log_softmax(prediction.log_weights if qmc else state.log_weights, -1)
        lw, log_pred = weighted(prev_lw, model.log_likelihood(obs, x))
        ess_now = ess(lw)
        a = float(self.options["shrinkage"]) if rejuvenates(self.options["rejuvenate"], model) else None
        if qmc:
            ancestors = prediction.ancestors
        else:
            x, lw, ancestors = resampled(x, lw, ess_now < self.options["ess_threshold"] * N, gens, a)
        info = StepInfo(log_pred, ess_now.to(torch.float64), ancestors=ancestors)
        return state.replace(particles=x, log_weights=lw), info

    def _factorised_update(
        self, state: ParticleState, obs: torch.Tensor, model: ModelFamily, gens: Generators, prediction: Prediction
    ):
        """Steps 2–3 as d one-dimensional filters (:mod:`~mpflow.operators.updaters.factorised`): each dimension's
        predicted points weighted by its own entry's likelihood p(o_j | x_ij) (an unobserved entry's is 1), the
        increment the sum of the d one-dimensional ones, log p(o | o_<m) = Σ_j log (1/N) Σ_i p(o_j | x_ij); the
        weighted points carried to the next step's predict, the stream's particles their per-dimension resampled
        copy. The step's ``ess`` is the smallest over the dimensions."""
        B, N, d = state.particles.shape
        x = to_dimensions(prediction.particles)
        prev_lw = torch.log_softmax(prediction.log_weights.repeat_interleave(d, 0), -1)
        lw, log_pred = weighted(prev_lw, model.per_dimension(B).log_likelihood(to_dimensions(obs), x))
        reads = factorised.read_copy(x, lw, gens, d)
        uniform = torch.full((B, N), -math.log(N), dtype=state.log_weights.dtype)
        new = factorised.carry(state.replace(particles=reads, log_weights=uniform), prediction.particles, lw)
        info = StepInfo(log_pred.reshape(B, d).sum(-1), ess(lw).reshape(B, d).min(-1).values.to(torch.float64))
        return new, info

    def _init(self, state: ParticleState, prior, model: ModelFamily, gens: Generators) -> ParticleState:
        """One filter per dimension (:meth:`factorises`) carries the prior's particles, uniformly weighted, from the
        start, so that a stream's state has the same tensors at every step (its snapshot's check reads them)."""
        return factorised.carry(state, state.particles) if self.factorises(model) else state

    def _unobserved(self, state: ParticleState, obs: torch.Tensor, model: ModelFamily, gens: Generators):
        """A step without a measurement; one filter per dimension (:meth:`factorises`) predicts from the carried
        weighted cloud by its quasi-random predict, and carries the moved points, uniformly weighted."""
        if not self.factorises(model):
            return super()._unobserved(state, obs, model, gens)
        new, info = self._predict(state, model, gens, self._prediction(state, model, gens))
        return factorised.carry(new, new.particles), info

    def from_particles(self, state: ParticleState, density=None) -> ParticleState:
        """A carried per-dimension cloud (:func:`factorised.adopted`) becomes the particles another method set."""
        return factorised.adopted(state)

    def kept(self, state: ParticleState, model: ModelFamily) -> Kept:
        """Besides the base's, the carried per-dimension cloud (:func:`factorised.kept`)."""
        return super().kept(state, model) | factorised.kept(state)

    def resume(self, new: ParticleState, before: ParticleState, obs: torch.Tensor, model: ModelFamily) -> ParticleState:
        """A fall-back's result: one filter per dimension (:meth:`factorises`) carries its particles, with their
        weights, as its weighted cloud (the form its own step leaves)."""
        return factorised.adopted(new, self.factorises(model))

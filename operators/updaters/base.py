"""The updater interface: one Bayes step for a batch of streams.

``Updater.init(prior, model, num_particles, seed)`` draws the step-0 particle cloud;
``Updater.update(state, obs, model)`` moves it from p(x | o_<m) to p(x | o_≤m) and returns the new state
and a :class:`~mpflow.operators.state.StepInfo` (log p(o_m | o_<m) estimate, ESS, iterations).

Shapes: state.particles [B, N, d], obs [B, *obs_shape], a model with batch size B (or 1, broadcast).

Gaps. NaN in obs marks what was not observed: a stream whose observation is NaN everywhere takes a predict-only
step (:meth:`Updater._predict`: transition, no conditioning, evidence increment 0); one with some NaN entries
conditions on the others (:meth:`~mpflow.operators.models.base.ModelFamily.observed_part`). A batch may mix the
two kinds; each group runs its own way and the rows are rejoined. A step's duration and inputs are in its model
(:meth:`~mpflow.operators.models.base.ModelFamily.at_step`). :meth:`Updater.forecast` gives the k-step-ahead
predictive (:mod:`mpflow.operators.updaters.predictive`) without changing the state.
Subclasses implement ``_update``; the base class restores each stream's generator, checks shapes and
finiteness, advances ``step``, accumulates ``log_evidence`` and saves the generators back, so every
method is reproducible per stream whatever the batch it ran in.
Each observed step also reports its predictive p-values and their non-saturating log tails (:meth:`predictive`,
:data:`PREDICTIVE_KEYS`); a method that declares
:attr:`Updater.shares_prediction` (``smc``, ``mpf``, the assumed-density flows) takes ``prediction`` in its
``_update``: the step's one transition draw (:meth:`Updater._prediction`), which the p-values read too, so a step
predicts once.

Cost. :meth:`Updater.step_work` and :meth:`Updater.forecast_work` estimate one update's and one forecast's
floating-point operations and peak bytes for the service's cost model (:mod:`mpflow.service.streams.costs`), which
refuses a request over its budget before any of this runs; a method whose work grows otherwise than a particle filter's
(iterations, pairs of particles, d³ algebra) overrides them.

Hand-over between methods. A step one method cannot compute (it fails numerically) may be computed by another
from the same state and the result taken back (the service's fall-back). Each method converts its own state, so
the caller never reads another method's extras:

* :meth:`Updater.to_particles` — the state in the *shared form*: particles, log-weights, step, evidence,
  generators and log-density as they are, no extras;
* :meth:`Updater.density` — what the method knows beyond its particles: the exact density of the belief, where
  it keeps one (kalman's Gaussian, a flow method's step-0 prior), else None;
* :meth:`Updater.from_particles` — a shared-form state (and, where known, that density) in this method's form;
  :meth:`Updater.resume` — the result of another method's step on this method's stream, in this method's form.

A new method overrides the three only where it keeps extras or a log-density; :attr:`Updater.weighted` methods
name in :attr:`Updater.uniform_weight_options` how they hand back uniformly weighted particles.

Capabilities. What a method can do is declared here once, on its class, and published from here — the stream
document's ``capabilities`` and ``GET /v1/models`` (docs/API.md), which the dashboard, the client and the docs
read: :attr:`Updater.weighted` (its cloud carries importance weights, so it is read by weight and its ESS
n = 1 / Σ wᵢ² is below N), :attr:`Updater.weighted_options` (the options that make an otherwise uniform cloud
weighted: mpf's ``flow_fraction: "auto"``), :attr:`Updater.exact` (the posterior is exact, not a particle
approximation), :attr:`Updater.forecasts`, :attr:`Updater.controls` (steps with inputs u), and the posterior
services :attr:`Updater.smoothing` (every built-in method) and :attr:`Updater.unknown_params`.
:meth:`Updater.capabilities_with` gives them for a stream's options; :data:`CAPABILITIES` names them.

Fixed-lag smoothing (:mod:`mpflow.operators.smoothing`). A state made with ``init(..., smoothing_lag=L)`` carries a
window of its last L steps; :meth:`Updater.update` takes it off before the method's step and puts it back moved on
by that step (:meth:`Updater.smoothed_step`), so no method's ``_update`` sees it; :meth:`Updater.smoothed` answers
p(x_s | o_1..t) for the window's steps. How a method smooths is its :attr:`Updater.smoother`: the RTS smoother over
the moments :meth:`Updater.filtered_moments` gives by default, the genealogy for ``smc``.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Sequence
from typing import Any, ClassVar, NamedTuple

import torch
from mpflow.operators import evidence, gaussian, smoothing
from mpflow.operators.kept import Kept
from mpflow.operators.models.base import ModelFamily, saturating_log_tails
from mpflow.operators.models.priors import GaussianMixture, ParticlePrior, Prior
from mpflow.operators.rng import Generators, StreamRNG, copied, generators_from_state, generators_state
from mpflow.operators.smoothing.rts import GaussianRTS
from mpflow.operators.state import ParticleState, StepInfo, ess, scatter_info
from mpflow.operators.updaters.predictive import Predictive, particle_predictive


class StepWork(NamedTuple):
    """An estimate of one update of one stream (:meth:`Updater.step_work`, read by :mod:`mpflow.service.streams.costs`):
    floating-point operations, and the peak bytes of the tensors it holds at once."""

    flops: float
    bytes: float


class Prediction(NamedTuple):
    """A step's transition draw (:meth:`Updater._prediction`): the moved particles x' [B, N, d] and the predictive's
    moments, mean [B, d] and covariance [B, d, d] (float64; :meth:`ModelFamily.propagate`). A method whose predict
    also resamples (``smc`` with sequential quasi-Monte Carlo, :mod:`mpflow.operators.sqmc`) gives the moved
    particles' ``log_weights`` [B, N] (uniform) and their ``ancestors`` [B, N]; None: the weights are the state's."""

    particles: torch.Tensor
    mean: torch.Tensor
    cov: torch.Tensor
    log_weights: torch.Tensor | None = None
    ancestors: torch.Tensor | None = None


#: the cost of one normal draw from a stream's generator in floating-point operations (measured: torch's
#: per-stream ``randn`` of n × d costs about as much as 30 n d multiply-adds)
RANDN_FLOPS = 30.0
#: the ``info.extras`` keys of a step's predictive tails (:meth:`Updater.predictive`), each [B, k] float64: the
#: p-values and the natural-log lower and upper tails, NaN where an entry was not observed
PREDICTIVE_KEYS = ("pit", "log_tail_lower", "log_tail_upper")
#: The constants below are measured, not counted: the work they price is memory-bound, so it is priced at the time
#: it takes in an ``smc`` step's operations (the reference step of ``benchmarks/smoothing_price.py``: ``lds``
#: d = 64, N = 16384). ``benchmarks/price_audit.py`` fits each from one row — the CPU time of the work at the
#: largest N the default limits accept — at 25 Gflop/s (CPU), the loaded side of the 16 to 83 Gflop/s the
#: reference step ran at on 2026-11-28 as the other jobs of the shared cores came and went (the memory-bound rows'
#: times moved a few percent; a fit against the step's rate of the moment moves with that rate). Each is set from
#: the runs' fits at that rate, rounded up; docs/benchmarks.md "What each method costs against its price".
#:
#: one particle's share of a particle step beyond its counted arithmetic — the cloud's float64 copies, the weights'
#: log-sum-exp and ESS, resampling's gathers: fitted from ``smc`` on ``lds`` d = 1, N = 65536 (``qmc: false``;
#: about 400 flops a particle counted), 1200 to 5500 in five runs (a step of 0.02 s: the fit is noisy). Without it
#: ``smc``'s step at d = 1 was priced at a twentieth of its time, ``smc2``'s at a thirtieth
PARTICLE_STEP_FLOPS = 6000.0
#: one number of a weighted quantile's pass (:func:`batch_weighted_quantiles` of the service's summaries and
#: forecasts: the sort along the particles — a strided dimension — the cumulative weights, the search and the
#: gathers) per log₂ N: fitted from a one-step forecast of ``enkf`` on ``lorenz96`` d = 40, N = 65536 (the
#: quantiles of 80 columns, 0.8 to 1.1 s CPU), 225 to 311 in five runs: kept at 250, at which a stream of
#: N = 65536, d = 64 is still accepted (every row of the audit at 0.53 or more of its price's time). It was 20: a
#: summary of d = 64, N = 16384 took 2.7 times its step's time, and forecasts 5 to 15 times what their price bought
QUANTILE_FLOPS = 250.0
#: one entry of a predictive p-value per particle, beyond the likelihood's counted work (the family's conditional
#: CDF — an erf of a standardised residual — and the weighted sum over the cloud): fitted from ``enkf``'s p-values on
#: ``lds`` d = 64 at the largest N the defaults accept (a second predict of the cloud and 64 CDFs a particle),
#: 491 to 934 in four runs; they were priced at a likelihood's 2 d + 10 an entry, the CDFs alone take 30 ns an
#: entry here (``lorenz96``: 20)
CDF_FLOPS = 1000.0
#: one horizon of a forecast besides its particles' work — the transition's and the draws' calls, the moments' and
#: the quantiles' calls (:func:`particle_predictive` and the answer): fitted from 1000 horizons of ``nvgd`` on
#: ``lds`` d = 8 at N = 376 (0.5 to 0.8 s CPU), −1.0e6 to 7.6e6 in five runs (3.2e6 in the last, where that row's
#: forecast took 1.2 times what its price bought)
HORIZON_FLOPS = 2e6


#: the capabilities a method publishes (:meth:`Updater.capabilities_with`), each with what it means (the API schema
#: and docs/API.md read these), in the order the documents list them
CAPABILITIES: dict[str, str] = {
    "weighted": "the particles carry importance weights: read the cloud by weight; its ESS is below N",
    "exact": "the posterior is exact for the families the method runs, not a particle approximation",
    "forecasts": "k-step-ahead predictives (GET .../forecast)",
    "controls": "steps with control inputs u",
    "smoothing": "smoothed posteriors of past steps",
    "unknown_params": "unknown static model parameters estimated with the state",
}


class NonFiniteError(FloatingPointError):
    """An update produced NaN or infinite particles; the caller keeps the old state."""


class Updater:
    name: ClassVar[str]
    #: particles carry importance weights (SMC); others keep them uniform
    weighted: ClassVar[bool] = False
    #: options under which a method whose particles are otherwise uniform carries weights (empty: none do)
    weighted_options: ClassVar[dict[str, Any]] = {}
    #: the posterior is exact for the families the method runs (Kalman), not a particle approximation
    exact: ClassVar[bool] = False
    #: the posterior is a Gaussian N(m, P) the method keeps in float64 (extras ``mean``, ``cov``: ``kalman``, ``ukf``),
    #: not a particle cloud: its particles are N fresh draws from it, so it has no effective sample size (the answers'
    #: ``ess`` is null), and it reads its model and observations in float64 (:attr:`model_dtype`), so its moments
    #: carry no float32 rounding (0.3 is not 0.30000001)
    gaussian_state: ClassVar[bool] = False
    #: the dtype the method's models are built in and its observations read in: float64 for a :attr:`gaussian_state`
    #: method, float32 (the particles') for the others
    model_dtype: ClassVar[torch.dtype] = torch.float32
    #: k-step-ahead predictives (:meth:`forecast`)
    forecasts: ClassVar[bool] = True
    #: steps with control inputs u (they enter through the family's transition, :meth:`ModelFamily.at_step`)
    controls: ClassVar[bool] = True
    #: smoothed posteriors p(x_m | o_≤n) of past steps: streams of this method may keep a smoothing window
    #: (``smoothing_lag`` ≥ 1, :attr:`smoother`)
    smoothing: ClassVar[bool] = True
    #: why a method without a smoother has none, and what to do instead (the refusal of ``smoothing_lag`` says it)
    no_smoother_reason: ClassVar[str] = ""
    #: only for linear-Gaussian families (Kalman)
    needs_linear_gaussian: ClassVar[bool] = False
    #: only for families with an explicit observation function and additive Gaussian noise (``enkf``, ``ukf``:
    #: ``ModelFamily.gaussian_observation``)
    needs_gaussian_observation: ClassVar[bool] = False
    #: runs dynamic families whose transition is not affine (``ModelFamily.affine_transition`` False): the method
    #: moves its particles only through ``ModelFamily.transition`` / ``transition_mean`` (``smc``, ``enkf``, ``ukf``)
    nonlinear_transition: ClassVar[bool] = False
    #: learns the unknown model parameters (those given as priors: ``ModelFamily.unknown``) with the state — the only
    #: methods that run such a model (``smc2``), and the only ones that need one
    unknown_params: ClassVar[bool] = False
    #: the method's ``_update`` takes the step's predicted cloud (a :class:`Prediction`) from the caller, so the
    #: predictive p-values (:meth:`pit`) and the update share one predict — one transition draw per step
    shares_prediction: ClassVar[bool] = False
    #: default options; ``__init__`` accepts only these keys
    defaults: ClassVar[dict[str, Any]] = {}
    #: the options a client may set for its own stream (``method_options`` of the REST API): cheap to honour and
    #: bounded in cost; the others are the server's (``MPFLOW_METHOD_OPTIONS``)
    stream_options: ClassVar[frozenset[str]] = frozenset()
    #: the options whose value is the registered name of a trained network the method runs (``ienkf``'s
    #: ``correction`` and ``relock``): the stream's ``operator_domain`` reads that network's domain
    learned_options: ClassVar[tuple[str, ...]] = ()
    #: options under which a weighted method returns uniformly weighted particles, so that a method that reads
    #: its particles unweighted can take its result back (empty: the method's particles are always uniform)
    uniform_weight_options: ClassVar[dict[str, Any]] = {}
    #: the method's fixed-lag smoother (module docstring): by default the (ensemble) RTS smoother over
    #: :meth:`filtered_moments`
    smoother: ClassVar[smoothing.FixedLagSmoother] = GaussianRTS()
    #: the particle count of a smoothing stream (``smoothing_lag`` ≥ 1) whose request names none, where the method's
    #: smoothed means are Monte Carlo: the N at which every single run was within 0.1 sd of the exact smoother
    #: (``benchmarks/smoothing.py``); None: the method's usual default
    smoothing_particles: ClassVar[int | None] = None

    def __init__(self, **options: Any):
        unknown = sorted(set(options) - set(self.defaults))
        if unknown:
            raise ValueError(f"options: unknown option(s) {unknown} for {self.name}; allowed: {sorted(self.defaults)}")
        self.options = {**self.defaults, **options}
        self.weighted = self.weighted_with(self.options)

    def own_model(self, model: ModelFamily) -> ModelFamily:
        """``model`` in :attr:`model_dtype` (itself when it is already): a fall-back step runs the stream's model
        in its own dtype."""
        dtypes = {t.dtype for t in model.params.values() if isinstance(t, torch.Tensor) and t.is_floating_point()}
        return model if dtypes <= {self.model_dtype} else model.to(self.model_dtype)

    # ------------------------------------------------------------------ capabilities
    @classmethod
    def weighted_with(cls, options: dict[str, Any]) -> bool:
        """Whether the method's particles carry weights under ``options`` (:attr:`weighted`, or every one of
        :attr:`weighted_options` set)."""
        return cls.weighted or (
            bool(cls.weighted_options) and all(options.get(k) == v for k, v in cls.weighted_options.items())
        )

    @classmethod
    def capabilities_with(cls, options: dict[str, Any] | None = None) -> dict[str, bool]:
        """What the method does under ``options`` (module docstring, "Capabilities"), as the documents publish it:
        ``{name: bool}`` over :data:`CAPABILITIES`."""
        return {name: getattr(cls, name) for name in CAPABILITIES} | {"weighted": cls.weighted_with(options or {})}

    @classmethod
    def catalogue_entry(cls) -> dict[str, Any]:
        """The method in ``GET /v1/models``: its capabilities with its default options, and ``weighted_with``,
        the options that make its cloud weighted (``{}``: none do, or it always is)."""
        return {**cls.capabilities_with(cls.defaults), "weighted_with": dict(cls.weighted_options)}

    # ------------------------------------------------------------------ compatibility
    @classmethod
    def refusal(cls, family: type[ModelFamily]) -> str | None:
        """Why this method cannot run the family (a message starting with "method:"), or None when it can; the
        catalogue's methods of a family (``GET /v1/models``) and the fall-backs read it too."""
        if cls.needs_linear_gaussian and not family.linear_gaussian:
            return (
                f"method: {cls.name} is exact only for linear-Gaussian families "
                f"(linear_gaussian, lds), not {family.name}; use smc, gpf or svgd"
            )
        if cls.needs_gaussian_observation and not family.gaussian_observation:
            return (
                f"method: {cls.name} needs an observation o = h(x) + N(0, R) with an explicit h, which the "
                f"{family.name} family does not have; use smc, gpf or mpf"
            )
        if family.dynamic and not family.affine_transition and not cls.nonlinear_transition:
            return (
                f"method: {cls.name} pushes Gaussian moments through an affine transition x' = F x + c + N(0, Q), and "
                f"the {family.name} family's transition is nonlinear; use smc, enkf, ienkf, ukf or mpf"
            )
        return None

    def check_compatible(self, model: ModelFamily, prior: Prior | None = None) -> None:
        """Raise ValueError (→ 422) if this method cannot run this model/prior."""
        reason = self.refusal(type(model))
        if reason is not None:
            raise ValueError(reason)
        if model.unknown and not self.unknown_params:
            name = sorted(model.unknown)[0]
            raise ValueError(
                f"method: {self.name} needs every model parameter as a value, and model.params.{name} is a prior; "
                "use smc2 (or omit method), which learns it"
            )

    # ------------------------------------------------------------------ init
    def init(
        self,
        prior: Prior,
        model: ModelFamily,
        num_particles: int,
        seed: int | Sequence[int] = 0,
        smoothing_lag: int = 0,
    ) -> ParticleState:
        """Step-0 state: N particles from the prior (or the given particles), uniform weights; with
        ``smoothing_lag`` L ≥ 1, an empty window for the last L steps (module docstring)."""
        smoothing.check_lag(smoothing_lag)
        if smoothing_lag and not self.smoothing:
            raise ValueError(self.smoothing_refusal())
        state = self._initial(prior, model, num_particles, seed)
        if smoothing_lag:
            state = smoothing.attach(state, self.smoother.empty(state, smoothing_lag))
        return state

    def _initial(
        self, prior: Prior, model: ModelFamily, num_particles: int, seed: int | Sequence[int]
    ) -> ParticleState:
        self.check_compatible(model, prior)
        B = prior.batch_size
        seeds = [seed] * B if isinstance(seed, int) else list(seed)
        if len(seeds) != B:
            raise ValueError(f"seed: expected {B} seeds, got {len(seeds)}")
        gens = StreamRNG.from_seeds(seeds)
        if prior.dim != model.state_dim:
            raise ValueError(
                f"prior: dimension {prior.dim} does not match the model's state dimension {model.state_dim}"
            )
        if isinstance(prior, ParticlePrior):
            if prior.particles.shape[1] != num_particles:
                raise ValueError(
                    f"num_particles: the particles prior has {prior.particles.shape[1]} particles but "
                    f"num_particles is {num_particles}; omit num_particles or make them agree"
                )
            particles = prior.particles.to(torch.float32)
        else:
            particles = prior.sample(num_particles, gens).to(torch.float32)
        state = ParticleState(
            particles=particles,
            log_weights=torch.full((B, num_particles), -math.log(num_particles)),
            step=torch.zeros(B, dtype=torch.int64),
            log_evidence=torch.zeros(B, dtype=torch.float64),
            rng=generators_state(gens),
        )
        return self._init(state, prior, model, gens)

    def _init(self, state: ParticleState, prior: Prior, model: ModelFamily, gens: Generators) -> ParticleState:
        """Method-specific initialisation (extras); the default keeps the sampled cloud."""
        return state

    # ------------------------------------------------------------------ update
    def autograd_free(self) -> bool:
        """True when this method's step records no gradient (the default: False). Its :meth:`update` then runs
        under ``torch.inference_mode`` — no autograd bookkeeping on any op, ~15 % of a small MPF step — and
        returns inference tensors: use them as values (functional ops, serialisation), not in autograd."""
        return False

    def update(self, state: ParticleState, obs: torch.Tensor, model: ModelFamily) -> tuple[ParticleState, StepInfo]:
        window, inner = smoothing.split(state)
        with torch.inference_mode(self.autograd_free()):
            new, info = self._checked_update(inner, obs, model)
            return self.smoothed_step(window, inner, new, info, model), info

    # ------------------------------------------------------------------ fixed-lag smoothing
    def smoothing_refusal(self) -> str:
        """The message refusing ``smoothing_lag`` ≥ 1 for a method without a smoother."""
        reason = f" ({self.no_smoother_reason})" if self.no_smoother_reason else ""
        return f"smoothing_lag: {self.name} has no smoother{reason}; use 0, or another method"

    def smoothed_step(
        self,
        window: dict[str, torch.Tensor],
        before: ParticleState,
        after: ParticleState,
        info: StepInfo | None,
        model: ModelFamily,
    ) -> ParticleState:
        """``after`` (a step's result, without a window) carrying ``window`` moved on by the step from ``before``
        (``info``: the step's; None when another method computed it, a fall-back); ``after`` itself without a
        window."""
        if not window:
            return after
        with torch.no_grad():
            entry = self.smoother.entry(self, before, after, info, model)
        return smoothing.attach(after, smoothing.pushed(window, entry))

    def filtered_moments(self, state: ParticleState) -> tuple[torch.Tensor, torch.Tensor]:
        """The filtering mean [B, d] and covariance [B, d, d] (float64) the RTS smoother reads: the cloud's weighted
        moments (``kalman`` and ``ukf``: their exact Gaussian)."""
        shared = self.to_particles(state)
        return gaussian.moments(shared.particles.to(torch.float64), shared.log_weights)

    def kept(self, state: ParticleState, model: ModelFamily) -> Kept:
        """What the method's own tensors of ``state`` (without its smoothing window: ``smoother.kept`` says what
        that holds) hold under ``model``, for the checks of a state read from outside — a snapshot's
        (:mod:`mpflow.operators.kept`; the core tensors are the service's). Here: an exact Gaussian's covariance
        (``cov``, as ``kalman`` and ``ukf`` keep it) and the step-0 prior's (:func:`prior_extras`); a method that
        keeps more says so."""
        covariances = {f"extras.{k}": state.extras[k] for k in ("cov", "prior_covs") if k in state.extras}
        return Kept(covariances=covariances)

    def smoothed(self, state: ParticleState) -> smoothing.Smoothed:
        """p(x_s | o_1..t) for the last min(L, t) steps of one stream (B = 1) that keeps a window; ValueError naming
        ``smoothing_lag`` for one that does not."""
        window, inner = smoothing.split(state)
        if not window:
            raise ValueError("smoothing_lag: this stream keeps no smoothing window")
        if int(inner.step[0]) == 0:  # no step taken yet: nothing to smooth
            d = inner.dim
            empty = torch.zeros(0, d, dtype=torch.float64)
            return smoothing.Smoothed(torch.zeros(0, dtype=torch.int64), empty, empty.reshape(0, d, d))
        return self.smoother.smooth(self, window, inner)

    def _checked_update(
        self, state: ParticleState, obs: torch.Tensor, model: ModelFamily
    ) -> tuple[ParticleState, StepInfo]:
        B = state.batch_size
        if obs.shape[0] != B:
            raise ValueError(f"observations: expected a batch of {B}, got {obs.shape[0]}")
        if model.batch_size not in (1, B):
            raise ValueError(f"model: batch of {model.batch_size} does not match {B} streams")
        if bool(torch.isinf(obs).any()):
            raise ValueError("observations: contain infinite values")
        gens = generators_from_state(state.rng)
        obs = obs.to(self.model_dtype)
        absent = torch.isnan(obs).flatten(1).all(1)  # [B]: no measurement at this step
        tails = None if bool(absent.all()) or self.predicts_once() else self.predictive(state, obs, model)
        if not bool(absent.any()):
            new, info = self._observed_step(state, obs, model, gens)
        elif bool(absent.all()):
            new, info = self._unobserved(state, obs, model, gens)
        else:  # a batch mixing steps with and without a measurement: each group its own way, then rejoined
            seen, unseen = (~absent).nonzero().flatten(), absent.nonzero().flatten()
            parts = []
            for rows, observed in ((seen, True), (unseen, False)):
                sub_state, sub_model = state.select(rows), model.select(rows)
                sub_gens = [gens[b] for b in rows.tolist()]
                if observed:
                    part = self._observed_step(sub_state, obs[rows], sub_model, sub_gens)
                else:
                    part = self._unobserved(sub_state, obs[rows], sub_model, sub_gens)
                parts.append((rows, part))
            new = ParticleState.scatter([(rows, s) for rows, (s, _) in parts], B)
            info = scatter_info([(rows, i) for rows, (_, i) in parts], B)
        finite = (
            torch.isfinite(new.particles).all()
            & torch.isfinite(info.log_evidence_increment).all()
            & ~torch.isnan(new.log_weights).any()  # −inf is a legitimate zero weight; NaN never is
            & (torch.logsumexp(new.log_weights, -1) > -torch.inf).all()
            & ~torch.isnan(info.ess).any()  # a degenerate cloud's health
        )
        if not bool(finite):
            raise NonFiniteError(f"{self.name} produced non-finite particles, weights or evidence")
        if tails is not None:
            info.extras.update(tails)
        else:  # from the observed rows' shared predict: none on a row without a measurement
            for key in PREDICTIVE_KEYS:
                if key in info.extras:
                    info.extras[key] = info.extras[key].masked_fill(absent[:, None], math.nan)
        new = new.replace(
            step=state.step + 1,
            log_evidence=state.log_evidence + info.log_evidence_increment.to(torch.float64),
            rng=generators_state(gens),
        )
        return new, info

    def pit(self, state: ParticleState, obs: torch.Tensor, model: ModelFamily) -> torch.Tensor | None:
        """The ``"pit"`` of :meth:`predictive`: the step's predictive p-values [B, k]; None for a family without an
        observation CDF."""
        tails = self.predictive(state, obs, model)
        return None if tails is None else tails["pit"]

    def predictive(self, state: ParticleState, obs: torch.Tensor, model: ModelFamily) -> dict[str, torch.Tensor] | None:
        """The step's predictive tails, each [B, k] float64 (:data:`PREDICTIVE_KEYS`, :meth:`_predictive_of`):
        ``pit``, its predictive p-values (:mod:`mpflow.operators.evidence`): for each entry j of the
        observation, P(O_j ≤ o_j | o_<m) under this method's own predictive — the predicted cloud of
        :meth:`_predict` drawn with a copy of each stream's generator, so the very draws the update itself makes
        (for ``smc`` and ``mpf`` the cloud its evidence averages over) and the stream's generator is not advanced
        (a method that :meth:`predicts_once` takes them from its one predict, :meth:`_observed_step`):
        Σ_i w_i F_j(o_j | x_i) with the family's conditional CDF F_j
        (:meth:`~mpflow.operators.models.base.ModelFamily.observation_cdf`); for an exact Gaussian belief of a
        linear-Gaussian family (``kalman``), Φ((o_j − (H m)_j) / √(H P Hᵀ + R)_jj); ``log_tail_lower`` and
        ``log_tail_upper``, log P(O_j ≤ o_j | o_<m) and log P(O_j ≥ o_j | o_<m) from the same cloud without
        saturation. NaN where o_j was not observed; None for a family without an observation CDF."""
        gens = generators_from_state(state.rng)
        if _takes_prediction(type(self)._predict):  # the step's own predict (smc's quasi-random one, where it runs)
            predicted, _ = self._predict(state, model, gens, self._prediction(state, model, gens))
        else:
            predicted, _ = self._predict(state, model, gens)
        return self._predictive_of(predicted, obs, model, gens)

    def _predictive_of(
        self, predicted: ParticleState, obs: torch.Tensor, model: ModelFamily, gens: Generators
    ) -> dict[str, torch.Tensor] | None:
        """:meth:`predictive` from the predicted state (``gens``: for a discrete family's randomisation, a copy):
        the p-values and the log tails read the same predictive — for a particle cloud the family's CDF once
        (:meth:`~mpflow.operators.models.base.ModelFamily.observation_cdf`, the only call that may draw from
        ``gens``, as before the log tails) and its log tails
        (:meth:`~mpflow.operators.models.base.ModelFamily.observation_log_tails`, handed that CDF), log-sum-exped
        over the weighted particles (:func:`~mpflow.operators.evidence.particle_log_tails`)."""
        missing = torch.isnan(obs).flatten(1)
        filled_obs = obs.nan_to_num(0.0)
        if model.linear_gaussian and "mean" in predicted.extras and "cov" in predicted.extras:
            H, R = (t.to(torch.float64) for t in model.observation_affine())
            m, P = predicted.extras["mean"].to(torch.float64), predicted.extras["cov"].to(torch.float64)
            S = H @ P @ H.transpose(-1, -2) + R
            y = torch.einsum("bkd,bd->bk", H, m)
            pit = evidence.gaussian_pit(filled_obs, y, S)
            lower, upper = evidence.gaussian_log_tails(filled_obs, y, S)
        else:
            cdf = model.observation_cdf(filled_obs, predicted.particles, gens)
            if cdf is None:
                return None
            pit = evidence.particle_pit(cdf, predicted.log_weights)
            per_particle = model.observation_log_tails(filled_obs, predicted.particles, gens, cdf=cdf)
            if per_particle is None:  # a family whose log tails answer nothing: those of its p-value (saturating)
                lower, upper = saturating_log_tails(pit)
            else:
                lower, upper = evidence.particle_log_tails(*per_particle, predicted.log_weights)
        # an entry not observed has no p-value (a family whose entries are not its observation's, as logistic's
        # labels, only knows whether the whole step was observed)
        unseen = missing if missing.shape == pit.shape else missing.all(1, keepdim=True).expand_as(pit)
        return {k: t.masked_fill(unseen, math.nan) for k, t in zip(PREDICTIVE_KEYS, (pit, lower, upper), strict=True)}

    def _observed_step(
        self, state: ParticleState, obs: torch.Tensor, model: ModelFamily, gens: Generators
    ) -> tuple[ParticleState, StepInfo]:
        """:meth:`_observed_update`; for a method that :attr:`shares_prediction`, the step's one predict
        (:meth:`_prediction`, with the streams' own generators) feeds both the p-values and log tails
        (:data:`PREDICTIVE_KEYS` in ``info.extras``, their randomisation drawn from a copy of the generators, so the
        update's draws are the same as without them) and the update."""
        if not self.predicts_once():
            return self._observed_update(state, obs, model, gens)
        prediction = self._prediction(state, model, gens)
        predicted, _ = self._predict(state, model, gens, prediction)
        tails = self._predictive_of(predicted, obs, model, copied(gens))
        new, info = self._observed_update(state, obs, model, gens, prediction=prediction)
        if tails is not None:
            info.extras.update(tails)
        return new, info

    @classmethod
    def predicts_once(cls) -> bool:
        """Whether a step shares its one predict between the p-values and the update: the class declares
        :attr:`shares_prediction` and its ``_update`` and ``_observed_update`` take the ``prediction`` (a subclass
        that overrides them with the four-argument signature — a wrapper, a test's faulty method — predicts for
        its p-values apart, as before)."""
        return cls.shares_prediction and _takes_prediction(cls._update) and _takes_prediction(cls._observed_update)

    def _observed_update(
        self,
        state: ParticleState,
        obs: torch.Tensor,
        model: ModelFamily,
        gens: Generators,
        prediction: Prediction | None = None,
    ) -> tuple[ParticleState, StepInfo]:
        """The Bayes step of streams that each observed something; a stream with missing entries (NaN) conditions
        on the entries it observed, through the family's :meth:`~ModelFamily.observed_part`. ``prediction``: the
        step's predict, already drawn (:attr:`shares_prediction`)."""
        if bool(torch.isnan(obs).any()):
            model, obs = model.observed_part(obs)
        if prediction is None:
            return self._update(state, obs, model, gens)
        return self._update(state, obs, model, gens, prediction=prediction)

    def _prediction(self, state: ParticleState, model: ModelFamily, gens: Generators) -> Prediction | None:
        """The step's transition draw x_i' ~ p(x' | x_i) of every particle with the predictive's moments
        (:meth:`ModelFamily.propagate`, weighted by the cloud's weights); None for a static family (nothing is
        drawn). What :meth:`_predict` and a :attr:`shares_prediction` method's ``_update`` start from."""
        if not model.dynamic:
            return None
        return Prediction(*model.propagate(state.particles, gens, state.log_weights))

    def _unobserved(
        self, state: ParticleState, obs: torch.Tensor, model: ModelFamily, gens: Generators
    ) -> tuple[ParticleState, StepInfo]:
        """The step of streams without a measurement (``obs`` all NaN): :meth:`_predict`; a method that keeps the
        observations themselves (``mpf``'s posterior moves) records the gap."""
        return self._predict(state, model, gens)

    def _predict(
        self, state: ParticleState, model: ModelFamily, gens: Generators, prediction: Prediction | None = None
    ) -> tuple[ParticleState, StepInfo]:
        """A step without a measurement: p(x_m | o_<m) = ∫ p(x_m | x_{m−1}) p(x_{m−1} | o_<m) dx_{m−1}, so a dynamic
        family moves the particles through the transition x' = F x + c + N(0, Q) and a static one keeps them;
        weights stay; the evidence increment is log 1 = 0. An unweighted cloud (N > d) is then mapped affinely onto
        the pushed moments F m + c, F C Fᵀ + Q of the cloud it came from (as ``mpf``'s predict does), so the
        moments carry no Monte Carlo noise; a tracked log-density becomes that Gaussian's. A nonlinear transition
        (``ModelFamily.affine_transition`` False) has no moments to push: its particles are moved and nothing else.
        ``prediction``: the transition draw, already made (:meth:`_prediction`)."""
        x, log_q = state.particles, state.log_density
        if model.dynamic and not model.affine_transition:  # no moments to push: the particles are the predictive
            x = model.transition(x, gens) if prediction is None else prediction.particles
            log_q = None
        elif model.dynamic:
            x, mean, cov = prediction[:3] if prediction is not None else model.propagate(x, gens, state.log_weights)
            if not self.weighted:
                x = gaussian.moment_matched(x, mean, cov)
            if log_q is not None:
                log_q = gaussian.log_prob(x.double(), mean, gaussian.cholesky(cov)).to(log_q.dtype)
        lw = state.log_weights if prediction is None or prediction.log_weights is None else prediction.log_weights
        info = StepInfo(torch.zeros(state.batch_size, dtype=torch.float64), ess(lw).to(torch.float64))
        return state.replace(particles=x, log_weights=lw, log_density=log_q), info

    def _update(
        self, state: ParticleState, obs: torch.Tensor, model: ModelFamily, gens: Generators
    ) -> tuple[ParticleState, StepInfo]:
        raise NotImplementedError

    # ------------------------------------------------------------------ cost (the service's cost model)
    def step_work(self, model: ModelFamily, n: int, dt: float = 1.0, k: int | None = None) -> StepWork:
        """One update of ``n`` particles of one stream under ``model``, a step of duration ``dt`` observing ``k``
        entries (None: the family's observation size). The default is a particle method's (``smc``): every
        particle's transition and likelihood (:meth:`ModelFamily.particle_flops`), the cloud's moments and a
        Liu–West move (a few n d², a d³ factorisation), n d normal draws (:data:`RANDN_FLOPS` each), the step's
        model (:meth:`ModelFamily.step_model_flops`) and each particle's memory-bound share
        (:data:`PARTICLE_STEP_FLOPS`); about eight float64 copies of the cloud and two of its predicted
        observations. Methods whose work grows otherwise (iterations, pairs of particles, d³ algebra) override it."""
        d = model.state_dim
        k = model.observation_size() if k is None else k
        per = model.particle_flops(dt, k) + 6.0 * d * d + RANDN_FLOPS * d + PARTICLE_STEP_FLOPS
        flops = n * per + 10.0 * d**3
        return StepWork(flops + model.step_fixed_flops(dt), 8.0 * n * (8 * d + 2 * k) + 80.0 * d * d)

    def pit_work(self, model: ModelFamily, n: int, dt: float = 1.0, k: int | None = None) -> StepWork:
        """:meth:`pit` of one observed step: the family's conditional CDF of each of the ``k`` entries per particle
        (about a likelihood's work, :meth:`ModelFamily.likelihood_flops`, and :data:`CDF_FLOPS` an entry) and its
        [n, k] values in float64; a method that does not predict once (:meth:`predicts_once`) also predicts the
        ``n`` particles a second time (every particle's transition, all its sub-steps, its n d draws and its
        memory-bound share, :data:`PARTICLE_STEP_FLOPS`) and holds that cloud."""
        d = model.state_dim
        k = model.observation_size() if k is None else k
        cdf = model.likelihood_flops(k) + CDF_FLOPS * k
        if self.predicts_once():
            return StepWork(n * cdf, 8.0 * n * k)
        per = model.transition_flops() * model.integration_substeps(dt) + cdf + RANDN_FLOPS * d + PARTICLE_STEP_FLOPS
        flops = n * per + model.step_fixed_flops(dt)
        return StepWork(flops, 8.0 * n * (2 * d + k))

    def forecast_work(self, model: ModelFamily, n: int, steps: int, dt: float = 1.0) -> StepWork:
        """:meth:`forecast` by propagation: per horizon every particle's transition (all its sub-steps) and one
        draw of its observation (2 d k + 2 k²), the weighted moments (2 (d² + k²)) and quantiles (a sort,
        :data:`QUANTILE_FLOPS` a number per log₂ n) and each horizon's calls (:data:`HORIZON_FLOPS`); every
        horizon's cloud is kept in float64 — k × n × (d + o) — and the quantiles' sort copies it about five times
        more."""
        d, k = model.state_dim, model.observation_size()
        sort = QUANTILE_FLOPS * (d + k) * math.log2(max(n, 2))
        per = model.transition_flops() * model.integration_substeps(dt) + 2.0 * d * k + 2.0 * k * k
        per += 2.0 * (d * d + k * k) + sort
        fixed = model.step_model_flops() + steps * (
            model.step_fixed_flops(dt) - model.step_model_flops() + HORIZON_FLOPS
        )
        return StepWork(steps * n * per + fixed, 8.0 * 6 * steps * n * (d + k))

    # ------------------------------------------------------------------ forecasts
    def forecast(self, state: ParticleState, model: ModelFamily, steps: int, gen: torch.Generator) -> Predictive:
        """The 1..``steps``-step-ahead predictive of one stream (B = 1; ``model``: the model of each step) by
        propagating its particles with draws from ``gen`` (:mod:`mpflow.operators.updaters.predictive`); the state
        is not changed. Methods that keep an exact density override it."""
        shared = self.to_particles(state)
        return particle_predictive(shared.particles, shared.log_weights, model, steps, gen)

    # ------------------------------------------------------------------ hand-over between methods
    def to_particles(self, state: ParticleState) -> ParticleState:
        """``state`` in the shared form every method reads (module docstring): without this method's extras —
        what they say about the belief is :meth:`density`'s."""
        return state.replace(extras={})

    def density(self, state: ParticleState) -> GaussianMixture | None:
        """The exact density of the belief ``state`` represents, where this method keeps one; None (the
        default) where the particles are all there is."""
        return None

    def from_particles(self, state: ParticleState, density: GaussianMixture | None = None) -> ParticleState:
        """A shared-form ``state`` (another method's, or the result of its step) in this method's form;
        ``density``: the belief's exact density where the other method knows it (:meth:`density`). The default
        is the state as it is, for a method that keeps nothing besides its particles and weights."""
        return state

    def resume(self, new: ParticleState, before: ParticleState, obs: torch.Tensor, model: ModelFamily) -> ParticleState:
        """The shared-form result ``new`` of another method's step on this method's stream (a fall-back), in this
        method's form, for the stream whose state was ``before`` and whose observation was ``obs``: by default
        :meth:`from_particles` (``mpf`` also carries its record of past observations over)."""
        return self.from_particles(new)


@functools.cache
def _takes_prediction(method) -> bool:
    """Whether the method accepts a ``prediction`` keyword (:meth:`Updater.predicts_once`)."""
    return "prediction" in inspect.signature(method).parameters


def prior_extras(prior: Prior) -> dict[str, torch.Tensor]:
    """The step-0 prior density as state extras (a Gaussian mixture), so flow methods use the exact
    prior at step 0; empty for a particles prior."""
    if isinstance(prior, GaussianMixture):
        return {"prior_weights": prior.weights, "prior_means": prior.means, "prior_covs": prior.covs}
    return {}


def prior_from_extras(extras: dict[str, torch.Tensor]) -> GaussianMixture | None:
    if "prior_weights" not in extras:
        return None
    return GaussianMixture(extras["prior_weights"], extras["prior_means"], extras["prior_covs"])


def without_prior(extras: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in extras.items() if not k.startswith("prior_")}

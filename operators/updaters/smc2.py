"""``smc2``: the state and the unknown static parameters θ together, online — SMC² (Chopin, Jacob & Papaspiliopoulos
2013) with the bounded rejuvenation of nested particle filters (Crisan & Míguez 2018).

The posterior p(θ, x_m | o_≤m) is held as M θ-particles θ_j with weights ω_j, each carrying a filter of x given θ_j
(docs/methods.md "Unknown parameters", eq. P1–P6):

* linear-Gaussian families with a Gaussian prior: an exact Kalman filter per θ_j (mean m_j, covariance P_j), whose
  predictive density is the exact marginal likelihood increment p(o_m | o_<m, θ_j) = N(o_m; H m_j⁻, H P_j⁻ Hᵀ + R)
  (eq. P2); SMC²'s θ-weights are then those of IBIS (Chopin 2002);
* every other family: a bootstrap particle filter of N_x particles per θ_j, whose likelihood estimate
  p̂(o_m | o_<m, θ_j) = Σ_i w_{j,i} p(o_m | x_{j,i}) is unbiased (eq. P3, SMC²'s "exact approximation").

Per observed step: ω_j ← ω_j p̂(o_m | o_<m, θ_j) (eq. P4); the evidence increment is Σ_j ω̄_j p̂_j (ω̄ normalised
before the step). When the θ-ESS falls under ``ess_threshold``·M, the θ-particles are resampled (systematic), each
copy with its filter, and moved by the jittering kernel of nested particle filters (eq. P5)

    u' = u + h M^{−1/2} s_u ξ,   ξ ~ N(0, 1),

in the unconstrained coordinate u of θ's support (:mod:`mpflow.operators.models.param_priors`), s_u the cloud's sd
of u and h the ``jitter`` option (0.5: the best of h ∈ {0.5, 1, 2} and Liu–West's kernel measured by
``benchmarks/params.py``); the filter of θ stays as it was (the approximation of Crisan & Míguez, whose error
vanishes as the kernel's scale ∝ M^{−1/2}). A move costs O(M) whatever the step: rejuvenation does not
re-run any filter from the first observation (which SMC²'s PMMH kernel does:
:mod:`mpflow.operators.references.smc2_pmmh` is that unbounded reference, measured against this one in
``benchmarks/params.py``).

``kernel: "mh"`` (a Gaussian prior): SMC²'s own resample-move instead, with Metropolis–Hastings moves accepted by the
block's prior × the likelihood of the block of at most ``history`` observations the state keeps — exact Kalman
likelihoods, or a particle filter's estimate per θ-particle (:mod:`~mpflow.operators.updaters.smc2_particle_replay`)
for the other families — exact while the stream is at most ``history`` steps old, under a Gaussian checkpoint of the
older blocks after (:mod:`mpflow.operators.updaters.smc2_mh`); random walks, independence moves from a learned
parameter observer when the stream names one (:mod:`~mpflow.operators.updaters.smc2_proposal`), and defensive draws
from the prior weighted by importance; the move's cost is bounded by ``history`` and priced on every step
(:meth:`SMC2Updater.step_work`).

The filtered state integrates over θ: its particles are the N = M·N_x pairs (θ_j, x_{j,i}) with weights ω_j w_{j,i}
(Kalman: N_x draws of N(m_j, P_j) per θ_j, weight ω_j / N_x), so every summary is of p(x_m | o_≤m) (eq. P6).
A step's predictive p-values mix every θ's own predictive by ω̄ (eq. P7, :meth:`SMC2Updater.pit`), and
:func:`cloud_health` says how much of the θ-cloud is left (its ESS, its distinct values, whether it collapsed).

State (extras, besides the particles): ``param.<name>`` [B, M] θ values (float64), ``param_log_weights`` [B, M]
(normalised), ``param_support.<name>`` [B, 3] (the support's kind — 0 ℝ, 1 (lo, ∞), 2 (lo, hi) — lo and hi, for the
jitter's coordinate), and the Kalman filters' ``theta_mean`` [B, M, d], ``theta_cov`` [B, M, d, d]; a particle
filter's particles and within-θ weights are the state's own, in M blocks of N_x; with ``kernel: "mh"``, the kept
block and its checkpoint, the ``mh_*`` extras (:mod:`~mpflow.operators.updaters.smc2_mh`).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from mpflow.operators import gaussian
from mpflow.operators.kept import Bound, Cloud, Fixed, Kept
from mpflow.operators.models.base import ModelFamily
from mpflow.operators.models.param_priors import from_unconstrained, to_unconstrained
from mpflow.operators.models.priors import GaussianMixture, Prior
from mpflow.operators.references.conjugate import conjugate_update
from mpflow.operators.references.exact_kalman import kalman_predict
from mpflow.operators.rng import Generators, generators_from_state, rand, randn
from mpflow.operators.state import ParticleState, StepInfo, ess, systematic_resample
from mpflow.operators.updaters import smc2_mh, smc2_particle_replay, smc2_proposal
from mpflow.operators.updaters.base import RANDN_FLOPS, StepWork, Updater
from mpflow.operators.updaters.predictive import Predictive
from mpflow.operators.updaters.smc import resample_low_ess

#: the θ-particles' move after resampling (:meth:`SMC2Updater._moved`)
KERNELS = ("jitter", "liu_west", "mh")
PARAM = "param."
SUPPORT = "param_support."
PARAM_LOG_WEIGHTS = "param_log_weights"
#: a θ-cloud is degenerate (:func:`cloud_health`) with fewer effective or distinct θ-particles than this
MIN_DISTINCT = 10
#: two θ-particles are one value when each unconstrained coordinate u agrees to this fraction of the cloud's
#: max(1, max_j |u_j|) (:func:`cloud_health`)
DISTINCT_RESOLUTION = 1e-6
#: a θ-cloud is degenerate when some parameter's weighted sd of u is below this fraction of max(1, |ū|)
MIN_RELATIVE_SD = 1e-3


def param_names(extras: dict[str, torch.Tensor]) -> list[str]:
    """The unknown parameters a state learns, in a fixed order (its ``param.<name>`` extras)."""
    return sorted(k[len(PARAM) :] for k in extras if k.startswith(PARAM))


def theta_count(n: int, kalman: bool, asked: int) -> int:
    """M, the θ-particles of a stream of n particles in all: ``asked`` when given (it must divide n), else n for
    Kalman filters (one draw of the state per θ) and the largest divisor of n not above √n for particle filters
    (M ≈ N_x, as in Crisan & Míguez's experiments)."""
    if asked:
        if n % asked:
            raise ValueError(
                f"num_particles: smc2 splits the {n} particles into theta_particles = {asked} filters of equal size; "
                f"give a multiple of {asked}"
            )
        return asked
    if kalman:
        return n
    return max(m for m in range(1, math.isqrt(n) + 1) if n % m == 0)


def support_code(lo: float, hi: float) -> list[float]:
    """A support (lo, hi) as the state keeps it, finite numbers only: [kind, lo, hi] (module docstring)."""
    if math.isfinite(lo) and math.isfinite(hi):
        return [2.0, lo, hi]
    if math.isfinite(lo):
        return [1.0, lo, 0.0]
    return [0.0, 0.0, 0.0]


def support_bounds(code: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(lo, hi) [B] from the stored [B, 3] codes, ±inf at open ends."""
    kind = code[:, 0]
    lo = torch.where(kind > 0, code[:, 1], -math.inf)
    hi = torch.where(kind > 1, code[:, 2], math.inf)
    return lo, hi


def theta_u(extras: dict[str, torch.Tensor], names: list[str]) -> torch.Tensor:
    """The θ-particles of a state in their unconstrained coordinates u [B, M, p] (eq. P5), float64."""
    us = []
    for n in names:
        lo, hi = support_bounds(extras[SUPPORT + n].to(torch.float64))
        us.append(to_unconstrained(extras[PARAM + n].to(torch.float64), lo[:, None], hi[:, None]))
    return torch.stack(us, -1)


def collapsed(theta: torch.Tensor) -> torch.Tensor:
    """[B] bool: every θ-particle of θ [B, M, p] within :data:`MIN_RELATIVE_SD` of the cloud's largest magnitude in
    some parameter — a cloud of copies, whatever its weights (the ``mh`` kernel's re-seeding test, a step's cheap
    part of :func:`cloud_health`)."""
    spread = theta.amax(1) - theta.amin(1)
    return (spread <= MIN_RELATIVE_SD * theta.abs().amax(1).clamp_min(1e-300)).any(-1)


class CloudHealth(NamedTuple):
    """The θ-cloud of every stream of a batch (:func:`cloud_health`): its ESS [B] (float64), its distinct θ-particles
    [B] (int64) and whether it is degenerate [B] (bool)."""

    ess: torch.Tensor
    distinct: torch.Tensor
    degenerate: torch.Tensor


def cloud_health(extras: dict[str, torch.Tensor]) -> CloudHealth | None:
    """How much of the θ-cloud {θ_j, ω_j} is left (docs/methods.md "smc2", degeneracy), from a state's extras; None
    for a state without unknown parameters. In the unconstrained coordinates u of each parameter (the jitter's, eq.
    P5):

    * ESS = 1 / Σ_j ω_j² of the θ-weights the state holds (after any rejuvenation of its last step);
    * distinct: the θ-particles that differ, two being one value when every u agrees to within
      :data:`DISTINCT_RESOLUTION`·max(1, max_j |u_j|) — resampling's copies, which a jitter scaled by a collapsed
      cloud's own sd (eq. P5) moves by less than that;
    * degenerate: ESS or distinct below :data:`MIN_DISTINCT`, or some parameter's weighted sd of u below
      :data:`MIN_RELATIVE_SD`·max(1, |ū|) (the cloud is one point at 0.1 %: the jitter, a fraction of that sd, can
      no longer move it towards what the data say — docs/methods.md "Limits").
    """
    names = param_names(extras)
    if not names:
        return None
    lw = extras[PARAM_LOG_WEIGHTS].to(torch.float64)
    w = torch.softmax(lw, -1)
    u = theta_u(extras, names).nan_to_num(0.0, posinf=1e300, neginf=-1e300)  # [B, M, p]
    scale = u.abs().amax(1, keepdim=True).clamp(1.0, 1e300)
    keys = torch.round(u / (DISTINCT_RESOLUTION * scale)).to(torch.int64)
    distinct = torch.tensor([len(torch.unique(k, dim=0)) for k in keys], dtype=torch.int64)
    mean = (w[..., None] * u).sum(1)
    sd = (w[..., None] * (u - mean[:, None]) ** 2).sum(1).clamp_min(0).sqrt()
    flat = (sd < MIN_RELATIVE_SD * mean.abs().clamp_min(1.0)).any(-1)
    e = ess(lw).to(torch.float64)
    return CloudHealth(e, distinct, (e < MIN_DISTINCT) | (distinct < MIN_DISTINCT) | flat)


class SMC2Updater(Updater):
    name = "smc2"
    weighted = True
    nonlinear_transition = True
    unknown_params = True
    #: no smoothing window: after each rejuvenation the θ-particles are resampled *and moved* (eq. P5), so a past
    #: step's x-particles were filtered under parameters no θ-particle holds any more — neither FFBSm (its kernel
    #: p(x_{s+1} | x_s, θ) would need the θ of both steps) nor the genealogy (a jittered θ has no parent) links them;
    #: the Kalman filters per θ keep no x-particles at all. A window per θ-particle (L steps × M filters) would be
    #: the exact answer only until the next move. Smoothing under learned parameters: fix them (numbers) and use
    #: ``kalman`` or ``smc``
    smoothing = False
    no_smoother_reason = (
        "its parameter particles are resampled and moved as it learns, so past states were filtered under "
        "parameters it no longer holds; give the parameters as numbers and use kalman or smc to smooth"
    )
    stream_options = frozenset(
        {"theta_particles", "ess_threshold", "jitter", "kernel", "history", "mh_moves", "observer", "defensive"}
    )
    defaults = {
        "theta_particles": 0,
        "ess_threshold": 0.5,
        "jitter": 0.5,
        "kernel": "jitter",
        "history": 1000,
        "mh_moves": 3,
        "observer": smc2_proposal.OBSERVER_OFF,
        "defensive": 0.05,
    }

    def __init__(self, **options: Any):
        super().__init__(**options)
        o = self.options
        m = o["theta_particles"]
        if isinstance(m, bool) or not isinstance(m, int) or m < 0:
            raise ValueError(f"options.theta_particles: a positive number of θ-particles (0: automatic), got {m!r}")
        t = o["ess_threshold"]
        if isinstance(t, bool) or not isinstance(t, int | float) or not 0 <= t <= 1:
            raise ValueError(f"options.ess_threshold: a fraction of the θ-particles in [0, 1], got {t!r}")
        h = o["jitter"]
        if isinstance(h, bool) or not isinstance(h, int | float) or not 0 <= h <= 10:
            raise ValueError(f"options.jitter: the jittering kernel's scale h in [0, 10], got {h!r}")
        if o["kernel"] not in KERNELS:
            raise ValueError(f"options.kernel: one of {', '.join(KERNELS)}, got {o['kernel']!r}")
        hist = o["history"]
        if isinstance(hist, bool) or not isinstance(hist, int) or not 1 <= hist <= smc2_mh.MAX_HISTORY:
            raise ValueError(
                f"options.history: the observations kept for the mh kernel's moves, 1 to {smc2_mh.MAX_HISTORY}, "
                f"got {hist!r}"
            )
        k = o["mh_moves"]
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= smc2_mh.MAX_MOVES:
            raise ValueError(
                f"options.mh_moves: the mh kernel's moves per rejuvenation, 1 to {smc2_mh.MAX_MOVES}, got {k!r}"
            )
        share = o["defensive"]
        if isinstance(share, bool) or not isinstance(share, int | float) or not 0 <= share <= 0.5:
            raise ValueError(
                f"options.defensive: the share of the mh kernel's θ-particles drawn from the prior at each "
                f"rejuvenation, in [0, 0.5], got {share!r}"
            )
        obs = o["observer"]
        if not isinstance(obs, str) or not obs or len(obs) > 100:
            raise ValueError(
                f"options.observer: none, auto or the name of a registered parameter observer, got {obs!r}"
            )

    #: a new stream's particle count θ × x when its request gives none: an exact Kalman filter per θ-particle
    #: (M = N, one draw each), or M = N_x = 64 particle filters (``benchmarks/params.py``)
    DEFAULT_PARTICLES = {"kalman": 1024, "particles": 4096}

    @classmethod
    def default_particles(cls, model: ModelFamily) -> int:
        return cls.DEFAULT_PARTICLES["kalman" if model.linear_gaussian else "particles"]

    # ------------------------------------------------------------------ compatibility

    @staticmethod
    def exact_inner(model: ModelFamily, prior: Prior | None) -> bool:
        """Whether each θ-particle carries an exact Kalman filter: a linear-Gaussian family and a Gaussian prior."""
        return model.linear_gaussian and isinstance(prior, GaussianMixture) and prior.weights.shape[1] == 1

    # ------------------------------------------------------------------ a state read from outside
    def kept(self, state: ParticleState, model: ModelFamily) -> Kept:
        """Besides the base's: the θ-cloud — the θ-particles θ_j [B, M, P] (``param.<name>``) with their weights ω_j
        (``param_log_weights``: normalised, eq. P4), each θ within its prior's support and each stored support
        (``param_support.<name>``) the model's — the per-θ Kalman filters' covariances P_j (``theta_cov``) and,
        with the ``mh`` kernel, its counts (``mh_length`` and ``mh_kept`` in [0, H], ``mh_blocks`` ≥ 0), its mask in
        [0, 1] and its covariances (``mh_start_cov``, ``mh_block_cov``)."""
        kept = super().kept(state, model)
        names = param_names(state.extras)
        lw = state.extras[PARAM_LOG_WEIGHTS]
        theta = torch.stack([state.extras[PARAM + n] for n in names], -1) if names else lw[..., None][..., :0]
        kept.clouds.append(Cloud(f"extras.{PARAM}{{{', '.join(names)}}}", theta, f"extras.{PARAM_LOG_WEIGHTS}", lw))
        for name in names:
            lo, hi = model.unknown[name].support
            kept.bounds.append(Bound(f"extras.{PARAM}{name}", state.extras[PARAM + name], lo, hi))
            code = state.extras[SUPPORT + name]
            expected = torch.tensor(support_code(lo, hi), dtype=code.dtype)
            kept.fixed.append(Fixed(f"extras.{SUPPORT}{name}", code, expected, "the support of the model's prior"))
        if "theta_cov" in state.extras:
            kept.covariances["extras.theta_cov"] = state.extras["theta_cov"]
        if smc2_mh.HISTORY in state.extras:  # the mh kernel's window (smc2_mh): its length and its start's covariance
            H = state.extras[smc2_mh.HISTORY].shape[1]
            kept.bounds.append(Bound(f"extras.{smc2_mh.LENGTH}", state.extras[smc2_mh.LENGTH], 0.0, float(H)))
            kept.bounds.append(Bound(f"extras.{smc2_mh.KEPT}", state.extras[smc2_mh.KEPT], 0.0, float(H)))
            kept.bounds.append(Bound(f"extras.{smc2_mh.OBSERVED}", state.extras[smc2_mh.OBSERVED], 0.0, 1.0))
            kept.bounds.append(Bound(f"extras.{smc2_mh.BLOCKS}", state.extras[smc2_mh.BLOCKS], 0.0, math.inf))
            kept.covariances[f"extras.{smc2_mh.START_COV}"] = state.extras[smc2_mh.START_COV]
            kept.covariances[f"extras.{smc2_mh.BLOCK_COV}"] = state.extras[smc2_mh.BLOCK_COV]
        return kept

    # ------------------------------------------------------------------ init
    def _init(self, state: ParticleState, prior: Prior, model: ModelFamily, gens: Generators) -> ParticleState:
        B, N, d = state.particles.shape
        exact = self.exact_inner(model, prior)
        M = theta_count(N, exact, self.options["theta_particles"])
        extras: dict[str, torch.Tensor] = {}
        for name in sorted(model.unknown):
            p = model.unknown[name]
            draws = [p.sample(g, M) for g in _torch_gens(gens)]
            extras[PARAM + name] = torch.stack(draws)
            extras[SUPPORT + name] = torch.tensor([support_code(*p.support)] * B, dtype=torch.float64)
        extras[PARAM_LOG_WEIGHTS] = torch.full((B, M), -math.log(M), dtype=torch.float64)
        gaussian_prior = isinstance(prior, GaussianMixture) and prior.weights.shape[1] == 1
        if self.options["kernel"] == "mh" and not gaussian_prior:
            raise ValueError(
                "options.kernel: mh replays its window from the prior's Gaussian, so it needs a Gaussian prior (one "
                "component); use jitter or liu_west with this prior"
            )
        mean, cov = prior.moments() if exact or self.options["kernel"] == "mh" else (None, None)
        if exact:
            extras["theta_mean"] = mean.to(torch.float64)[:, None].expand(B, M, d).clone()
            extras["theta_cov"] = cov.to(torch.float64)[:, None].expand(B, M, d, d).clone()
        if self.options["kernel"] == "mh":
            k = model.observation_size()
            extras.update(smc2_mh.init_extras(B, self.options["history"], k, mean, cov, len(model.unknown)))
            self._observer(model, sorted(model.unknown))  # a bad observer option is refused at creation
        return state.replace(extras=extras)

    # ------------------------------------------------------------------ update
    def _observed_update(self, state, obs, model, gens):
        # a partial observation conditions per θ-particle (:meth:`_update`), after θ is set: the padding of
        # ``observed_part`` must not scale with θ
        return self._update(state, obs, model, gens)

    def _update(self, state: ParticleState, obs: torch.Tensor, model: ModelFamily, gens: Generators):
        return self._step(state, obs, model, gens)

    def _predict(self, state: ParticleState, model: ModelFamily, gens: Generators):
        return self._step(state, None, model, gens)

    def _step(self, state: ParticleState, obs: torch.Tensor | None, model: ModelFamily, gens: Generators):
        """One step of every θ-particle's filter (``obs`` None: predict only), the θ-weights and, below the
        threshold, the θ-particles' resampling and jitter (module docstring). ``info.extras["theta_ess_fraction"]``
        [B]: the θ-ESS over M after the reweighting, before any rejuvenation (the service's health metric)."""
        B, N, d = state.particles.shape
        names = param_names(state.extras)
        M = state.extras[PARAM_LOG_WEIGHTS].shape[1]
        Nx = N // M
        if obs is None and not model.dynamic:  # a static state without a measurement: nothing changes
            fraction = {"theta_ess_fraction": ess(state.extras[PARAM_LOG_WEIGHTS].to(torch.float64)) / M}
            return state, StepInfo(
                torch.zeros(B, dtype=torch.float64), ess(state.log_weights).to(torch.float64), extras=fraction
            )
        per_theta = self._at_thetas(state, model)
        obs_r = None if obs is None else obs.repeat_interleave(M, 0)
        if obs_r is not None and bool(torch.isnan(obs_r).any()):
            per_theta, obs_r = per_theta.observed_part(obs_r)
        exact = "theta_mean" in state.extras
        if exact:
            inner, log_pred = self._kalman(state, per_theta, obs_r, B, M, d)
        else:
            inner, log_pred = self._particles(state, per_theta, obs_r, gens, B, M, Nx, d)
        lw_prev = state.extras[PARAM_LOG_WEIGHTS].to(torch.float64)
        log_pred = torch.nan_to_num(log_pred.reshape(B, M), nan=-math.inf)
        increment = torch.logsumexp(lw_prev + log_pred, -1)
        lw = torch.log_softmax(lw_prev + log_pred, -1)
        lw = torch.where(torch.isfinite(increment)[:, None], lw, lw_prev)  # every θ impossible: keep the weights
        increment = torch.where(torch.isfinite(increment), increment, torch.full_like(increment, -1e30))
        ess_theta = ess(lw)
        theta_bm = torch.stack([state.extras[PARAM + n] for n in names], -1) if names else torch.zeros(B, M, 0)
        extras = smc2_mh.upgraded(dict(state.extras), len(names))  # a state stored before blocks steps on
        if smc2_mh.HISTORY in extras:  # this step's observation joins the block (the move's target includes it)
            extras = smc2_mh.append(extras, obs, lambda: self._checkpoint(state, names))
            if obs is not None:  # the block's evidence so far: Ẑ of eq. M3
                extras[smc2_mh.BLOCK_EVIDENCE] = extras[smc2_mh.BLOCK_EVIDENCE] + increment
        rows = ess_theta < self.options["ess_threshold"] * M
        observer = self._observer(model, names) if smc2_mh.HISTORY in extras else None
        if observer is not None:  # a collapsed cloud is re-seeded: the observer's moves can leave it
            rows = rows | (ess_theta < MIN_DISTINCT) | collapsed(theta_bm)
        if bool(rows.any()):
            if smc2_mh.HISTORY in extras:
                theta_bm, lw, inner = self._mh(extras, model, names, theta_bm, lw, inner, rows, gens, observer)
            else:
                theta_bm, lw, inner = self._rejuvenate(state, names, theta_bm, lw, inner, rows, gens)
        extras.update({PARAM + n: theta_bm[..., i].contiguous() for i, n in enumerate(names)})
        extras[PARAM_LOG_WEIGHTS] = lw
        if exact:
            mean, cov = inner
            extras["theta_mean"], extras["theta_cov"] = mean, cov
            x, joint = self._draws(mean, cov, lw, Nx, gens)
        else:
            x, lwx = inner
            joint = (lw[..., None] + lwx).reshape(B, N)
            x = x.reshape(B, N, d)
        info = StepInfo(
            increment if obs is not None else torch.zeros_like(increment),
            ess(joint).to(torch.float64),
            extras={"theta_ess_fraction": ess_theta.to(torch.float64) / M},
        )
        new = state.replace(particles=x.to(state.particles.dtype), log_weights=joint.to(state.log_weights.dtype))
        return new.replace(extras=extras), info

    # ------------------------------------------------------------------ predictive p-values
    def predictive(self, state: ParticleState, obs: torch.Tensor, model: ModelFamily) -> dict[str, torch.Tensor] | None:
        """The step's predictive p-values [B, k] under the θ-mixture of the predictives of eq. P2–P3 (eq. P7):

            u_j = Σ_θ ω̄_θ P(O_j ≤ o_j | o_<m, θ),

        ω̄ the normalised θ-weights before the step (those the evidence increment of eq. P4 averages with), each θ's
        term its own filter's predictive observed under its own θ (a learned R included): for a Kalman filter per θ
        Φ((o_j − (H m_θ⁻)_j) / √(H P_θ⁻ Hᵀ + R(θ))_jj), for a particle filter Σ_i w_{θ,i} F_j(o_j | x_{θ,i}, θ) over
        its predicted particles — drawn with a copy of each stream's generator, so the very draws the update makes.
        The rows of the model at every θ (:meth:`_at_thetas`) are read by the base's p-value
        (:meth:`Updater._predictive_of`), then mixed; NaN where o_j was not observed, None for a family without a CDF.
        The log tails mix the same way, in log space: log Σ_θ ω̄_θ P(O_j ≤ o_j | o_<m, θ) as a logsumexp over θ of
        log ω̄_θ plus each θ's log tail (and the upper tail alike), so they do not saturate either."""
        B, N, d = state.particles.shape
        M = state.extras[PARAM_LOG_WEIGHTS].shape[1]
        gens = generators_from_state(state.rng)  # a copy of the stream's generators: they are not advanced
        per_theta = self._at_thetas(state, model)
        if "theta_mean" in state.extras:
            m, P = self._kalman_predicted(state, per_theta, B, M, d)
            zero = torch.zeros(B * M, 1, dtype=state.log_weights.dtype)
            predicted = state.replace(particles=m[:, None], log_weights=zero, extras={"mean": m, "cov": P})
        else:
            x, lwx = self._particles_predicted(state, per_theta, gens, B, M, N // M, d)
            predicted = state.replace(particles=x, log_weights=lwx, extras={})
        tails = self._predictive_of(predicted, obs.repeat_interleave(M, 0), per_theta, _theta_rows(gens, M))
        if tails is None:
            return None
        w = torch.softmax(state.extras[PARAM_LOG_WEIGHTS].to(torch.float64), -1)
        log_w = torch.log_softmax(state.extras[PARAM_LOG_WEIGHTS].to(torch.float64), -1)[..., None]
        mixed = {"pit": torch.einsum("bm,bmk->bk", w, tails["pit"].reshape(B, M, -1))}
        for key in ("log_tail_lower", "log_tail_upper"):
            mixed[key] = torch.logsumexp(log_w + tails[key].reshape(B, M, -1), 1)
        return mixed

    @staticmethod
    def _at_thetas(state: ParticleState, model: ModelFamily) -> ModelFamily:
        """The model at every θ-particle: B·M rows, row b·M + j stream b's θ_j."""
        B, M = state.extras[PARAM_LOG_WEIGHTS].shape
        return model.at_values({n: state.extras[PARAM + n].reshape(B * M) for n in param_names(state.extras)}, B * M)

    @staticmethod
    def _kalman_predicted(state, per_theta, B, M, d):
        """Every θ-particle's Kalman predict p(x_m | o_<m, θ_j) = N(m_j⁻, P_j⁻): ([B·M, d], [B·M, d, d])."""
        m = state.extras["theta_mean"].reshape(B * M, d)
        P = state.extras["theta_cov"].reshape(B * M, d, d)
        return kalman_predict(m, P, per_theta)

    @classmethod
    def _kalman(cls, state, per_theta, obs_r, B, M, d):
        """Every θ-particle's Kalman predict and, with an observation, update (eq. P2): ((mean, cov), log p̂)."""
        m, P = cls._kalman_predicted(state, per_theta, B, M, d)
        if obs_r is None:
            log_pred = torch.zeros(B * M, dtype=torch.float64)
        else:
            H, R = per_theta.observation_affine()
            m, P, log_pred = conjugate_update(m, P, H, R, obs_r)
            log_pred = log_pred + per_theta.observation_log_offset().to(torch.float64)
        return (m.reshape(B, M, d), P.reshape(B, M, d, d)), log_pred

    @staticmethod
    def _particles_predicted(state, per_theta, gens, B, M, Nx, d):
        """Every θ-particle's predicted cloud x_{j,i} ~ p(x_m | x_{j,i}, θ_j): (x [B·M, N_x, d], within-θ
        log-weights [B·M, N_x]), θ-particle j of stream b drawing from stream b's generator."""
        x = state.particles.reshape(B * M, Nx, d)
        lwx = torch.log_softmax(state.log_weights.to(torch.float64).reshape(B * M, Nx), -1)
        return per_theta.transition(x, _theta_rows(gens, M)), lwx

    @classmethod
    def _particles(cls, state, per_theta, obs_r, gens, B, M, Nx, d):
        """Every θ-particle's bootstrap filter step (eq. P3): ((x [B, M, N_x, d], within-θ log-weights), log p̂)."""
        x, lwx = cls._particles_predicted(state, per_theta, gens, B, M, Nx, d)
        row_gens = _theta_rows(gens, M)
        if obs_r is None:
            return (x.reshape(B, M, Nx, d), lwx.reshape(B, M, Nx)), torch.zeros(B * M, dtype=torch.float64)
        ll = torch.nan_to_num(per_theta.log_likelihood(obs_r, x).to(torch.float64), nan=-math.inf)
        log_pred = torch.logsumexp(lwx + ll, -1)
        lwx = torch.where(torch.isfinite(log_pred)[:, None], torch.log_softmax(lwx + ll, -1), lwx)
        low = ess(lwx) < 0.5 * Nx
        shrink = None if per_theta.dynamic else gaussian.LIU_WEST_SHRINKAGE  # a static state's copies must move
        x, lwx = resample_low_ess(x, lwx, low, row_gens, shrink)
        return (x.reshape(B, M, Nx, d), lwx.reshape(B, M, Nx)), log_pred

    def _rejuvenate(self, state, names, theta, lw, inner, rows, gens):
        """Resample the θ-particles of the streams ``rows`` (systematic), each copy with its filter, and jitter
        them (eq. P5). Only those streams draw, from their own generators, so a stream's draws do not depend on its
        batch."""
        rs = rows.nonzero().flatten()
        sub_gens = [_rows(gens)[b] for b in rs.tolist()]
        R, M, p = len(rs), theta.shape[1], theta.shape[2]
        idx = systematic_resample(lw[rs], rand(sub_gens, [1], torch.float64)[:, 0])  # [R, M]
        th = torch.gather(theta[rs], 1, idx[..., None].expand(R, M, p))
        moved_inner = []
        for t in inner:
            sub = t[rs]
            moved_inner.append(
                t.index_copy(0, rs, torch.gather(sub, 1, idx.reshape(R, M, *[1] * (t.dim() - 2)).expand_as(sub)))
            )
        xi = randn(sub_gens, [M, p], torch.float64)
        moved = []
        for i, n in enumerate(names):
            lo, hi = support_bounds(state.extras[SUPPORT + n][rs].to(torch.float64))
            u = to_unconstrained(th[..., i], lo[:, None], hi[:, None])
            u = self._moved(u, xi[..., i])
            moved.append(from_unconstrained(u, lo[:, None], hi[:, None]))
        if moved:
            th = torch.stack(moved, -1)
        theta = theta.index_copy(0, rs, th)
        lw = lw.index_copy(0, rs, torch.full((R, M), -math.log(M), dtype=lw.dtype))
        return theta, lw, tuple(moved_inner)

    def _mh(self, extras, model, names, theta, lw, inner, rows, gens, observer):
        """SMC²'s resample-move for the streams ``rows`` (:mod:`mpflow.operators.updaters.smc2_mh`): resample the
        θ-particles (systematic), then ``mh_moves`` MH moves (eq. M1–M2, independence moves from the stream's
        parameter observer when it has one) accepted by the block's prior × the block's likelihood (exact Kalman,
        or a particle filter's estimate), then the last ``defensive``·M θ-particles redrawn from the prior and every
        one weighted by eq. M3; each θ-particle's filter is its replay's. ``observer``: the stream's parameter
        observer (:meth:`_observer`), or None."""
        rs = rows.nonzero().flatten()
        sub_gens = [_rows(gens)[b] for b in rs.tolist()]
        R, M, p = len(rs), theta.shape[1], theta.shape[2]
        idx = systematic_resample(lw[rs], rand(sub_gens, [1], torch.float64)[:, 0])  # [R, M]
        th = torch.gather(theta[rs], 1, idx[..., None].expand(R, M, p))
        bounds = [support_bounds(extras[SUPPORT + n][rs].to(torch.float64)) for n in names]
        los = torch.stack([b[0] for b in bounds], -1)[:, None]  # [R, 1, p]
        his = torch.stack([b[1] for b in bounds], -1)[:, None]
        priors = {n: model.unknown[n] for n in names}
        sub = {k: v[rs] for k, v in extras.items() if k.startswith("mh_")}
        rows_model = model if model.batch_size == 1 else model.select(rs)
        if "theta_mean" in extras:
            target = smc2_mh.kalman_target(rows_model, names, priors, los, his, sub)
        else:
            target = smc2_particle_replay.particle_target(
                rows_model, names, priors, los, his, sub, inner[0].shape[2], sub_gens
            )
        proposal = (
            None if observer is None else smc2_proposal.observer_proposal(observer, rows_model, names, sub, los, his)
        )
        u = to_unconstrained(th, los, his)
        u, (th, *moved), _, log_pi = smc2_mh.mh_move(u, target, sub_gens, self.options["mh_moves"], proposal)
        fresh = torch.full((R, M), -math.log(M), dtype=lw.dtype)
        K = min(round(self.options["defensive"] * M), M - 1)
        if K > 0:  # the last K give way to the prior's draws, all weighted by eq. M3
            u_d, (th_d, *moved_d), log_pi_d = smc2_mh.defensive_draws(target, names, priors, los, his, sub_gens, K)
            u = torch.cat([u[:, : M - K], u_d], 1)
            th = torch.cat([th[:, : M - K], th_d], 1)
            moved = [torch.cat([a[:, : M - K], b.to(a.dtype)], 1) for a, b in zip(moved, moved_d, strict=True)]
            log_pi = torch.cat([log_pi[:, : M - K], log_pi_d], 1)
            log_q = smc2_mh.stream_log_prior(u, th, names, priors, los, his)
            fresh = smc2_mh.defensive_log_weights(log_pi, log_q, sub[smc2_mh.BLOCK_EVIDENCE], K / M)
        theta = theta.index_copy(0, rs, th)
        inner = tuple(t.index_copy(0, rs, new.to(t.dtype)) for t, new in zip(inner, moved, strict=True))
        lw = lw.index_copy(0, rs, fresh.to(lw.dtype))
        return theta, lw, inner

    def _observer(self, model: ModelFamily, names: list[str]):
        """The stream's parameter observer (:func:`mpflow.operators.updaters.smc2_proposal.resolve`), or None."""
        if self.options["observer"] == smc2_proposal.OBSERVER_OFF:
            return None
        return smc2_proposal.resolve(self.options["observer"], model, names)

    @staticmethod
    def _checkpoint(state: ParticleState, names: list[str]) -> smc2_mh.Checkpoint:
        """A block's checkpoint (:func:`smc2_mh.cloud_checkpoint`) of every stream's cloud as ``state`` holds it:
        the θ-particles in u with their weights, and the moments of their filters (a Kalman filter's, or a particle
        filter's weighted cloud)."""
        lw = state.extras[PARAM_LOG_WEIGHTS]
        if "theta_mean" in state.extras:
            means, covs = state.extras["theta_mean"], state.extras["theta_cov"]
        else:
            B, N, d = state.particles.shape
            M = lw.shape[1]
            x = state.particles.to(torch.float64).reshape(B * M, N // M, d)
            lwx = state.log_weights.to(torch.float64).reshape(B * M, N // M)
            m, C = gaussian.moments(x, lwx)
            means, covs = m.reshape(B, M, d), C.reshape(B, M, d, d)
        return smc2_mh.cloud_checkpoint(theta_u(state.extras, names), lw, means, covs)

    def _moved(self, u: torch.Tensor, xi: torch.Tensor) -> torch.Tensor:
        """The resampled θ-particles' coordinates u [R, M] moved by the kernel (eq. P5): ``jitter``
        u + h M^{−1/2} s_u ξ; ``liu_west`` a u + (1 − a) ū + √(1 − a²) s_u ξ, a = 0.98 (Liu & West 2001: the
        cloud's mean and variance kept)."""
        M = u.shape[-1]
        sd = u.std(-1, keepdim=True).nan_to_num(0.0).clamp_min(1e-6)
        if self.options["kernel"] == "liu_west":
            a = gaussian.LIU_WEST_SHRINKAGE
            return a * u + (1 - a) * u.mean(-1, keepdim=True) + math.sqrt(1 - a * a) * sd * xi
        return u + self.options["jitter"] * sd / math.sqrt(M) * xi

    @staticmethod
    def _draws(mean, cov, lw, Nx, gens):
        """N_x draws of N(m_j, P_j) per θ-particle, weight ω_j / N_x each: (x [B, M·N_x, d], log-weights)."""
        B, M, d = mean.shape
        L = gaussian.cholesky(cov)
        xi = randn(gens, [M, Nx, d], torch.float64)
        x = (mean[:, :, None] + xi @ L.transpose(-1, -2)).reshape(B, M * Nx, d)
        return x, (lw[..., None] - math.log(Nx)).expand(B, M, Nx).reshape(B, M * Nx)

    # ------------------------------------------------------------------ cost
    def step_work(self, model: ModelFamily, n: int, dt: float = 1.0, k: int | None = None) -> StepWork:
        """A particle filter's work for the n = M·N_x pairs (:meth:`Updater.step_work`) — it bounds the Kalman
        filters' too for d, k ≤ 8 — plus, per θ-particle, a Kalman predict and update (30 d³ + 20 d² k + 10 k³), the
        model's parameters (M copies) and the jitter; the θ-particles count is at most n."""
        d = model.state_dim
        k = model.observation_size() if k is None else k
        base = super().step_work(model, n, dt, k)
        per_theta = 30.0 * d**3 + 20.0 * d * d * k + 10.0 * k**3 + 4.0 * (d * d + k * k) + RANDN_FLOPS
        params = sum(v[0].numel() for v in model.params.values())
        flops, nbytes = base.flops + n * per_theta, base.bytes + 8.0 * n * (3 * d * d + 2 * k * k + params)
        if self.options["kernel"] == "mh":  # the move's worst case, on every step (smc2_mh)
            H, replays = self.options["history"], self.options["mh_moves"] + 1 + (self.options["defensive"] > 0)
            if model.linear_gaussian:  # a Kalman filter per θ-particle (mh needs a Gaussian prior)
                scalar = d == 1 and k == 1
                per_step = smc2_mh.REPLAY_STEP_FLOPS[scalar] + n * smc2_mh.REPLAY_FACTOR[scalar] * smc2_mh.replay_flops(
                    d, k
                )
                flops += replays * H * per_step
            else:  # a particle filter per θ-particle
                M = self.options["theta_particles"]  # 0: the automatic count, as the replay's price reads it
                flops += replays * smc2_particle_replay.particle_replay_work(model, n, H, M, k)
                nbytes += 8.0 * 6 * n * d
            if self.options["observer"] != smc2_proposal.OBSERVER_OFF:  # its answer, and its draws and densities
                flops += smc2_proposal.answer_flops() + replays * n * smc2_proposal.DRAW_FLOPS
            nbytes += 8.0 * (H * k * (n + 1) + 6 * n * (d * d + k * k + d * k + params))
        return StepWork(flops, nbytes)

    #: the p-values' Kalman algebra per θ-particle (:meth:`pit_work`) against its count: M small d × d products in
    #: float64 run far below the cost model's 25 Gflop/s — the predict and predictive covariance (4 d³ + 2 d² k +
    #: 2 d k²) of M = 1024 θ-particles on ``lds`` with R learned took 10 to 24 times their count's time at d = 8,
    #: 11 at 16, 6 to 8 at 32, 4 to 5 at 64 (1.7 to 4 ms, 15 ms, 45 to 83 ms, 0.37 to 0.41 s; three runs on the
    #: loaded development machine, 2026-12-07; below d = 8 the base's per-particle share covers it)
    KALMAN_PIT_FACTOR = 12.0

    def pit_work(self, model: ModelFamily, n: int, dt: float = 1.0, k: int | None = None) -> StepWork:
        """:meth:`pit`: the base's (the n pairs predicted again, a particle filter per θ, and their CDFs) plus, for a
        Kalman filter per θ-particle (at most n of them), its predict F P Fᵀ + Q and predictive covariance
        H P⁻ Hᵀ + R(θ) — 4 d³ + 2 d² k + 2 d k² counted, :data:`KALMAN_PIT_FACTOR` times that — and the model's
        parameters at every θ, both in float64."""
        d = model.state_dim
        k = model.observation_size() if k is None else k
        base = super().pit_work(model, n, dt, k)
        kalman = self.KALMAN_PIT_FACTOR * (4.0 * d**3 + 2.0 * d * d * k + 2.0 * d * k * k)
        params = sum(v[0].numel() for v in model.params.values())
        return StepWork(base.flops + n * kalman, base.bytes + 8.0 * n * (2 * d * d + k * k + params))

    # ------------------------------------------------------------------ forecasts
    def forecast(self, state: ParticleState, model: ModelFamily, steps: int, gen: torch.Generator) -> Predictive:
        """The predictive of the pairs (θ_j, x_{j,i}): each propagated under its own θ_j (module docstring), as one
        model of N rows whose transition, and then observation, draws the noise of all N from ``gen`` in one call
        each — the observation predictive's pairs each observed under their own θ — priced as a particle
        filter's forecast (:meth:`Updater.forecast_work`, its observation's draw, moments and quantiles
        included), which covers it: 47 horizons at N = 65536 took 0.93 to 0.95 s of CPU, their answer included,
        where that price buys 0.99 s at 25 Gflop/s (``benchmarks/price_audit.py``, 2026-11-28; without the
        observation 0.53 to 0.57 s; moved one pair at a time, a generator's call each, 63 horizons took 18 s and
        were priced 120000 flops a pair)."""
        from mpflow.operators.updaters.predictive import particle_predictive

        B, N, d = state.particles.shape
        names = param_names(state.extras)
        M = state.extras[PARAM_LOG_WEIGHTS].shape[1]
        per_pair = model.at_values(
            {n: state.extras[PARAM + n].repeat_interleave(N // M, 1).reshape(N) for n in names}, N
        )
        x = state.particles.reshape(N, 1, d)
        return particle_predictive(x.transpose(0, 1), state.log_weights, _PerParticle(per_pair), steps, gen)


def _rows(gens: Generators) -> list:
    return list(gens) if not isinstance(gens, list) else gens


def _theta_rows(gens: Generators, M: int) -> list:
    """The generators of the B·M rows of the model at every θ-particle (:meth:`SMC2Updater._at_thetas`): stream
    b's for each of its M θ-particles."""
    return [g for g in _rows(gens) for _ in range(M)]


def _torch_gens(gens: Generators) -> list[torch.Generator]:
    from mpflow.operators.rng import torch_generator

    return [torch_generator(g) for g in _rows(gens)]


class _PerParticle:
    """A model of N rows (one per particle, its own θ) seen as one stream's model of N particles, for forecasts."""

    def __init__(self, model: ModelFamily):
        self.model = model

    def transition(self, x: torch.Tensor, gens) -> torch.Tensor:
        """x [1, N, d] moved a step, particle i under row i's θ: the noise of all N drawn from the stream's one
        generator in one call ([1, N, d], as a particle filter's forecast draws it), the rows moved in one tensor
        operation (:meth:`ModelFamily.transition_from_noise`)."""
        if not self.model.dynamic:
            return x
        z = randn(gens, list(x.shape[1:]), x.dtype)
        return self.model.transition_from_noise(x.transpose(0, 1), z.transpose(0, 1)).transpose(0, 1)

    def observation_draws(self, x: torch.Tensor, gen: torch.Generator) -> torch.Tensor | None:
        """One observation of each state x [1, N, d], particle i's under row i's θ (the observation noise may be
        learned: ``lds``'s R), all N from ``gen`` in one call (:meth:`ModelFamily.observation_draws` of the N-row
        model, a state a row: the numbers a particle filter's forecast draws for the same states)."""
        o = self.model.observation_draws(x.transpose(0, 1), gen)
        return None if o is None else o.transpose(0, 1)


__all__ = ["PARAM", "PARAM_LOG_WEIGHTS", "CloudHealth", "SMC2Updater", "cloud_health", "param_names", "theta_count"]

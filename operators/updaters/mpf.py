"""``mpf``: the Meta Particle Flow updater (Chen, Dai & Song, §2–3): one short ODE integration per observation
moves the particles from p(x | o_<m) to p(x | o_≤m) (eq. 4), optionally carrying their log-density (eq. 8).

Per step, for each stream (:mod:`mpflow.operators.mpf.step`, shared with meta-training):
  1. predict   dynamic families move the particles through the transition, mapped affinely onto the pushed
               moments of the previous cloud (MPF §5 LDS: "predict with the transition, then apply F");
  2. linearise the likelihood: exactly (Hᵀ R⁻¹ H, Hᵀ R⁻¹ o) for linear-Gaussian families, else by Stein's
               identity from the scores at the particles, for the base flow re-fitted at the Gaussian posterior it
               gives (``linearisation="posterior"``, the default; :mod:`mpflow.operators.mpf.daum_huang`); a
               factorised family (``ModelFamily.per_dimension``) runs the base flow one dimension at a time;
  3. flow      integrate dx/dλ = f_θ(X_m, o, x(λ), λ) over λ ∈ [0, 1] with ``solver`` (RK4 with ``steps``
               equal steps by default: the reference used one); with ``substeps`` K > 1 the update runs as K
               stages, each conditioning on p(o | x)^{1/K} and re-fitting step 2 to the moved cloud
               (:mod:`mpflow.operators.models.tempered`): the base flow's single Gaussian fit is the main error of
               an untrained flow on a non-linear likelihood, and K stages shrink it at K times the cost;
  4. evidence  log p(o_m | o_<m) ≈ log mean_i p(o_m | x_i) over the predicted particles;
  5. health    the ESS of the importance weights that would correct the step (:mod:`mpflow.operators.mpf.health`),
               reported as the step's ``ess``: N when the step is exact (a linear-Gaussian likelihood and the base
               flow: not computed, the closed-form flow is exact for the predictive's Gaussian fit), low when the
               flow misrepresents it; a stream whose ESS is below ``ess_threshold``·N runs the step again in twice
               as many stages, up to ``max_substeps`` (default ``substeps``, no correction, for the base flow;
               4 × ``substeps`` with a trained operator or ``correct``: ``ON_DEMAND_STAGES``; the corrected
               flow's health ESS is that of its own weights);
  6. moves     on a static family, ``moves`` Langevin (MALA) steps against the posterior with its last ``window``
               observations exact and the older ones as Gaussian sites (:mod:`mpflow.operators.mpf.posterior_moves`;
               ``auto``: where ``ModelFamily.posterior_moves``); the step reports their ``acceptance`` rate.

f_θ is :class:`mpflow.operators.mpf.network.MPFVelocity`: the exact Daum–Huang flow plus a learned residual,
held at exactly zero for a linear-Gaussian likelihood (where the base flow is already exact). A
trained operator comes from the registry (:mod:`mpflow.operators.registry`): ``MPFUpdater(operator="lds-d2-v1")``
(a name or a folder); its ``config.json`` gives the architecture and the solver. Without an operator the
residual is zero — the updater is then the exact Daum–Huang filter, exact for linear-Gaussian models up to
the ODE error. ``track_density=True`` also integrates d log q/dλ = −∇·f (exact divergence for d ≤ 8, so
costlier); serving leaves it off since nothing the API returns reads it. At step 0 with a Gaussian prior
and N > d the particles are mapped onto the prior's exact mean and covariance.
"""

from __future__ import annotations

import math

import torch
from mpflow.operators import evidence, gaussian, mixture_evidence
from mpflow.operators.kept import Kept
from mpflow.operators.models.base import ModelFamily
from mpflow.operators.models.priors import GaussianMixture, Prior
from mpflow.operators.models.tempered import tempered
from mpflow.operators.mpf import consistency, correction, marginal, posterior_moves
from mpflow.operators.mpf.daum_huang import LINEARISATIONS, POSTERIOR_ITERATIONS, posterior_fit
from mpflow.operators.mpf.health import flow_ess
from mpflow.operators.mpf.kalman_particle import adaptive_kalman_particle_step, kalman_particle_step
from mpflow.operators.mpf.network import MPFVelocity
from mpflow.operators.mpf.posterior_moves import Sites
from mpflow.operators.mpf.scalar_flow import scalar_base_flow
from mpflow.operators.mpf.step import flow_step, predict
from mpflow.operators.rng import Generators, rand
from mpflow.operators.state import ParticleState, StepInfo, ess, systematic_resample
from mpflow.operators.trained_operators import load_operator, serves_dimension
from mpflow.operators.updaters import factorised
from mpflow.operators.updaters.base import Prediction, StepWork, Updater
from mpflow.operators.updaters.enkf import check_inflation
from mpflow.operators.updaters.smc import (
    check_rejuvenation,
    factorise_refusal,
    liu_west_moves,
    rejuvenates,
    resample_low_ess,
    sqmc_refusal,
)


def check_moves(options: dict) -> None:
    """ValueError unless ``options`` has valid posterior ``moves`` and ``window`` (and no moves with ``correct`` or
    ``track_density``)."""
    moves, window = options["moves"], options["window"]
    if moves != "auto" and (not isinstance(moves, int) or isinstance(moves, bool) or not 0 <= moves <= 64):
        raise ValueError(f"options.moves: auto or an integer from 0 to 64, got {moves!r}")
    if not isinstance(window, int) or isinstance(window, bool) or not 0 <= window <= 16:
        raise ValueError(f"options.window: an integer from 0 to 16 (observations kept exactly), got {window!r}")
    if moves not in ("auto", 0) and (options["correct"] or options["track_density"]):
        raise ValueError(
            "options.moves: the posterior moves do not run with correct (its weights) or track_density (its "
            "densities): set moves to 0"
        )


#: the estimates of a step's log-evidence (the ``evidence`` option: :meth:`MPFUpdater.step_evidence`,
#: :meth:`MPFUpdater.mixture_evidence`)
EVIDENCE = ("gaussian", "mixture")

#: ``flow_fraction`` for the share chosen per step (:mod:`~mpflow.operators.mpf.kalman_particle`)
AUTO = "auto"


def check_flow_fraction(options: dict) -> None:
    """ValueError unless ``options`` has a ``flow_fraction`` γ in (0, 1] or ``"auto"``, other than 1 only with
    ``correct``."""
    gamma = options["flow_fraction"]
    if gamma != AUTO and (not isinstance(gamma, int | float) or isinstance(gamma, bool) or not 0 < gamma <= 1):
        raise ValueError(f'options.flow_fraction: a share γ of the likelihood in (0, 1] or "auto", got {gamma!r}')
    if gamma != 1 and not options["correct"]:
        raise ValueError(
            "options.flow_fraction: below 1 (or auto) the rest of the likelihood enters as importance weights, "
            "which only the corrected flow has: set correct to true"
        )


def _mixture(prior: Prior | None) -> bool:
    """Whether ``prior`` is a Gaussian mixture of several components (no Gaussian density for the moves' target)."""
    return isinstance(prior, GaussianMixture) and prior.weights.shape[1] > 1


#: a trained operator re-runs a step whose health ESS is low in up to this many times its stages (``max_substeps``'s
#: default with an operator; the base flow's is ``substeps``). Measured with ``benchmarks.equal_compute`` (N = 256,
#: 64 streams, mean error in posterior sd, one stage → on demand, at +0–20 % compute): gmm-d2-v4 0.096 → 0.096
#: (s = 0.5, prior 4I, outside its domain: 0.277 → 0.195), stochastic_volatility-d2-v1 0.146 → 0.122 (μ = −1,
#: φ = 0.98, σ = 0.15: 0.188 → 0.161), logistic-d10-v1 0.238 → 0.195. The corrected flow (``correct``) re-stages on
#: its weights' ESS up to the same (``benchmarks.range_bearing``'s scenarios, 32 streams, N = 256 / 512, one stage →
#: on demand: crossing behind the sensor 0.027 / 0.211 → 0.020 / 0.014, close pass 0.079 / 0.117 → 0.052 / 0.050;
#: the one-stage errors were a few streams passing near the sensor whose weights collapsed to ESS ≈ 1; elsewhere in
#: ``benchmarks.equal_compute`` no change beyond noise but logistic d = 30, 0.414 / 0.315 → 0.469 / 0.355, where
#: joint weights in 30 dimensions degenerate at any number of stages)
ON_DEMAND_STAGES = 4


class MPFUpdater(Updater):
    name = "mpf"
    shares_prediction = True
    #: the automatic share carries its weights between steps, as smc does
    weighted_options = {"flow_fraction": AUTO}
    #: a nonlinear transition's predictive is the mapped cloud, fitted by its moments (``predicted_moments``)
    nonlinear_transition = True
    stream_options = frozenset(
        {
            "substeps",
            "max_substeps",
            "ess_threshold",
            "correct",
            "flow_fraction",
            "rejuvenate",
            "shrinkage",
            "inflation",
            "linearisation",
            "moves",
            "window",
            "marginal",
        }
    )
    defaults = {
        "operator": None,
        "network": None,
        "solver": None,
        "steps": None,
        "substeps": None,
        "max_substeps": None,
        "ess_threshold": 0.5,
        "track_density": False,
        "correct": False,
        # the corrected flow's share γ of a linear observation's likelihood; the weights take the rest (1: all
        # to the flow; auto: the smallest share that keeps the weights' ESS ≥ ess_threshold·N; kalman_particle)
        "flow_fraction": 1.0,
        # the corrected flow's Liu–West moves after resampling (as smc's): auto = static families only
        "rejuvenate": "auto",
        "shrinkage": gaussian.LIU_WEST_SHRINKAGE,
        # the predictive's multiplicative inflation ρ (anomalies × ρ), as enkf's
        "inflation": 1.0,
        # the base flow's fit of a non-Gaussian likelihood (an operator uses the one it was trained with)
        "linearisation": "posterior",
        # MALA moves against the posterior after the flow, for static families (posterior_moves): auto = MOVES
        # where the family's likelihood is log-concave and the step is neither corrected nor density-tracked
        "moves": "auto",
        # the observations the moves' target keeps exactly (the older ones enter as Gaussian sites)
        "window": posterior_moves.WINDOW,
        # the step's log-evidence: the predictive Gaussian fit's ("gaussian"), or the defensive importance estimate
        # of the mixture predictive over the previous cloud with its standard error ("mixture"; mixture_evidence)
        "evidence": "gaussian",
        # the flow as the proposal of a marginal particle filter, weighted against the exact mixture predictive and
        # driven by quasi-random points (mpf.marginal). auto (the default): wherever it applies and the posterior is
        # not Gaussian (a linear-Gaussian family's flow is exact, and weights would only add Monte Carlo error), so
        # that the step's evidence carries no Gaussian-belief bias at outliers (docs/benchmarks.md "Anomaly scores");
        # false: the plain flow, 2.6x cheaper at d = 1 and 10-20x batched, whose anomaly scores run low at outliers
        "marginal": "auto",
    }

    def __init__(self, **options):
        super().__init__(**options)
        o = self.options
        self.record = None
        if o["operator"] is not None and o["network"] is not None:
            raise ValueError("options: give either operator (a registered name or folder) or network, not both")
        if o["operator"] is not None:
            self.record, o["network"] = load_operator(o["operator"])
        net = o["network"]
        if net is not None and not isinstance(net, MPFVelocity):
            raise ValueError("options.network: expected an MPFVelocity (load one with operators.registry)")
        solver = (self.record.config.get("solver", {}) if self.record is not None else {}) or {}
        o["solver"] = o["solver"] or solver.get("method", "rk4")
        o["steps"] = o["steps"] or solver.get("steps", 1)
        if o["substeps"] is None:
            o["substeps"] = solver.get("substeps", 1)
        if o["max_substeps"] is None:
            on_demand = o["substeps"]
            if self.record is not None or o["correct"]:
                on_demand = ON_DEMAND_STAGES * o["substeps"]
            o["max_substeps"] = solver.get("max_substeps", on_demand)
        for key in ("substeps", "max_substeps"):
            if not isinstance(o[key], int) or isinstance(o[key], bool) or not 1 <= o[key] <= 64:
                raise ValueError(f"options.{key}: an integer from 1 to 64, got {o[key]!r}")
        if o["max_substeps"] < o["substeps"]:
            raise ValueError(f"options.max_substeps: at least substeps ({o['substeps']}), got {o['max_substeps']}")
        if not isinstance(o["ess_threshold"], int | float) or not 0 <= o["ess_threshold"] <= 1:
            raise ValueError(f"options.ess_threshold: a fraction of N in [0, 1], got {o['ess_threshold']!r}")
        if not isinstance(o["correct"], bool):
            raise ValueError(f"options.correct: true or false, got {o['correct']!r}")
        check_flow_fraction(o)
        check_rejuvenation(o)
        check_inflation(o["inflation"])
        if o["linearisation"] not in LINEARISATIONS:
            raise ValueError(f"options.linearisation: one of {list(LINEARISATIONS)}, got {o['linearisation']!r}")
        check_moves(o)
        if o["evidence"] not in EVIDENCE:
            raise ValueError(f"options.evidence: one of {list(EVIDENCE)}, got {o['evidence']!r}")
        if o["correct"] and (net is not None or o["track_density"]):
            raise ValueError(
                "options.correct: the importance correction weights the base flow (an affine map whose Jacobian "
                "cancels); it does not run with an operator's learned residual or with track_density"
            )
        if not (o["marginal"] is True or o["marginal"] is False or o["marginal"] == "auto"):
            raise ValueError(f'options.marginal: expected "auto", true or false, got {o["marginal"]!r}')
        self._untrained: dict[int, MPFVelocity] = {}

    def marginal_refusal(self, model: ModelFamily) -> str | None:
        """Why the marginal particle filter (:mod:`~mpflow.operators.mpf.marginal`) cannot run ``model`` under
        these options, or None when it can: it needs sequential quasi-Monte Carlo's one-dimensional problems (a
        dynamic family with d = 1 or factorised per dimension, Q > 0) and the base flow's affine map."""
        o = self.options
        if o["network"] is not None or o["track_density"] or o["flow_fraction"] != 1:
            return "it weights the base flow's affine map (no operator, track_density or flow_fraction)"
        return sqmc_refusal(model) if model.state_dim == 1 else factorise_refusal(model)

    def uses_marginal(self, model: ModelFamily) -> bool:
        """Whether the steps of ``model`` run the marginal particle filter (option ``marginal``): where it applies,
        and for ``auto`` not on a linear-Gaussian family, whose flow is already exact."""
        marginal = self.options["marginal"]
        if marginal is False or (marginal == "auto" and model.linear_gaussian):
            return False
        return self.marginal_refusal(model) is None

    def _prediction(self, state: ParticleState, model: ModelFamily, gens: Generators) -> Prediction | None:
        """The step's predict; for the marginal particle filter by sequential quasi-Monte Carlo, per dimension, from
        the weighted cloud the last step carried (:func:`factorised.carried`; the stream's particles where there is
        none), its predictive moments per dimension (a factorised family's dimensions are independent)."""
        if not self.uses_marginal(model):
            return super()._prediction(state, model, gens)
        split = model if model.state_dim == 1 else model.per_dimension(state.batch_size)
        return factorised.prediction(state, split, gens, replicates=2)  # two blocks: marginal.crossed_maps

    @staticmethod
    def runs_operator(options: dict) -> bool:
        """Whether a stream with these ``options`` can run a trained operator: not with ``correct``, whose weights
        are those of the base flow (its affine map's Jacobian cancels; a learned residual's would not)."""
        return not options.get("correct", False)

    def check_compatible(self, model: ModelFamily, prior: Prior | None = None) -> None:
        super().check_compatible(model, prior)
        if self.record is not None and (
            self.record.family != model.name or not serves_dimension(self.record.state_dim, model)
        ):
            raise ValueError(
                f"method: operator {self.record.name} is for {self.record.family} with d = {self.record.state_dim}, "
                f"not {model.name} with d = {model.state_dim}"
            )
        net = self.options["network"]
        if net is not None and net.dim < model.state_dim and self.options["track_density"]:
            raise ValueError(
                f"options.track_density: the operator (d = {net.dim}) serves d = {model.state_dim} one dimension at "
                "a time, where the joint density is not tracked: set track_density to false"
            )
        if self.options["flow_fraction"] != 1 and not (model.gaussian_observation and model.linear_observation()):
            raise ValueError(
                f"options.flow_fraction: the weighted share of the likelihood needs a linear observation "
                f"o = H x + N(0, R); {model.name} observes here through a nonlinear h(x): set flow_fraction to 1"
            )
        reason = self.marginal_refusal(model) if self.options["marginal"] is True else None
        if reason is not None:
            raise ValueError(f'options.marginal: the marginal particle filter does not apply: {reason}; use "auto"')
        if self.options["moves"] != "auto" and self.options["moves"] > 0:
            if model.dynamic:
                raise ValueError(
                    f"options.moves: posterior moves are for static families; {model.name} is dynamic (its "
                    "transition noise moves the particles; use correct: true to weight the flow)"
                )
            if _mixture(prior):
                raise ValueError(
                    "options.moves: posterior moves need the prior's density as a Gaussian (or particles, which "
                    "enter as their fitted Gaussian); this prior is a mixture: set moves to 0"
                )

    def moves(self, model: ModelFamily) -> int:
        """The posterior moves a step of ``model`` runs (:mod:`mpflow.operators.mpf.posterior_moves`): the option,
        or for ``auto`` ``MOVES`` on a static family with a log-concave likelihood (0 with ``correct`` or
        ``track_density``, whose weights and densities the moves would not keep)."""
        o = self.options
        if o["moves"] != "auto":
            return o["moves"]
        plain = not (o["correct"] or o["track_density"])
        return posterior_moves.MOVES if plain and not model.dynamic and model.posterior_moves else 0

    def step_work(self, model: ModelFamily, n: int, dt: float = 1.0, k: int | None = None) -> StepWork:
        """The predict of a particle method (:meth:`Updater.step_work`), then up to ``max_substeps`` stages, each
        a re-fit of the likelihood (``POSTERIOR_ITERATIONS`` of every particle's score) and ``steps`` RK4 steps of
        the velocity (4 evaluations: the base flow's d × d map, 4 d², and a trained network's 2 flops per
        weight), and the posterior moves (``moves`` × (``window`` + 1) likelihoods per particle); with ``evidence:
        "mixture"`` the importance estimate's pairs of draws and components (:func:`mixture_evidence.work`), and for
        the marginal particle filter its pairs of points and components (:func:`marginal.work`)."""
        base = super().step_work(model, n, dt, k)
        net = self.options["network"]
        weights = sum(p.numel() for p in net.parameters()) if net is not None else 0
        likelihood = model.likelihood_flops(k)
        stage = 4.0 * self.options["steps"] * (4.0 * model.state_dim**2 + 2.0 * weights)
        stage += POSTERIOR_ITERATIONS * likelihood
        moves = self.moves(model) * (self.options["window"] + 1) * likelihood
        flops, peak = base.flops + n * (self.options["max_substeps"] * stage + moves), 2.0 * base.bytes
        if self.options["evidence"] == "mixture" and model.dynamic:
            extra_flops, extra_bytes = mixture_evidence.work(model, n)
            flops, peak = flops + extra_flops, max(peak, extra_bytes)
        if self.uses_marginal(model):
            extra_flops, extra_bytes = marginal.work(model.state_dim, n)
            flops, peak = flops + extra_flops, max(peak, extra_bytes)
        return StepWork(flops, peak)

    def base_flow(self, dim: int) -> MPFVelocity:
        """The zero residual: the exact Daum–Huang flow of dimension ``dim``."""
        if dim not in self._untrained:
            with torch.inference_mode(False):  # normal parameters, even when first built inside a step
                self._untrained[dim] = MPFVelocity(dim, linearisation=self.options["linearisation"]).eval()
        return self._untrained[dim]

    def is_base_flow(self, net: MPFVelocity) -> bool:
        """Whether ``net`` is the zero residual (:meth:`base_flow`), not a trained operator's network."""
        return net is self._untrained.get(net.dim)

    def network(self, dim: int, model: ModelFamily | None = None) -> MPFVelocity:
        """The flow a step of ``model`` runs: the operator's, except for a linear-Gaussian likelihood, where the
        base flow is exact and the residual is held at exactly zero (a learned residual could only add error
        there); without an operator, the base flow."""
        net = self.options["network"]
        if net is None or (model is not None and model.linear_gaussian):
            net = self.base_flow(dim)
        if net.dim != dim and not (model is not None and serves_dimension(net.dim, model)):
            raise ValueError(f"options.network: the operator is for d = {net.dim}, the model has d = {dim}")
        return net

    def autograd_free(self) -> bool:
        """Serving's step (no density tracking) needs no autograd; tracking takes ∇·f by autograd."""
        return not self.options["track_density"]

    def _init(self, state: ParticleState, prior: Prior, model: ModelFamily, gens: Generators) -> ParticleState:
        x = state.particles
        if isinstance(prior, GaussianMixture) and prior.weights.shape[1] == 1:
            x = gaussian.moment_matched(x, *prior.moments())
        if self.moves(model) and not _mixture(prior):
            # the moves' target starts at the prior (a particle prior: its fitted Gaussian)
            gap = model.missing_observation(x.dtype)
            placeholder = gap.expand(state.batch_size, *gap.shape)
            moments = prior.moments() if isinstance(prior, GaussianMixture) else gaussian.moments(x.double())
            state = Sites.start(*moments, placeholder, self.options["window"]).write(state)
        if self.uses_marginal(model):  # the first step's mixture predictive is over the prior's particles
            state = factorised.carry(state, x)
        if not self.options["track_density"]:
            return state.replace(particles=x)
        if isinstance(prior, GaussianMixture):
            log_q = prior.to(torch.float64).log_prob(x.double()).to(x.dtype)
        else:  # a particle prior has no density: use its fitted Gaussian's
            mean, cov = gaussian.moments(x.double())
            log_q = gaussian.log_prob(x.double(), mean, gaussian.cholesky(cov)).to(x.dtype)
        return state.replace(particles=x, log_density=log_q)

    def from_particles(self, state: ParticleState, density: GaussianMixture | None = None) -> ParticleState:
        """A tracked log-density does not follow particles another method moved: where the state carries one it
        becomes the log-density of the Gaussian fitted to the particles. ``density`` is not used (the flow
        starts from the particles). The marginal particle filter's carried cloud (:func:`factorised.carried`) becomes
        these particles with their weights."""
        state = factorised.adopted(state)
        if state.log_density is None:
            return state
        x = state.particles.to(torch.float64)
        mean, cov = gaussian.moments(x, state.log_weights)
        log_q = gaussian.log_prob(x, mean, gaussian.cholesky(cov)).to(state.log_density.dtype)
        return state.replace(log_density=log_q)

    def kept(self, state: ParticleState, model: ModelFamily) -> Kept:
        """Besides the base's, the marginal particle filter's carried cloud (:func:`factorised.kept`)."""
        return super().kept(state, model) | factorised.kept(state)

    def _observed_update(
        self,
        state: ParticleState,
        obs: torch.Tensor,
        model: ModelFamily,
        gens: Generators,
        prediction: Prediction | None = None,
    ):
        """The flow's step, then, on a stream that carries sites (:meth:`_init`), the posterior moves against the
        full observation ``obs`` (its NaN entries: not observed) and ``model``; the step reports their acceptance
        rate (``acceptance``)."""
        new, info = super()._observed_update(state, obs, model, gens, prediction)
        sites = Sites.read(state)
        if sites is None:
            return new, info
        x, sites, acceptance = sites.step(model, obs, new.particles, self.moves(model), gens)
        info.extras["acceptance"] = acceptance
        return sites.write(new.replace(particles=x)), info

    def _unobserved(self, state: ParticleState, obs: torch.Tensor, model: ModelFamily, gens: Generators):
        """A step without a measurement keeps the particles of a static family; its gap enters the moves' window
        (so a stream's window is always its last ``window`` steps)."""
        new, info = super()._unobserved(state, obs, model, gens)
        if factorised.carried(state) is not None:  # the predicted particles, uniformly weighted, are the next cloud
            new = factorised.carry(new, new.particles)
        sites = Sites.read(state)
        if sites is None:
            return new, info
        return sites.advance(model, obs, new.particles).write(new), info

    def resume(self, new: ParticleState, before: ParticleState, obs: torch.Tensor, model: ModelFamily):
        """After another method's step (a fall-back) the sites advance by its observation at its cloud, and the
        marginal filter carries its particles as its weighted cloud."""
        new = factorised.adopted(self.from_particles(new), self.uses_marginal(model))
        sites = Sites.read(before)
        return new if sites is None else sites.advance(model, obs, new.particles).write(new)

    def _flow(self, net, model, obs, x, log_q, white, stages: int, track: bool):
        """The flow of one Bayes step in ``stages`` tempered stages → (x1, log q1, the step's health ESS [B] where the
        flow computed it on the way — the one-dimensional base flow in one stage — else None)."""
        base = self.is_base_flow(net)
        if base and net.dim == 1 and not track and not model.linear_gaussian and net.linearisation != "importance":
            # the same flow, element-wise, from the moments ``white`` already holds
            iterations = POSTERIOR_ITERATIONS if net.linearisation == "posterior" else 0
            moments = (white.mean[:, None], white.chol.square())
            x1, n_eff = scalar_base_flow(model, obs, x, stages, moments, iterations)
            return x1, None, n_eff
        stage_model = tempered(model, stages)
        x1, log_q1 = x, log_q
        for stage in range(stages):
            x1, log_q1 = flow_step(
                net,
                stage_model,
                obs,
                x1,
                log_q1,
                method=self.options["solver"],
                steps=self.options["steps"],
                divergence="auto" if track else "none",
                whitened=white if stage == 0 else None,
                residual=not base,
            )
        return x1, log_q1, None

    def _update(
        self,
        state: ParticleState,
        obs: torch.Tensor,
        model: ModelFamily,
        gens: Generators,
        prediction: Prediction | None = None,
    ):
        if self.uses_marginal(model):
            return self._marginal_update(state, obs, model, gens, prediction)
        if self.options["correct"]:
            return self._corrected_update(state, obs, model, gens, prediction)
        B, N, d = state.particles.shape
        o = self.options
        track = o["track_density"]
        x, log_q, white = predict(
            model,
            state.particles,
            gens,
            state.log_weights,
            density=track,
            inflation=float(o["inflation"]),
            propagated=prediction,
        )
        if log_q is None and track:
            log_q = state.log_density
        with torch.no_grad():
            inc = self.step_evidence(model, obs, x)
            net = self.network(d, model)
            # the cloud the step starts from, whitened once: the flow's first stage and the health check read it
            white = white if white is not None else gaussian.whiten(x.detach().double())
            by_dimension = d > 1 and not track and (self.is_base_flow(net) or net.dim == 1)
            split = model.per_dimension(B) if by_dimension else None
            if split is not None:
                # a factorised family's flow, one dimension at a time (the base flow element-wise: no d × d algebra,
                # and no Monte Carlo cross-terms in the fitted likelihood; a d = 1 operator: on B·d one-dimensional
                # streams); the step's ESS is the smallest over dimensions
                x_dims = correction.to_dimensions(x)
                x1, _, n_eff, _ = self._staged_flow(
                    net if net.dim == 1 else self.base_flow(1),
                    split,
                    correction.to_dimensions(obs),
                    x_dims,
                    None,
                    correction.split_whitened(white, x_dims),
                    False,
                )
                x1, n_eff = correction.from_dimensions(x1, d), n_eff.reshape(B, d).min(-1).values
                log_q1 = None
            else:
                x1, log_q1, n_eff, _ = self._staged_flow(net, model, obs, x, log_q, white, track)
            predictive = None
            if white is not None and model.dynamic:
                predictive = (white.mean, white.chol @ white.chol.transpose(-1, -2))
            info = self.mixture_evidence(model, obs, state, x1, predictive, gens, inc, n_eff)
        return state.replace(particles=x1, log_density=log_q1), info

    def mixture_evidence(self, model, obs, before: ParticleState, x1, predictive, gens, inc, n_eff) -> StepInfo:
        """The step's info; with ``evidence: "mixture"`` its evidence estimated by defensive importance sampling of
        the exact mixture predictive over the previous cloud (:mod:`mpflow.operators.mixture_evidence`), the flowed
        cloud x1 guiding the proposal, and the estimate's standard error as ``log_evidence_sd``. ``inc`` (the
        predictive Gaussian fit's, :meth:`step_evidence`) by default, and where the family has no transition
        density, the step has no predictive fit (a static family, N ≤ d) or the estimate is not finite."""
        if self.options["evidence"] != "mixture" or predictive is None or not model.dynamic:
            return StepInfo(inc, n_eff)
        found = mixture_evidence.defensive_evidence(
            model, obs, before.particles, before.log_weights, x1, predictive, gens
        )
        if found is None:
            return StepInfo(inc, n_eff)
        ok = torch.isfinite(found.log_z) & torch.isfinite(found.sd)
        inc = torch.where(ok, found.log_z, inc.to(torch.float64))
        return StepInfo(inc, n_eff, None, {"log_evidence_sd": torch.where(ok, found.sd, torch.zeros_like(found.sd))})

    @staticmethod
    def step_evidence(
        model: ModelFamily, obs: torch.Tensor, x: torch.Tensor, moments: list[torch.Tensor] | None = None
    ) -> torch.Tensor:
        """log p(o_m | o_<m) [B] for the predicted cloud x [B, N, d]: the flow treats its predictive as the Gaussian
        of the cloud's moments (step 1 maps the cloud onto them), so the step's evidence is that Gaussian's,
        without Monte Carlo noise where it has a closed form or a quadrature (a linear observation; a factorised
        likelihood: :func:`~mpflow.operators.evidence.gaussian_fit`), else the particle average
        log mean_i p(o | x_i). On the GBP/USD returns (``benchmarks.evidence``) the particle average of N = 256 was
        up to 0.58 nat low at the largest outlier, the Gaussian's at most 0.15. ``moments``: the predictive's
        (mean, cov) where the step knows them exactly (the corrected flow's pushed moments), else the cloud's."""
        if moments is not None or x.shape[1] > x.shape[2]:
            mean, cov = moments if moments is not None else gaussian.moments(x.to(torch.float64))
            fit = evidence.gaussian_fit(model, obs, mean, cov)
            if fit is not None:
                return fit
        return evidence.predictive(model.log_likelihood(obs, x))

    def _staged_flow(self, net, model, obs, x, log_q, white, track: bool, corrected: bool = False):
        """The flow of one Bayes step in ``substeps`` stages and its health ESS; the streams whose ESS is low run it
        again in more stages (module docstring, 5.) → (x1, log q1, ESS [B], None). ``corrected``: the health ESS is
        that of the correction's weights (:func:`~mpflow.operators.mpf.correction.log_weights`, ``white`` the
        predictive's fit), returned as the fourth item [B, N]."""
        o = self.options
        B, N, d = x.shape
        stages = o["substeps"]

        def health(m, ob, wh, moved) -> tuple[torch.Tensor, torch.Tensor | None]:
            """(ESS [B], the correction's log-weights [B, N] or None) of a flowed cloud."""
            if not corrected:
                return flow_ess(m, ob, wh, moved), None
            lw = correction.log_weights(m, ob, wh, moved)
            return ess(lw), lw

        log_w = None
        if corrected and stages == 1 and self._fitted_in_closed_form(model, x):
            # the base flow in one stage is the posterior fit's own map: its points and weights, computed once
            fit = posterior_fit(model, obs, x, white, model.score(obs, x), POSTERIOR_ITERATIONS)
            x1, log_q1, n_eff, log_w = fit.points, None, ess(fit.log_weights), fit.log_weights
        else:
            x1, log_q1, n_eff = self._flow(net, model, obs, x, log_q, white, stages, track)
        # a cloud of N ≤ d has no Gaussian fit: no health signal; with a linear-Gaussian likelihood the step is the
        # exact base flow from the predictive's Gaussian fit, in closed form, whose weights are uniform (N;
        # tests/unit/test_tempered_substeps.py checks flow_ess there)
        if not corrected and (d >= N or (model.linear_observation() and self.is_base_flow(net))):
            return x1, log_q1, torch.full((B,), float(N), dtype=torch.float64), None
        if log_w is None and (corrected or n_eff is None):  # the scalar flow's own ESS is the uncorrected health's
            n_eff, log_w = health(model, obs, white, x1)
        # the correction a low ESS triggers: the streams below the threshold — only those — run the step again in
        # twice as many tempered stages, up to max_substeps (from the same predicted particles: deterministic, and
        # a stream's result does not depend on the others in its batch)
        while stages < o["max_substeps"] and bool((low := n_eff < o["ess_threshold"] * N).any()):
            stages = min(2 * stages, o["max_substeps"])
            rows = low.nonzero().flatten()
            sub_model, sub_obs = model.select(rows), obs[rows]
            sub_white = white.select(rows)
            sub_log_q = None if log_q is None else log_q[rows]
            x1_rows, log_q1_rows, _ = self._flow(net, sub_model, sub_obs, x[rows], sub_log_q, sub_white, stages, track)
            x1 = x1.index_copy(0, rows, x1_rows)
            log_q1 = None if log_q1 is None else log_q1.index_copy(0, rows, log_q1_rows)
            n_eff_rows, log_w_rows = health(sub_model, sub_obs, sub_white, x1_rows)
            n_eff = n_eff.index_copy(0, rows, n_eff_rows)
            log_w = None if log_w is None else log_w.index_copy(0, rows, log_w_rows)
        return x1, log_q1, n_eff, log_w

    def _fitted_in_closed_form(self, model: ModelFamily, x: torch.Tensor) -> bool:
        """Whether a one-stage base flow of ``model`` from the cloud x [B, N, d] is the map of
        :func:`~mpflow.operators.mpf.daum_huang.posterior_fit` (the posterior linearisation of a nonlinear
        observation in d > 1; d = 1 runs :mod:`~mpflow.operators.mpf.scalar_flow`), which also gives the corrected
        flow's weights: then the step takes both from it instead of mapping and weighting the cloud again."""
        linear = model.linear_observation()
        return self.options["linearisation"] == "posterior" and not linear and 1 < x.shape[-1] < x.shape[1]

    def _corrected_update(
        self,
        state: ParticleState,
        obs: torch.Tensor,
        model: ModelFamily,
        gens: Generators,
        prediction: Prediction | None = None,
    ):
        """One corrected step (:mod:`mpflow.operators.mpf.correction`): propagate and moment-match, flow in
        ``substeps`` tempered stages, weight against the predictive's Gaussian fit (a stream whose weights' ESS is
        below ``ess_threshold``·N flows again in twice as many stages, up to ``max_substeps``) and resample — per
        dimension where the family factorises. A static family's resampled copies are then moved apart by the
        Liu–West kernel (it keeps the cloud's mean and covariance), as ``smc`` does. The step's ``ess`` is the
        weights' (the smallest over the dimensions). With ``flow_fraction`` γ < 1 (a linear observation) the flow
        takes γ of the likelihood and the weights the rest (:mod:`~mpflow.operators.mpf.kalman_particle`)."""
        if self.options["flow_fraction"] == AUTO:
            return self._auto_flow_update(state, obs, model, gens, prediction)
        B, N, d = state.particles.shape
        x_prev = state.particles
        x, predictive = x_prev, None
        if model.dynamic:
            x, mean, cov = prediction[:3] if prediction is not None else model.propagate(x_prev, gens)
            predictive = [mean, cov * float(self.options["inflation"]) ** 2]
        inc = self.step_evidence(model, obs, x, predictive)
        if self.options["flow_fraction"] < 1:
            rho = float(self.options["inflation"])
            if predictive is None:
                predictive = gaussian.moments(x.to(torch.float64))
            elif rho != 1.0:  # the cloud's anomalies × ρ, as its covariance's ρ² above
                x = gaussian.inflated(x, predictive[0], rho)
            u = rand(gens, [1], torch.float64).reshape(-1)
            x1, log_alpha = kalman_particle_step(model, obs, x, predictive[1], self.options["flow_fraction"], u, gens)
            return self._rejuvenated(state.replace(particles=x1), model, gens), StepInfo(inc, ess(log_alpha))
        split = model.per_dimension(B)
        u = rand(gens, [d if split is not None else 1], torch.float64).reshape(-1)
        full, pushed = (model, obs), predictive
        if split is not None:
            model, obs, x = split, *(correction.to_dimensions(t) for t in (obs, x))
            predictive = predictive and correction.marginals(*predictive)
        if predictive:
            white = gaussian.matched(x.double(), *predictive)
            x = white.points().to(x_prev.dtype)
        else:
            white = gaussian.whiten(x.double())
        base = self.base_flow(model.state_dim)
        x1, _, n_eff, log_w = self._staged_flow(base, model, obs, x, None, white, False, corrected=True)
        log_w = correction.tempered_to_ess(log_w, correction.MIN_ESS_FRACTION * N, current=n_eff)
        x1 = torch.gather(x1, 1, systematic_resample(log_w, u)[..., None].expand_as(x1))
        if split is not None:
            x1, n_eff = correction.from_dimensions(x1, d), n_eff.reshape(B, d).min(-1).values
            model, obs = full
        info = self.mixture_evidence(model, obs, state, x1, pushed, gens, inc, n_eff)
        return self._rejuvenated(state.replace(particles=x1), model, gens), info

    def _marginal_update(
        self,
        state: ParticleState,
        obs: torch.Tensor,
        model: ModelFamily,
        gens: Generators,
        prediction: Prediction | None = None,
    ):
        """One step of the marginal particle filter with the flow as its proposal (:mod:`~mpflow.operators.mpf.
        marginal`), as d one-dimensional problems where the family factorises: the quasi-random predict from the
        weighted cloud the last step carried (:meth:`_prediction`, :func:`factorised.carried`), the moment match onto
        the predictive's pushed moments (× ``inflation``²) and the base flow in ``substeps`` stages, the weights
        against the exact mixture predictive, their evidence; the weighted points are carried to the next step
        (:func:`factorised.carry`) and the stream's particles are their sorted systematic resampling. The step's
        ``ess`` is the weights' (the smallest over the dimensions); a stream whose flow was not affine keeps the
        flowed cloud, uniformly weighted, and the predictive Gaussian fit's evidence. ``log_evidence_sd``: the
        increment's standard error, the carried cloud's share included (:func:`marginal.log_evidence_sd`, summed
        in variance over the dimensions; NaN where the stream kept the Gaussian fit's evidence)."""
        B, N, d = state.particles.shape
        if prediction is None:
            prediction = self._prediction(state, model, gens)
        split = model if d == 1 else model.per_dimension(B)
        x_pred, obs_d = (correction.to_dimensions(t) for t in (prediction.particles, obs))
        x_prev, prev_lw = factorised.carried(state) or (correction.to_dimensions(state.particles), None)
        mean, cov = prediction.mean, prediction.cov * float(self.options["inflation"]) ** 2
        inc = self.step_evidence(model, obs, prediction.particles, [mean, cov])
        x1 = torch.empty_like(x_pred)
        for half in marginal.halves(N):  # two clouds, each flowed alone (marginal.crossed_maps)
            white = gaussian.matched(x_pred[:, half].double(), *correction.marginals(mean, cov))
            x0 = white.points().to(x_prev.dtype)
            x1[:, half] = self._staged_flow(self.base_flow(1), split, obs_d, x0, None, white, False)[0]
        found = marginal.log_weights(split, obs_d, x_prev, x_pred, x1, prev_lw)
        log_z = evidence.log_mean_exp(found.log_weights).reshape(B, d).sum(-1)
        affine = found.affine.reshape(B, d).all(-1)
        log_w = torch.where(found.affine[:, None], found.log_weights, torch.zeros_like(found.log_weights))
        x1 = factorised.read_copy(found.points, log_w, gens, d)
        n_eff = ess(log_w).reshape(B, d).min(-1).values
        ok = affine & torch.isfinite(log_z)
        inc = torch.where(ok, log_z, inc.to(torch.float64))
        sd = torch.where(ok, found.log_sd.reshape(B, d).square().sum(-1).sqrt(), math.nan)  # independent dimensions
        new = factorised.carry(state.replace(particles=x1), correction.from_dimensions(found.points, d), log_w)
        return new, StepInfo(inc, n_eff, None, {"log_evidence_sd": sd})

    def _rejuvenated(self, state: ParticleState, model: ModelFamily, gens: Generators) -> ParticleState:
        """The corrected step's resampled cloud, its copies moved apart by the Liu–West kernel (which keeps the
        cloud's mean and covariance) where ``rejuvenate`` asks for it, as ``smc`` does."""
        if not rejuvenates(self.options["rejuvenate"], model):
            return state
        x = state.particles
        return state.replace(particles=liu_west_moves(x, x, None, gens, float(self.options["shrinkage"])))

    def _auto_flow_update(
        self,
        state: ParticleState,
        obs: torch.Tensor,
        model: ModelFamily,
        gens: Generators,
        prediction: Prediction | None = None,
    ):
        """The corrected flow with its share γ chosen per stream and step, weights carried (``flow_fraction:
        "auto"``; :func:`~mpflow.operators.mpf.kalman_particle.adaptive_kalman_particle_step`):

        1. predict    the particles through the transition, with the weighted moments (m, C) of the result, its
                      anomalies × ``inflation`` ρ;
        2. rescue     a stream whose innovation fails the consistency test has its anomalies inflated until the
                      predictive's spread matches it (:mod:`~mpflow.operators.mpf.consistency`);
        3. evidence   log p(o_m | o_<m) ≈ log Σᵢ w̄ᵢ p(o_m | xᵢ), as ``smc``'s;
        4. flow       the smallest share γ whose component weights α keep ESS ≥ ``ess_threshold``·N (0 on most
                      steps: the bootstrap update), weights w ← w α;
        5. resample   the streams whose weights' ESS fell below ``ess_threshold``·N (systematic), their copies moved
                      apart by the Liu–West kernel where ``rejuvenate`` asks for it, as ``smc`` does.

        The step reports the weights' ESS before resampling, the share it took (``flow_fraction``, 0: none) and
        whether it rescued the stream (``rescued``)."""
        B, N, d = state.particles.shape
        prev_lw = torch.log_softmax(state.log_weights.to(torch.float64), -1)
        if model.dynamic:
            if prediction is None:
                prediction = Prediction(*model.propagate(state.particles, gens, state.log_weights))
            x, mean, cov = prediction[:3]
        else:
            x = state.particles
            mean, cov = gaussian.moments(x.to(torch.float64), state.log_weights)
        rho = float(self.options["inflation"])
        if rho != 1.0:
            x, cov = gaussian.inflated(x, mean, rho), cov * rho**2
        x, cov, rescued = consistency.inflate_diverged(model, obs, x, mean, cov)
        ll = torch.nan_to_num(model.log_likelihood(obs, x).to(torch.float64), nan=-math.inf)
        inc = evidence.predictive(ll, prev_lw)
        floor = float(self.options["ess_threshold"])
        x, log_alpha, gamma = adaptive_kalman_particle_step(model, obs, x, ll, cov, floor, gens)
        lw = torch.log_softmax(prev_lw + log_alpha, -1)
        n_eff = ess(lw)
        a = float(self.options["shrinkage"]) if rejuvenates(self.options["rejuvenate"], model) else None
        x, lw = resample_low_ess(x, lw, n_eff < floor * N, gens, a)
        info = StepInfo(inc, n_eff, None, {"flow_fraction": gamma, "rescued": rescued})
        return state.replace(particles=x, log_weights=lw.to(state.log_weights.dtype)), info

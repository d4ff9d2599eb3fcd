"""The model-family base class.

A family is a small class whose parameters are tensors with a leading batch dimension B (one row per
stream), so B streams with different parameters are updated in one tensor call. Particles are
x [B, N, d]; one step's observation is obs [B, *obs_shape]; a sequence is [B, T, *obs_shape].

Subclasses declare ``name``, ``dynamic``, ``spec`` (their parameters and catalogue text: a
:class:`~mpflow.operators.models.spec.FamilySpec`) and implement ``log_likelihood``; they may override ``score``
with a closed form (the default differentiates ``log_likelihood`` with autograd), and dynamic families give their
transition as x_m = F x_{m-1} + c + N(0, Q) through ``transition_affine`` — or, nonlinear
(``affine_transition = False``), as x_m = f(x_{m-1}) + N(0, Q) through ``transition`` and ``transition_mean``.
Families with an observation o = h(x) + N(0, R) (``gaussian_observation``) give h and R (``observation_function``,
``observation_noise``) for the ensemble and unscented Kalman filters, and every residual o − h(x) goes through
``observation_residual``.

Gaps, time and inputs: :meth:`ModelFamily.read_observation` reads JSON observations with ``null`` (none, or
entries not observed: NaN in the tensor), :meth:`ModelFamily.observed_part` conditions on the observed entries of a
partial observation (families with ``partial_observations``), :meth:`ModelFamily.at_step` is the model of a step of
duration dt with inputs u, and :meth:`ModelFamily.observation_draws` draws observations for forecasts.

A family class is its probabilistic model; a new family is one file (plus its entry point in the group
``mpflow.families``, which puts it in :data:`mpflow.operators.models.FAMILIES`;
:mod:`mpflow.operators.models.plugins`). Around the model:

* its parameters as the API takes them and the catalogue's text (``GET /v1/models``) are its ``spec``
  (:mod:`mpflow.operators.models.spec`); the names of the state's dimensions are :meth:`ModelFamily.state_names`
  (the stream document's ``state_names``);
* the cost of its work, for the service's cost model (:mod:`mpflow.service.streams.costs`): the integration sub-steps of
  a step (:meth:`ModelFamily.integration_substeps`, bounded by the service before any step runs) and the
  floating-point operations of one particle's step (:meth:`ModelFamily.particle_flops`);
* what a trained operator's task distribution covers (:meth:`ModelFamily.task_domain`) and how a stream is
  measured against it (:meth:`ModelFamily.domain_measures`; checked by
  :func:`mpflow.operators.trained_operators.outside_domain`);
* :meth:`ModelFamily.posterior_modes` (mode-fraction diagnostics) and :meth:`ModelFamily.example_params`
  (``mpflow filter``, the plugin check).

Its meta-training task distribution, evaluation and benchmark settings are the training side's
(:mod:`mpflow.training.task_distribution`).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
from mpflow.operators import gaussian, validation
from mpflow.operators.models.param_priors import ParamPrior
from mpflow.operators.models.spec import FamilySpec, learnable_param, read_params
from mpflow.operators.rng import Generators, randn


class ModelFamily:
    """A model family: p(o | x) and, for a dynamic family, p(x_m | x_{m-1}), for B streams at once (module
    docstring). A plugin subclasses it and gives at least ``name``, :attr:`obs_shape`, :meth:`log_likelihood` and
    :meth:`sample_observation` (what :func:`mpflow.operators.models.plugins.family_problem` checks), ``spec`` when
    it takes parameters, and a dynamic one its transition. Every other method has a default that works from those."""

    #: the family's name: the API's ``model.family`` and the name of its entry point in ``mpflow.families``
    name: ClassVar[str]
    #: the state moves between steps (a transition); False: a static state, learned from every observation
    dynamic: ClassVar[bool] = False
    #: exact Kalman/conjugate updates apply (linear transition and linear-Gaussian observation)
    linear_gaussian: ClassVar[bool] = False
    #: the parameters as the API takes them and the catalogue's text (:mod:`mpflow.operators.models.spec`)
    spec: ClassVar[FamilySpec] = FamilySpec()
    #: fixed state dimension, when the family has one (gmm: 2)
    fixed_state_dim: ClassVar[int | None] = None
    #: the likelihood can condition on some entries of an observation alone (``null`` entries: not observed)
    partial_observations: ClassVar[bool] = False
    #: the smallest state dimension the family is defined for (lorenz96: 4)
    min_state_dim: ClassVar[int] = 1
    #: a dynamic family's transition is x_m = F x_{m-1} + c + N(0, Q) (:meth:`transition_affine`); False: it is
    #: x_m = f(x_{m-1}) + N(0, Q) with a nonlinear f (:meth:`transition_mean`), and only the methods that read the
    #: transition through :meth:`transition` / :meth:`transition_mean` run it (``Updater.nonlinear_transition``)
    affine_transition: ClassVar[bool] = True
    #: the observation is o = h(x) + N(0, R) with an explicit h (:meth:`observation_function`) and R
    #: (:meth:`observation_noise`): what the ensemble and unscented Kalman filters (``enkf``, ``ukf``) need
    gaussian_observation: ClassVar[bool] = False
    #: ``mpf`` runs posterior moves (Langevin, :mod:`mpflow.operators.mpf.posterior_moves`) on this static family by
    #: default: its log-likelihood is concave in x (the moves mix) and not quadratic (where the flow is exact)
    posterior_moves: ClassVar[bool] = False
    #: every model of the family factorises over its dimensions (:meth:`per_dimension` never returns None), so an
    #: ``mpf`` operator trained at d = 1 serves every d, one dimension at a time
    factorised: ClassVar[bool] = False
    #: the parameters that set how many numerical-integration sub-steps a step runs (``lorenz96``: delta,
    #: rk4_step; :meth:`integration_substeps`), named when a step would run too many; empty: closed form
    substep_params: ClassVar[tuple[str, ...]] = ()
    #: the work of one integration sub-step whatever the particle count, in floating-point operations' worth: the
    #: launch of its tensor operations (:meth:`step_fixed_flops`)
    substep_overhead_flops: ClassVar[float] = 0.0
    #: the range of a learnable parameter's value where the family defines one narrower than its parser's
    #: (:meth:`param_domain`; ``stochastic_volatility``: σ > 0, |φ| < 1)
    param_domains: ClassVar[dict[str, tuple[float, float]]] = {}
    #: the unknown parameters a learned parameter observer of the family answers
    #: (:mod:`mpflow.operators.param_observer`), each as (name, the coordinate v it is answered in — "log", "atanh"
    #: or "identity" — and whether v moves by log c² when the observations are scaled by c); empty: none
    observer_params: ClassVar[tuple[tuple[str, str, bool], ...]] = ()

    def __init__(self, params: dict[str, torch.Tensor], state_dim: int):
        self.params = params
        self.state_dim = state_dim
        #: the parameters given as priors (:mod:`mpflow.operators.models.param_priors`), set by :meth:`from_params`
        #: on a stream's model; their entries in ``params`` hold the unit value (θ = 1: 1, 1·1 or I) that
        #: :meth:`at_values` scales
        self.unknown: dict[str, ParamPrior] = {}

    # ----------------------------------------------------------------- construction
    @classmethod
    def from_params(
        cls, params: dict[str, Any] | None, state_dim: int, dtype: torch.dtype = torch.float32
    ) -> ModelFamily:
        """Validate the API's ``model.params`` for one stream and build a B = 1 model."""
        params = dict(params or {})
        validation.positive_int("state_dim", state_dim)
        if cls.fixed_state_dim is not None and state_dim != cls.fixed_state_dim:
            raise ValueError(
                f"prior: the {cls.name} family has a {cls.fixed_state_dim}-dimensional state, got {state_dim}"
            )
        if state_dim < cls.min_state_dim:
            raise ValueError(
                f"prior: the {cls.name} family needs at least {cls.min_state_dim} dimensions, got {state_dim}"
            )
        parsed, unknown = read_params(cls, params, state_dim, dtype)
        model = cls({k: v[None] for k, v in parsed.items()}, state_dim)
        model.check()
        return model._learning(unknown)

    # ----------------------------------------------------------------- unknown parameters (priors)
    @classmethod
    def param_unit(cls, name: str, params: dict[str, Any], state_dim: int, dtype: torch.dtype) -> torch.Tensor:
        """The value of a learnable parameter at θ = 1, shaped as the family's default: the identity for a
        covariance (θ·I), ones for a per-dimension vector (θ·1), 1 for a number. ``params``: the request's, for
        families whose shapes depend on another parameter (the observation noise on the rows of H)."""
        value = learnable_param(cls, name).default(state_dim, dtype)
        if value.dim() == 2:
            return torch.eye(value.shape[0], dtype=dtype)
        return torch.ones_like(value)

    def at_values(self, values: dict[str, torch.Tensor], rows: int) -> ModelFamily:
        """This model (batch B or 1) for ``rows`` = B·M θ-particles, M consecutive rows per stream, with the unknown
        parameters set: ``values[name]`` [B·M]; every other parameter is repeated for them and each unknown one is
        θ × its unit value (:meth:`param_unit`): the model of :mod:`~mpflow.operators.updaters.smc2`'s θ-particles."""
        R = rows
        reps = R // self.batch_size
        params = {
            k: v.expand(R, *v.shape[1:]) if v.shape[0] == 1 else v.repeat_interleave(reps, 0)
            for k, v in self.params.items()
        }
        for name, theta in values.items():
            unit = params[name]
            params[name] = theta.to(unit.dtype).reshape(R, *[1] * (unit.dim() - 1)) * unit
        return type(self)(params, self.state_dim)

    def observer_context(self) -> torch.Tensor | None:
        """The fixed parameters [B, c] a parameter observer of the family (:attr:`observer_params`) reads beside the
        observations; None where this model lies outside what such an observer was trained on (the default)."""
        return None

    @classmethod
    def observer_tasks(cls, n: int, gen: torch.Generator) -> tuple[ModelFamily, dict[str, torch.Tensor], torch.Tensor]:
        """n random tasks to train a parameter observer on (the family's broad task domain): (the model of n rows,
        the values [n] of each of :attr:`observer_params`, the initial states x_0 [n, d]), float64."""
        raise NotImplementedError(f"the {cls.name} family has no parameter observer")

    def check(self) -> None:
        """Cross-parameter checks (shapes that must agree); raise ValueError naming the field."""

    @classmethod
    def stack(cls, models: list[ModelFamily]) -> ModelFamily:
        dims = {m.state_dim for m in models}
        if len(dims) != 1:
            raise ValueError("models of different state dimensions cannot be batched")
        try:
            params = {k: torch.cat([m.params[k] for m in models]) for k in models[0].params}
        except RuntimeError as exc:
            raise ValueError(f"models with differently shaped parameters cannot be batched ({exc})") from None
        return cls(params, dims.pop())._learning(
            models[0].unknown if all(m.unknown == models[0].unknown for m in models) else {}
        )

    def _learning(self, unknown: dict[str, ParamPrior]) -> ModelFamily:
        """This model with ``unknown`` as its parameters given as priors (kept by :meth:`stack`, :meth:`select` and
        :meth:`to`: the same stream's model)."""
        self.unknown = unknown
        return self

    def select(self, rows: torch.Tensor) -> ModelFamily:
        """The streams ``rows`` (indices) of a batched model; a model of batch 1, shared by every stream, is
        returned as it is."""
        if self.batch_size == 1:
            return self
        return type(self)({k: v[rows] for k, v in self.params.items()}, self.state_dim)._learning(self.unknown)

    def to(self, dtype: torch.dtype) -> ModelFamily:
        return type(self)({k: v.to(dtype) for k, v in self.params.items()}, self.state_dim)._learning(self.unknown)

    @property
    def batch_size(self) -> int:
        return next(iter(self.params.values())).shape[0] if self.params else 1

    # ----------------------------------------------------------------- observations
    @property
    def obs_shape(self) -> tuple[int, ...]:
        """The shape of one step's observation (``(k,)`` for a vector of k entries); every family gives it."""
        raise NotImplementedError

    def parse_observation(self, value: Any, field: str = "observation", dtype=torch.float32) -> torch.Tensor:
        """Validate one step's observation from JSON → tensor of ``obs_shape``."""
        return validation.check_shape(field, validation.as_tensor(field, value, dtype), list(self.obs_shape))

    def missing_observation(self, dtype=torch.float32) -> torch.Tensor:
        """The observation of a step without a measurement: NaN everywhere, in the family's observation shape (one
        row where the shape is free). An updater given it predicts only (:meth:`Updater._predict`)."""
        return torch.full([1 if n < 0 else n for n in self.obs_shape], float("nan"), dtype=dtype)

    def read_observation(self, value: Any, field: str = "observation", dtype=torch.float32) -> torch.Tensor:
        """One step's observation from JSON, gaps included: ``None`` is a step without a measurement
        (:meth:`missing_observation`), an array with ``None`` entries a partial observation — NaN at the gaps,
        for families whose likelihood can condition on the observed entries alone (``partial_observations``;
        ValueError naming ``field`` for the others). A bare number is the observation ``[number]`` of a family whose
        observation is one number (``obs_shape`` (1,)). Everything else is :meth:`parse_observation`'s."""
        if value is None:
            return self.missing_observation(dtype)
        if isinstance(value, int | float) and not isinstance(value, bool) and tuple(self.obs_shape) == (1,):
            value = [value]
        if not _has_gaps(value):
            return self.parse_observation(value, field, dtype)
        whole = isinstance(value, list) and not any(v is not None for v in _leaves(value))
        if not (self.partial_observations or whole):
            raise ValueError(self._no_partial(field))
        t = self.parse_observation(_filled(value, 0.0), field, dtype)  # the shape, checked as for any observation
        if whole:
            return self.missing_observation(dtype)
        gaps = torch.as_tensor(_gap_mask(value), dtype=torch.bool).reshape(t.shape)
        return t.masked_fill(gaps, float("nan"))

    def observed_part(self, obs: torch.Tensor) -> tuple[ModelFamily, torch.Tensor]:
        """(model, obs) conditioning on the observed entries of obs [B, *obs_shape] only (NaN: not observed), for
        families with ``partial_observations``: a model of batch B whose log-likelihood of the returned obs (gaps
        filled) is log p(o_S | x), S the observed entries, exactly."""
        raise ValueError(self._no_partial("observations"))

    def _no_partial(self, field: str) -> str:
        return (
            f"{field}: the {self.name} family cannot condition on part of an observation; send all of it, or null "
            "for a step without a measurement"
        )

    def observation_log_offset(self) -> torch.Tensor:
        """[B]: the constant a partial observation's model (:meth:`observed_part`) adds to its Gaussian
        observation density so that it is the observed entries' (0 for a full observation)."""
        return torch.zeros(self.batch_size)

    def expanded(self, batch: int) -> dict[str, torch.Tensor]:
        """The parameters with the batch dimension ``batch`` (a shared B = 1 model's repeated)."""
        return {k: v.expand(batch, *v.shape[1:]) if v.shape[0] != batch else v for k, v in self.params.items()}

    # ----------------------------------------------------------------- likelihood
    def log_likelihood(self, obs: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """log p(o | x) for obs [B, *obs_shape], x [B, N, d] → [B, N]."""
        raise NotImplementedError

    def score(self, obs: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """∇x log p(o | x) → [B, N, d] (autograd unless a family gives the closed form).

        When x is part of a graph (an ODE whose divergence differentiates the velocity, which contains the
        score), the result stays differentiable in x, as the closed forms are; otherwise it is detached."""
        if torch.is_grad_enabled() and x.requires_grad:
            (g,) = torch.autograd.grad(self.log_likelihood(obs, x).sum(), x, create_graph=True)
            return g
        # an autograd-free step (``Updater.autograd_free``) runs in inference mode, whose tensors autograd cannot
        # save: differentiate normal copies of them
        with torch.inference_mode(False), torch.enable_grad():
            model = self
            if any(torch.is_inference(v) for v in self.params.values()):
                model = type(self)({k: v.clone() for k, v in self.params.items()}, self.state_dim)
            xg = x.detach().clone().requires_grad_(True)
            obs = obs.clone() if torch.is_inference(obs) else obs
            (g,) = torch.autograd.grad(model.log_likelihood(obs, xg).sum(), xg)
        return g

    def sample_observation(self, x: torch.Tensor, gens: Generators) -> torch.Tensor:
        """Draw o ~ p(o | x) for true states x [B, d] → [B, *obs_shape]."""
        raise NotImplementedError

    # ----------------------------------------------------------------- time and inputs
    def at_step(self, dt: float = 1.0, u: torch.Tensor | None = None, field: str = "observation") -> ModelFamily:
        """The model of one step that lasts ``dt`` (> 0) time units and carries the inputs ``u`` (a vector, or
        None): the model itself for a step of 1 without inputs. A static family's state does not move with time, so
        ``dt`` only has to be positive, and it takes no inputs; dynamic families override this with their
        transition over ``dt``. ValueError naming ``field``.dt or ``field``.u otherwise."""
        check_dt(dt, field)
        if u is not None:
            raise ValueError(f"{subfield(field, 'u')}: the {self.name} family takes no inputs")
        return self

    def observation_draws(self, x: torch.Tensor, gen: torch.Generator) -> torch.Tensor | None:
        """One draw o_{b,i} ~ p(o | x_{b,i}) under row b's parameters for each of the states x [B, N, d] →
        [B, N, *obs_shape], all from the one generator ``gen``, each kind of draw one call for all B·N states
        (forecasts: one stream's cloud is B = 1; ``smc2``'s forecast, a row per (θ, x) pair, N = 1 — the same
        numbers for the same states);
        None for a family whose observation has no predictive of its own (the default: ``logistic``, whose
        features are the caller's)."""
        return None

    # ----------------------------------------------------------------- dynamics
    def transition_affine(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(F [B,d,d], c [B,d], Q [B,d,d]) with x_m = F x_{m-1} + c + N(0, Q)."""
        raise TypeError(f"the {self.name} family is static: it has no transition")

    def predicted_moments(
        self, x: torch.Tensor, log_weights: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and covariance (float64) of the predictive of the cloud x [B, N, d] (``log_weights``: its weights):
        the cloud's moments (m, C) pushed through the affine transition, F m + c and F C Fᵀ + Q. A nonlinear
        transition x' = f(x) + N(0, Q) (``affine_transition`` False) has no closed form: the moments are those of
        the mapped cloud f(xᵢ), weighted, plus Q — the noise enters exactly, only the propagation of the cloud's
        spread through f is Monte Carlo (the ensemble forecast of an EnKF, Evensen 2003 eq. 20–21)."""
        if self.dynamic and not self.affine_transition:
            return self._mapped_moments(self.transition_mean(x), log_weights)
        return _pushed_moments(x, log_weights, *self.transition_affine())

    def _mapped_moments(self, fx: torch.Tensor, log_weights: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        mean, cov = gaussian.moments(fx.to(torch.float64), log_weights)
        return mean, cov + self.transition_noise().to(torch.float64)

    def propagate(
        self,
        x: torch.Tensor,
        gens: Generators,
        log_weights: torch.Tensor | None = None,
        *,
        moments_graph: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One draw of the transition and the predictive's moments together → (x' [B, N, d], mean, cov): what
        :meth:`transition` and :meth:`predicted_moments` give, with a nonlinear f applied to the cloud once
        (Lorenz-96's RK4 is most of a step's cost) instead of once for each. The moments are constants of the
        cloud (detached) unless ``moments_graph`` (``mpflow train --loss predictive``, whose score reads them)."""
        keep = (lambda t: t) if moments_graph else torch.Tensor.detach
        if not self.affine_transition:
            fx = self.transition_mean(x)
            return self.perturbed(fx, gens), *self._mapped_moments(keep(fx), log_weights)
        F, c, Q = self.transition_affine()
        return _affine_draw(x, gens, F, c, Q), *_pushed_moments(keep(x), log_weights, F, c, Q)

    def transition_mean(self, x: torch.Tensor) -> torch.Tensor:
        """f(x) of x_m = f(x_{m-1}) + N(0, Q) for x [B, N, d] → [B, N, d]: F x + c for an affine transition."""
        F, c, _ = self.transition_affine()
        return x @ F.transpose(-1, -2) + c[:, None]

    def transition_noise(self) -> torch.Tensor:
        """Q [B, d, d] of x_m = f(x_{m-1}) + N(0, Q)."""
        return self.transition_affine()[2]

    def transition_log_density(self, x_next: torch.Tensor, x_prev: torch.Tensor) -> torch.Tensor | None:
        """log p(x_next_j | x_prev_i) = log N(x_next_j; f(x_prev_i), Q) for every pair (j, i) of x_next [B, M, d] and
        x_prev [B, N, d] → [B, M, N] (float64): the transition density the exact mixture predictive
        Σ_i w_i p(x | x_prev_i) is made of (:mod:`mpflow.operators.mixture_evidence`). Computed as
        −½ (|a_j|² + |b_i|² − 2 a_j·b_i) − log|L| − d/2 log 2π with a = L⁻¹ x_next, b = L⁻¹ f(x_prev), LLᵀ = Q, so
        the pairs cost one [M, d] × [d, N] product, not an [M, N, d] tensor. None where there is no density: a static
        family, or a singular Q (a deterministic transition, Lorenz-96 with Q = 0)."""
        if not self.dynamic:
            return None
        chol, info = torch.linalg.cholesky_ex(self.transition_noise().to(torch.float64))
        if bool((info != 0).any()):
            return None
        f = self.to(torch.float64).transition_mean(x_prev.detach().to(torch.float64))
        a = torch.linalg.solve_triangular(chol, x_next.to(torch.float64).transpose(-1, -2), upper=False)  # [B, d, M]
        b = torch.linalg.solve_triangular(chol, f.transpose(-1, -2), upper=False)  # [B, d, N]
        sq = (a * a).sum(-2)[..., :, None] + (b * b).sum(-2)[..., None, :] - 2.0 * a.transpose(-1, -2) @ b
        half_logdet = torch.log(torch.diagonal(chol, dim1=-2, dim2=-1)).sum(-1)[:, None, None]
        return -0.5 * sq.clamp_min(0.0) - half_logdet - 0.5 * x_next.shape[-1] * math.log(2 * math.pi)

    # ----------------------------------------------------------------- cost (the service's cost model)
    def integration_substeps(self, dt: float = 1.0) -> float:
        """The sub-steps of numerical integration that one step of duration ``dt`` runs (the largest over the batch):
        1 for a transition in closed form (every family but ``lorenz96``). A float, which may be astronomically
        large: a caller compares it with its limit before running the step (:mod:`mpflow.service.streams.costs`)."""
        return 1.0

    def transition_flops(self) -> float:
        """Floating-point operations of one particle's transition over one sub-step: a dense F x and a correlated
        noise draw, about 4 d², for a dynamic family; 0 for a static one."""
        return 4.0 * self.state_dim**2 if self.dynamic else 0.0

    def observation_size(self) -> int:
        """The entries of one step's observation (one row where the shape is free: ``logistic``'s M)."""
        return math.prod(1 if n < 0 else n for n in self.obs_shape)

    def likelihood_flops(self, k: int | None = None) -> float:
        """Floating-point operations of one particle's log-likelihood (or score) of an observation of ``k`` entries
        (None: :meth:`observation_size`): about 2 d k + 10 k, a linear map and a few operations per entry."""
        k = self.observation_size() if k is None else k
        return 2.0 * self.state_dim * k + 10.0 * k

    def step_model_flops(self) -> float:
        """Floating-point operations of building the model of a step of another duration (:meth:`at_step`): 0 for
        a parameter rescaled; the continuous-time ``lds`` computes two matrix exponentials."""
        return 0.0

    def step_fixed_flops(self, dt: float = 1.0) -> float:
        """The work of a step of duration ``dt`` that does not grow with the particles: its model
        (:meth:`step_model_flops`) and the launch of every integration sub-step's operations."""
        return self.step_model_flops() + self.integration_substeps(dt) * self.substep_overhead_flops

    def particle_flops(self, dt: float = 1.0, k: int | None = None) -> float:
        """One particle's share of a step of duration ``dt`` observing ``k`` entries: its transition over every
        sub-step and its likelihood."""
        return self.transition_flops() * self.integration_substeps(dt) + self.likelihood_flops(k)

    # ----------------------------------------------------------------- additive Gaussian observations
    def linear_observation(self) -> bool:
        """Whether every stream's observation is o = H x + N(0, R), with (H, R) from ``observation_affine``: then a
        flow's Gaussian likelihood is the likelihood itself, not a fit (the linear-Gaussian families; ``lorenz96``
        without ``arctan``, whose transition is nonlinear)."""
        return self.linear_gaussian

    def observation_function(self, x: torch.Tensor) -> torch.Tensor:
        """h(x) of o = h(x) + N(0, R) for x [B, N, d] → [B, N, k] (families with ``gaussian_observation``)."""
        raise TypeError(f"the {self.name} family has no explicit observation function h(x) with additive noise")

    def observation_noise(self) -> torch.Tensor:
        """R [B, k, k] of o = h(x) + N(0, R) (families with ``gaussian_observation``)."""
        raise TypeError(f"the {self.name} family has no additive Gaussian observation noise")

    def observation_residual(self, obs: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """o − y for obs [B, k] and predicted observations y [B, N, k] → [B, N, k]: the one place a residual is
        formed, so that families with angles wrap it (range_bearing: the bearing's into [−π, π))."""
        return obs[:, None] - y

    def observation_cdf(self, obs: torch.Tensor, x: torch.Tensor, gens: Generators) -> torch.Tensor | None:
        """F_j(o_j | x_i) = P(O_j ≤ o_j | x_i) for each observed entry j of obs [B, *obs_shape] and state x [B, N, d]
        → [B, N, k] (float64): the conditional CDF that a predictive p-value averages over the predicted cloud
        (:func:`mpflow.operators.evidence.particle_pit`). For a discrete O_j it is randomised,
        P(O_j < o_j) + v_j P(O_j = o_j) with v_j ~ U(0, 1) from ``gens`` (Brockwell 2007), so that it is uniform under
        the model. The default, for o = h(x) + N(0, R): Φ((o − h(x))_j / √R_jj) (the residual as
        :meth:`observation_residual` forms it); None for a family without either (no p-value)."""
        if not self.gaussian_observation:
            return None
        return torch.special.ndtr(self._standardised_residual(obs, x))

    def _standardised_residual(self, obs: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """(o − h(x))_j / √R_jj [B, N, k] (float64) for o = h(x) + N(0, R): what the default conditional CDF and
        log tails (:meth:`observation_cdf`, :meth:`observation_log_tails`) read."""
        resid = self.observation_residual(obs.to(torch.float64), self.observation_function(x.to(torch.float64)))
        sd = self.observation_noise().to(torch.float64).diagonal(dim1=-2, dim2=-1).sqrt()
        return resid / sd[:, None]

    def observation_log_tails(
        self, obs: torch.Tensor, x: torch.Tensor, gens: Generators, cdf: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(log P(O_j ≤ o_j | x_i), log P(O_j ≥ o_j | x_i)) for each entry j of obs [B, *obs_shape] and state x
        [B, N, d] → two [B, N, k] (float64): the conditional log tails that the non-saturating log tails of a step
        (:func:`mpflow.operators.evidence.particle_log_tails`) log-sum-exp over the predicted cloud. The default, for
        o = h(x) + N(0, R) with the default :meth:`observation_cdf`: log Φ(±(o − h(x))_j / √R_jj) by
        ``torch.special.log_ndtr``, exact far in the tails. A family with only an :meth:`observation_cdf` of its own
        falls back to log F and log(1 − F) of it (``cdf``, when the caller has it already: the same randomisation
        for a discrete family), clamped at the smallest normal float64 — these saturate as F does (beyond about
        8.3 sd for a Gaussian), so such a family should override this method; None without either."""
        if self.gaussian_observation and type(self).observation_cdf is ModelFamily.observation_cdf:
            z = self._standardised_residual(obs, x)
            return torch.special.log_ndtr(z), torch.special.log_ndtr(-z)
        if cdf is None:
            cdf = self.observation_cdf(obs, x, gens)
        if cdf is None:
            return None
        return saturating_log_tails(cdf)

    def localisation_distances(self) -> torch.Tensor | None:
        """[B, d, k]: the distance between each state variable and each observed entry, for families where
        covariance localisation has a meaning (lorenz96: the distance around the ring); None (the default)."""
        return None

    def per_dimension(self, streams: int) -> ModelFamily | None:
        """This model for ``streams`` streams (B) as d one-dimensional models, batch B·d (row b·d + j: dimension j
        of stream b), when its transition and likelihood factorise over the dimensions — p(x' | x) = Π_j p(x'_j | x_j)
        and p(o | x) = Π_j p(o_j | x_j), o_j the j-th entry — so that with a factorised prior the posterior is the
        product of d one-dimensional ones; None (the default) when they do not."""
        return None

    def transition(self, x: torch.Tensor, gens: Generators) -> torch.Tensor:
        """Sample x_m ~ p(x_m | x_{m-1}) for x [B, N, d] (identity for static families): f(x) + N(0, Q)."""
        if not self.dynamic:
            return x
        if not self.affine_transition:
            return self.perturbed(self.transition_mean(x), gens)
        return _affine_draw(x, gens, *self.transition_affine())

    def perturbed(self, fx: torch.Tensor, gens: Generators) -> torch.Tensor:
        """fx [B, N, d] plus a draw of the transition noise N(0, Q) (:meth:`noise_added` of a standard-normal
        draw)."""
        return self.noise_added(fx, randn(gens, fx.shape[1:], fx.dtype))

    def noise_added(self, fx: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """fx [B, N, d] plus the transition noise made of the standard-normal draws z [B, N, d]: L z with LLᵀ = Q
        (needs Q positive definite; a family whose Q may be singular overrides it: ``lorenz96``'s √Q z)."""
        return _noise_added(fx, z, self.transition_noise())

    def transition_from_noise(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """The transition of x [B, N, d] driven by the given standard-normal noise z [B, N, d]: f(x) + L z with
        LLᵀ = Q — what :meth:`transition` draws, with the draw made by the caller: sequential quasi-Monte Carlo
        (:mod:`mpflow.operators.sqmc`) passes Φ⁻¹ of quasi-random points, and ``smc2``'s forecast one stream's draw
        for a model of a row per (θ, x) pair (each row its own parameters, one generator's call for them all).
        Identity for static families."""
        if not self.dynamic:
            return x
        if not self.affine_transition:
            return self.noise_added(self.transition_mean(x), z)
        F, c, Q = self.transition_affine()
        return _noise_added(x @ F.transpose(-1, -2) + c[:, None], z, Q)

    # ----------------------------------------------------------------- simulation
    def simulate(self, T: int, x0: torch.Tensor, gens: Generators) -> tuple[torch.Tensor, torch.Tensor]:
        """Simulate T steps from the true initial state x0 [B, d]: states [B, T, d] and
        observations [B, T, *obs_shape]. Static families keep x fixed; dynamic ones move it first."""
        xs, obs = [], []
        x = x0
        for _ in range(T):
            x = self.transition(x[:, None], gens)[:, 0]
            xs.append(x)
            obs.append(self.sample_observation(x, gens))
        return torch.stack(xs, 1), torch.stack(obs, 1)

    # ----------------------------------------------------------------- a trained operator's domain
    @classmethod
    def task_domain(cls, options: dict[str, Any]) -> dict[str, list[float]]:
        """The region the family's meta-training tasks (:mod:`mpflow.training.task_distribution`) cover under the
        task ``options``, as a range [lo, hi] per named quantity of a stream (:meth:`domain_measures`): what an
        operator trained on it has seen. It is recorded
        in the operator's config.json (``domain``) and checked when a stream is created
        (:func:`mpflow.operators.trained_operators.outside_domain`). Default — the Gaussian task prior N(μ, Σ):
        μ_i ~ N(0, 1), so |μ_i| ≤ 3 (3 sd), and Σ's eigenvalues in ``scale_range``; families add their parameters."""
        lo, hi = options.get("scale_range", DEFAULT_SCALE_RANGE)
        return {"prior mean": [-PRIOR_MEAN_BOUND, PRIOR_MEAN_BOUND], "prior variance": [float(lo), float(hi)]}

    def domain_measures(self, prior_mean: torch.Tensor, prior_cov: torch.Tensor) -> dict[str, tuple[float, float]]:
        """(smallest, largest) value of each quantity of :meth:`task_domain` for this one-stream model and a
        prior with mean [d] and covariance [d, d]."""
        return {
            "prior mean": span(prior_mean),
            "prior variance": span(torch.linalg.eigvalsh(prior_cov.to(torch.float64))),
        }

    # ----------------------------------------------------------------- evaluation and benchmarks
    @classmethod
    def posterior_modes(cls, x_true: torch.Tensor) -> torch.Tensor | None:
        """The posterior's modes [B, K, d] (float64) given the true states x_true [B, d], for families whose
        posterior is known to be multimodal (evaluation reports the particle weight nearest to each); None."""
        return None

    @classmethod
    def example_state_dim(cls) -> int:
        """The state dimension of the demonstration model (``mpflow filter`` without ``--dim``, the plugin check):
        the fixed one, else the smallest of at least 2."""
        return cls.fixed_state_dim or max(2, cls.min_state_dim)

    @classmethod
    def example_params(cls, d: int) -> dict[str, Any]:
        """Parameters of the demonstration model of ``mpflow filter`` (JSON form): the family's required
        parameters, where it has any (the defaults do the rest)."""
        return {}

    # ----------------------------------------------------------------- description
    @classmethod
    def state_names(cls, d: int) -> list[str] | None:
        """The names of the ``d`` state dimensions where the family gives them a meaning (``range_bearing``: px, py,
        vx, vy); ``None`` where it does not (a state is any d-vector, e.g. ``lds``): readers then call them
        x[0] … x[d-1]. The stream document's ``state_names``."""
        return None


#: the smallest normal float64: where the fall-back log tails (:func:`saturating_log_tails`) are clamped
TINY = float(torch.finfo(torch.float64).tiny)


def saturating_log_tails(cdf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log F, log(1 − F)) of conditional CDFs F, clamped at log :data:`TINY` (about −708): the log tails of a family
    that has only its :meth:`ModelFamily.observation_cdf` — they saturate where F does."""
    cdf = cdf.to(torch.float64)
    floor = math.log(TINY)
    return cdf.clamp_min(TINY).log(), torch.log1p(-cdf.clamp(max=1.0)).clamp_min(floor)


def _with_noise(fx: torch.Tensor, gens: Generators, Q: torch.Tensor) -> torch.Tensor:
    """fx [B, N, d] plus a draw of N(0, Q)."""
    return _noise_added(fx, randn(gens, fx.shape[1:], fx.dtype), Q)


def _noise_added(fx: torch.Tensor, z: torch.Tensor, Q: torch.Tensor) -> torch.Tensor:
    """fx + L z for fx, z [B, N, d] and LLᵀ = Q [B, d, d]."""
    return fx + z @ torch.linalg.cholesky(Q).transpose(-1, -2)


def _affine_draw(x: torch.Tensor, gens: Generators, F: torch.Tensor, c: torch.Tensor, Q: torch.Tensor) -> torch.Tensor:
    """x' = F x + c + N(0, Q) for x [B, N, d]."""
    return _with_noise(x @ F.transpose(-1, -2) + c[:, None], gens, Q)


def _pushed_moments(
    x: torch.Tensor, log_weights: torch.Tensor | None, F: torch.Tensor, c: torch.Tensor, Q: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The cloud's (weighted) moments pushed through x' = F x + c + N(0, Q): F m + c, F C Fᵀ + Q (float64)."""
    mean, cov = gaussian.moments(x.to(torch.float64), log_weights)
    return gaussian.affine_push(mean, cov, *(t.to(torch.float64) for t in (F, c, Q)))


def _has_gaps(value: Any) -> bool:
    """Whether a JSON array holds ``null`` entries (at any depth)."""
    if isinstance(value, dict):
        return any(v is None or _has_gaps(v) for v in value.values())
    return isinstance(value, list) and any(v is None or _has_gaps(v) for v in value)


def _leaves(value: Any) -> list[Any]:
    """The entries of a JSON array, flattened."""
    return [leaf for v in value for leaf in _leaves(v)] if isinstance(value, list) else [value]


def _filled(value: Any, fill: Any) -> Any:
    """The JSON array with each ``null`` replaced by ``fill``."""
    if value is None:
        return fill
    return [_filled(v, fill) for v in value] if isinstance(value, list) else value


def _gap_mask(value: Any) -> Any:
    """The JSON array's shape with True at its ``null`` entries, False elsewhere."""
    if isinstance(value, list):
        return [_gap_mask(v) for v in value]
    return value is None


#: the task prior's means are N(0, 1) per coordinate: a trained operator has seen |μ_i| up to about 3
PRIOR_MEAN_BOUND = 3.0
#: the default range of the task prior's covariance eigenvalues (``scale_range``, :mod:`mpflow.training.task_priors`)
DEFAULT_SCALE_RANGE = (0.5, 2.0)


def span(t: torch.Tensor) -> tuple[float, float]:
    """(min, max) of a tensor's entries, as floats."""
    return float(t.min()), float(t.max())


def subfield(field: str, name: str) -> str:
    """The path of ``name`` inside ``field`` (``observations[0].dt``), or ``name`` alone when ``field`` is empty (a
    query parameter)."""
    return f"{field}.{name}" if field else name


def check_dt(dt: float, field: str) -> float:
    """A step's duration: a positive finite number (ValueError naming ``field``.dt)."""
    if isinstance(dt, bool) or not isinstance(dt, int | float) or not math.isfinite(dt) or dt <= 0:
        name = subfield(field, "dt")
        raise ValueError(f"{name}: the time since the previous step must be a positive number, got {dt!r}")
    return float(dt)


def scaled_step(model: ModelFamily, name: str, dt: float, u: torch.Tensor | None, field: str) -> ModelFamily:
    """The model of a step lasting ``dt`` of the model's own steps, for a family whose step duration is its
    parameter ``name`` (that times dt) and that takes no inputs (ValueError naming ``field``.dt or ``field``.u)."""
    dt = check_dt(dt, field)
    if u is not None:
        raise ValueError(f"{subfield(field, 'u')}: the {model.name} family takes no inputs")
    if dt == 1.0:
        return model
    return type(model)({**model.params, name: model.params[name] * dt}, model.state_dim)

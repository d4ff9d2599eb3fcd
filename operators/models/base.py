"""The model-family base class.

A family is a small class whose parameters are tensors with a leading batch dimension B (one row per
stream), so B streams with different parameters are updated in one tensor call. Particles are
x [B, N, d]; one step's observation is obs [B, *obs_shape]; a sequence is [B, T, *obs_shape].

Subclasses declare ``name``, ``dynamic``, ``param_specs`` (how to validate each parameter from JSON) and
implement ``log_likelihood``; they may override ``score`` with a closed form (the default differentiates
``log_likelihood`` with autograd), and dynamic families give their transition as
x_m = F x_{m-1} + c + N(0, Q) through ``transition_affine`` — or, nonlinear (``affine_transition = False``), as
x_m = f(x_{m-1}) + N(0, Q) through ``transition`` and ``transition_mean``. Families with an observation
o = h(x) + N(0, R) (``gaussian_observation``) give h and R (``observation_function``, ``observation_noise``) for the
ensemble and unscented Kalman filters, and every residual o − h(x) goes through ``observation_residual``.

Gaps, time and inputs: :meth:`ModelFamily.read_observation` reads JSON observations with ``null`` (none, or
entries not observed: NaN in the tensor), :meth:`ModelFamily.observed_part` conditions on the observed entries of a
partial observation (families with ``partial_observations``), :meth:`ModelFamily.at_step` is the model of a step of
duration dt with inputs u, and :meth:`ModelFamily.observation_draws` draws observations for forecasts.

Everything else the project knows about a family lives on its class too, so a new family is one file (plus
its entry point in the group ``mpflow.families``, which puts it in :data:`mpflow.operators.models.FAMILIES`;
:mod:`mpflow.operators.models.plugins`):

* the catalogue (``GET /v1/models``): ``description``, ``observation_format`` and the parameters' kinds
  (the ``kind`` of each parser, :func:`param_kind`), assembled by :meth:`ModelFamily.catalogue_entry`; the names
  of the state's dimensions (:meth:`ModelFamily.state_names`, the stream document's ``state_names``);
* the meta-training task distribution (MPF §3.1): :meth:`ModelFamily.sample_task_models` draws B task models
  and priors, ``task_options`` names the options it reads, ``paper_true_x`` the true state of the paper's
  experiment (:func:`mpflow.training.tasks.sample_tasks` simulates the observations);
* the cost of its work, for the service's cost model (:mod:`mpflow.service.streams.costs`): the integration sub-steps of
  a step (:meth:`ModelFamily.integration_substeps`, bounded by the service before any step runs) and the
  floating-point operations of one particle's step (:meth:`ModelFamily.particle_flops`);
* evaluation and benchmark defaults: ``eval_steps`` and ``eval_particles`` (``mpflow evaluate``),
  :meth:`ModelFamily.posterior_modes` (mode-fraction diagnostics), :meth:`ModelFamily.example_params`
  (``mpflow filter``), :meth:`ModelFamily.benchmark_params`, ``benchmark_model`` and ``latency_benchmark``
  (``benchmarks.engine``, ``benchmarks.mpf_latency``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from mpflow.operators import gaussian, validation
from mpflow.operators.models.param_priors import ParamPrior, is_prior, parse_prior
from mpflow.operators.models.priors import GaussianMixture
from mpflow.operators.models.task_priors import DEFAULT_SCALE_RANGE, task_prior
from mpflow.operators.rng import Generators, randn

# (name, parser(value, state_dim, dtype) -> tensor, default(state_dim, dtype) -> tensor or None if required)
ParamSpec = tuple[str, Callable[..., torch.Tensor], Callable[[int, torch.dtype], torch.Tensor] | None]


class ModelFamily:
    name: ClassVar[str]
    dynamic: ClassVar[bool] = False
    #: exact Kalman/conjugate updates apply (linear transition and linear-Gaussian observation)
    linear_gaussian: ClassVar[bool] = False
    param_specs: ClassVar[tuple[ParamSpec, ...]] = ()
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

    # catalogue (``GET /v1/models``)
    #: the model in one line
    description: ClassVar[str] = ""
    #: the JSON form of one step's observation
    observation_format: ClassVar[str] = ""

    # meta-training tasks (:meth:`sample_task_models`)
    #: the task options this family's distribution reads besides ``task_priors.SHARED_TASK_OPTIONS``
    task_options: ClassVar[tuple[str, ...]] = ()
    #: the true state of the paper's experiment, the default ``true_x`` of a task ("paper"); None: x ~ prior
    paper_true_x: ClassVar[tuple[float, ...] | None] = None

    # evaluation and benchmarks
    #: ``mpflow evaluate``'s default sequence length T (the paper's, where it has one)
    eval_steps: ClassVar[int] = 20
    #: ``mpflow evaluate``'s default particle counts N
    eval_particles: ClassVar[tuple[int, ...]] = (256,)
    #: the model of :meth:`benchmark_params` in words (``benchmarks.engine``'s metadata)
    benchmark_model: ClassVar[str] = "the family's default parameters"
    #: one of ``benchmarks.mpf_latency``'s default families (one-stream serving latency at d = 2)
    latency_benchmark: ClassVar[bool] = True

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
        validation.unknown_keys("model.params", params, [n for n, _, _ in cls.param_specs])
        parsed, unknown = {}, {}
        for name, parse, default in cls.param_specs:
            field = f"model.params.{name}"
            if name in params and is_prior(params[name]):
                parsed[name] = cls.param_unit(name, params, state_dim, dtype)
                unknown[name] = parse_prior(field, params[name], cls.param_domain(name))
            elif name in params:
                parsed[name] = parse(field, params[name], state_dim, dtype)
            elif default is not None:
                value = default(state_dim, dtype)
                if value is not None:  # None: an optional parameter without a default (``absent``)
                    parsed[name] = value
            else:
                raise ValueError(f"{field}: required for the {cls.name} family")
        model = cls({k: v[None] for k, v in parsed.items()}, state_dim)
        model.check()
        return model._learning(unknown)

    # ----------------------------------------------------------------- unknown parameters (priors)
    @classmethod
    def _learnable_spec(cls, name: str) -> tuple[Callable[..., torch.Tensor], Callable[[int, torch.dtype], Any]]:
        """(parser, default) of a parameter that may be given as a prior; ValueError naming it otherwise."""
        parse, default = {n: (p, d) for n, p, d in cls.param_specs}[name]
        if not getattr(parse, "learnable", False) or default is None or name in cls.substep_params:
            raise ValueError(
                f"model.params.{name}: a prior may stand for a scalar parameter or a covariance (read as r·I), not "
                f"for {name} ({param_kind(parse)}) of the {cls.name} family; give it as a value"
            )
        return parse, default

    @classmethod
    def learnable(cls, name: str) -> bool:
        """Whether the parameter may be given as a prior (the catalogue's ``learnable``)."""
        try:
            cls._learnable_spec(name)
        except ValueError:
            return False
        return True

    @classmethod
    def param_domain(cls, name: str) -> tuple[float, float]:
        """The open range (lo, hi) a learnable parameter's value must lie in: the family's ``param_domains``, else
        (0, ∞) for a covariance or positive number and ℝ for the others (its parser's ``domain``)."""
        if name in cls.param_domains:
            return cls.param_domains[name]
        parse, _ = cls._learnable_spec(name)
        return getattr(parse, "domain", (-math.inf, math.inf))

    @classmethod
    def param_unit(cls, name: str, params: dict[str, Any], state_dim: int, dtype: torch.dtype) -> torch.Tensor:
        """The value of a learnable parameter at θ = 1, shaped as the family's default: the identity for a
        covariance (θ·I), ones for a per-dimension vector (θ·1), 1 for a number. ``params``: the request's, for
        families whose shapes depend on another parameter (the observation noise on the rows of H)."""
        _, default = cls._learnable_spec(name)
        value = default(state_dim, dtype)
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
        ValueError naming ``field`` for the others). Everything else is :meth:`parse_observation`'s."""
        if value is None:
            return self.missing_observation(dtype)
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
        """One draw o_i ~ p(o | x_i) for each of the states x [N, d] of one stream (a B = 1 model) → [N, *obs_shape],
        all from ``gen`` (forecasts); None for a family whose observation has no predictive of its own (the
        default: ``logistic``, whose features are the caller's)."""
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
        self, x: torch.Tensor, gens: Generators, log_weights: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One draw of the transition and the predictive's moments together → (x' [B, N, d], mean, cov): what
        :meth:`transition` and :meth:`predicted_moments` give, with a nonlinear f applied to the cloud once
        (Lorenz-96's RK4 is most of a step's cost) instead of once for each."""
        if not self.affine_transition:
            fx = self.transition_mean(x)
            return self.perturbed(fx, gens), *self._mapped_moments(fx.detach(), log_weights)
        F, c, Q = self.transition_affine()
        return _affine_draw(x, gens, F, c, Q), *_pushed_moments(x.detach(), log_weights, F, c, Q)

    def transition_mean(self, x: torch.Tensor) -> torch.Tensor:
        """f(x) of x_m = f(x_{m-1}) + N(0, Q) for x [B, N, d] → [B, N, d]: F x + c for an affine transition."""
        F, c, _ = self.transition_affine()
        return x @ F.transpose(-1, -2) + c[:, None]

    def transition_noise(self) -> torch.Tensor:
        """Q [B, d, d] of x_m = f(x_{m-1}) + N(0, Q)."""
        return self.transition_affine()[2]

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
        resid = self.observation_residual(obs.to(torch.float64), self.observation_function(x.to(torch.float64)))
        sd = self.observation_noise().to(torch.float64).diagonal(dim1=-2, dim2=-1).sqrt()
        return torch.special.ndtr(resid / sd[:, None])

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
        """fx [B, N, d] plus a draw of the transition noise N(0, Q)."""
        return _with_noise(fx, gens, self.transition_noise())

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

    # ----------------------------------------------------------------- meta-training tasks
    @classmethod
    def sample_task_models(
        cls, gens: Generators, d: int, dtype: torch.dtype, options: dict[str, Any]
    ) -> tuple[ModelFamily, GaussianMixture]:
        """The family's meta-training task distribution (MPF §3.1): B = len(gens) task models (one stream
        each, batched) and their priors, task b drawn from ``gens[b]`` only. ``options`` are the task options
        (:data:`mpflow.training.tasks.TASK_OPTIONS`); a family reads its own (``task_options``) and the shared
        prior options of :func:`mpflow.operators.models.task_priors.task_prior`. The true state and the
        observations are drawn afterwards, by :func:`mpflow.training.tasks.sample_tasks`.

        Default: every task has the family's default parameters, the prior is :func:`task_prior`'s. Families
        with required or random parameters override it."""
        one = cls.from_params(None, d, dtype)
        return cls.stack([one] * len(gens)), task_prior(gens, d, dtype, options)

    # ----------------------------------------------------------------- a trained operator's domain
    @classmethod
    def task_domain(cls, options: dict[str, Any]) -> dict[str, list[float]]:
        """The region :meth:`sample_task_models` covers under the task ``options``, as a range [lo, hi] per named
        quantity of a stream (:meth:`domain_measures`): what an operator trained on it has seen. It is recorded
        in the operator's config.json (``domain``) and checked when a stream is created
        (:meth:`outside_domain`). Default — the Gaussian task prior N(μ, Σ): μ_i ~ N(0, 1), so |μ_i| ≤ 3 (3 sd),
        and Σ's eigenvalues in ``scale_range``; families add their parameters."""
        lo, hi = options.get("scale_range", DEFAULT_SCALE_RANGE)
        return {"prior mean": [-PRIOR_MEAN_BOUND, PRIOR_MEAN_BOUND], "prior variance": [float(lo), float(hi)]}

    def domain_measures(self, prior_mean: torch.Tensor, prior_cov: torch.Tensor) -> dict[str, tuple[float, float]]:
        """(smallest, largest) value of each quantity of :meth:`task_domain` for this one-stream model and a
        prior with mean [d] and covariance [d, d]."""
        return {
            "prior mean": span(prior_mean),
            "prior variance": span(torch.linalg.eigvalsh(prior_cov.to(torch.float64))),
        }

    def outside_domain(
        self, domain: dict[str, list[float]], prior_mean: torch.Tensor, prior_cov: torch.Tensor
    ) -> list[str]:
        """What of this stream lies outside an operator's ``domain`` (:meth:`task_domain`), one phrase per
        quantity; empty when the stream is inside. Bounds are compared with a relative slack of 1e-6."""
        measures = self.domain_measures(prior_mean, prior_cov)
        outside = []
        for name, (lo, hi) in domain.items():
            if name not in measures:
                continue
            low, high = measures[name]
            slack = 1e-6 * max(abs(lo), abs(hi), 1.0)
            if low < lo - slack or high > hi + slack:
                value = f"{low:.4g}" if low == high else f"{low:.4g} … {high:.4g}"
                outside.append(f"{name} {value} outside the trained [{lo:.4g}, {hi:.4g}]")
        return outside

    @classmethod
    def _stack_params(cls, params: list[dict[str, Any]], d: int, dtype: torch.dtype) -> ModelFamily:
        """Validate one parameter dict per task and batch them into one model."""
        return cls.stack([cls.from_params(p, d, dtype) for p in params])

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

    @classmethod
    def benchmark_params(cls, d: int, gen: torch.Generator) -> dict[str, Any]:
        """Parameters of a held-out benchmark model drawn from ``gen`` (JSON form; ``benchmark_model`` says
        what they are): {} = the family's defaults, no draw."""
        return {}

    # ----------------------------------------------------------------- description
    @classmethod
    def state_names(cls, d: int) -> list[str] | None:
        """The names of the ``d`` state dimensions where the family gives them a meaning (``range_bearing``: px, py,
        vx, vy); ``None`` where it does not (a state is any d-vector, e.g. ``lds``): readers then call them
        x[0] … x[d-1]. The stream document's ``state_names``."""
        return None

    @classmethod
    def catalogue_entry(cls, max_state_dim: int) -> dict[str, Any]:
        """The family's ``GET /v1/models`` entry, without "methods" (the service adds those)."""
        fixed = cls.fixed_state_dim
        return {
            "family": cls.name,
            "dynamic": cls.dynamic,
            "linear_gaussian": cls.linear_gaussian,
            "description": cls.description,
            "state_dim": {"fixed": fixed, "min": fixed or cls.min_state_dim, "max": fixed or max_state_dim},
            "observation": cls.observation_format,
            "parameters": [
                {
                    "name": p,
                    "kind": param_kind(parse),
                    "required": default is None,
                    "default": describe_default(default),
                    "learnable": cls.learnable(p),
                }
                for p, parse, default in cls.param_specs
            ],
        }

    @classmethod
    def describe(cls) -> dict[str, Any]:
        return {
            "family": cls.name,
            "dynamic": cls.dynamic,
            "linear_gaussian": cls.linear_gaussian,
            "parameters": [n for n, _, _ in cls.param_specs],
            "required": [n for n, _, d in cls.param_specs if d is None],
            "fixed_state_dim": cls.fixed_state_dim,
        }


def _with_noise(fx: torch.Tensor, gens: Generators, Q: torch.Tensor) -> torch.Tensor:
    """fx [B, N, d] plus a draw of N(0, Q)."""
    return fx + randn(gens, fx.shape[1:], fx.dtype) @ torch.linalg.cholesky(Q).transpose(-1, -2)


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


def param_kind(parse: Callable[..., torch.Tensor]) -> str:
    """What a parameter parser accepts, in words (its ``kind`` attribute; "value" when it has none)."""
    return getattr(parse, "kind", "value")


def describe_default(default: Callable[[int, torch.dtype], torch.Tensor] | None) -> str | None:
    """The default of a parameter in words, read off the family's default at d = 2 (c·I, or a value; a vector
    whose length does not follow d, as ``range_bearing``'s ``sensor``, as the vector: ``[0, 0]``)."""
    if default is None:
        return None
    t = default(2, torch.float64)
    if t is None:  # optional, no default
        return None
    if t.dim() == 2 and torch.equal(t, t[0, 0] * torch.eye(2, dtype=t.dtype)):
        return f"{t[0, 0].item():g}·I"
    follows_d = t.dim() == 1 and default(3, torch.float64).shape != t.shape
    if follows_d and bool((t == t[0]).all()):
        return f"{t[0].item():g}"
    if t.dim() == 1:
        return "[" + ", ".join(f"{v:g}" for v in t.tolist()) + "]"
    if t.dim() == 0:
        return f"{t.item():g}"
    return str(t.tolist())


def _kind(
    words: str, domain: tuple[float, float] | None = None
) -> Callable[[Callable[..., torch.Tensor]], Callable[..., torch.Tensor]]:
    """Mark a parameter parser with what it accepts (:func:`param_kind`) and, for a parameter that may be given as a
    prior (a scalar, or a covariance read as r·I), the open range of its value (``domain``)."""

    def mark(parse: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        parse.kind = words  # type: ignore[attr-defined]
        if domain is not None:
            learnable(domain)(parse)
        return parse

    return mark


def learnable(domain: tuple[float, float]) -> Callable[[Callable[..., torch.Tensor]], Callable[..., torch.Tensor]]:
    """Mark a parameter parser as one whose parameter may be given as a prior, with the open range of its value."""

    def mark(parse: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        parse.learnable = True  # type: ignore[attr-defined]
        parse.domain = domain  # type: ignore[attr-defined]
        return parse

    return mark


#: the domain of a variance or a positive number, and of an unconstrained number
POSITIVE = (0.0, math.inf)
REAL = (-math.inf, math.inf)


#: the task prior's means are N(0, 1) per coordinate: a trained operator has seen |μ_i| up to about 3
PRIOR_MEAN_BOUND = 3.0


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


def absent(d: int, dtype: torch.dtype) -> None:
    """The "default" of an optional parameter that has none: the model simply does not have it."""
    return None


def identity(scale: float = 1.0) -> Callable[[int, torch.dtype], torch.Tensor]:
    return lambda d, dtype: scale * torch.eye(d, dtype=dtype)


def filled(value: float) -> Callable[[int, torch.dtype], torch.Tensor]:
    return lambda d, dtype: torch.full((d,), value, dtype=dtype)


@_kind("matrix")
def parse_matrix(name: str, value, d: int, dtype) -> torch.Tensor:
    return validation.matrix(name, value, None, None, dtype)


@_kind("covariance matrix (symmetric positive definite)", POSITIVE)
def parse_cov(name: str, value, d: int, dtype) -> torch.Tensor:
    return validation.covariance(name, value, None, dtype)


@_kind("covariance matrix (symmetric positive semi-definite)", POSITIVE)
def parse_psd(name: str, value, d: int, dtype) -> torch.Tensor:
    """A symmetric positive semi-definite matrix (a diffusion may drive only some coordinates)."""
    c = validation.matrix(name, value, None, None, torch.float64)
    if c.shape[0] != c.shape[1] or not torch.allclose(c, c.T, atol=1e-8 * float(c.abs().max().clamp_min(1.0))):
        raise ValueError(f"{name}: must be a symmetric square matrix, got {list(c.shape)}")
    eig_min = float(torch.linalg.eigvalsh(c).min())
    if eig_min < -1e-10 * float(c.abs().max().clamp_min(1.0)):
        raise ValueError(f"{name}: must be positive semi-definite (smallest eigenvalue {eig_min:.3g})")
    return c.to(dtype)


@_kind("number or vector of length d", REAL)
def parse_per_dim(name: str, value, d: int, dtype) -> torch.Tensor:
    """A number (broadcast to all d dimensions) or a vector of length d."""
    t = validation.as_tensor(name, value, dtype)
    if t.dim() == 0:
        return t.expand(d).clone()
    return validation.check_shape(name, t, [d])


@_kind("positive number", POSITIVE)
def parse_positive(name: str, value, d: int, dtype) -> torch.Tensor:
    return validation.positive(name, value, dtype)

"""``ienkf``: the iterative ensemble Kalman filter (IEnKF; Sakov, Oliver & Bertino 2012, transform version; the lag-1
iEnKS of Bocquet & Sakov 2014) — for families with an observation o = h(x) + N(0, R) (``gaussian_observation``)
whose transition is deterministic, x_m = f(x_{m-1}) (``transition_mean``), or nearly so.

An EnKF linearises the forecast f and the observation h around the forecast ensemble once; over a long interval
between observations (Lorenz-96 at Δ = 0.4) f is far from linear over the ensemble's spread and the analysis is
wrong. The IEnKF analyses the *previous* analysis ensemble E0 (the stream's cloud, at m − 1) against the new
observation with f inside the cost, and minimises by Gauss–Newton in the ensemble space. With x̄0 the mean of E0
and A0 = ρ (E0 − x̄0) its anomalies [N, d] (multiplicative inflation ρ, ``inflation``), a state is x(w) = x̄0 + A0ᵀ w,
and (Sakov et al. 2012 eq. 11; Bocquet & Sakov 2014 eq. 5)

    J(w) = ½ (N − 1) ‖w‖² + ½ ‖o ⊖ h(f(x(w)))‖²_R.

Each iteration j (at most ``iterations``), for every stream still iterating:

1. ensemble   E_i = x̄0 + A0ᵀ (w + T_i) (T: the current transform, I at first) and its forecast F_i = f(E_i);
2. sensitivity  the transform trick (Sakov et al. 2012 eq. 19): the observation anomalies Y of h(F) are those of an
              ensemble whose anomalies are T A0, so the linearisation of w ↦ h(f(x(w))) is Ỹ = T⁻¹ Y, whitened
              Ỹ_R = Ỹ R^{-1/2}; the innovation is ē = mean_i o ⊖ h(F_i) (whitened δ = R^{-1/2} ē);
3. Gauss–Newton  the Hessian C = (N − 1) I + Ỹ_R Ỹ_Rᵀ and the gradient ∇J = (N − 1) w − Ỹ_R δ give
              Δw = −C⁻¹ ∇J, w ← w + Δw, and the new transform T = [(N − 1) C⁻¹]^{1/2} (symmetric; eq. 15), from
              the thin SVD of Ỹ_R as in the ETKF (:func:`mpflow.operators.updaters.enkf.transformed`);
4. stop       when the increment is below ``tolerance`` in the prior's units, √((N − 1) mean_k Δw_k²) (a stream
              that stops keeps its w and T: its result does not depend on its batch).

The analysis at m is the forecast of the analysed ensemble at m − 1: x_i^a = f(x̄0 + A0ᵀ (w* + T_i)), one more
ensemble forecast — so a step costs (iterations + 1) forecasts of the N members. Where the family has model noise
(Q > 0), the noise N(0, Q) is drawn and added to that final forecast only (the iterations see f alone: the IEnKF
treats the model as perfect over the interval; a large Q wants an EnKF instead). A static family has f = id: the
IEnKF is then the iterated ETKF of a nonlinear h. With linear f and h the first iteration lands on the minimum, the
second finds Δw = 0, and the analysis is the ETKF's exactly (the Kalman filter's mean and covariance).

Evidence: log p(o_m | o_<m) ≈ log N(ē; 0, Y Yᵀ/(N − 1) + R) of the first iteration (the forecast ensemble of E0,
the EnKF's Gaussian predictive). The ensemble keeps uniform weights; the step's ``ess`` is N and its
``iterations`` the Gauss–Newton iterations run.

Global: no localisation, so the ensemble must span the unstable directions (N near d; on Lorenz-96 d = 40 at
Δ = 0.4, spantini2019, N = 40 with ρ = 1.2 and at most 4 iterations gets 0.63 where the LETKF N = 100 gets 0.97,
while N = 20 loses the truth; docs/benchmarks.md). DAPPER's iEnKS inflates its smoothed ensemble at the window's
start before forecasting it on; here the stream's cloud (the previous analysis) is inflated as the step starts:
once per cycle either way.

``correction`` (Lorenz-96 only): the registered name of a learned ring correction
(:mod:`mpflow.operators.mpf.ring_correction`, trained by ``ring_train --arch correction --base ienkf``) applied to the
analysis, X' = g_θ(f(x̄0 + A0), X^a, o), before the model noise; with it and no ``inflation`` ρ follows the stream's Δ
by :func:`lorenz96_inflation`, the rule it was trained with. Measured on spantini2019 it does not beat the IEnKF alone
(docs/benchmarks.md): no default names one.

``relock`` (Lorenz-96 only): the registered name of a learned ring observer
(:mod:`mpflow.operators.mpf.ring_observer`, trained by ``observer_train``): a stream whose innovations say it lost
the truth is re-seeded around the observer's estimate from its last K observations (:mod:`.relock`; the state carries
that window and the innovation ratio's average, and a step reports ``relocked``). On spantini2019 it is what keeps
the IEnKF's twins on track (docs/benchmarks.md "Re-locking ``ienkf``"), and the default there names it.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from mpflow.operators import gaussian
from mpflow.operators.models.base import ModelFamily
from mpflow.operators.rng import Generators, copied
from mpflow.operators.state import ParticleState, StepInfo
from mpflow.operators.updaters import relock
from mpflow.operators.updaters.base import NonFiniteError, StepWork, Updater
from mpflow.operators.updaters.enkf import check_inflation, ensemble_innovations, predictive_log_density

#: the most Gauss–Newton iterations a stream may ask for (each one is a forecast of the whole ensemble)
MAX_ITERATIONS = 20


#: the measured ρ of ``ienkf`` N = 40 on Lorenz-96 d = 40 at two observation intervals Δ (benchmarks.lorenz96:
#: sakov2008 Δ = 0.05 → 1.02, rmse 0.177; spantini2019 Δ = 0.4 → 1.2, rmse 0.63), the ends of :func:`lorenz96_inflation`
LORENZ96_INFLATION = ((0.05, 1.02), (0.4, 1.2))


def lorenz96_inflation(delta: torch.Tensor | float) -> torch.Tensor:
    """ρ(Δ) of ``ienkf`` on Lorenz-96 (the rule that training and serving of the correction after it both read):
    log-linear in log Δ through the two measured points of :data:`LORENZ96_INFLATION`, clipped to them,

        ρ = ρ₀ + (ρ₁ − ρ₀) · clip((log Δ − log Δ₀) / (log Δ₁ − log Δ₀), 0, 1)   (ρ 1.02 … 1.2 for Δ 0.05 … 0.4)."""
    (d0, r0), (d1, r1) = LORENZ96_INFLATION
    t = (torch.as_tensor(delta, dtype=torch.float64).log() - math.log(d0)) / (math.log(d1) - math.log(d0))
    return r0 + (r1 - r0) * t.clamp(0.0, 1.0)


def check_iterations(value: Any) -> None:
    """``options.iterations``: an integer 1 … :data:`MAX_ITERATIONS`."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_ITERATIONS:
        raise ValueError(
            f"options.iterations: the most Gauss–Newton iterations, an integer from 1 to {MAX_ITERATIONS}, "
            f"got {value!r}"
        )


def check_tolerance(value: Any) -> None:
    """``options.tolerance``: a non-negative number below 1 (0: always run ``iterations``)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1:
        raise ValueError(
            f"options.tolerance: the increment (in prior sd) that stops the iterations, in [0, 1), got {value!r}"
        )


class IEnKFUpdater(Updater):
    name = "ienkf"
    needs_gaussian_observation = True
    nonlinear_transition = True
    defaults = {"inflation": 1.0, "iterations": 10, "tolerance": 1e-3, "correction": None, "relock": None}
    stream_options = frozenset({"inflation", "iterations", "tolerance", "correction", "relock"})
    learned_options = ("correction", "relock")

    def __init__(self, **options):
        super().__init__(**options)
        check_inflation(self.options["inflation"])
        check_iterations(self.options["iterations"])
        check_tolerance(self.options["tolerance"])
        #: the learned correction after the analysis (``correction``, a registered name), or None
        self.correction = (
            None if self.options["correction"] is None else load_learned("correction", self.options["correction"])
        )
        #: with a correction and no ``inflation`` given, ρ follows each stream's Δ (:func:`lorenz96_inflation`)
        self.inflation_rule = self.correction is not None and "inflation" not in options
        #: the learned observer a lost stream re-locks from (``relock``, a registered name), or None
        self.observer = None if self.options["relock"] is None else load_learned("relock", self.options["relock"])

    def check_compatible(self, model: ModelFamily, prior=None) -> None:
        super().check_compatible(model, prior)
        for option, learned, verb in (
            ("correction", self.correction, "corrects"),
            ("relock", self.observer, "observes"),
        ):
            if learned is not None and (model.name != "lorenz96" or not model.linear_observation()):
                raise ValueError(
                    f"options.{option}: {self.options[option]} {verb} lorenz96 with a linear observation "
                    f"(no arctan), not {model.name}; omit {option}"
                )

    def step_work(self, model: ModelFamily, n: int, dt: float = 1.0, k: int | None = None) -> StepWork:
        """At most ``iterations`` + 1 forecasts of the ``n`` members with their predicted observations
        (:meth:`ModelFamily.particle_flops`, its fixed per-sub-step work included), and per iteration the
        anomalies' products (about 4 n d k + 2 n² d) and the thin SVD of the n × k whitened sensitivities
        (about 4 n k² + 4 n² k); a few n × d and n × n float64 copies are held."""
        d = model.state_dim
        k = model.observation_size() if k is None else k
        runs = int(self.options["iterations"]) + 1
        per = n * model.particle_flops(dt, k) + model.step_fixed_flops(dt)
        algebra = 4.0 * n * d * k + 2.0 * n * n * d + 4.0 * n * k * k + 4.0 * n * n * k
        held = 8.0 * (6 * n * d + 4 * n * k + 4 * n * n)
        learned = 0.0 if self.correction is None else self.correction.flops(n, d)
        if self.observer is not None:  # the observer (at most once a step) and the innovation ratio
            learned += self.observer.flops(d) + 4.0 * n * k
        return StepWork(runs * per + (runs - 1) * algebra + learned, held)

    @classmethod
    def predicts_once(cls) -> bool:
        """A step's p-values read ienkf's own predictive — the first iterate's forecast f(x̄0 + A0), the ensemble
        its evidence is computed from, with the model noise the step itself draws (:meth:`_observed_step`) — so a
        step forecasts its ensemble once for both, instead of a transition draw apart for the p-values (the base
        class's :meth:`pit`). It shares no :class:`~mpflow.operators.updaters.base.Prediction`: the iterations
        forecast their own ensembles. A subclass with an ``_update`` of its own predicts for its p-values apart."""
        return cls._update is IEnKFUpdater._update

    def _observed_step(
        self, state: ParticleState, obs: torch.Tensor, model: ModelFamily, gens: Generators
    ) -> tuple[ParticleState, StepInfo]:
        """The update, and its p-values from the first iterate's forecast plus the model noise the update adds
        (drawn from a copy of the generators taken before it: the very draws the analysis gets)."""
        if not self.predicts_once():
            return super()._observed_step(state, obs, model, gens)
        pit_gens = copied(gens)
        B, N, _ = state.particles.shape
        if bool(torch.isnan(obs).any()):  # the entries observed: their part of the model (the forecast is the same)
            sub_model, sub_obs = model.observed_part(obs)
        else:
            sub_model, sub_obs = model, obs
        xa, log_pred, iters, first = self._analysed(state.particles, sub_obs, sub_model, gens)
        n = torch.full((B,), float(N), dtype=torch.float64)
        info = StepInfo(log_pred, n, iterations=iters)
        state, xa = self._relocked(state, xa, first, (obs, sub_obs), (model, sub_model), gens, info)
        predicted = model.to(torch.float64).perturbed(first, pit_gens) if model.dynamic else first
        tails = self._predictive_of(state.replace(particles=predicted, extras={}), obs, model, pit_gens)
        if tails is not None:
            info.extras.update(tails)
        return state.replace(particles=xa.to(state.particles.dtype)), info

    def _update(self, state: ParticleState, obs: torch.Tensor, model: ModelFamily, gens: Generators):
        B, N, _ = state.particles.shape
        xa, log_pred, iters, first = self._analysed(state.particles, obs, model, gens)
        info = StepInfo(log_pred, torch.full((B,), float(N), dtype=torch.float64), iterations=iters)
        state, xa = self._relocked(state, xa, first, (obs, obs), (model, model), gens, info)
        return state.replace(particles=xa.to(state.particles.dtype)), info

    def _relocked(self, state, xa, first, obs, model, gens, info: StepInfo):
        """With ``relock``: the step's test and re-lock (:func:`.relock.relocked`; ``obs``, ``model``: the full ones
        and their observed part) → (the state with its new window and ratio, the analysis); ``info`` reports
        ``relocked`` [B]. Without: (state, xa) as they are."""
        if self.observer is None:
            return state, xa
        xa, extras, fired = relock.relocked(self.observer, state, xa, first, obs, model, gens)
        info.extras["relocked"] = fired
        return state.replace(extras=extras), xa

    def _init(self, state: ParticleState, prior, model: ModelFamily, gens: Generators) -> ParticleState:
        """With ``relock``: an empty window and an innovation ratio of 1 (:func:`.relock.started`)."""
        return state if self.observer is None else relock.started(state, self.observer.history)

    def from_particles(self, state: ParticleState, density=None) -> ParticleState:
        """With ``relock``, a state another method made starts an empty window (:func:`.relock.started`)."""
        return state if self.observer is None else relock.started(state, self.observer.history)

    def resume(self, new: ParticleState, before: ParticleState, obs: torch.Tensor, model: ModelFamily) -> ParticleState:
        """After another method's step (a fall-back) the stream keeps its window, moved on by that observation."""
        if self.observer is None or relock.WINDOW not in before.extras:
            return self.from_particles(new)
        return relock.carried(new, before, obs, model)

    def _unobserved(self, state: ParticleState, obs: torch.Tensor, model: ModelFamily, gens: Generators):
        """A step without a measurement: the forecast, and with ``relock`` a gap in the window."""
        new, info = super()._unobserved(state, obs, model, gens)
        if self.observer is None:
            return new, info
        return new.replace(extras={**new.extras, **relock.pushed(state.extras, None, model)}), info

    def analysis(
        self, previous: torch.Tensor, obs: torch.Tensor, model: ModelFamily, gens: Generators
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Steps 1–4 of the module docstring from the previous analysis ensemble [B, N, d], then the learned
        correction when there is one (:meth:`corrected`; ρ per stream by :func:`lorenz96_inflation` of its Δ unless
        the stream gave ``inflation``), then the model noise → (analysis ensemble at this step [B, N, d] float64,
        log p(o | o_<m) [B], Gauss–Newton iterations [B] int64)."""
        return self._analysed(previous, obs, model, gens)[:3]

    def _analysed(
        self, previous: torch.Tensor, obs: torch.Tensor, model: ModelFamily, gens: Generators
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`analysis` and the first iterate's forecast f(x̄0 + A0) [B, N, d] (float64)."""
        rho = None
        if self.inflation_rule:
            rho = lorenz96_inflation(model.expanded(previous.shape[0])["delta"])[:, None, None]
        xa, log_pred, iters, first = self.iterate(previous, obs, model, rho)
        if self.correction is not None:
            xa = self.corrected(first, xa, obs, model)
        if model.dynamic:
            xa = model.to(torch.float64).perturbed(xa, gens)
        return xa, log_pred, iters, first

    def corrected(self, first: torch.Tensor, xa: torch.Tensor, obs: torch.Tensor, model: ModelFamily) -> torch.Tensor:
        """The learned correction X' = g_θ(f(x̄0 + A0), X^a, o) of the IEnKF's analysis X^a, from the first iterate's
        forecast f(x̄0 + A0) (:class:`~mpflow.operators.mpf.ring_correction.RingCorrection`) → [B, N, d] float64."""
        dtype = next(self.correction.parameters()).dtype
        with torch.no_grad():
            x = self.correction(first.to(dtype), xa.to(dtype), obs.to(dtype), model.to(dtype)).to(torch.float64)
        if not bool(torch.isfinite(x).all()):
            raise NonFiniteError("ienkf: the learned correction's ensemble is not finite")
        return x

    def iterate(
        self,
        previous: torch.Tensor,
        obs: torch.Tensor,
        model: ModelFamily,
        inflation: torch.Tensor | None = None,
        strict: bool = True,
        frozen_transform: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Steps 1–4 of the module docstring without the correction and the model noise, and with the first
        iterate's forecast f(x̄0 + A0) [B, N, d] (the inflated previous ensemble carried to this step: the forecast a
        correction after the IEnKF reads) → (f(x̄0 + A0ᵀ (w* + T_i)), log p(o | o_<m), iterations, f(x̄0 + A0)).
        ``inflation``: ρ per stream [B, 1, 1] in place of the option's. ``strict=False``: a stream whose forecast is
        not finite (or whose anomalies overflow) comes back not finite instead of raising (training restarts that twin
        alone), and log p(o | o_<m) is not computed (NaN).
        ``frozen_transform=True`` (training through the IEnKF, ``ring_train --window``): each Gauss–Newton step by
        :func:`gauss_newton_frozen` — the same iterates, with the gradient through w, the forecasts and the
        sensitivities but not through the transform T, T⁻¹ (the thin SVD's backward is unstable near repeated
        singular values)."""
        B, N, d = previous.shape
        m64 = model.to(torch.float64)
        obs = obs.to(torch.float64)
        E0 = previous.to(torch.float64)
        x0 = E0.mean(1, keepdim=True)
        rho = float(self.options["inflation"]) if inflation is None else inflation.to(torch.float64)
        A0 = rho * (E0 - x0)
        L = gaussian.cholesky(m64.observation_noise().expand(B, -1, -1))
        eye = torch.eye(N, dtype=torch.float64).expand(B, N, N)
        w = torch.zeros(B, N, 1, dtype=torch.float64)
        T, T_inv = eye, eye
        active = torch.ones(B, dtype=torch.bool)
        iters = torch.zeros(B, dtype=torch.int64)
        log_pred = None
        tol = float(self.options["tolerance"])
        first = None
        blown = torch.zeros(B, dtype=torch.bool)
        for _ in range(int(self.options["iterations"])):
            F = forecast(m64, x0 + (w.transpose(-1, -2) + T) @ A0)
            if strict and not bool(torch.isfinite(F).all()):
                raise NonFiniteError("ienkf: the forecast of a Gauss–Newton iterate is not finite")
            blown = blown | ~torch.isfinite(F).flatten(1).all(1)
            F = torch.where(blown[:, None, None], 0.0, F)  # strict=False: such a stream iterates on zeros, then NaN
            first = F if first is None else first
            _, e_bar, Y = ensemble_innovations(F, obs, m64)
            if log_pred is None and not strict:  # training: not read, and a huge stream's S is not positive definite
                log_pred = torch.full((B,), torch.nan, dtype=torch.float64)
            elif log_pred is None:
                S = Y.transpose(-1, -2) @ Y / (N - 1) + m64.observation_noise().expand(B, -1, -1)
                log_pred = predictive_log_density(e_bar, S) + m64.observation_log_offset().to(torch.float64)
            Yw = torch.linalg.solve_triangular(L, (T_inv @ Y).transpose(-1, -2), upper=False).transpose(-1, -2)
            delta = torch.linalg.solve_triangular(L, e_bar[..., None], upper=False)  # R^{-1/2} ē  [B, k, 1]
            if not strict:  # a finite but huge forecast overflows its anomalies: that stream blew up too
                blown = blown | ~(torch.isfinite(Yw).flatten(1).all(1) & torch.isfinite(delta).flatten(1).all(1))
                Yw, delta = torch.where(blown[:, None, None], 0.0, Yw), torch.where(blown[:, None, None], 0.0, delta)
            dw, T_new, T_inv_new = (gauss_newton_frozen if frozen_transform else gauss_newton)(Yw, delta, w)
            step = active[:, None, None]
            w = torch.where(step, w + dw, w)
            T, T_inv = torch.where(step, T_new, T), torch.where(step, T_inv_new, T_inv)
            iters = iters + active.long()
            small = (dw.pow(2).mean((1, 2)) * (N - 1)).sqrt() < tol
            active = active & ~small
            if not bool(active.any()):
                break
        xa = forecast(m64, x0 + (w.transpose(-1, -2) + T) @ A0)
        return torch.where(blown[:, None, None], torch.nan, xa), log_pred, iters, first


def load_learned(option: str, name: Any):
    """``options.correction`` / ``options.relock``: the trained ring correction or observer of a registered operator
    *name* (:func:`mpflow.operators.trained_operators.load_correction`, :func:`~mpflow.operators.trained_operators.
    load_observer`), a ValueError naming the option otherwise."""
    from mpflow.operators.trained_operators import load_correction, load_observer  # torch.nn: only when named

    try:
        return (load_correction if option == "correction" else load_observer)(name)
    except ValueError as exc:
        raise ValueError(f"options.{option}: {exc}") from None


def forecast(model: ModelFamily, x: torch.Tensor) -> torch.Tensor:
    """f(x) of the transition x_m = f(x_{m-1}) + N(0, Q) (``transition_mean``); the identity for a static family."""
    return model.transition_mean(x) if model.dynamic else x


def gauss_newton(
    Yw: torch.Tensor, delta: torch.Tensor, w: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One Gauss–Newton step of J (module docstring, 3.) for whitened sensitivities Yw [B, N, k], whitened innovation
    δ [B, k, 1] and the iterate w [B, N, 1] → (Δw [B, N, 1], T = [(N − 1) C⁻¹]^{1/2}, T⁻¹). With the thin SVD
    Yw = U S Vᵀ, C = (N − 1) I + Yw Ywᵀ has eigenvectors U (eigenvalues N − 1 + s²) and N − 1 elsewhere, so
    Δw = C⁻¹ (Yw δ − (N − 1) w) = U diag(1/(N − 1 + s²)) Uᵀ g + (g − U Uᵀ g)/(N − 1) with g that gradient's
    negative, and T = I + U diag(√((N − 1)/(N − 1 + s²)) − 1) Uᵀ (T⁻¹ likewise with the reciprocal roots)."""
    N = Yw.shape[-2]
    U, s, Vh = torch.linalg.svd(Yw, full_matrices=False)
    denom = (N - 1) + s**2
    g = U @ (s[..., None] * (Vh @ delta)) - (N - 1) * w
    Ug = U.transpose(-1, -2) @ g
    dw = (g - U @ Ug) / (N - 1) + U @ (Ug / denom[..., None])
    eye = torch.eye(N, dtype=Yw.dtype)
    root = torch.sqrt((N - 1) / denom)
    T = eye + U @ ((root - 1)[..., None] * U.transpose(-1, -2))
    T_inv = eye + U @ ((1 / root - 1)[..., None] * U.transpose(-1, -2))
    return dw, T, T_inv


def gauss_newton_frozen(
    Yw: torch.Tensor, delta: torch.Tensor, w: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`gauss_newton` for back-propagation through the IEnKF: the same Δw = C⁻¹ (Yw δ − (N − 1) w) with
    C = (N − 1) I + Yw Ywᵀ, by a Cholesky solve (C ⪰ (N − 1) I: well conditioned, its backward stable), so the
    gradient reaches Yw, δ and w; T and T⁻¹ come from :func:`gauss_newton` without a gradient (constants of the
    step: the SVD's backward has 1/(s_i² − s_j²) terms that blow up where singular values nearly repeat)."""
    N = Yw.shape[-2]
    with torch.no_grad():
        _, T, T_inv = gauss_newton(Yw.detach(), delta.detach(), w.detach())
    eye = torch.eye(N, dtype=Yw.dtype)
    C = (N - 1) * eye + Yw @ Yw.transpose(-1, -2)
    L, info = torch.linalg.cholesky_ex(C)
    if bool((info != 0).any()):  # a stream whose huge sensitivities lost C's definiteness to rounding: Δw = ∇/(N − 1)
        L = torch.where((info != 0)[:, None, None], math.sqrt(N - 1) * eye, L)  # (it has lost the truth anyway)
    dw = torch.cholesky_solve(Yw @ delta - (N - 1) * w, L)
    return dw, T, T_inv

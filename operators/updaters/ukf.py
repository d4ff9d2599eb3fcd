"""``ukf``: the unscented Kalman filter (Julier & Uhlmann 1997; Wan & van der Merwe 2000) for families with
x_m = f(x_{m-1}) + N(0, Q) (``ModelFamily.transition_mean``, ``transition_noise``; affine or not) and
o = h(x) + N(0, R) (``ModelFamily.gaussian_observation``).

The state is a Gaussian N(m, P) (float64 extras ``mean``, ``cov``, as ``kalman`` keeps them), and the particles
are N fresh draws from it after each step. With n = d, λ = α²(n + κ) − n, the 2n + 1 sigma points of N(m, P) are
χ_0 = m, χ_{±i} = m ± √(n + λ) L_i (L Lᵀ = P), weighted W^m_0 = λ/(n + λ), W^c_0 = W^m_0 + 1 − α² + β,
W_i = 1 / (2(n + λ)). Defaults α = 1, β = 0, κ = 0 (λ = 0: the cubature rule of Arasaratnam & Haykin 2009, all
weights positive — stable in any dimension).

* predict: m⁻ = Σ W^m f(χ), P⁻ = Σ W^c (f(χ) − m⁻)(f(χ) − m⁻)ᵀ + Q (static families: unchanged);
* update: sigma points χ of N(m⁻, P⁻), residuals e = o ⊖ h(χ) (the family's: angles wrapped, so the innovation
  never jumps by 2π), ν = Σ W^m e, S = Σ W^c (e − ν)(e − ν)ᵀ + R, C = −Σ W^c (χ − m⁻)(e − ν)ᵀ, K = C S⁻¹,
  m = m⁻ + K ν, P = P⁻ − K S Kᵀ; log p(o_m | o_<m) ≈ log N(ν; 0, S).

Exact (the Kalman filter) on linear-Gaussian families. A partial observation's model has h = 0 and R = 1 at the gaps
(:meth:`~mpflow.operators.models.base.ModelFamily.observed_part`): the innovation is 0 there and the evidence that of
the observed entries. Forecasts are the unscented predictive, Gaussian at every horizon (:meth:`UKFUpdater.forecast`).
"""

from __future__ import annotations

import math

import torch
from mpflow.operators import gaussian
from mpflow.operators.models.base import ModelFamily
from mpflow.operators.models.priors import Prior
from mpflow.operators.rng import Generators
from mpflow.operators.state import ParticleState, StepInfo
from mpflow.operators.updaters.base import StepWork, Updater
from mpflow.operators.updaters.enkf import predictive_log_density
from mpflow.operators.updaters.kalman import KalmanUpdater
from mpflow.operators.updaters.predictive import Predictive


class UKFUpdater(KalmanUpdater):
    name = "ukf"
    needs_linear_gaussian = False
    #: the unscented transform approximates the moments of a nonlinear model: Kalman's algebra, not its exactness
    exact = False
    needs_gaussian_observation = True
    nonlinear_transition = True
    defaults = {"alpha": 1.0, "beta": 0.0, "kappa": 0.0}
    stream_options = frozenset({"alpha", "beta", "kappa"})

    def __init__(self, **options):
        super().__init__(**options)
        for key in ("alpha", "beta", "kappa"):
            v = self.options[key]
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
                raise ValueError(f"options.{key}: a number, got {v!r}")
        if not self.options["alpha"] > 0:
            raise ValueError(f"options.alpha: the sigma points' spread, positive, got {self.options['alpha']!r}")

    def check_compatible(self, model: ModelFamily, prior: Prior | None = None) -> None:
        """Any prior: the filter starts from its mean and covariance."""
        Updater.check_compatible(self, model, prior)

    def step_work(self, model: ModelFamily, n: int, dt: float = 1.0, k: int | None = None) -> StepWork:
        """The Kalman filter's algebra (:meth:`KalmanUpdater.step_work`) with 2d + 1 sigma points, each moved through
        the transition and the observation function, and their (2d + 1) × (d + k) cross-moments."""
        base = super().step_work(model, n, dt, k)
        d = model.state_dim
        k = model.observation_size() if k is None else k
        points = 2 * d + 1
        flops = base.flops + points * (model.particle_flops(dt, k) + 4.0 * (d + k) ** 2)
        return StepWork(flops, base.bytes + 8.0 * 4 * points * (d + k))

    # ------------------------------------------------------------------ the unscented transform
    def _sigma(self, m: torch.Tensor, P: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(χ [B, 2n+1, n], W^m [2n+1], W^c [2n+1]) of N(m, P)."""
        n = m.shape[-1]
        a, b, k = (float(self.options[key]) for key in ("alpha", "beta", "kappa"))
        lam = a * a * (n + k) - n
        if not n + lam > 0:
            raise ValueError(f"options: α²(n + κ) must be positive (n = {n}), got α = {a}, κ = {k}")
        L = gaussian.cholesky(0.5 * (P + P.transpose(-1, -2)))
        cols = math.sqrt(n + lam) * L.transpose(-1, -2)  # rows: the scaled columns of L
        chi = torch.cat([m[:, None], m[:, None] + cols, m[:, None] - cols], 1)
        wm = torch.full((2 * n + 1,), 1 / (2 * (n + lam)), dtype=m.dtype)
        wc = wm.clone()
        wm[0] = lam / (n + lam)
        wc[0] = wm[0] + 1 - a * a + b
        return chi, wm, wc

    def _moments_predict(self, m: torch.Tensor, P: torch.Tensor, model: ModelFamily):
        """(m⁻, P⁻): the sigma points through f, plus Q (module docstring); unchanged for a static family."""
        if not model.dynamic:
            return m, P
        chi, wm, wc = self._sigma(m, P)
        f = model.transition_mean(chi)
        mean = torch.einsum("j,bjd->bd", wm, f)
        diff = f - mean[:, None]
        cov = torch.einsum("j,bjd,bje->bde", wc, diff, diff) + model.transition_noise().expand_as(P)
        return mean, 0.5 * (cov + cov.transpose(-1, -2))

    # ------------------------------------------------------------------ steps
    def _update(self, state: ParticleState, obs: torch.Tensor, model: ModelFamily, gens: Generators):
        m64 = model.to(torch.float64)
        m, P = self._moments_predict(state.extras["mean"], state.extras["cov"], m64)
        chi, wm, wc = self._sigma(m, P)
        e = m64.observation_residual(obs.to(torch.float64), m64.observation_function(chi))
        nu = torch.einsum("j,bjk->bk", wm, e)
        de = e - nu[:, None]
        S = torch.einsum("j,bjk,bjl->bkl", wc, de, de) + m64.observation_noise().expand(m.shape[0], -1, -1)
        S = 0.5 * (S + S.transpose(-1, -2))
        C = -torch.einsum("j,bjd,bjk->bdk", wc, chi - m[:, None], de)
        gain_t = torch.linalg.solve(S, C.transpose(-1, -2))  # Kᵀ = S⁻¹ Cᵀ
        m = m + (nu[:, None] @ gain_t)[:, 0]
        P = P - gain_t.transpose(-1, -2) @ S @ gain_t
        log_pred = predictive_log_density(nu, S) + m64.observation_log_offset().to(torch.float64)
        n = torch.full((state.batch_size,), float(state.num_particles), dtype=torch.float64)
        return self._drawn(state, m, 0.5 * (P + P.transpose(-1, -2)), gens), StepInfo(log_pred, n)

    def _predict(self, state: ParticleState, model: ModelFamily, gens: Generators):
        """No measurement: the unscented predict alone (a static family keeps its state); increment 0."""
        if not model.dynamic:
            return Updater._predict(self, state, model, gens)
        m, P = self._moments_predict(state.extras["mean"], state.extras["cov"], model.to(torch.float64))
        zero = torch.zeros(state.batch_size, dtype=torch.float64)
        n = torch.full((state.batch_size,), float(state.num_particles), dtype=torch.float64)
        return self._drawn(state, m, P, gens), StepInfo(zero, n)

    def forecast_work(self, model: ModelFamily, n: int, steps: int, dt: float = 1.0) -> StepWork:
        """:meth:`forecast`'s: per horizon the unscented predict and the observation's unscented moments — 2d + 1
        sigma points through f and h, their (d + k)² cross-moments — and the Kalman algebra (no particles)."""
        d, k = model.state_dim, model.observation_size()
        points = 2 * d + 1
        per = points * (model.particle_flops(dt, k) + 4.0 * (d + k) ** 2) + 30.0 * d**3
        return StepWork(steps * per + model.step_fixed_flops(dt), 8.0 * 4 * steps * (points * (d + k) + d * d + k * k))

    def forecast(self, state: ParticleState, model: ModelFamily, steps: int, gen: torch.Generator) -> Predictive:
        """The unscented predictive, Gaussian at every horizon j (float64, no particles): (m_j, P_j) the unscented
        predict of (m_{j−1}, P_j−1) (module docstring), and the observation's moments from the sigma points χ of
        N(m_j, P_j) about h(m_j) — e = h(χ) ⊖ h(m_j) (angles wrapped), mean h(m_j) + Σ W^m e, covariance
        Σ W^c (e − ē)(e − ē)ᵀ + R."""
        m64 = model.to(torch.float64)
        m, P = state.extras["mean"].to(torch.float64), state.extras["cov"].to(torch.float64)
        means, covs, obs_means, obs_covs = [], [], [], []
        for _ in range(steps):
            m, P = self._moments_predict(m, P, m64)
            chi, wm, wc = self._sigma(m, P)
            center = m64.observation_function(m[:, None])[:, 0]  # [1, k]
            e = -m64.observation_residual(center, m64.observation_function(chi))  # h(χ) ⊖ h(m)
            e_mean = torch.einsum("j,bjk->bk", wm, e)
            de = e - e_mean[:, None]
            S = torch.einsum("j,bjk,bjl->bkl", wc, de, de) + m64.observation_noise().expand(1, -1, -1)
            means.append(m[0])
            covs.append(P[0])
            obs_means.append((center + e_mean)[0])
            obs_covs.append((0.5 * (S + S.transpose(-1, -2)))[0])
        return Predictive(torch.stack(means), torch.stack(covs), torch.stack(obs_means), torch.stack(obs_covs))

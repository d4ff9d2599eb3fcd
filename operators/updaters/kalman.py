"""``kalman``: the exact Kalman / conjugate update for linear-Gaussian families.

The state keeps the exact filtering mean and covariance (float64, extras ``mean`` [B, d] and ``cov``
[B, d, d]), computed from a float64 model and float64 observations (:attr:`Updater.gaussian_state`); particles are
N fresh draws from N(mean, cov) after each step — for the particle views (the dashboard's cloud, a fall-back's
start), not a cloud: the summaries read the Gaussian itself and report no ESS. log p(o_m | o_<m) is exact:
log N(o; H m⁻, H P⁻ Hᵀ + R). A step without a
measurement is the predict alone (increment 0); a partial one conditions on the observed entries o_S only — H_S,
R_SS — exactly (:meth:`~mpflow.operators.models.linear_observation.LinearObservationFamily.observed_part`).

**Outlier clipping** (option ``outlier_clip`` c, in sd; off by default). Real sensors spike: one reading 20 sd out
drags an exact Kalman filter's state with it, and the readings after it look anomalous too. With c set, a reading
whose Mahalanobis distance from its predictive, d² = vᵀ S⁻¹ v (v = o − H m⁻, S = H P⁻ Hᵀ + R), exceeds c is
conditioned on as if its noise were inflated so that it sits at c sd:

    R_eff = R + (d²/c² − 1) S,   so that   S_eff = H P⁻ Hᵀ + R_eff = (d²/c²) S,

which shrinks the gain by c²/d² — the update of a heavy-tailed observation noise, the scale of whose noise is
inferred from the reading itself (one fixed-point step of the variational Student-t filter, Särkkä & Nummenmaa
2009 eq. 9; Piché, Särkkä & Hartikainen 2012 §III: the noise is scaled by (ν + d²)/(ν + k), here clipped at c so
that readings within c sd are conditioned on exactly). The step's evidence, p-values and log tails stay the model's
(N(H m⁻, S)): the clip changes what the filter believes after a spike, not how surprising the spike was.
"""

from __future__ import annotations

import torch
from mpflow.operators import gaussian
from mpflow.operators.models.base import ModelFamily
from mpflow.operators.models.priors import GaussianMixture, Prior
from mpflow.operators.references.conjugate import conjugate_update
from mpflow.operators.references.exact_kalman import kalman_predict
from mpflow.operators.rng import Generators, randn
from mpflow.operators.state import ParticleState, StepInfo
from mpflow.operators.updaters.base import CDF_FLOPS, StepWork, Updater
from mpflow.operators.updaters.predictive import Predictive, gaussian_predictive

#: floating-point operations' worth of one float64 normal draw of a Gaussian state's fresh particles (torch's
#: float64 ``randn`` from a stream's generator and the copy around it) — measured, not counted, as
#: :data:`~mpflow.operators.updaters.base.PARTICLE_STEP_FLOPS` is: ``benchmarks/price_audit.py`` fits it from
#: ``kalman``'s p-values on ``lds`` d = 128 at N = 37849 (a second predict and N d draws: 0.16 s CPU, priced at a
#: quarter to a half of that at :data:`~mpflow.operators.updaters.base.RANDN_FLOPS`' 30 a draw), 488 to 1072 at
#: 25 Gflop/s in three runs on 2026-11-28
DRAW_FLOPS = 1100.0


class KalmanUpdater(Updater):
    name = "kalman"
    needs_linear_gaussian = True
    exact = True
    gaussian_state = True
    model_dtype = torch.float64
    defaults = {"outlier_clip": None}
    stream_options = frozenset({"outlier_clip"})
    #: the bounds of ``outlier_clip`` (sd)
    CLIP_RANGE = (1.0, 100.0)

    def __init__(self, **options):
        super().__init__(**options)
        clip = self.options.get("outlier_clip")
        lo, hi = self.CLIP_RANGE
        if clip is not None and not (isinstance(clip, int | float) and not isinstance(clip, bool) and lo <= clip <= hi):
            raise ValueError(f"options.outlier_clip: null (off) or a number of sd from {lo:g} to {hi:g}, got {clip!r}")

    def check_compatible(self, model: ModelFamily, prior: Prior | None = None) -> None:
        super().check_compatible(model, prior)
        if prior is not None and not (isinstance(prior, GaussianMixture) and prior.weights.shape[1] == 1):
            raise ValueError("prior: kalman needs a gaussian prior (mean, cov); use smc or gpf for other priors")

    def _init(self, state: ParticleState, prior: Prior, model: ModelFamily, gens: Generators) -> ParticleState:
        mean, cov = prior.moments()
        return state.replace(extras={"mean": mean.to(torch.float64), "cov": cov.to(torch.float64)})

    def density(self, state: ParticleState) -> GaussianMixture:
        """The exact filtering Gaussian N(mean, cov), in float64."""
        return GaussianMixture.gaussian(state.extras["mean"].to(torch.float64), state.extras["cov"].to(torch.float64))

    def filtered_moments(self, state: ParticleState) -> tuple[torch.Tensor, torch.Tensor]:
        """The exact filtering moments (float64), so the RTS smoother over them is the exact one."""
        return state.extras["mean"].to(torch.float64), state.extras["cov"].to(torch.float64)

    def from_particles(self, state: ParticleState, density: GaussianMixture | None = None) -> ParticleState:
        """The filter's Gaussian (float64): ``density``'s moments where it is given, else the particles' weighted
        moments m = Σ w_i x_i, C = Σ w_i (x_i − m)(x_i − m)ᵀ."""
        if density is not None:
            mean, cov = density.to(torch.float64).moments()
        else:
            mean, cov = gaussian.moments(state.particles.to(torch.float64), state.log_weights)
        return state.replace(extras={"mean": mean, "cov": cov})

    def _update(self, state: ParticleState, obs: torch.Tensor, model: ModelFamily, gens: Generators):
        H, R = model.observation_affine()
        m, P = kalman_predict(state.extras["mean"], state.extras["cov"], model)
        clip = self.options.get("outlier_clip")
        if clip is None:
            m, P, log_pred = conjugate_update(m, P, H, R, obs)
        else:  # the model's evidence; the belief of the clipped update (module docstring)
            log_pred = conjugate_update(m, P, H, R, obs)[2]
            m, P, _ = conjugate_update(m, P, H, clipped_noise(m, P, H, R, obs, clip), obs)
        # a partial observation's model carries the constant that makes log N(o; H m, S) that of the observed entries
        log_pred = log_pred + model.observation_log_offset().to(torch.float64)
        n = torch.full((state.batch_size,), float(state.num_particles), dtype=torch.float64)
        return self._drawn(state, m, P, gens), StepInfo(log_pred, n)

    def _predict(self, state: ParticleState, model: ModelFamily, gens: Generators):
        """No measurement: the Kalman predict m⁻ = F m + c, P⁻ = F P Fᵀ + Q (a static family keeps its state);
        the evidence increment is 0."""
        if not model.dynamic:
            return super()._predict(state, model, gens)
        m, P = kalman_predict(state.extras["mean"], state.extras["cov"], model)
        zero = torch.zeros(state.batch_size, dtype=torch.float64)
        n = torch.full((state.batch_size,), float(state.num_particles), dtype=torch.float64)
        return self._drawn(state, m, P, gens), StepInfo(zero, n)

    def step_work(self, model: ModelFamily, n: int, dt: float = 1.0, k: int | None = None) -> StepWork:
        """The Kalman predict and update in float64 (products and factorisations of d × d and k × k: about
        30 d³ + 20 d² k + 10 k³) and n fresh draws of the Gaussian (n d float64 normal draws,
        :data:`DRAW_FLOPS` each, and 2 n d²)."""
        d = model.state_dim
        k = model.observation_size() if k is None else k
        draws = n * d * (DRAW_FLOPS + 2.0 * d)
        flops = 30.0 * d**3 + 20.0 * d * d * k + 10.0 * k**3 + draws + model.step_fixed_flops(dt)
        return StepWork(flops, 8.0 * (3 * n * d + 20 * (d + k) ** 2))

    def pit_work(self, model: ModelFamily, n: int, dt: float = 1.0, k: int | None = None) -> StepWork:
        """The p-values: a second predict (the particles it redraws included), as :meth:`step_work`, and — where the
        family's predictive is not the closed-form Gaussian (``ukf`` on a nonlinear family) — each redrawn
        particle's conditional CDF of the k entries (its likelihood's work and :data:`CDF_FLOPS` an entry)."""
        work = self.step_work(model, n, dt, k)
        if model.linear_gaussian:
            return work
        k = model.observation_size() if k is None else k
        return StepWork(work.flops + n * (model.likelihood_flops(k) + CDF_FLOPS * k), work.bytes + 8.0 * n * k)

    def forecast_work(self, model: ModelFamily, n: int, steps: int, dt: float = 1.0) -> StepWork:
        """The exact predictive: per horizon a Kalman predict and the observation's moments (d × d and k × k
        algebra, no particles)."""
        d, k = model.state_dim, model.observation_size()
        flops = steps * (30.0 * d**3 + 20.0 * d * d * k + 10.0 * k**3) + model.step_fixed_flops(dt)
        return StepWork(flops, 8.0 * 4 * steps * (d * d + k * k))

    def forecast(self, state: ParticleState, model: ModelFamily, steps: int, gen: torch.Generator) -> Predictive:
        """The exact predictive: the Kalman predict ``steps`` times, and N(H m_j, H P_j Hᵀ + R)."""
        return gaussian_predictive(state.extras["mean"], state.extras["cov"], model, steps)

    @staticmethod
    def _drawn(state: ParticleState, m: torch.Tensor, P: torch.Tensor, gens: Generators) -> ParticleState:
        """The state of the Gaussian N(m, P): its moments as extras and N fresh draws as particles."""
        L = gaussian.cholesky(P)
        xi = randn(gens, [state.num_particles, state.dim], torch.float64)
        particles = (m[:, None] + xi @ L.transpose(-1, -2)).to(state.particles.dtype)
        return state.replace(particles=particles, extras={"mean": m, "cov": P})


def clipped_noise(
    m: torch.Tensor, P: torch.Tensor, H: torch.Tensor, R: torch.Tensor, obs: torch.Tensor, clip: float
) -> torch.Tensor:
    """R_eff = R + max(0, d²/c² − 1) S [B, k, k] (module docstring, "Outlier clipping") for the predicted m [B, d],
    P [B, d, d] and the reading obs [B, k], in float64."""
    m, P, H, R, obs = (t.to(torch.float64) for t in (m, P, H, R, obs))
    S = H @ P @ H.transpose(-1, -2) + R
    v = obs - torch.einsum("bkd,bd->bk", H, m)
    d2 = torch.einsum("bk,bk->b", v, torch.linalg.solve(S, v[..., None])[..., 0])
    excess = (d2 / clip**2 - 1.0).clamp_min(0.0)
    return R + excess[:, None, None] * S

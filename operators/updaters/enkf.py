"""``enkf``: the ensemble Kalman filter (Evensen 1994), the data-assimilation baseline — for families with an
observation o = h(x) + N(0, R) (``ModelFamily.gaussian_observation``), any transition (it moves the ensemble through
``ModelFamily.transition``, nonlinear ones included).

Per step, for each stream (float64 inside):

1. forecast   x_i ← x_i' ~ p(x_m | x_{m-1} = x_i); multiplicative inflation of the anomalies by ρ (``inflation``;
              the covariance by ρ², the convention of Sakov & Oke 2008 and DAPPER): A_i = ρ (x_i − x̄), x_i = x̄ + A_i;
2. observe    e_i = o ⊖ h(x_i) (the family's residual: angles wrapped), ē = mean e_i (the innovation o − ȳ), and the
              observation anomalies Y_i = −(e_i − ē) = h(x_i) − ȳ;
3. analysis   ``variant="etkf"`` — the ensemble transform Kalman filter in its symmetric square-root form (Bishop,
              Etherington & Majumdar 2001; Hunt, Kostelich & Szunyogh 2007 eqs. 20–25): with Ỹ = Y R^{-1/2} and
              C = (N − 1) I + Ỹ Ỹᵀ = V Λ Vᵀ, the weights w̄ = C⁻¹ Ỹ R^{-1/2} ē and W = [(N − 1) C⁻¹]^{1/2} give
              x_i^a = x̄ + Σ_j (w̄_j + W_ji) A_j (deterministic: the analysis mean and covariance are the Kalman
              filter's for the ensemble's Gaussian, exactly);
              ``variant="perturbed"`` — the stochastic EnKF (Burgers, van Leeuwen & Evensen 1998):
              K = P_xy (P_yy + R)⁻¹ with P_xy = Aᵀ Y/(N − 1), P_yy = Yᵀ Y/(N − 1), and x_i^a = x_i + K (e_i + ε_i),
              ε_i ~ N(0, R) (centred over the ensemble, so the mean update is the Kalman one);
4. evidence   log p(o_m | o_<m) ≈ log N(ē; 0, P_yy + R) (the Gaussian predictive of the ensemble).

Localisation (``localisation`` = c, ETKF only): the local ETKF (LETKF; Hunt et al. 2007) — every state variable j
takes its own analysis with R⁻¹ tapered by the Gaspari–Cohn function of the distance between j and each observed
entry (:meth:`~mpflow.operators.models.base.ModelFamily.localisation_distances`; half-width c, zero beyond 2c;
Gaspari & Cohn 1999 eq. 4.10), which needs a diagonal R. The ensemble keeps uniform weights; the step's ``ess`` is N.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from mpflow.operators import gaussian
from mpflow.operators.models.base import ModelFamily
from mpflow.operators.models.priors import Prior
from mpflow.operators.rng import Generators, randn
from mpflow.operators.state import ParticleState, StepInfo
from mpflow.operators.updaters.base import PARTICLE_STEP_FLOPS, StepWork, Updater

VARIANTS = ("etkf", "perturbed")


def gaspari_cohn(r: torch.Tensor) -> torch.Tensor:
    """The Gaspari–Cohn fifth-order piecewise rational taper of r = distance / c (1 at 0, 0 from r = 2 on)."""
    r = r.abs()
    near = 1 - 5 / 3 * r**2 + 5 / 8 * r**3 + 1 / 2 * r**4 - 1 / 4 * r**5
    far = 4 - 5 * r + 5 / 3 * r**2 + 5 / 8 * r**3 - 1 / 2 * r**4 + 1 / 12 * r**5 - 2 / (3 * r.clamp_min(1e-12))
    return torch.where(r <= 1, near, torch.where(r < 2, far, torch.zeros_like(r)))


def ensemble_innovations(
    x: torch.Tensor, obs: torch.Tensor, model: ModelFamily
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e [B, N, k], ē [B, k], Y [B, N, k]) of the ensemble x [B, N, d] (float64; module docstring, 2.)."""
    e = model.observation_residual(obs, model.observation_function(x))
    e_bar = e.mean(1)
    return e, e_bar, -(e - e_bar[:, None])


def predictive_log_density(e_bar: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
    """log N(ē; 0, S) → [B]."""
    return gaussian.log_prob(e_bar[:, None], torch.zeros_like(e_bar), gaussian.cholesky(S))[:, 0]


def check_inflation(value: Any) -> None:
    """``options.inflation``: a multiplicative inflation ρ of the forecast anomalies, 1 ≤ ρ < 10."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 1 <= value < 10:
        raise ValueError(f"options.inflation: a multiplicative inflation ρ of the anomalies in [1, 10), got {value!r}")


class EnKFUpdater(Updater):
    name = "enkf"
    needs_gaussian_observation = True
    nonlinear_transition = True
    defaults = {"variant": "etkf", "inflation": 1.0, "localisation": None}
    stream_options = frozenset({"variant", "inflation", "localisation"})
    #: the ensemble RTS smoother's means were within 0.1 sd of the exact smoother in every run at N = 2048 (max 0.08
    #: over 16 runs), not at 1024 (0.10) or 256 (0.28): ``benchmarks/smoothing.py``
    smoothing_particles = 2048

    def __init__(self, **options):
        super().__init__(**options)
        o = self.options
        if o["variant"] not in VARIANTS:
            raise ValueError(f"options.variant: expected one of {list(VARIANTS)}, got {o['variant']!r}")
        check_inflation(o["inflation"])
        loc = o["localisation"]
        if loc is not None:
            if isinstance(loc, bool) or not isinstance(loc, int | float) or not 0 < loc < math.inf:
                raise ValueError(f"options.localisation: a positive Gaspari–Cohn half-width, got {loc!r}")
            if o["variant"] != "etkf":
                raise ValueError("options.localisation: localises the ETKF (LETKF); use variant etkf or omit it")

    def check_compatible(self, model: ModelFamily, prior: Prior | None = None) -> None:
        super().check_compatible(model, prior)
        if self.options["localisation"] is None:
            return
        if model.localisation_distances() is None:
            raise ValueError(
                f"options.localisation: the {model.name} family defines no distance between its variables and its "
                "observations; omit localisation"
            )
        R = model.observation_noise()
        if not torch.equal(R, torch.diag_embed(torch.diagonal(R, dim1=-2, dim2=-1))):
            raise ValueError("options.localisation: the LETKF needs independent observation errors (a diagonal R)")

    def step_work(self, model: ModelFamily, n: int, dt: float = 1.0, k: int | None = None) -> StepWork:
        """Every member's transition and predicted observation (:meth:`ModelFamily.particle_flops`) and its
        memory-bound share (:data:`~mpflow.operators.updaters.base.PARTICLE_STEP_FLOPS`), the
        anomalies' products (2 n d k) and the thin SVD of the n × k whitened anomalies (about 4 n k²) — once for
        the ETKF, once per state variable for the LETKF (``localisation``), which holds d tapered n × k copies
        (:data:`LOCAL_ANALYSIS_FLOPS` a variable and member besides)."""
        d = model.state_dim
        k = model.observation_size() if k is None else k
        local = self.options["localisation"] is not None
        analyses = d if local else 1
        flops = n * (model.particle_flops(dt, k) + PARTICLE_STEP_FLOPS) + 2.0 * n * d * k
        flops += analyses * (4.0 * n * k * k + 4.0 * n * k) + (d * n * LOCAL_ANALYSIS_FLOPS if local else 0.0)
        held = 8.0 * (6 * n * d + 4 * n * k + 3 * analyses * n * k)
        return StepWork(flops + model.step_fixed_flops(dt), held)

    def _update(self, state: ParticleState, obs: torch.Tensor, model: ModelFamily, gens: Generators):
        B, N, _ = state.particles.shape
        xa, log_pred = self.analysis(model.transition(state.particles, gens), obs, model, gens)
        n = torch.full((B,), float(N), dtype=torch.float64)
        return state.replace(particles=xa.to(state.particles.dtype)), StepInfo(log_pred, n)

    def analysis(
        self, forecast: torch.Tensor, obs: torch.Tensor, model: ModelFamily, gens: Generators
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Steps 1 (inflation) to 4 of the module docstring on the forecast ensemble [B, N, d] → (analysis ensemble
        [B, N, d] float64, log p(o | o_<m) [B])."""
        B, N, d = forecast.shape
        x = forecast.to(torch.float64)
        m64 = model.to(torch.float64)
        mean = x.mean(1, keepdim=True)
        A = float(self.options["inflation"]) * (x - mean)
        x = mean + A
        e, e_bar, Y = ensemble_innovations(x, obs.to(torch.float64), m64)
        R = m64.observation_noise().expand(B, -1, -1)
        S = Y.transpose(-1, -2) @ Y / (N - 1) + R
        log_pred = predictive_log_density(e_bar, S) + m64.observation_log_offset().to(torch.float64)
        if self.options["variant"] == "perturbed":
            eps = randn(gens, [N, R.shape[-1]], torch.float64) @ gaussian.cholesky(R).transpose(-1, -2)
            eps = eps - eps.mean(1, keepdim=True)
            gain_t = torch.linalg.solve(S, Y.transpose(-1, -2) @ A / (N - 1))  # Kᵀ = S⁻¹ P_xyᵀ  [B, k, d]
            xa = x + (e + eps) @ gain_t
        elif self.options["localisation"] is None:
            xa = self._global_analysis(mean, A, Y, e_bar, R)
        else:
            xa = self._local_analysis(mean, A, Y, e_bar, R, m64)
        return xa, log_pred

    @staticmethod
    def _global_analysis(mean: torch.Tensor, A: torch.Tensor, Y: torch.Tensor, e_bar: torch.Tensor, R: torch.Tensor):
        """The ETKF (module docstring, 3.): x^a = x̄ + T A with R^{-1/2} from R's Cholesky factor."""
        L = gaussian.cholesky(R)
        Yw = torch.linalg.solve_triangular(L, Y.transpose(-1, -2), upper=False).transpose(-1, -2)  # Y R^{-1/2}
        dw = torch.linalg.solve_triangular(L, e_bar[..., None], upper=False)  # R^{-1/2} ē  [B, k, 1]
        return mean + transformed(Yw, dw, A)

    def _local_analysis(
        self, mean: torch.Tensor, A: torch.Tensor, Y: torch.Tensor, e_bar: torch.Tensor, R: torch.Tensor, model
    ) -> torch.Tensor:
        """The LETKF: one ETKF per state variable j with R⁻¹ tapered by ρ_jk = GC(dist_jk / c) (module docstring)."""
        B, N, d = A.shape
        taper = gaspari_cohn(model.localisation_distances().to(torch.float64) / float(self.options["localisation"]))
        taper = taper.expand(B, d, -1).sqrt()  # [B, d, k]
        r_sd = torch.diagonal(R, dim1=-2, dim2=-1).sqrt()  # [B, k]
        Yw = (Y / r_sd[:, None])[:, None] * taper[:, :, None]  # [B, d, N, k]
        dw = ((e_bar / r_sd)[:, None] * taper)[..., None]  # [B, d, k, 1]
        columns = A.transpose(-1, -2)[..., None]  # [B, d, N, 1]: variable j's anomalies
        return mean + transformed(Yw, dw, columns)[..., 0].transpose(-1, -2)


#: floating-point operations' worth of one state variable's local analysis of the LETKF per member, beyond its
#: counted 4 n k² + 4 n k: the tapered [N, k] copy of the whitened anomalies, a batched SVD's LAPACK calls and the
#: products around it — measured, not counted, as :data:`~mpflow.operators.updaters.base.PARTICLE_STEP_FLOPS` is:
#: ``benchmarks/price_audit.py`` fits it from ``enkf`` with ``localisation: 4`` on ``lorenz96`` d = 40 at N = 9678
#: (0.35 to 0.63 s CPU, priced at a quarter of it), 15000 to 29000 at 25 Gflop/s in four runs on 2026-11-28
LOCAL_ANALYSIS_FLOPS = 30000.0


def transformed(Yw: torch.Tensor, dw: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
    """T A with T = W + 1 w̄ᵀ, for whitened anomalies Yw [..., N, k], innovation dw [..., k, 1] and A [..., N, m]:
    C = (N − 1) I + Yw Ywᵀ, w̄ = C⁻¹ Yw dw, W = ((N − 1) C⁻¹)^{1/2}. With the thin SVD Yw = U S Vᵀ, C's eigenvectors
    are U (eigenvalues N − 1 + s²) and 1 elsewhere, so w̄ = U diag(s / (N − 1 + s²)) Vᵀ dw and
    W = I + U diag(√((N − 1)/(N − 1 + s²)) − 1) Uᵀ: O(N k²), no N × N matrix."""
    N = Yw.shape[-2]
    U, S, Vh = torch.linalg.svd(Yw, full_matrices=False)
    denom = (N - 1) + S**2
    w_bar = U @ ((S / denom)[..., None] * (Vh @ dw))  # [..., N, 1]
    g = torch.sqrt((N - 1) / denom) - 1
    return A + U @ (g[..., None] * (U.transpose(-1, -2) @ A)) + w_bar.transpose(-1, -2) @ A

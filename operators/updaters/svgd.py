"""``svgd``: Stein Variational Gradient Descent (Liu & Wang 2016) as a plain solver (:func:`svgd`) and as
an assumed-density filter (:class:`SVGDUpdater`).

With the RBF kernel k(x, y) = exp(−‖x − y‖² / h) and the median heuristic h = med(‖x_i − x_j‖²) / log(N + 1),

    φ(x_i) = (1/N) Σ_j [ k(x_j, x_i) ∇ log π(x_j) + ∇_{x_j} k(x_j, x_i) ],     x_i ← x_i + ε φ(x_i)

(Zaki et al. eq. 8). The flow runs in whitened coordinates z = L⁻¹ (x − m), LLᵀ the target's covariance as
estimated at the start from Stein's identity (E_q[∇ log π (x − m)ᵀ] = −Λ C for a Gaussian π with
precision Λ; the particle covariance C when that estimate is not positive definite), which makes the
bandwidth and the step size scale-free. The step is ε = step_size / mean_ij k(x_i, x_j) — a constant
rescaling of time per iteration, so the drift term moves at rate ≈ step_size whatever the bandwidth — and
shrinks when a step would move a particle by more than ``max_move`` (in whitened units). It stops when
mean ‖φ‖² < ``tol``·mean(K)² (the same threshold on the rescaled velocity).

KL integration (Zaki et al. eq. 6, 10): dKL/dt ≈ −φᵀ (K + νI)⁻¹ φ (the RKHS norm of φ), integrated
over the flow's time with the trapezoid rule (§2.4 uses the left Riemann sum Σ ε_t dKL/dt, whose O(ε)
bias is large at these step sizes); the KL divergence is invariant under the whitening map.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from mpflow.operators import gaussian
from mpflow.operators.models.base import ModelFamily
from mpflow.operators.rng import Generators
from mpflow.operators.updaters.assumed_density import AssumedDensityUpdater, FlowResult, PosteriorTarget, Whitening
from mpflow.operators.updaters.base import StepWork

Score = Callable[[torch.Tensor], torch.Tensor]


#: one SVGD iteration's fixed cost whatever N, in floating-point operations' worth — its Python and its tensor
#: operations' launches (the score in whitened coordinates, the kernel, the Stein direction, the step size), the
#: whole of its time at small N: fitted from ``benchmarks/price_audit.py``'s row "svgd lds d=2 N=16" (a step's mean
#: CPU time over the passes of its loop, 30 to 84) at NOMINAL_RATE (25 Gflop/s CPU): 8.3e6 to 1.2e7 in four runs
#: of 2026-11-28 and 1.7e7 in a fifth at a load of 5; their median rounded up
ITERATION_FLOPS = 1.2e7


@dataclass
class SVGDTrace:
    iterations: torch.Tensor  # [B]
    kl_decrease: torch.Tensor | None  # [B] Σ ε_t dKL/dt (≤ 0), when requested
    converged: torch.Tensor  # [B]


def rbf_kernel(z: torch.Tensor, max_median_points: int = 200) -> tuple[torch.Tensor, torch.Tensor]:
    """K [B, N, N] and bandwidth h [B] by the median heuristic. The median is taken over the pairwise
    distances of an evenly strided subset of at most ``max_median_points`` particles (an O(N²) sort per
    iteration otherwise dominates the cost at N = 1024; the estimate is the same statistic)."""
    n = z.shape[1]
    sq = torch.cdist(z, z).pow(2)
    if n > max_median_points:
        idx = torch.linspace(0, n - 1, max_median_points).round().long()
        sub = sq[:, idx][:, :, idx]
    else:
        sub = sq
    med = sub.flatten(1).median(-1).values.clamp_min(1e-12)
    h = med / math.log(n + 1)
    return sq.mul_(-1.0 / h[:, None, None]).exp_(), h  # in place: K is the only N×N buffer


def stein_direction(z: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """φ(z_i) = (1/N) Σ_j [k_ji s_j + ∇_{z_j} k_ji]; returns (φ [B, N, d], K).
    With ∇_{z_j} k_ji = (2/h) (z_i − z_j) k_ji (K symmetric): φ = (K s + (2/h)(z ∘ K1 − K z)) / N."""
    N, d = z.shape[1:]
    K, h = rbf_kernel(z)
    Ks_Kz_K1 = K @ torch.cat([s, z, torch.ones_like(z[..., :1])], dim=-1)  # one pass over K
    Ks, Kz, K1 = Ks_Kz_K1[..., :d], Ks_Kz_K1[..., d : 2 * d], Ks_Kz_K1[..., 2 * d :]
    repulsion = (2.0 / h)[:, None, None] * (z * K1 - Kz)
    return (Ks + repulsion) / N, K


def rkhs_norm_sq(phi: torch.Tensor, K: torch.Tensor, nu: float) -> torch.Tensor:
    """φᵀ (K + νI)⁻¹ φ summed over dimensions → [B] (Zaki et al. eq. 10)."""
    eye = torch.eye(K.shape[-1], dtype=K.dtype)
    L = gaussian.cholesky(K.to(torch.float64) + nu * eye.to(torch.float64))
    alpha = torch.cholesky_solve(phi.to(torch.float64), L)
    return (phi.to(torch.float64) * alpha).sum((-1, -2))


def svgd(
    x: torch.Tensor,
    score: Score,
    *,
    step_size: float = 0.3,
    max_iters: int = 100,
    tol: float = 1e-4,
    max_move: float = 0.5,
    whiten: bool = True,
    want_kl: bool = False,
    nu: float = 1e-2,
) -> tuple[torch.Tensor, SVGDTrace]:
    """Move x [B, N, d] towards π (``score`` = ∇ log π). See the module docstring."""
    B = x.shape[0]
    w = Whitening.fit(x, score, whiten)
    z = w.to_z(x)
    active = torch.ones(B, dtype=torch.bool)
    iters = torch.zeros(B, dtype=torch.int64)
    kl = torch.zeros(B, dtype=torch.float64) if want_kl else None
    prev = None  # (ε, dKL/dt) of the previous step, for the trapezoid rule
    for _ in range(max_iters):
        s = w.score_z(score(w.to_x(z)))
        phi, K = stein_direction(z, s)
        rate = rkhs_norm_sq(phi, K, nu) if kl is not None else None
        if prev is not None:  # ∫ dKL/dt over the last step, trapezoid rule
            kl = kl - prev[0] * 0.5 * (prev[1] + rate)
        size = (phi * phi).sum(-1).mean(-1) / K.mean((-1, -2)) ** 2
        active = active & (size > tol)
        if not bool(active.any()):
            break
        # time scale: ε = step_size / mean(K), so the kernel-averaged drift moves at rate ≈ step_size
        # whatever the bandwidth (a uniform reparametrisation of time: still the SVGD flow)
        nominal = step_size / K.mean((-1, -2))
        biggest = (phi * phi).sum(-1).amax(-1).sqrt()
        eps = torch.minimum(max_move / biggest.clamp_min(1e-30), nominal)
        eps = torch.where(active, eps, torch.zeros_like(eps))
        if kl is not None:
            prev = (eps.to(torch.float64), rate)
        z = z + eps[:, None, None] * phi
        iters += active.to(torch.int64)
    else:
        if kl is not None and prev is not None:  # close the last interval with the final velocity
            s = w.score_z(score(w.to_x(z)))
            phi, K = stein_direction(z, s)
            kl = kl - prev[0] * 0.5 * (prev[1] + rkhs_norm_sq(phi, K, nu))
    return w.to_x(z), SVGDTrace(iters, kl, ~active)


class SVGDUpdater(AssumedDensityUpdater):
    name = "svgd"
    supports_kl = True
    defaults = {
        "evidence": "predictive",
        "step_size": 0.3,
        "max_iters": 100,
        "tol": 1e-4,
        "max_move": 0.5,
        "whiten": True,
        "nu": 1e-2,
    }

    def iteration_flops(self) -> float:
        """:data:`ITERATION_FLOPS`."""
        return ITERATION_FLOPS

    def iteration_work(self, model: ModelFamily, n: int) -> StepWork:
        """The kernel: n × n distances and K (two float32 n × n buffers) and one product K [s, z, 1] — about
        n² (16 d + 50) operations' worth (measured: about four times the n² (4 d + 12) counted, the n × n passes
        being bound by memory, not arithmetic); with ``evidence="kl"`` also the RKHS norm's float64 factorisation
        of K + νI (n³ / 3, two float64 n × n buffers)."""
        d = model.state_dim
        flops, held = n * n * (16.0 * d + 50.0), 8.0 * n * n + 80.0 * n * d
        if self.options["evidence"] == "kl":
            flops, held = flops + n**3 / 3.0, held + 16.0 * n * n
        return StepWork(flops, held)

    def solve(self, x: torch.Tensor, target: PosteriorTarget, gens: Generators, want_kl: bool) -> FlowResult:
        x, trace = svgd(x, target.score, want_kl=want_kl, **self.solver_options())
        return FlowResult(x, trace.iterations, trace.kl_decrease, {"converged": trace.converged})

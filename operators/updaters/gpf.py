"""``gpf``: Gaussian Particle Flow (Galy-Fajou, Perrone & Opper 2021), as a plain VI solver on any
log-density (:func:`gaussian_particle_flow`) and as an assumed-density filter (:class:`GPFUpdater`).

With φ = −log π, g_i = ∇φ(x_i), m = mean x_i, C = the particles' covariance (eq. 15), the particles
follow the linear flow (eq. 5, 8, 13; Algorithm 2)

    x_i ← x_i − η₁ b − η₂ A (x_i − m),   A = (1/N) Σ_j g_j (x_j − m)ᵀ − I,   b = ḡ  (or C ḡ: natural mean),

which decreases the empirical free energy (eq. 14/17)  F̃ = −½ log|C| + (1/N) Σ_i φ(x_i)
(zero eigenvalues of C counted as 1 when N ≤ D, §3.4.1). Its rate is −dF/dt = bᵀḡ + ‖A‖²_F (eq. 6),
used as the convergence criterion. For a Gaussian target D + 1 particles converge to the exact mean
and covariance (Theorem 1). Step sizes adapt per stream: a step that raises F̃ is undone and η halved,
an accepted one grows η (up to ``max_step``). Optional dimension-wise RMSProp / Adam preconditioners
(Appendix H, Algorithms A2 and A6) keep the flow linear where element-wise ones would not.

KL integration (Zaki et al. eq. 6): under the Gaussian reading q_t = N(m_t, C_t) of the particles,
KL(q_t ‖ p) = F(q_t) + log Z, so the flow's KL change is the sum of the accepted free-energy changes —
exact for this linear flow (a Riemann sum Σ ε dKL/dt would carry an O(ε) bias at these step sizes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from mpflow.operators import gaussian
from mpflow.operators.models.priors import GaussianMixture
from mpflow.operators.rng import Generators
from mpflow.operators.updaters.assumed_density import AssumedDensityUpdater, FlowResult, PosteriorTarget

LogDensity = Callable[[torch.Tensor], torch.Tensor]


def regularized_logdet(cov: torch.Tensor) -> torch.Tensor:
    """log|C| with (numerically) zero eigenvalues replaced by 1 (GPF §3.4.1) → [B]."""
    eig = torch.linalg.eigvalsh(cov)
    floor = eig.amax(-1, keepdim=True).clamp_min(1e-30) * (1e-10 if cov.dtype == torch.float64 else 1e-6)
    return torch.where(eig > floor, torch.log(eig.clamp_min(1e-300)), torch.zeros_like(eig)).sum(-1)


def free_energy(x: torch.Tensor, log_prob: LogDensity) -> torch.Tensor:
    """Empirical free energy F̃ = −½ log|C| − mean log π(x_i) (eq. 17) → [B]."""
    _, cov = gaussian.moments(x)
    return -0.5 * regularized_logdet(cov) - log_prob(x).mean(-1)


@dataclass
class GPFTrace:
    iterations: torch.Tensor  # [B] accepted + rejected iterations
    free_energy: torch.Tensor  # [B] final F̃
    kl_decrease: torch.Tensor  # [B] F̃_final − F̃_initial (≤ 0)
    rate: torch.Tensor  # [B] final −dF/dt
    converged: torch.Tensor  # [B] bool


#: one GPF iteration's fixed cost whatever N, in floating-point operations' worth — its Python and its tensor
#: operations' launches (two scores and free energies, the moments, the acceptance test, all in float64), the whole
#: of its time at small N: fitted from ``benchmarks/price_audit.py``'s row "gpf lds d=2 N=16" (a step's mean CPU
#: time over the passes of its loop, 17 to 19, 10 to 23 ms) at NOMINAL_RATE (25 Gflop/s CPU): 1.4e7 to 1.8e7 in
#: four runs of 2026-11-28 and 3.1e7 in a fifth at a load of 5; their median rounded up. Without it a step of N = 16
#: was priced 5.5e5 (its 500 iterations' arithmetic), a 25th of one iteration's time; now 1e10, so two steps a
#: request (500 iterations could take 0.5 s)
ITERATION_FLOPS = 2e7


def gaussian_particle_flow(
    x: torch.Tensor,
    log_prob: LogDensity,
    score: LogDensity,
    *,
    step_size: float = 0.5,
    max_step: float = 0.5,
    max_iters: int = 500,
    tol: float = 1e-9,
    natural_mean: bool = True,
    optimizer: str = "plain",
    rho: float = 0.9,
    beta1: float = 0.9,
    eps: float = 1e-9,
    patience: int = 25,
) -> tuple[torch.Tensor, GPFTrace]:
    """Run Algorithm 2 on the particles x [B, N, d] towards π (``log_prob`` → [B, N], ``score`` = ∇ log π).

    Stops per stream when −dF/dt < ``tol``, or when F̃ has not improved by more than its resolution
    (~1e3·eps·|F̃|) for ``patience`` iterations (F̃ is then at its floating-point floor: run in float64 for
    tight tolerances). Converged streams stop moving, so a stream's result does not depend on the batch
    it runs in.
    """
    if optimizer not in ("plain", "rmsprop", "adam"):
        raise ValueError(f"options.optimizer: expected plain, rmsprop or adam, got {optimizer!r}")
    B, N, d = x.shape
    dtype = x.dtype
    eye = torch.eye(d, dtype=dtype)
    slack = 1e3 * torch.finfo(dtype).eps
    eta = torch.full((B,), float(step_size), dtype=dtype)
    F = free_energy(x, log_prob)
    F0 = F.clone()
    active = torch.ones(B, dtype=torch.bool)
    iters = torch.zeros(B, dtype=torch.int64)
    stalled = torch.zeros(B, dtype=torch.int64)  # iterations since F̃ last improved beyond its resolution
    rate = torch.full((B,), float("inf"), dtype=dtype)
    v = torch.zeros(B, 1, d, dtype=dtype)  # dimension-wise second moment
    mom = torch.zeros_like(x)  # Adam first moment (per particle, per dimension)
    for t in range(1, max_iters + 1):
        g = -score(x)
        m = x.mean(1, keepdim=True)
        xc = x - m
        gbar = g.mean(1)
        A = torch.einsum("bni,bnj->bij", g, xc) / N - eye
        b = torch.einsum("bij,bj->bi", torch.einsum("bni,bnj->bij", xc, xc) / N, gbar) if natural_mean else gbar
        rate = torch.where(active, (b * gbar).sum(-1) + (A * A).sum((-1, -2)), rate)
        active = active & (rate > tol) & (stalled < patience)
        if not bool(active.any()):
            break
        delta = b[:, None] + xc @ A.transpose(-1, -2)  # the descent direction; velocity = −delta
        if optimizer == "plain":
            direction = delta
        else:
            v_new = rho * v + (1 - rho) * (delta * delta).mean(1, keepdim=True)
            if optimizer == "rmsprop":
                direction = delta / torch.sqrt(v_new + eps)
            else:
                mom_new = beta1 * mom + (1 - beta1) * delta
                direction = (mom_new / (1 - beta1**t)) / torch.sqrt(v_new / (1 - rho**t) + eps)
        x_new = x - eta[:, None, None] * direction
        F_new = free_energy(x_new, log_prob)
        # F̃ is only resolved to ~1e3·eps·|F̃| (log-determinant and N-term means): smaller rises are noise
        accept = active & torch.isfinite(F_new) & (F_new <= F + slack * F.abs().clamp_min(1.0))
        improved = accept & (F_new < F - slack * F.abs().clamp_min(1.0))
        stalled = torch.where(improved, torch.zeros_like(stalled), stalled + active.to(torch.int64))
        x = torch.where(accept[:, None, None], x_new, x)
        F = torch.where(accept, F_new, F)
        if optimizer != "plain":
            v = torch.where(accept[:, None, None], v_new, v)
            if optimizer == "adam":
                mom = torch.where(accept[:, None, None], mom_new, mom)
        grow = torch.clamp(eta * 1.25, max=max_step)
        eta = torch.where(accept, grow, torch.where(active, eta * 0.5, eta))
        iters += active.to(torch.int64)
    converged = rate <= tol
    return x, GPFTrace(iters, F, (F - F0).to(torch.float64), rate, converged)


class GPFUpdater(AssumedDensityUpdater):
    """GPF as an assumed-density filter (see :mod:`mpflow.operators.updaters.assumed_density`).

    At step 0 with a Gaussian prior and N > d the sampled particles are mapped affinely onto the prior's
    exact mean and covariance, and for dynamic families the predicted particles onto the predicted
    moments, so Monte Carlo noise does not enter: for linear-Gaussian models GPF then tracks the exact
    posterior up to the convergence tolerance (Theorem 1).
    """

    name = "gpf"
    supports_kl = True
    defaults = {
        "evidence": "kl",
        "step_size": 0.5,
        "max_step": 0.5,
        "max_iters": 500,
        "tol": 1e-9,
        "natural_mean": True,
        "optimizer": "plain",
    }

    def iteration_flops(self) -> float:
        """:data:`ITERATION_FLOPS`."""
        return ITERATION_FLOPS

    def start(self, x: torch.Tensor, prior: GaussianMixture) -> torch.Tensor:
        return gaussian.moment_matched(x, *prior.moments()) if prior.weights.shape[1] == 1 else x

    def solve(self, x: torch.Tensor, target: PosteriorTarget, gens: Generators, want_kl: bool) -> FlowResult:
        # in float64: F̃ must resolve changes far below float32's 1e-7 relative precision
        t64 = PosteriorTarget(target.prior.to(torch.float64), target.model.to(torch.float64), target.obs.double())
        x64, trace = gaussian_particle_flow(x.double(), t64.log_prob, t64.score, **self.solver_options())
        return FlowResult(x64.to(x.dtype), trace.iterations, trace.kl_decrease, {"converged": trace.converged})

"""``nvgd``: Neural Variational Gradient Descent (Langosco et al.) as a plain solver (:func:`nvgd`) and as an
assumed-density filter (:class:`NVGDUpdater`).

A witness network f_θ : R^d → R^d is trained to maximise the regularised Stein discrepancy (eq. 3, 4)

    RSD(f) = E_q[ f(x)ᵀ ∇ log π(x) + div f(x) ] − ½ E_q ‖f(x)‖²,

whose maximiser is f* = ∇ log π − ∇ log q, the Wasserstein gradient of −KL(q ‖ π) (the flow eq. 1); the
particles then take the step x ← x + ε f_θ(x) (eq. 2). Algorithm 1: at every particle step the particles
are split at random into training and validation halves, θ takes up to ``inner_steps`` Adam steps on the
Monte Carlo loss −RSD̂ = mean_i[ −(f(x_i)·s_i + div f(x_i)) + ½‖f(x_i)‖² ] (s = ∇ log π) of the training
half and stops early when the validation loss has not improved for ``patience`` steps, keeping the
parameters with the best validation loss; θ (and its Adam state) is warm-started from the previous
particle step.

f_θ is an MLP [32, 32, d] with swish (SiLU) activations times a learnable scale, the last layer
initialised to zero (f ≡ 0 at the start). div f is exact, Σ_k e_kᵀ J e_k (d tangents, cheap for small d),
or Hutchinson's unbiased estimate mean_p v_pᵀ J v_p with Rademacher probes v_p (§3.1). The tangents J v are
carried forward through the layers next to the activations (forward mode), so the loss needs one backward
pass for θ.

Batched over B streams: every stream has its own witness parameters (θ [B, P], weights [B, in, out]),
Adam moments and step count, early-stopping counter and convergence flag; its random draws (initial
weights, splits, probes) come from its own generator and only while it is active, so a stream's result
does not depend on the batch it runs in. The flow runs in the whitened coordinates z = L⁻¹ (x − m) of
:mod:`mpflow.operators.updaters.svgd` (LLᵀ the target covariance estimated by Stein's identity), so ε, the
learning rate and ``tol`` are scale-free; ε shrinks when a step would move a particle by more than
``max_move`` (whitened units). The outer loop stops after ``max_iters`` particle steps or, per stream,
when mean ‖f‖² < ``tol``: for a Gaussian whose mean is off by δ target standard deviations, ‖f*‖² = δ², so
the default 1e-2 stops at about 0.1 sd, below the Monte Carlo resolution of a few hundred particles.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from mpflow.operators import rng
from mpflow.operators.models.base import ModelFamily
from mpflow.operators.rng import Generators
from mpflow.operators.updaters.assumed_density import AssumedDensityUpdater, FlowResult, PosteriorTarget, Whitening
from mpflow.operators.updaters.base import StepWork
from torch.nn import functional

Score = Callable[[torch.Tensor], torch.Tensor]
DIVERGENCES = ("auto", "exact", "hutchinson")
#: ``divergence="auto"`` is exact up to this dimension (d tangents per particle), Hutchinson above it
AUTO_EXACT_MAX_DIM = 16


#: one Adam step's fixed cost whatever N, in floating-point operations' worth — the witness's forward pass with its
#: tangents, autograd's backward pass, the early-stopping bookkeeping and the Adam update, each a few dozen small
#: tensor operations: fitted from ``benchmarks/price_audit.py``'s row "nvgd lds d=2 N=16" (a step's mean CPU time,
#: 0.5 to 0.9 s, over its Adam steps, 470 to 630 in 60 iterations; the iterations at :data:`ITERATION_FLOPS`) at
#: NOMINAL_RATE (25 Gflop/s CPU): 2.5e7 to 3.8e7 in five runs of 2026-11-28; their median (3.5e7) rounded up
ADAM_STEP_FLOPS = 4e7
#: one outer iteration's fixed cost besides its Adam steps — the score, the random split's draws, the witness on
#: every particle and the move: fitted from the row "nvgd lds d=2 N=16 inner_steps=2 tol=0" (60 iterations of 2
#: Adam steps, 0.15 to 0.18 s CPU; the Adam steps at :data:`ADAM_STEP_FLOPS`): −7.6e6 to 1.7e7 with them at 3e7
#: or 4e7 — collinear with them, 2 a pass: the pass with its 2 Adam steps fitted 6.4e7 to 7.7e7 in three runs of
#: 2026-11-28, here 1e8
ITERATION_FLOPS = 2e7


@dataclass
class NVGDTrace:
    iterations: torch.Tensor  # [B] particle steps taken
    inner_steps: torch.Tensor  # [B] Adam steps taken in all
    witness_norm: torch.Tensor  # [B] the last mean ‖f‖² (whitened units when whitening)
    converged: torch.Tensor  # [B] bool: mean ‖f‖² < tol was reached


# ---------------------------------------------------------------------------------------- witness network
def _layer_shapes(d: int, hidden: Sequence[int]) -> list[tuple[int, int]]:
    """(rows, cols) of W₁, b₁, …, W_L, b_L, scale for the MLP d → hidden → d."""
    shapes: list[tuple[int, int]] = []
    for n_in, n_out in itertools.pairwise([d, *hidden, d]):
        shapes += [(n_in, n_out), (1, n_out)]
    return [*shapes, (1, 1)]


def unpack(theta: torch.Tensor, d: int, hidden: Sequence[int]) -> list[torch.Tensor]:
    """Views [W₁ [B, d, H₁], b₁ [B, 1, H₁], …, W_L [B, H_L, d], b_L [B, 1, d], scale [B, 1, 1]] of the flat
    per-stream parameters θ [B, P]."""
    shapes = _layer_shapes(d, hidden)
    parts = theta.split([r * c for r, c in shapes], dim=1)
    return [p.reshape(theta.shape[0], r, c) for p, (r, c) in zip(parts, shapes, strict=True)]


def init_witness(
    gens: Generators, d: int, hidden: Sequence[int] = (32, 32), dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Flat per-stream parameters θ [B, P] (layout: :func:`unpack`): hidden-layer weights LeCun-normal
    from each stream's generator, biases 0, the output layer 0 (so f ≡ 0 at the start), scale 1."""
    B = len(gens)
    shapes = _layer_shapes(d, hidden)
    n_hidden_weights = 2 * len(hidden)  # W₁, b₁, …, W_L', b_L' of the hidden layers
    parts = []
    for k, (r, c) in enumerate(shapes):
        if k < n_hidden_weights and k % 2 == 0:
            parts.append(rng.randn(gens, (r * c,), dtype) / math.sqrt(r))
        else:
            parts.append(torch.full((B, r * c), 1.0 if k == len(shapes) - 1 else 0.0, dtype=dtype))
    return torch.cat(parts, 1)


def _silu_grad(a: torch.Tensor) -> torch.Tensor:
    """d/da [a σ(a)] = σ(a) (1 + a (1 − σ(a)))."""
    sig = torch.sigmoid(a)
    return sig * (1 + a * (1 - sig))


def _per_stream_matmul(t: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    """t [B, N, P, i] @ W [B, i, o] → [B, N, P, o] as one bmm (cheaper to differentiate than a broadcast)."""
    B, N, P, _ = t.shape
    return torch.bmm(t.reshape(B, N * P, -1), W).reshape(B, N, P, -1)


def witness(params: Sequence[torch.Tensor], z: torch.Tensor) -> torch.Tensor:
    """f_θ(z) for z [B, N, d] → [B, N, d] (``params`` from :func:`unpack`)."""
    *layers, scale = params
    h = z
    for W, b in zip(layers[:-2:2], layers[1:-2:2], strict=True):
        h = functional.silu(torch.baddbmm(b, h, W))
    return scale * torch.baddbmm(layers[-1], h, layers[-2])


def witness_and_divergence(
    params: Sequence[torch.Tensor], z: torch.Tensor, probes: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """f_θ(z) [B, N, d] and div f_θ(z) [B, N].

    ``probes`` None: exact, Σ_k e_kᵀ J e_k. Otherwise v [B, N, P, d]: Hutchinson, (1/P) Σ_p v_pᵀ J v_p.
    """
    *layers, scale = params
    d = z.shape[-1]
    if probes is None:
        v, weight = torch.eye(d, dtype=z.dtype).expand(*z.shape[:2], d, d), 1.0
    else:
        v, weight = probes, 1.0 / probes.shape[-2]
    h, t = z, v  # activations [B, N, H], tangents J_h v [B, N, P, H]
    for W, b in zip(layers[:-2:2], layers[1:-2:2], strict=True):
        a = torch.baddbmm(b, h, W)
        t = _silu_grad(a)[:, :, None, :] * _per_stream_matmul(t, W)
        h = functional.silu(a)
    W, b = layers[-2], layers[-1]
    f = scale * torch.baddbmm(b, h, W)
    Jv = scale[:, :, :, None] * _per_stream_matmul(t, W)  # [B, N, P, d]
    return f, weight * (Jv * v).sum((-1, -2))


# ---------------------------------------------------------------------------------------- helpers
def _draw(
    draw: Callable[[Generators, Sequence[int], torch.dtype], torch.Tensor],
    gens: Generators,
    mask: torch.Tensor,
    shape: Sequence[int],
    dtype: torch.dtype,
) -> torch.Tensor:
    """[B, *shape] draws from the generators of the streams in ``mask`` only (zeros elsewhere), so an
    inactive stream's generator does not advance."""
    out = torch.zeros(len(gens), *shape, dtype=dtype)
    idx = mask.nonzero().flatten().tolist()
    if idx:
        out[idx] = draw([gens[i] for i in idx], shape, dtype)
    return out


def _adam_step(
    theta: torch.Tensor,
    grad: torch.Tensor,
    state: dict[str, torch.Tensor],
    active: torch.Tensor,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
) -> torch.Tensor:
    """One Adam step (Kingma & Ba) on θ [B, P] for the streams in ``active``; the others keep parameters
    and moments. Element-wise, with a step count per stream, so streams stay independent."""
    b1, b2 = betas
    state["t"] = state["t"] + active.to(torch.int64)
    t = state["t"].clamp_min(1).to(theta.dtype)[:, None]
    on = active[:, None]
    state["m"] = torch.where(on, b1 * state["m"] + (1 - b1) * grad, state["m"])
    state["v"] = torch.where(on, b2 * state["v"] + (1 - b2) * grad * grad, state["v"])
    step = (state["m"] / (1 - b1**t)) / ((state["v"] / (1 - b2**t)).sqrt() + eps)
    return torch.where(on, theta - lr * step, theta)


# ---------------------------------------------------------------------------------------- solver
def nvgd(
    x: torch.Tensor,
    score: Score,
    gens: Generators,
    *,
    step_size: float = 0.2,
    max_iters: int = 60,
    tol: float = 1e-2,
    max_move: float = 1.0,
    inner_steps: int = 20,
    patience: int = 5,
    lr: float = 3e-3,
    hidden: Sequence[int] = (32, 32),
    divergence: str = "auto",
    probes: int = 1,
    whiten: bool = True,
) -> tuple[torch.Tensor, NVGDTrace]:
    """Move x [B, N, d] towards π (``score`` = ∇ log π → [B, N, d]) by Algorithm 1; ``gens`` are the B
    stream generators. See the module docstring. Returns the particles and an :class:`NVGDTrace`."""
    if divergence not in DIVERGENCES:
        raise ValueError(f"options.divergence: expected one of {list(DIVERGENCES)}, got {divergence!r}")
    B, N, d = x.shape
    if len(gens) != B:
        raise ValueError(f"gens: expected {B} generators, got {len(gens)}")
    if N < 4:
        raise ValueError(f"particles: NVGD needs at least 4 particles (train/validation halves), got {N}")
    for field, value in (("inner_steps", inner_steps), ("patience", patience), ("probes", probes)):
        if int(value) < 1:
            raise ValueError(f"options.{field}: expected a positive integer, got {value}")
    dtype = x.dtype
    exact = divergence == "exact" or (divergence == "auto" and d <= AUTO_EXACT_MAX_DIM)
    w = Whitening.fit(x, score, whiten)
    z = w.to_z(x)

    theta = init_witness(gens, d, hidden, dtype)
    adam = {"m": torch.zeros_like(theta), "v": torch.zeros_like(theta), "t": torch.zeros(B, dtype=torch.int64)}
    n_train = N // 2
    active = torch.ones(B, dtype=torch.bool)
    iters = torch.zeros(B, dtype=torch.int64)
    inner_total = torch.zeros(B, dtype=torch.int64)
    size = torch.full((B,), float("inf"), dtype=dtype)
    for _ in range(max_iters):
        s = w.score_z(score(w.to_x(z)))
        # RandomSplit: the first N/2 of a random permutation train, the rest validate
        perm = _draw(rng.rand, gens, active, (N,), dtype).argsort(-1)
        train = torch.zeros(B, N, dtype=dtype).scatter_(1, perm[:, :n_train], 1.0)
        val = 1.0 - train
        best = torch.full((B,), float("inf"), dtype=dtype)
        best_theta = theta
        since_best = torch.zeros(B, dtype=torch.int64)
        training = active.clone()
        for _ in range(inner_steps):
            v = None if exact else _draw(rng.rademacher, gens, training, (N, probes, d), dtype)
            theta = theta.detach().requires_grad_(True)
            f, div = witness_and_divergence(unpack(theta, d, hidden), z, v)
            loss = -((f * s).sum(-1) + div) + 0.5 * (f * f).sum(-1)  # −RSD̂ per particle [B, N]
            # early stopping on the validation half (the loss of θ before this step's update)
            val_loss = (loss.detach() * val).sum(-1) / (N - n_train)
            improved = training & (val_loss < best)
            best = torch.where(improved, val_loss, best)
            best_theta = torch.where(improved[:, None], theta.detach(), best_theta)
            since_best = torch.where(improved, torch.zeros_like(since_best), since_best + 1)
            training = training & (since_best < patience)
            if not bool(training.any()):
                break
            train_loss = (loss * train).sum(-1) / n_train  # [B]; streams summed below stay independent
            (grad,) = torch.autograd.grad((train_loss * training).sum(), theta)
            theta = _adam_step(theta.detach(), grad, adam, training, lr)
            inner_total += training.to(torch.int64)
        theta = best_theta
        with torch.no_grad():
            f = witness(unpack(theta, d, hidden), z)
        size = torch.where(active, (f * f).sum(-1).mean(-1), size)
        active = active & (size > tol)
        if not bool(active.any()):
            break
        biggest = (f * f).sum(-1).amax(-1).sqrt()
        eps = torch.clamp(max_move / biggest.clamp_min(1e-30), max=step_size)
        eps = torch.where(active, eps, torch.zeros_like(eps))
        z = z + eps[:, None, None] * f
        iters += active.to(torch.int64)
    return w.to_x(z), NVGDTrace(iters, inner_total, size, size <= tol)


class NVGDUpdater(AssumedDensityUpdater):
    name = "nvgd"
    supports_kl = False
    #: ``max_iters`` 50 × ``inner_steps`` 10 (the plain solver's 60 × 20 is over a request's budget): each step is
    #: priced at its ``max_iters`` outer iterations and their Adam steps' fixed cost (:data:`ADAM_STEP_FLOPS`,
    #: :data:`ITERATION_FLOPS`): 2.1e10 of the 2.5e10 default budget, so a default stream takes one observation a
    #: request. ``patience`` 5 ends the inner loop at about 9 Adam steps on average (535 in 60 outer iterations at
    #: N = 16), so the cap of 10 seldom binds
    defaults = {
        "evidence": "predictive",
        "step_size": 0.2,
        "max_iters": 50,
        "tol": 1e-2,
        "max_move": 1.0,
        "inner_steps": 10,
        "patience": 5,
        "lr": 3e-3,
        "hidden": (32, 32),
        "divergence": "auto",
        "probes": 1,
        "whiten": True,
    }

    def iteration_flops(self) -> float:
        """:data:`ITERATION_FLOPS`: an outer iteration's fixed cost (its Adam steps' are :meth:`iteration_work`'s)."""
        return ITERATION_FLOPS

    def iteration_work(self, model: ModelFamily, n: int) -> StepWork:
        """Up to ``inner_steps`` Adam steps of the witness MLP d → ``hidden`` → d: forward and backward on the
        training half, forward on the validation half (about 4 flops per weight and particle), carrying t tangents
        for the divergence (t = d when exact: ``divergence`` "exact", or "auto" up to d = 16; else ``probes``),
        and each step's fixed cost whatever n (:data:`ADAM_STEP_FLOPS`):

            inner_steps · (4 n W (1 + t) + ADAM_STEP_FLOPS),  W the network's weights;

        activations and tangents in float32."""
        d = model.state_dim
        sizes = [d, *self.options["hidden"], d]
        exact = self.options["divergence"] == "exact" or (
            self.options["divergence"] == "auto" and d <= AUTO_EXACT_MAX_DIM
        )
        tangents = d if exact else int(self.options["probes"])
        weights = sum(a * b for a, b in itertools.pairwise(sizes))
        flops = float(self.options["inner_steps"]) * (4.0 * n * weights * (1 + tangents) + ADAM_STEP_FLOPS)
        return StepWork(flops, 4.0 * 6 * n * sum(sizes) * (1 + tangents) + 80.0 * n * d)

    def solve(self, x: torch.Tensor, target: PosteriorTarget, gens: Generators, want_kl: bool) -> FlowResult:
        x, trace = nvgd(x, target.score, gens, **self.solver_options())
        extras = {"converged": trace.converged, "inner_steps": trace.inner_steps, "witness_norm": trace.witness_norm}
        return FlowResult(x, trace.iterations, None, extras)

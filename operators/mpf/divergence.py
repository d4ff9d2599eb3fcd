"""Divergence of a particle velocity field, ∇ₓ·f = Σ_k ∂f_k/∂x_k, for the density ODE of MPF (eq. 8)

    d log q(x(t))/dt = −∇ₓ·f(x(t), t).

Two estimators, both by reverse-mode autograd on a batch x [B, N, d]:

- exact (FFJORD / the MPF reference): d vector–Jacobian products, one per output coordinate k,
  ∂(Σ_{b,n} f_k)/∂x [..., k] = ∂f_k/∂x_k;
- Hutchinson: vᵀ J v averaged over given probes v with E[v vᵀ] = I (Rademacher or standard Gaussian),
  one vector–Jacobian product per probe. Unbiased; variance 2(‖J_s‖²_F − Σ_k J_kk²) per Rademacher probe
  and 2‖J_s‖²_F per Gaussian probe, J_s = (J + Jᵀ)/2.

Both read a per-particle divergence off one gradient of a sum over all particles and streams. That is
right only when particle n's velocity depends on x[b, n] alone (its Jacobian is block-diagonal over
particles and streams) — true for MPF, whose set embedding is computed from the *detached* prior
particles, not from the moving x(t). A field that mixes particles (batch norm, attention over x(t))
would get the wrong divergence.

Serving runs under ``torch.no_grad()``: :func:`velocity_and_divergence` switches grad on internally for
x and, unless a differentiable graph is asked for (``create_graph=True`` *and* grad mode on at the call),
returns detached tensors.

Example::

    import torch
    from mpflow.operators.mpf import velocity_and_divergence

    A = torch.tensor([[0.0, 1.0], [-1.0, -0.5]])
    x = torch.randn(1, 4, 2)
    f, div = velocity_and_divergence(lambda x, t: x @ A.T, x, torch.zeros(1))
    # div == tr(A) = -0.5 for every particle
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from mpflow.operators import rng

Velocity = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

DIVERGENCE_METHODS = ("exact", "hutchinson", "auto")
EXACT_MAX_DIM = 8  # "auto" uses the exact divergence up to this state dimension


def _check_pair(f_out: torch.Tensor, x: torch.Tensor) -> None:
    if x.dim() != 3:
        raise ValueError(f"x must have shape [B, N, d], got {tuple(x.shape)}")
    if f_out.shape != x.shape:
        raise ValueError(f"f_out must have the shape of x {tuple(x.shape)}, got {tuple(f_out.shape)}")
    if not x.requires_grad:
        raise ValueError("x must require grad and be the tensor f_out was computed from")


def divergence_exact(f_out: torch.Tensor, x: torch.Tensor, *, create_graph: bool = False) -> torch.Tensor:
    """Σ_k ∂f_k/∂x_k [B, N] by d autograd calls (f_out [B, N, d] computed from x [B, N, d]).

    ``create_graph=True`` keeps the result differentiable (training: gradients of −∫∇·f dt reach the
    velocity's parameters). The graph of f_out is always retained, so f_out stays usable afterwards.
    """
    _check_pair(f_out, x)
    div = torch.zeros(x.shape[:-1], dtype=x.dtype, device=x.device)
    if not f_out.requires_grad:  # f does not depend on anything that requires grad: constant in x
        return div
    for k in range(x.shape[-1]):
        (g,) = torch.autograd.grad(
            f_out[..., k].sum(), x, retain_graph=True, create_graph=create_graph, allow_unused=True
        )
        if g is not None:
            div = div + g[..., k]
    return div


def divergence_hutchinson(
    f_out: torch.Tensor, x: torch.Tensor, probes: torch.Tensor, *, create_graph: bool = False
) -> torch.Tensor:
    """Hutchinson estimate (1/P) Σ_p v_pᵀ J v_p [B, N] with the given probes [B, N, d] or [P, B, N, d].

    Each probe costs one vector–Jacobian product vᵀJ = ∂(v·f)/∂x. Probes must satisfy E[v vᵀ] = I
    (see :func:`rademacher_probes`); the same probes should be reused over one ODE solve so the dynamics
    are deterministic (FFJORD). Averaging over all 2^d sign vectors gives the trace exactly.
    """
    _check_pair(f_out, x)
    if probes.dim() == 3:
        probes = probes.unsqueeze(0)
    if probes.dim() != 4 or probes.shape[1:] != x.shape:
        raise ValueError(
            f"probes must have shape [B, N, d] or [P, B, N, d] with [B, N, d] = {tuple(x.shape)}, "
            f"got {tuple(probes.shape)}"
        )
    est = torch.zeros(x.shape[:-1], dtype=x.dtype, device=x.device)
    if not f_out.requires_grad:
        return est
    probes = probes.to(dtype=x.dtype, device=x.device)
    for v in probes:
        (vjp,) = torch.autograd.grad(
            f_out, x, grad_outputs=v, retain_graph=True, create_graph=create_graph, allow_unused=True
        )
        if vjp is not None:
            est = est + (vjp * v).sum(-1)
    return est / probes.shape[0]


def rademacher_probes(
    gens: rng.Generators, num_probes: int, num_particles: int, dim: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """±1 Hutchinson probes [P, B, N, d], stream b's drawn from ``gens[b]`` (see ``mpflow.operators.rng``)."""
    if num_probes < 1:
        raise ValueError(f"num_probes must be >= 1, got {num_probes}")
    return rng.rademacher(gens, (num_probes, num_particles, dim), dtype).movedim(1, 0).contiguous()


def resolve_method(method: str, dim: int, probes: torch.Tensor | None) -> str:
    """The divergence method to use, "exact" or "hutchinson": "auto" is exact when d ≤ EXACT_MAX_DIM or no probes
    were given (mpflow never draws random numbers without an explicit generator), Hutchinson otherwise."""
    if method not in DIVERGENCE_METHODS:
        raise ValueError(f"method must be one of {DIVERGENCE_METHODS}, got {method!r}")
    if method == "auto":
        return "exact" if dim <= EXACT_MAX_DIM or probes is None else "hutchinson"
    if method == "hutchinson" and probes is None:
        raise ValueError("probes are required for the Hutchinson divergence (see rademacher_probes)")
    return method


def velocity_and_divergence(
    velocity_fn: Velocity,
    x: torch.Tensor,
    t: torch.Tensor,
    *,
    method: str = "auto",
    probes: torch.Tensor | None = None,
    create_graph: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """f = velocity_fn(x, t) [B, N, d] and ∇ₓ·f [B, N] (exact or Hutchinson, see :func:`resolve_method`).

    Grad is switched on inside, so this works under ``torch.no_grad()``. A differentiable result (graph to
    x and to whatever velocity_fn depends on) is built only when ``create_graph`` is true and grad mode is
    on at the call; otherwise both outputs are detached. (This makes torchdiffeq's adjoint forward pass,
    which runs without grad, cheap, while its backward pass, run with grad on, gets the full graph.)
    """
    if x.dim() != 3:
        raise ValueError(f"x must have shape [B, N, d], got {tuple(x.shape)}")
    which = resolve_method(method, x.shape[-1], probes)
    build = create_graph and torch.is_grad_enabled()
    with torch.enable_grad():
        xg = x if (build and x.requires_grad) else x.detach().requires_grad_(True)
        f = velocity_fn(xg, t)
        if f.shape != x.shape:
            raise ValueError(f"velocity_fn must return the shape of x {tuple(x.shape)}, got {tuple(f.shape)}")
        if which == "exact":
            div = divergence_exact(f, xg, create_graph=build)
        else:
            div = divergence_hutchinson(f, xg, probes, create_graph=build)  # type: ignore[arg-type]
    if not build:
        f, div = f.detach(), div.detach()
    return f, div

"""Integrating a particle velocity field together with the particles' log-density (MPF eq. 4 and 8):

    dx/dt = f(x, t),    d log q(x(t))/dt = −∇ₓ·f(x, t),    t ∈ [t0, t1],

so x1 = x0 + ∫ f dt (eq. 4) and log q1(x1) = log q0(x0) − ∫ ∇ₓ·f dt (eq. 8, the instantaneous change of
variables). The ODE state is the tuple (x [B, N, d], log q [B, N]); any velocity ``velocity_fn(x, t)``
with x [B, N, d], t [B] → [B, N, d] can be integrated (the MPF network supplies one).

Per-stream spans. The reference's ``time_mode adaptive`` predicts a span [t0_b, t1_b] per stream, so one
odeint call serves the whole batch by integrating over s ∈ [0, 1] with t_b(s) = t0_b + s (t1_b − t0_b):

    dx/ds = (t1_b − t0_b) f(x, t_b(s)),    d log q/ds = −(t1_b − t0_b) ∇ₓ·f(x, t_b(s)).

For fixed-step solvers this is exactly the per-stream integration with ``steps`` equal steps of
(t1_b − t0_b)/steps each; adaptive solvers pick one step sequence for the batch (their error norm
covers all streams), so a stream's answer depends on its batch-mates only within the tolerance.

Solvers (torchdiffeq): fixed-step "rk4" (torchdiffeq's rk4 is the 3/8-rule variant), "euler",
"midpoint" take ``steps`` equal steps in s (the reference: ONE rk4 step per observation); adaptive
"dopri5", "dopri8", "bosh3", "adaptive_heun" use ``rtol``/``atol``. The fixed grid is given to
torchdiffeq as an explicit ``grid_constructor`` rather than ``step_size=1/steps``: with a step size,
round-off in ceil(1/step_size + 1) adds a spurious near-zero-length extra step for some ``steps``
(e.g. 49 in float64, 61 in float32).

Gradients. ``create_graph=True`` (with grad mode on) makes (x1, log q1) differentiable with respect to
x0, log q0, t0, t1 and whatever ``velocity_fn`` depends on; ``create_graph=False`` or ``torch.no_grad()``
(serving) returns detached tensors. ``adjoint=True`` uses ``torchdiffeq.odeint_adjoint`` (O(1) memory in
the number of steps, gradients from a backward ODE solve): torchdiffeq only returns gradients for the
tensors listed in ``adjoint_params``, so pass every tensor that the velocity closes over and that needs a
gradient — in particular *context* tensors computed outside the ODE (set and observation embeddings).
The parameters of ``velocity_fn`` when it is an ``nn.Module``, and t0/t1 when they require grad, are
added automatically (duplicates removed: a tensor listed twice would get its gradient twice).

Example::

    import torch
    from mpflow.operators.mpf import integrate

    A = torch.tensor([[0.0, 1.0], [-1.0, -0.5]])
    x0 = torch.randn(3, 64, 2)
    log_q0 = -0.5 * (x0**2).sum(-1) - torch.log(torch.tensor(2 * torch.pi))
    t1 = torch.tensor([0.5, 1.0, 2.0])  # one span per stream
    x1, log_q1 = integrate(lambda x, t: x @ A.T, x0, log_q0, 0.0, t1, method="rk4", steps=8)
    # log_q1 == log_q0 + 0.5 * t1[:, None]   (−tr(A)·(t1 − t0))
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch
from mpflow.operators.mpf.divergence import DIVERGENCE_METHODS, Velocity, resolve_method, velocity_and_divergence
from torch import nn

FIXED_STEP_METHODS = ("rk4", "euler", "midpoint")
ADAPTIVE_METHODS = ("dopri5", "dopri8", "bosh3", "adaptive_heun")
ODE_METHODS = FIXED_STEP_METHODS + ADAPTIVE_METHODS


def _span_end(value: float | torch.Tensor, name: str, batch: int, like: torch.Tensor) -> torch.Tensor:
    """A span end point as a tensor [B] in x's dtype and device."""
    t = torch.as_tensor(value, dtype=like.dtype, device=like.device)
    if t.dim() == 0:
        t = t.expand(batch)
    if t.shape != (batch,):
        raise ValueError(f"{name} must be a float or a tensor [B] with B = {batch}, got shape {tuple(t.shape)}")
    if not torch.isfinite(t).all():
        raise ValueError(f"{name} must be finite")
    return t


def _uniform_grid(steps: int):
    """torchdiffeq grid_constructor: ``steps`` equal steps between the first and last requested time."""

    def grid(func, y0, t):  # torchdiffeq's signature
        return torch.linspace(float(t[0]), float(t[-1]), steps + 1, dtype=t.dtype, device=t.device)

    return grid


def _unique(tensors: Iterable[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    seen: set[int] = set()
    out = []
    for p in tensors:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return tuple(out)


def integrate(
    velocity_fn: Velocity,
    x0: torch.Tensor,
    log_q0: torch.Tensor | None,
    t0: float | torch.Tensor,
    t1: float | torch.Tensor,
    *,
    method: str = "rk4",
    steps: int = 1,
    rtol: float = 1e-5,
    atol: float = 1e-5,
    divergence: str = "auto",
    probes: torch.Tensor | None = None,
    adjoint: bool = False,
    adjoint_params: Iterable[torch.Tensor] = (),
    create_graph: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Transport particles x0 [B, N, d] along ``velocity_fn`` from t0 to t1 (floats or [B], one span per
    stream) and track their log-density (eq. 4, 8) → (x1 [B, N, d], log_q1 [B, N]).

    ``log_q0`` [B, N] is the particles' log-density at t0; ``None`` starts it at 0, so log_q1 is the
    log-density change −∫∇·f dt. ``divergence``: "exact" | "hutchinson" (needs ``probes`` [B, N, d] or
    [P, B, N, d], held fixed over the solve) | "auto" (exact when d ≤ 8 or no probes) | "none" (do not
    track the density: returns (x1, None), one velocity evaluation per stage and no autograd).
    ``steps``: number of equal steps for fixed-step methods; ``rtol``/``atol``: adaptive methods only.
    See the module docstring for ``create_graph``, ``adjoint`` and ``adjoint_params``.
    """
    if x0.dim() != 3 or not x0.is_floating_point():
        raise ValueError(f"x0 must be a floating tensor [B, N, d], got {x0.dtype} {tuple(x0.shape)}")
    B, N, d = x0.shape
    if method not in ODE_METHODS:
        raise ValueError(f"method must be one of {ODE_METHODS}, got {method!r}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    if divergence not in (*DIVERGENCE_METHODS, "none"):
        raise ValueError(f"divergence must be one of {(*DIVERGENCE_METHODS, 'none')}, got {divergence!r}")
    track = divergence != "none"
    div_method = resolve_method(divergence, d, probes) if track else "none"
    if log_q0 is not None and log_q0.shape != (B, N):
        raise ValueError(f"log_q0 must have shape [B, N] = {(B, N)}, got {tuple(log_q0.shape)}")
    # the unit span [0, 1] of every stream (serving's): t = s, no rescaling
    unit = not isinstance(t0, torch.Tensor) and not isinstance(t1, torch.Tensor) and t0 == 0 and t1 == 1
    if unit:
        start = length = None
    else:
        start = _span_end(t0, "t0", B, x0)
        length = _span_end(t1, "t1", B, x0) - start  # [B], may be negative (a backward flow)
    build = create_graph and torch.is_grad_enabled()

    def dynamics(s: torch.Tensor, state):
        t = s.expand(B) if unit else start + s * length  # [B]
        if not track:  # no autograd needed: under no_grad (serving) the output is detached anyway
            return velocity_fn(state, t) if unit else velocity_fn(state, t) * length[:, None, None]
        x, _ = state
        f, div = velocity_and_divergence(velocity_fn, x, t, method=div_method, probes=probes, create_graph=create_graph)
        if unit:
            return f, -div
        return f * length[:, None, None], -div * length[:, None]

    if log_q0 is None:
        log_q0 = torch.zeros(B, N, dtype=x0.dtype, device=x0.device)
    y0 = (x0, log_q0.to(x0.dtype)) if track else x0
    s_span = torch.tensor([0.0, 1.0], dtype=x0.dtype, device=x0.device)
    if method in FIXED_STEP_METHODS:
        kwargs = dict(method=method, options=dict(grid_constructor=_uniform_grid(steps)))
    else:
        kwargs = dict(method=method, rtol=rtol, atol=atol)

    # here, not at import: torchdiffeq imports scipy.integrate, a tenth of a server worker's start-up
    from torchdiffeq import odeint, odeint_adjoint

    grad_ctx = contextlib.nullcontext() if build else torch.no_grad()
    with grad_ctx:
        if adjoint:
            params = list(adjoint_params)
            if isinstance(velocity_fn, nn.Module):
                params += list(velocity_fn.parameters())
            params += [t for t in (start, length) if t is not None and t.requires_grad]
            sol = odeint_adjoint(dynamics, y0, s_span, adjoint_params=_unique(params), **kwargs)
        else:
            sol = odeint(dynamics, y0, s_span, **kwargs)
    if not track:
        return sol[-1], None
    return sol[0][-1], sol[1][-1]

"""operators.mpf.divergence / operators.mpf.ode: the (x, log q) ODE of MPF eq. (4), (8), checked in float64
against Jacobian traces, matrix exponentials, exact pushforward densities and flow-map determinants."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import scipy.linalg
import torch
from mpflow.operators.mpf import (
    divergence_exact,
    divergence_hutchinson,
    integrate,
    rademacher_probes,
    velocity_and_divergence,
)
from torch import nn
from torch.nn.functional import softplus
from torchdiffeq import odeint

F64 = torch.float64
TIGHT = dict(method="dopri5", rtol=1e-10, atol=1e-10)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=g, dtype=F64)


class TanhField(nn.Module):
    """A smooth, time-dependent, non-linear field coupling the coordinates of each particle:
    f(x, t) = W2 tanh(W1 [x, t] + b1) + b2, applied to every particle independently."""

    def __init__(self, dim: int, hidden: int = 16, seed: int = 0, scale: float = 0.7):
        super().__init__()
        self.l1 = nn.Linear(dim + 1, hidden, dtype=F64)
        self.l2 = nn.Linear(hidden, dim, dtype=F64)
        g = gen(seed)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(scale * randn(g, *p.shape) / math.sqrt(p.shape[-1]))

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        tt = t.reshape(-1, 1, 1).expand(*x.shape[:-1], 1)
        return self.l2(torch.tanh(self.l1(torch.cat([x, tt], -1))))


def jacobian_blocks(field, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Per-particle Jacobians ∂f(x_n)/∂x_n [B*N, d, d] from the full autograd Jacobian."""
    B, N, d = x.shape
    J = torch.autograd.functional.jacobian(lambda z: field(z, t), x).reshape(B * N, d, B * N, d)
    idx = torch.arange(B * N)
    blocks = J[idx, :, idx, :]
    off = J.clone()
    off[idx, :, idx, :] = 0
    assert off.abs().max() == 0  # the field acts on each particle alone (divergence.py's assumption)
    return blocks


def all_sign_probes(B: int, N: int, d: int) -> torch.Tensor:
    """The 2^d Rademacher vectors [2^d, B, N, d]: their average of v vᵀ is exactly I."""
    signs = torch.tensor(list(itertools.product([-1.0, 1.0], repeat=d)), dtype=F64)
    return signs[:, None, None, :].expand(-1, B, N, -1).contiguous()


# ---------------------------------------------------------------------------------------------- (a) divergence


def test_divergence_exact_is_the_jacobian_trace():
    field, g = TanhField(3, seed=1), gen(2)
    x, t = randn(g, 2, 5, 3), randn(g, 2)
    trace = jacobian_blocks(field, x, t).diagonal(dim1=-2, dim2=-1).sum(-1).reshape(2, 5)
    xg = x.clone().requires_grad_(True)
    div = divergence_exact(field(xg, t), xg)
    assert div.shape == (2, 5)
    assert trace.abs().min() > 1e-3  # a non-trivial field
    torch.testing.assert_close(div, trace, rtol=0, atol=1e-12)
    # all 2^d sign probes make Hutchinson exact; a single probe does not
    f = field(xg, t)
    torch.testing.assert_close(divergence_hutchinson(f, xg, all_sign_probes(2, 5, 3)), trace, rtol=0, atol=1e-12)
    one = divergence_hutchinson(f, xg, all_sign_probes(2, 5, 3)[1])
    assert (one - trace).abs().max() > 1e-3


@pytest.mark.parametrize("kind", ["gaussian", "rademacher"])
def test_hutchinson_converges_to_the_trace(kind):
    """Mean of P probe estimates within 5 standard errors of the trace, with the exact per-probe variance
    2‖J_s‖²_F (Gaussian) or 2(‖J_s‖²_F − Σ J_kk²) (Rademacher), J_s = (J + Jᵀ)/2."""
    B, N, d, P = 2, 4, 3, 2000
    field, g = TanhField(d, seed=3, scale=1.0), gen(4)
    x, t = randn(g, B, N, d), randn(g, B)
    J = jacobian_blocks(field, x, t)
    Js = 0.5 * (J + J.transpose(-1, -2))
    var = 2 * Js.pow(2).sum((-1, -2))
    if kind == "gaussian":
        probes = randn(g, P, B, N, d)
    else:
        var = var - 2 * J.diagonal(dim1=-2, dim2=-1).pow(2).sum(-1)
        probes = rademacher_probes([gen(10 + b) for b in range(B)], P, N, d, dtype=F64)
        assert probes.shape == (P, B, N, d) and set(probes.unique().tolist()) == {-1.0, 1.0}
    stderr = (var / P).sqrt().reshape(B, N)
    trace = J.diagonal(dim1=-2, dim2=-1).sum(-1).reshape(B, N)
    xg = x.clone().requires_grad_(True)
    est = divergence_hutchinson(field(xg, t), xg, probes)
    assert stderr.max() < 0.05  # the check is sharp
    assert ((est - trace).abs() <= 5 * stderr).all(), (est - trace) / stderr


def test_velocity_and_divergence_methods_and_no_grad():
    field, g = TanhField(3, seed=5), gen(6)
    x, t = randn(g, 2, 3, 3), randn(g, 2)
    probes = rademacher_probes([gen(0), gen(1)], 1, 3, 3, dtype=F64)
    f_e, div_e = velocity_and_divergence(field, x, t, method="exact")
    f_a, div_a = velocity_and_divergence(field, x, t, method="auto", probes=probes)  # d ≤ 8: exact
    f_h, div_h = velocity_and_divergence(field, x, t, method="hutchinson", probes=probes)
    torch.testing.assert_close(div_a, div_e, rtol=0, atol=0)
    assert (div_h - div_e).abs().max() > 1e-6  # one probe: an estimate
    torch.testing.assert_close(f_h, f_e, rtol=0, atol=0)
    assert not (f_e.requires_grad or div_e.requires_grad)  # create_graph=False: detached
    with torch.no_grad():
        f_n, div_n = velocity_and_divergence(field, x, t, create_graph=True)
    assert not (f_n.requires_grad or div_n.requires_grad)
    torch.testing.assert_close(div_n, div_e, rtol=0, atol=0)
    f_g, div_g = velocity_and_divergence(field, x, t, create_graph=True)
    assert div_g.requires_grad  # differentiable for training
    # d > 8: auto is Hutchinson with probes, exact without
    big, xb = TanhField(10, seed=7), randn(g, 1, 2, 10)
    pb = rademacher_probes([gen(3)], 1, 2, 10, dtype=F64)
    torch.testing.assert_close(
        velocity_and_divergence(big, xb, t[:1], probes=pb)[1],
        velocity_and_divergence(big, xb, t[:1], method="hutchinson", probes=pb)[1],
    )
    torch.testing.assert_close(
        velocity_and_divergence(big, xb, t[:1])[1], velocity_and_divergence(big, xb, t[:1], method="exact")[1]
    )


# ------------------------------------------------------------------------------------------- (b) linear field


def linear_case(seed: int = 0):
    g = gen(seed)
    d, B, N = 3, 2, 4
    A, b = 0.6 * randn(g, d, d), randn(g, d)
    t0, t1 = torch.tensor([0.2, -0.1], dtype=F64), torch.tensor([0.9, 1.0], dtype=F64)
    x0, log_q0 = randn(g, B, N, d), randn(g, B, N)
    return A, b, t0, t1, x0, log_q0


def affine_flow(A, b, tau, x0, series=None):
    """x(τ) for dx/dt = A x + b via the augmented matrix L = [[A, b], [0, 0]] τ: exp(L) (exact), or the
    Taylor polynomial Σ_{k≤p} L^k/k! (the stability function of a p-stage order-p explicit RK step)."""
    d = A.shape[0]
    L = np.zeros((d + 1, d + 1))
    L[:d, :d], L[:d, d] = A.numpy() * tau, b.numpy() * tau
    if series is None:
        M = scipy.linalg.expm(L)
    else:
        M = sum(np.linalg.matrix_power(L, k) / math.factorial(k) for k in range(series + 1))
    aug = np.concatenate([x0.numpy(), np.ones((*x0.shape[:-1], 1))], -1)
    return torch.from_numpy(aug @ M.T)[..., :d], np.linalg.norm(L, 2)


@pytest.mark.parametrize("solver", [dict(**TIGHT), dict(method="rk4", steps=64)])
def test_linear_field_matches_matrix_exponential(solver):
    A, b, t0, t1, x0, log_q0 = linear_case()
    x1, log_q1 = integrate(lambda x, t: x @ A.T + b, x0, log_q0, t0, t1, **solver)
    tau = t1 - t0
    exact = torch.stack([affine_flow(A, b, float(tau[i]), x0[i])[0] for i in range(2)])
    # dopri5 at 1e-10; rk4, h = 1/64 and ‖Lτ‖ ≈ 2: global error ≈ ‖L‖⁵ h⁴ / 5! ≈ 2e-8 (observed ~1e-9)
    torch.testing.assert_close(x1, exact, rtol=0, atol=1e-8)
    torch.testing.assert_close(log_q1, log_q0 - torch.trace(A) * tau[:, None], rtol=0, atol=1e-12)


@pytest.mark.parametrize(("method", "order"), [("rk4", 4), ("midpoint", 2), ("euler", 1)])
def test_one_fixed_step_is_the_taylor_polynomial(method, order):
    """One step of a p-stage order-p method on an affine field is x0 ↦ T_p(L)[x0; 1] exactly, so its error
    against exp(L) is at most Σ_{k>p} ‖L‖^k/k! ≤ ‖L‖^{p+1}/(p+1)! e^{‖L‖} times ‖[x0; 1]‖; the density,
    with a constant divergence tr A, is exact for any solver."""
    A, b, t0, t1, x0, log_q0 = linear_case(1)
    x1, log_q1 = integrate(lambda x, t: x @ A.T + b, x0, log_q0, t0, t1, method=method, steps=1)
    tau = t1 - t0
    for i in range(2):
        taylor, _ = affine_flow(A, b, float(tau[i]), x0[i], series=order)
        exact, norm_L = affine_flow(A, b, float(tau[i]), x0[i])
        torch.testing.assert_close(x1[i], taylor, rtol=0, atol=1e-12)
        bound = norm_L ** (order + 1) / math.factorial(order + 1) * math.exp(norm_L)
        size = torch.cat([x0[i], torch.ones(4, 1, dtype=F64)], -1).norm(dim=-1)
        assert ((x1[i] - exact).norm(dim=-1) <= bound * size).all()
        assert (x1[i] - exact).abs().max() > 1e-6  # one step does truncate
    torch.testing.assert_close(log_q1, log_q0 - torch.trace(A) * tau[:, None], rtol=0, atol=1e-12)


# ---------------------------------------------------------------------------------- (c) change of variables


def std_normal_log_prob(x: torch.Tensor, var: torch.Tensor | float = 1.0) -> torch.Tensor:
    var = torch.as_tensor(var, dtype=x.dtype)
    return -0.5 * (x.pow(2) / var + torch.log(2 * math.pi * var)).sum(-1)


def test_scaling_field_pushes_standard_normal_to_scaled_normal():
    """f = a x pushes N(0, I) forward to N(0, e^{2aτ} I)."""
    g = gen(8)
    a, t0, t1 = 0.7, torch.tensor([0.0, 0.5], dtype=F64), torch.tensor([1.0, -0.3], dtype=F64)
    x0 = randn(g, 2, 50, 3)
    x1, log_q1 = integrate(lambda x, t: a * x, x0, std_normal_log_prob(x0), t0, t1, **TIGHT)
    tau = (t1 - t0)[:, None, None]
    torch.testing.assert_close(x1, x0 * torch.exp(a * tau), rtol=1e-9, atol=0)
    expected = std_normal_log_prob(x1, torch.exp(2 * a * tau))
    torch.testing.assert_close(log_q1, expected, rtol=1e-9, atol=1e-9)  # |log q| up to ~15


def test_cubic_field_matches_exact_pushforward_density():
    """f = −x³ (per coordinate): x(τ) = x0 / √(1 + 2 x0² τ), inverse x0 = x1 / √(1 − 2 x1² τ) with
    dx0/dx1 = (1 − 2 x1² τ)^{−3/2}, so q1(x1) = N(x0(x1); 0, I) Π (1 − 2 x1² τ)^{−3/2}."""
    g, tau = gen(9), 0.8
    x0 = randn(g, 1, 40, 2)
    x1, log_q1 = integrate(lambda x, t: -(x**3), x0, std_normal_log_prob(x0), 0.0, tau, **TIGHT)
    torch.testing.assert_close(x1, x0 / torch.sqrt(1 + 2 * x0**2 * tau), rtol=0, atol=1e-9)
    u = 1 - 2 * x1**2 * tau
    exact = std_normal_log_prob(x1 / u.sqrt()) - 1.5 * torch.log(u).sum(-1)
    # dopri5's error norm is an RMS over all particles: the tail particles carry ~5e-8 (observed)
    torch.testing.assert_close(log_q1, exact, rtol=0, atol=2e-7)


def test_tracked_density_equals_flow_map_determinant():
    """For a coupled non-linear time-dependent field, log q1 − log q0 = −log|det ∂x1/∂x0| (the finite
    change of variables), with ∂x1/∂x0 by autograd through the solve."""
    field, g = TanhField(3, seed=11, scale=1.2), gen(12)
    x0 = randn(g, 1, 4, 3).requires_grad_(True)
    x1, dlogq = integrate(field, x0, None, -0.3, 0.9, create_graph=True, **TIGHT)
    rows = [torch.autograd.grad(x1[..., k].sum(), x0, retain_graph=True)[0] for k in range(3)]
    J = torch.stack(rows, -2)  # [B, N, d, d]: row k = ∂x1_k/∂x0
    sign, logdet = torch.linalg.slogdet(J)
    assert (sign > 0).all() and logdet.abs().min() > 1e-2
    torch.testing.assert_close(dlogq.detach(), -logdet, rtol=0, atol=1e-8)


# ----------------------------------------------------------------------------------------- (d) per-stream spans


@pytest.mark.parametrize(("solver", "tol"), [(dict(method="rk4", steps=3), 1e-12), (TIGHT, 1e-8)])
def test_batched_spans_equal_streams_one_at_a_time(solver, tol):
    field, g = TanhField(2, seed=13, scale=1.0), gen(14)
    t0, t1 = torch.tensor([0.0, 0.3, 0.5], dtype=F64), torch.tensor([1.0, 0.4, -0.2], dtype=F64)
    x0, log_q0 = randn(g, 3, 5, 2), randn(g, 3, 5)
    x1, log_q1 = integrate(field, x0, log_q0, t0, t1, **solver)
    for b in range(3):
        xb, lb = integrate(field, x0[b : b + 1], log_q0[b : b + 1], t0[b : b + 1], t1[b : b + 1], **solver)
        torch.testing.assert_close(x1[b : b + 1], xb, rtol=0, atol=tol)
        torch.testing.assert_close(log_q1[b : b + 1], lb, rtol=0, atol=tol)


def test_span_reparametrisation_matches_direct_integration_in_t():
    """The s ∈ [0, 1] formulation equals torchdiffeq integrating (f, −∇·f) directly over t ∈ [t0, t1],
    for a forward and a backward span."""
    field, g = TanhField(2, seed=15, scale=1.0), gen(16)
    for t0, t1 in [(0.2, 1.3), (0.5, -0.4)]:
        x0, log_q0 = randn(g, 1, 5, 2), randn(g, 1, 5)

        def direct(t, state):
            f, div = velocity_and_divergence(field, state[0], t.reshape(1))
            return f, -div

        span = torch.tensor([t0, t1], dtype=F64)
        xs, ls = odeint(direct, (x0, log_q0), span, rtol=1e-10, atol=1e-10, method="dopri5")
        x1, log_q1 = integrate(field, x0, log_q0, t0, t1, **TIGHT)
        torch.testing.assert_close(x1, xs[-1], rtol=0, atol=1e-8)
        torch.testing.assert_close(log_q1, ls[-1], rtol=0, atol=1e-8)


# --------------------------------------------------------------------------------------------- (e) gradients


def gradient_case():
    net = TanhField(2, hidden=8, seed=17, scale=1.0)
    gate_logit = nn.Parameter(torch.tensor([0.4, -0.3], dtype=F64))  # a per-stream context tensor's source
    span_raw = nn.Parameter(torch.tensor([0.2, -0.5], dtype=F64))  # learned span t1 = t0 + softplus(·)
    g = gen(18)
    x0, log_q0 = randn(g, 2, 6, 2), randn(g, 2, 6)
    return net, gate_logit, span_raw, x0, log_q0


def run_gradient_case(adjoint: bool, **solver):
    net, gate_logit, span_raw, x0, log_q0 = gradient_case()
    gate = torch.sigmoid(gate_logit)[:, None, None]  # context computed outside the ODE (non-leaf)

    def velocity(x, t):
        return gate * net(x, t)

    t0 = torch.tensor([0.0, 0.1], dtype=F64)
    x1, log_q1 = integrate(
        velocity, x0, log_q0, t0, t0 + softplus(span_raw), create_graph=True,
        adjoint=adjoint, adjoint_params=(*net.parameters(), gate), **solver,
    )  # fmt: skip
    loss = x1.pow(2).sum(-1).mean() + log_q1.mean()
    params = [*net.parameters(), gate_logit, span_raw]
    return torch.autograd.grad(loss, params)


def test_gradients_reach_parameters_context_and_span_plain_and_adjoint():
    plain = run_gradient_case(adjoint=False, **TIGHT)
    adj = run_gradient_case(adjoint=True, **TIGHT)
    for gp, ga in zip(plain, adj, strict=True):
        assert gp.abs().max() > 1e-4
        torch.testing.assert_close(ga, gp, rtol=1e-6, atol=1e-9)
    one_step = run_gradient_case(adjoint=False, method="rk4", steps=1)  # the reference's configuration
    assert all(gr.abs().max() > 1e-4 for gr in one_step)


def test_adjoint_takes_module_parameters_automatically():
    net = TanhField(2, hidden=8, seed=19)
    x0 = randn(gen(20), 1, 3, 2)
    x1, log_q1 = integrate(net, x0, None, 0.0, 1.0, create_graph=True, adjoint=True, method="rk4", steps=2)
    grads = torch.autograd.grad(x1.sum() + log_q1.sum(), list(net.parameters()))
    assert all(gr.abs().max() > 0 for gr in grads)


# ----------------------------------------------------------------------------------- (f) serving and plumbing


def test_no_grad_serving_returns_detached_equal_values():
    field, g = TanhField(2, seed=21), gen(22)
    x0, log_q0 = randn(g, 2, 4, 2).requires_grad_(True), randn(g, 2, 4)
    t1 = torch.tensor([0.7, 1.2], dtype=F64)
    ref_x, ref_q = integrate(field, x0, log_q0, 0.0, t1, method="rk4", steps=2, create_graph=True)
    assert ref_x.requires_grad and ref_q.requires_grad
    for kw in (dict(create_graph=True), dict(create_graph=True, adjoint=True), dict()):
        with torch.no_grad():
            x1, log_q1 = integrate(field, x0, log_q0, 0.0, t1, method="rk4", steps=2, **kw)
        assert not (x1.requires_grad or log_q1.requires_grad)
        torch.testing.assert_close(x1, ref_x.detach(), rtol=0, atol=1e-14)
        torch.testing.assert_close(log_q1, ref_q.detach(), rtol=0, atol=1e-14)
    x1, log_q1 = integrate(field, x0, log_q0, 0.0, t1, method="rk4", steps=2)  # grad on, create_graph off
    assert not (x1.requires_grad or log_q1.requires_grad)
    with torch.no_grad():
        xn, none = integrate(field, x0, log_q0, 0.0, t1, method="rk4", steps=2, divergence="none")
    assert none is None and not xn.requires_grad
    torch.testing.assert_close(xn, ref_x.detach(), rtol=0, atol=1e-14)


def test_hutchinson_probes_inside_integrate():
    field, g = TanhField(3, seed=23), gen(24)
    x0, log_q0 = randn(g, 2, 3, 3), randn(g, 2, 3)
    exact = integrate(field, x0, log_q0, 0.0, 1.0, method="rk4", steps=2, divergence="exact")
    full = integrate(
        field, x0, log_q0, 0.0, 1.0, method="rk4", steps=2, divergence="hutchinson", probes=all_sign_probes(2, 3, 3)
    )
    torch.testing.assert_close(full[1], exact[1], rtol=0, atol=1e-12)
    one = integrate(
        field, x0, log_q0, 0.0, 1.0, method="rk4", steps=2, divergence="hutchinson",
        probes=rademacher_probes([gen(0), gen(1)], 1, 3, 3, dtype=F64),
    )  # fmt: skip
    torch.testing.assert_close(one[0], exact[0], rtol=0, atol=0)  # the particles do not depend on the estimate
    assert (one[1] - exact[1]).abs().max() > 1e-6


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(x0=torch.zeros(2, 3)), "x0"),
        (dict(method="rk45"), "method"),
        (dict(steps=0), "steps"),
        (dict(t1=torch.zeros(3)), "t1"),
        (dict(t0=float("nan")), "t0"),
        (dict(log_q0=torch.zeros(2, 4)), "log_q0"),
        (dict(divergence="hutchinson"), "probes"),
        (dict(divergence="trace"), "divergence"),
        (dict(velocity_fn=lambda x, t: x[..., :1]), "velocity_fn"),
    ],
)
def test_bad_input_raises_value_error_naming_the_field(kwargs, field):
    args = dict(velocity_fn=lambda x, t: -x, x0=torch.zeros(2, 3, 2), log_q0=None, t0=0.0, t1=1.0)
    args.update(kwargs)
    with pytest.raises(ValueError, match=f"^{field}"):
        integrate(args.pop("velocity_fn"), args.pop("x0"), args.pop("log_q0"), args.pop("t0"), args.pop("t1"), **args)


@pytest.mark.parametrize("divergence", ["none", "exact"])
def test_unit_span_fast_path_equals_the_general_path(divergence):
    """Floats t0 = 0, t1 = 1 (serving's span) skip the span rescaling; the result is the general path's."""
    field, g = TanhField(2, seed=21, scale=1.0), gen(22)
    x0, log_q0 = randn(g, 3, 5, 2), randn(g, 3, 5)
    fast = integrate(field, x0, log_q0, 0.0, 1.0, method="rk4", steps=2, divergence=divergence)
    ones = torch.ones(3, dtype=F64)
    general = integrate(field, x0, log_q0, 0 * ones, ones, method="rk4", steps=2, divergence=divergence)
    torch.testing.assert_close(fast[0], general[0], rtol=0, atol=1e-14)
    if divergence == "exact":
        torch.testing.assert_close(fast[1], general[1], rtol=0, atol=1e-14)

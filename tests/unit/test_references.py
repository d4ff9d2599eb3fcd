"""Exact references: the sequential Kalman filter on a static model equals the batch conjugate posterior."""

import torch
from mpflow.operators.models import make_model
from mpflow.operators.references import conjugate_update, kalman_filter
from mpflow.operators.rng import generator


def batch_posterior(m0, P0, H, R, obs):
    """All T observations at once: precision P0⁻¹ + T HᵀR⁻¹H, mean P (P0⁻¹ m0 + Hᵀ R⁻¹ Σ o_t)."""
    Ri = torch.linalg.inv(R)
    prec = torch.linalg.inv(P0) + obs.shape[0] * H.T @ Ri @ H
    P = torch.linalg.inv(prec)
    return P @ (torch.linalg.solve(P0, m0) + H.T @ Ri @ obs.sum(0)), P


def test_kalman_on_static_model_equals_conjugate_posterior():
    d, k, T = 3, 2, 40
    g = torch.Generator().manual_seed(0)
    H = torch.randn(k, d, generator=g, dtype=torch.float64)
    R = torch.tensor([[2.0, 0.3], [0.3, 1.0]], dtype=torch.float64)
    model = make_model("linear_gaussian", {"H": H.tolist(), "R": R.tolist()}, d, dtype=torch.float64)
    m0 = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)
    A = torch.randn(d, d, generator=g, dtype=torch.float64)
    P0 = A @ A.T + 0.5 * torch.eye(d, dtype=torch.float64)
    _, obs = model.simulate(T, torch.ones(1, d, dtype=torch.float64), [generator(1)])
    means, covs, logz = kalman_filter(m0[None], P0[None], model, obs)
    m_ref, P_ref = batch_posterior(m0, P0, H, R, obs[0])
    assert torch.allclose(means[0, -1], m_ref, atol=1e-10)
    assert torch.allclose(covs[0, -1], P_ref, atol=1e-10)
    # evidence: Σ log p(o_t | o_<t) equals the joint marginal log N(vec o; (I⊗H) m0, (I⊗H) P0 (I⊗H)ᵀ + I⊗R)
    Hs = torch.cat([H] * T)
    cov = Hs @ P0 @ Hs.T + torch.block_diag(*[R] * T)
    joint = torch.distributions.MultivariateNormal(Hs @ m0, cov).log_prob(obs[0].reshape(-1))
    assert abs(float(logz.sum() - joint)) < 1e-8


def test_conjugate_update_matches_information_form():
    g = torch.Generator().manual_seed(3)
    d, k = 4, 3
    m = torch.randn(2, d, generator=g, dtype=torch.float64)
    A = torch.randn(2, d, d, generator=g, dtype=torch.float64)
    P = A @ A.transpose(-1, -2) + torch.eye(d, dtype=torch.float64)
    H = torch.randn(2, k, d, generator=g, dtype=torch.float64)
    R = torch.eye(k, dtype=torch.float64).expand(2, k, k) * 0.7
    o = torch.randn(2, k, generator=g, dtype=torch.float64)
    m1, P1, _ = conjugate_update(m, P, H, R, o)
    prec = torch.linalg.inv(P) + H.transpose(-1, -2) @ torch.linalg.inv(R) @ H
    P_ref = torch.linalg.inv(prec)
    rhs = torch.linalg.solve(P, m[..., None]) + H.transpose(-1, -2) @ torch.linalg.solve(R, o[..., None])
    assert torch.allclose(P1, P_ref, atol=1e-10)
    assert torch.allclose(m1, (P_ref @ rhs)[..., 0], atol=1e-10)

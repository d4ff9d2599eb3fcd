"""The Daum–Huang base flow moves a Gaussian prior exactly onto the conjugate posterior."""

import torch
from torchdiffeq import odeint

from operators import gaussian
from operators.models import make_model
from operators.mpf.gaussian_flow import DaumHuangFlow, linear_gaussian_likelihood, statistical_linearisation
from operators.references import conjugate_update

F64 = torch.float64


def setup(d=3, k=2, seed=0, B=2):
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(B, d, generator=g, dtype=F64)
    A = torch.randn(B, d, d, generator=g, dtype=F64)
    P = A @ A.transpose(-1, -2) + 0.3 * torch.eye(d, dtype=F64)
    H = torch.randn(B, k, d, generator=g, dtype=F64)
    R = 0.5 * torch.eye(k, dtype=F64).expand(B, k, k).clone()
    o = torch.randn(B, k, generator=g, dtype=F64)
    return m, P, H, R, o, g


def flow_to_one(flow, x0, log_q0):
    def rhs(lam, state):
        x, _ = state
        lam_b = lam.expand(x.shape[0])
        return flow.velocity(x, lam_b), -flow.divergence(lam_b)[:, None].expand_as(state[1])

    xs, lqs = odeint(rhs, (x0, log_q0), torch.tensor([0.0, 1.0], dtype=F64), method="dopri5", rtol=1e-10, atol=1e-10)
    return xs[-1], lqs[-1]


def test_exact_flow_maps_prior_samples_onto_the_conjugate_posterior():
    m, P, H, R, o, g = setup()
    m_post, P_post, _ = conjugate_update(m, P, H, R, o)
    L = torch.linalg.cholesky(P)
    x0 = m[:, None] + torch.randn(2, 4000, 3, generator=g, dtype=F64) @ L.transpose(-1, -2)
    x0 = gaussian.match_moments(x0, m, P)  # exact prior moments: the map is affine, so moments map exactly
    log_q0 = gaussian.log_prob(x0, m, L)
    flow = DaumHuangFlow(m, P, linear_gaussian_likelihood(H, R, o))
    x1, log_q1 = flow_to_one(flow, x0, log_q0)
    m1, C1 = gaussian.moments(x1)
    assert torch.allclose(m1, m_post, atol=1e-7)
    assert torch.allclose(C1, P_post, atol=1e-7)
    # the tracked density (MPF eq. 8) is the posterior density at the moved particles
    exact = gaussian.log_prob(x1, m_post, torch.linalg.cholesky(P_post))
    assert torch.allclose(log_q1, exact, atol=1e-6)


def test_statistical_linearisation_is_exact_for_linear_gaussian_likelihoods():
    m, P, H, R, o, g = setup(B=1)
    model = make_model("linear_gaussian", {"H": H[0].tolist(), "R": R[0].tolist()}, 3, dtype=F64)
    x = m[:, None] + torch.randn(1, 500, 3, generator=g, dtype=F64) @ torch.linalg.cholesky(P).transpose(-1, -2)
    fitted = statistical_linearisation(x, model.score(o, x))
    exact = linear_gaussian_likelihood(H, R, o)
    assert torch.allclose(fitted.precision, exact.precision, atol=1e-8)
    assert torch.allclose(fitted.information, exact.information, atol=1e-8)


def test_singular_likelihood_precision_is_handled():
    """One scalar observation of a 3-D state: Λ has rank 1; the flow must still reach the posterior."""
    m, P, H, R, o, g = setup(k=1)
    m_post, P_post, _ = conjugate_update(m, P, H, R, o)
    flow = DaumHuangFlow(m, P, linear_gaussian_likelihood(H, R, o))
    x0 = gaussian.match_moments(torch.randn(2, 50, 3, generator=g, dtype=F64), m, P)
    x1, _ = flow_to_one(flow, x0, torch.zeros(2, 50, dtype=F64))
    m1, C1 = gaussian.moments(x1)
    assert torch.allclose(m1, m_post, atol=1e-7) and torch.allclose(C1, P_post, atol=1e-7)


def test_whiten_and_matched_clouds():
    """whiten: z has mean 0 and covariance I and x = m + z Lᵀ; matched: the same z mapped onto (m, P) exactly."""
    m, P, *_, g = setup(d=3, B=2)
    x = torch.randn(2, 40, 3, generator=g, dtype=F64) * 2.0 + 1.0
    white = gaussian.whiten(x)
    zm, zc = gaussian.moments(white.z)
    torch.testing.assert_close(zm, torch.zeros_like(zm), rtol=0, atol=1e-12)
    torch.testing.assert_close(zc, torch.eye(3, dtype=F64).expand(2, 3, 3), rtol=0, atol=1e-12)
    torch.testing.assert_close(white.points(), x, rtol=0, atol=1e-12)
    moved = gaussian.matched(x, m, P)
    torch.testing.assert_close(moved.z, white.z)
    mm, mc = gaussian.moments(moved.points())
    torch.testing.assert_close(mm, m, rtol=0, atol=1e-12)
    torch.testing.assert_close(mc, P, rtol=0, atol=1e-10)

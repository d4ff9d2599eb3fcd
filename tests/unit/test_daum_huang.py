"""The Daum–Huang base flow moves a Gaussian prior exactly onto the conjugate posterior."""

import torch
from mpflow.operators import gaussian
from mpflow.operators.models import make_model
from mpflow.operators.mpf.daum_huang import DaumHuangFlow, linear_gaussian_likelihood, statistical_linearisation
from mpflow.operators.references import conjugate_update
from torchdiffeq import odeint

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


def two_modes(n=600, sd=0.3, seed=3):
    """A cloud around the gmm posterior's two modes (1, −2) and (−1, 2), every other particle in each."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.tensor([[1.0, -2.0], [-1.0, 2.0]], dtype=F64)
    return centres[torch.arange(n) % 2][None] + sd * torch.randn(1, n, 2, generator=g, dtype=F64)


def moved_moments(x, lik):
    """Moments of the cloud x after the Daum–Huang flow of the Gaussian likelihood ``lik`` from its own moments."""
    mean, cov = gaussian.moments(x)
    x1, _ = flow_to_one(DaumHuangFlow(mean, cov, lik), x, torch.zeros(x.shape[:2], dtype=F64))
    return gaussian.moments(x1)


def test_mode_split_separates_modes_and_not_a_gaussian():
    from mpflow.operators.mpf.daum_huang import mode_split

    g = torch.Generator().manual_seed(0)
    labels, eta = mode_split(gaussian.whiten(torch.randn(1, 4000, 2, generator=g, dtype=F64)))
    assert abs(float(eta) - 2 / torch.pi) < 0.03  # the best split of a Gaussian
    x = two_modes()
    labels, eta = mode_split(gaussian.whiten(x))
    assert float(eta) > 0.95
    truth = (torch.arange(600) % 2 == 1)[None]
    assert bool((labels == truth).all() or (labels == ~truth).all())


def test_importance_linearisation_moves_the_cloud_onto_the_reweighted_moments():
    """On a unimodal cloud the importance fit's base flow moves the cloud's Gaussian onto the mean and
    covariance of the cloud reweighted by the likelihood, exactly."""
    from mpflow.operators.mpf.daum_huang import importance_linearisation

    g = torch.Generator().manual_seed(4)
    x = torch.randn(1, 500, 2, generator=g, dtype=F64) @ torch.tensor([[1.0, 0.5], [0.0, 0.7]], dtype=F64)
    model = make_model("gmm", {}, 2, dtype=F64)
    lw = model.log_likelihood(torch.tensor([[1.3]], dtype=F64), x)
    m1, c1 = moved_moments(x, importance_linearisation(lw, gaussian.whiten(x)))
    m_target, c_target = gaussian.moments(x, lw)
    assert torch.allclose(m1, m_target, atol=1e-7) and torch.allclose(c1, c_target, atol=1e-7)


def test_importance_linearisation_holds_separated_modes():
    """On two separated modes the weights are renormalised within each mode: the flow moves every mode onto
    its own reweighted moments and keeps the modes' shares (an affine map cannot move particles from one
    mode to the other: following the plain weights would translate both). Stein's global fit instead reads
    the between-mode spread as curvature and pulls the modes together."""
    from mpflow.operators.mpf.daum_huang import importance_linearisation

    x = two_modes()
    x1_obs = make_model("linear_gaussian", {"H": [[1.0, 0.0]], "R": [[1.0]]}, 2, dtype=F64)
    lw = x1_obs.log_likelihood(torch.tensor([[0.8]], dtype=F64), x)  # x₁ ≈ 0.8: favours mode (1, −2)
    first = torch.arange(600) % 2 == 0
    held = torch.zeros(600, dtype=F64)
    for group in (first, ~first):
        held[group] = 0.5 * torch.softmax(lw[0, group], -1)
    m_held, c_held = gaussian.moments(x, held.log()[None])
    m1, c1 = moved_moments(x, importance_linearisation(lw, gaussian.whiten(x)))
    assert torch.allclose(m1, m_held, atol=1e-7) and torch.allclose(c1, c_held, atol=1e-7)
    m_plain, _ = gaussian.moments(x, lw)
    assert float((m_plain - m_held).norm()) > 1.0  # the plain weights would have moved the whole cloud
    model, o = make_model("gmm", {}, 2, dtype=F64), torch.tensor([[0.8]], dtype=F64)
    top = lambda cov: float(torch.linalg.eigvalsh(cov)[..., -1])  # noqa: E731
    _, c_imp = moved_moments(x, importance_linearisation(model.log_likelihood(o, x), gaussian.whiten(x)))
    _, c_stein = moved_moments(x, statistical_linearisation(x, model.score(o, x)))
    assert top(c_imp) > 0.97 * top(gaussian.moments(x)[1])  # one gmm observation barely moves the modes
    assert top(c_stein) < 0.8 * top(c_imp)  # Stein: modes pulled together


def test_importance_linearisation_agrees_with_the_exact_likelihood_on_a_gaussian_problem():
    """Gaussian cloud, linear-Gaussian likelihood: the reweighted moments are the conjugate posterior's up to
    Monte Carlo error, so the fit is (Hᵀ R⁻¹ H, Hᵀ R⁻¹ o) up to that error."""
    from mpflow.operators.mpf.daum_huang import importance_linearisation

    m, P, H, R, o, g = setup(d=2, k=2, B=1)
    R = 4.0 * R  # a weak observation: the weights stay even, so 20 000 particles estimate the moments well
    model = make_model("linear_gaussian", {"H": H[0].tolist(), "R": R[0].tolist()}, 2, dtype=F64)
    x = m[:, None] + torch.randn(1, 20000, 2, generator=g, dtype=F64) @ torch.linalg.cholesky(P).transpose(-1, -2)
    fitted = importance_linearisation(model.log_likelihood(o, x), gaussian.whiten(x))
    exact = linear_gaussian_likelihood(H, R, o)
    scale = float(torch.linalg.matrix_norm(exact.precision))
    assert float(torch.linalg.matrix_norm(fitted.precision - exact.precision)) < 0.1 * scale
    assert torch.allclose(fitted.information, exact.information, atol=0.1 * float(exact.information.abs().max()))


def test_unknown_linearisation_is_refused():
    import pytest
    from mpflow.operators.mpf.daum_huang import linearised_likelihood

    model = make_model("gmm", {}, 2)
    with pytest.raises(ValueError, match="linearisation"):
        linearised_likelihood(model, torch.zeros(1, 1), torch.randn(1, 8, 2), method="laplace")


def test_importance_linearisation_hands_over_to_stein_when_few_particles_carry_the_weight():
    """An observation far outside the cloud leaves ~1 effective particle: the fit is then Stein's (which
    extrapolates from the scores) and finite; between 2(d+1) and 4(d+1) effective particles it is the blend."""
    from mpflow.operators.mpf.daum_huang import FALLBACK_ESS, importance_linearisation

    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, 256, 2, generator=g, dtype=F64)
    white = gaussian.whiten(x)
    model = make_model("gmm", {}, 2, dtype=F64)
    o = torch.tensor([[50.0]], dtype=F64)
    stein = statistical_linearisation(x, model.score(o, x), whitened=white)
    fit = importance_linearisation(model.log_likelihood(o, x), white, fallback=lambda: stein)
    assert fit is stein

    lw = torch.full((1, 256), -1e4, dtype=F64)
    lw[0, :9] = 0.0  # 9 equal weights: effective sample size 9, halfway between 6 and 12 for d = 2
    assert FALLBACK_ESS == (2.0, 4.0)
    blend = importance_linearisation(lw, white, fallback=lambda: stein)
    alone = importance_linearisation(lw, white)
    torch.testing.assert_close(blend.precision, 0.5 * alone.precision + 0.5 * stein.precision)
    torch.testing.assert_close(blend.information, 0.5 * alone.information + 0.5 * stein.information)
    lw[0, :40] = 0.0  # 40 effective particles: the importance fit alone
    assert importance_linearisation(lw, white, fallback=lambda: stein).precision.equal(
        importance_linearisation(lw, white).precision
    )

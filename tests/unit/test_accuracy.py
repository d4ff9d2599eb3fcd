"""Tests of operators.accuracy against closed forms (Gaussian laws) with stated Monte-Carlo tolerances.

Tolerances are a few Monte-Carlo standard errors (estimated from the samples or replications) unless a
quantity is exact (then 1e-10). All draws use explicit generators, so the tests are deterministic.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from mpflow.operators import accuracy, gaussian, rng

F64 = torch.float64


def sample(mean: torch.Tensor, cov: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    """n draws of N(mean, cov) → [n, d]."""
    L = gaussian.cholesky(cov[None])[0]
    z = rng.randn([rng.generator(seed)], (n, mean.shape[-1]), F64)[0]
    return mean + z @ L.T


def log_normal(x: torch.Tensor, mean: torch.Tensor, cov: torch.Tensor) -> torch.Tensor:
    return gaussian.log_prob(x[None], mean[None], gaussian.cholesky(cov[None]))[0]


def is_cloud(mean, cov, n, seed, scale=1.6):
    """Importance-weighted particles for N(mean, cov) drawn from the wider N(mean + 0.3, scale² cov)."""
    prop_mean = mean + 0.3
    x = sample(prop_mean, scale**2 * cov, n, seed)
    lw = log_normal(x, mean, cov) - log_normal(x, prop_mean, scale**2 * cov)
    return x, lw


def resample(x: torch.Tensor, lw: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    idx = torch.multinomial(torch.softmax(lw, 0), n, replacement=True, generator=rng.generator(seed))
    return x[idx]


def rbf_expectation(m1, S1, m2, S2, h):
    """E exp(−‖x − y‖² / 2h²), x ~ N(m1, S1), y ~ N(m2, S2) independent (Gaussian convolution)."""
    eye = torch.eye(m1.shape[0], dtype=F64)
    S, D = S1 + S2, m1 - m2
    return torch.linalg.det(eye + S / h**2) ** -0.5 * torch.exp(-0.5 * D @ torch.linalg.solve(h**2 * eye + S, D))


def mmd2_exact(m1, S1, m2, S2, hs):
    """Population MMD² between two Gaussians for the kernel Σ_h exp(−‖x − y‖² / 2h²)."""
    return sum(
        rbf_expectation(m1, S1, m1, S1, h) + rbf_expectation(m2, S2, m2, S2, h) - 2 * rbf_expectation(m1, S1, m2, S2, h)
        for h in hs
    )


MEAN3 = torch.tensor([0.5, -1.0, 0.2], dtype=F64)
_L3 = torch.tensor([[1.0, 0.3, 0.0], [0.3, 0.8, -0.2], [0.0, -0.2, 0.5]], dtype=F64)
COV3 = _L3 @ _L3.T
MEAN2 = torch.tensor([1.0, -0.5], dtype=F64)
COV2 = torch.tensor([[1.0, 0.5], [0.5, 2.0]], dtype=F64)
HS = (0.5, 1.0, 2.0)


# ------------------------------------------------------------------------------------------------ MMD²


@pytest.mark.parametrize("chunk", [1 << 20, 100])  # one block, and many row blocks (symmetric-block logic)
def test_mmd2_equals_the_u_and_v_statistics_written_out(chunk, monkeypatch):
    # Gretton et al. (2012) eq. 3 (U) and eq. 5 (V), brute force on small sets
    monkeypatch.setattr(accuracy, "_CHUNK_ELEMENTS", chunk)
    x = sample(MEAN3, COV3, 30, 1)
    y = sample(MEAN3 + 0.5, COV3, 41, 2)

    def k(a, b):
        d2 = torch.cdist(a, b) ** 2
        return sum(torch.exp(-d2 / (2 * h**2)) for h in HS)

    kxx, kyy, kxy = k(x, x), k(y, y), k(x, y)
    n, m = 30, 41
    u = (kxx.sum() - kxx.trace()) / (n * (n - 1)) + (kyy.sum() - kyy.trace()) / (m * (m - 1)) - 2 * kxy.mean()
    v = kxx.mean() + kyy.mean() - 2 * kxy.mean()
    torch.testing.assert_close(accuracy.mmd2(x, y, bandwidths=HS), u, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(accuracy.mmd2(x, y, bandwidths=HS, unbiased=False), v, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("shift", [0.0, 0.3])
def test_mmd2_unbiased_mean_matches_closed_form_and_v_statistic_is_biased(shift):
    mq = MEAN3 + torch.tensor([shift, 0.0, 0.0], dtype=F64)
    exact = float(mmd2_exact(mq, COV3, MEAN3, COV3, HS))
    R, n = 20, 300
    pairs = [(sample(mq, COV3, n, 2 * r), sample(MEAN3, COV3, n, 2 * r + 1)) for r in range(R)]
    u = torch.stack([accuracy.mmd2(x, y, bandwidths=HS) for x, y in pairs])
    v = torch.stack([accuracy.mmd2(x, y, bandwidths=HS, unbiased=False) for x, y in pairs])
    se = float(u.std()) / math.sqrt(R)
    assert abs(float(u.mean()) - exact) < 4 * se + 1e-4, (float(u.mean()), exact, se)
    # V-statistic bias ≈ (E k(x,x) − E k(x,x'))(1/N + 1/M) > 0: clearly above the unbiased estimate
    assert float((v - u).mean()) > 0.006


def test_mmd2_same_law_near_zero_and_monotone_in_shift():
    y = sample(MEAN2, COV2, 2000, 100)
    null = [float(accuracy.mmd2(sample(MEAN2, COV2, 512, 200 + s), y)) for s in range(3)]
    assert max(abs(v) for v in null) < 0.005, null  # sd of the null statistic here is ≈ 0.001
    shifts = [0.0, 0.25, 0.5, 1.0, 2.0]
    x0 = sample(MEAN2, COV2, 512, 101)
    vals = [float(accuracy.mmd2(x0 + torch.tensor([s, 0.0], dtype=F64), y)) for s in shifts]
    assert all(b > a for a, b in itertools.pairwise(vals)), vals
    assert vals[2] > 0.05 and vals[3] > 0.2, vals  # ≥ 10× the null bound for a half-sd shift


def test_mmd2_batched_broadcast_and_default_bandwidths():
    xs = torch.stack([sample(MEAN2, COV2, 200, s) for s in range(3)])
    y = sample(MEAN2, COV2, 300, 9)
    batched = accuracy.mmd2(xs, y)
    assert batched.shape == (3,) and batched.dtype == F64
    loop = torch.stack([accuracy.mmd2(xs[b], y) for b in range(3)])
    torch.testing.assert_close(batched, loop, rtol=1e-10, atol=1e-12)
    # the default is the median heuristic × (0.25, 0.5, 1, 2, 4), computed with explicit widths too
    h = accuracy.median_bandwidth(xs[:1], y[None])[0] * torch.tensor(accuracy.MMD_BANDWIDTH_FACTORS, dtype=F64)
    torch.testing.assert_close(accuracy.mmd2(xs[0], y, bandwidths=h), loop[0], rtol=1e-9, atol=1e-12)
    # float32 input is cast to float64
    assert accuracy.mmd2(xs[0].float(), y.float()).dtype == F64


def test_mmd2_weights_exact_identities():
    x = sample(MEAN2, COV2, 60, 1)
    y = sample(MEAN2, COV2, 80, 2)
    counts = torch.randint(1, 4, (60,), generator=rng.generator(3))
    dup = x.repeat_interleave(counts, dim=0)
    # V-statistic: integer weight ratios are duplicated particles
    w = accuracy.mmd2(x, y, bandwidths=HS, x_log_weights=counts.to(F64).log(), unbiased=False)
    torch.testing.assert_close(w, accuracy.mmd2(dup, y, bandwidths=HS, unbiased=False), rtol=1e-10, atol=1e-12)
    # zero weights (−inf) drop particles, for the U- and the V-statistic
    lw = torch.zeros(60, dtype=F64)
    lw[::3] = -math.inf
    keep = torch.isfinite(lw)
    for unbiased in (True, False):
        got = accuracy.mmd2(x, y, bandwidths=HS, x_log_weights=lw, unbiased=unbiased)
        want = accuracy.mmd2(x[keep], y, bandwidths=HS, unbiased=unbiased)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_mmd2_importance_weighted_agrees_with_resampled_and_closed_form():
    y = sample(MEAN3, COV3, 1500, 11)
    x, lw = is_cloud(MEAN3, COV3, 3000, 12)
    weighted = float(accuracy.mmd2(x, y, bandwidths=HS, x_log_weights=lw))
    resampled = float(accuracy.mmd2(resample(x, lw, 1500, 13), y, bandwidths=HS))
    # both estimate MMD²(p, p) = 0; the null sd for these sizes is ≈ 0.002 (n_eff ≈ 1000)
    assert abs(weighted) < 0.008 and abs(resampled) < 0.008, (weighted, resampled)
    assert abs(weighted - resampled) < 0.01
    # a wrong weighting (ignoring the weights) is detected: the proposal is wider and shifted
    exact_unweighted = float(mmd2_exact(MEAN3 + 0.3, 1.6**2 * COV3, MEAN3, COV3, HS))
    assert exact_unweighted > 0.1
    assert abs(float(accuracy.mmd2(x, y, bandwidths=HS)) - exact_unweighted) < 0.02


# ------------------------------------------------------------------------------------------------ KDE


def test_kde_single_particle_is_a_gaussian_with_diagonal_bandwidth():
    particle = torch.tensor([[0.3, -1.2, 2.0]], dtype=F64)
    h = torch.tensor([0.5, 1.5, 0.8], dtype=F64)
    pts = sample(MEAN3, COV3, 7, 5)
    got = accuracy.kde_log_density(pts, particle, bandwidth=h)
    torch.testing.assert_close(got, log_normal(pts, particle[0], torch.diag(h**2)), rtol=1e-10, atol=1e-10)
    scalar = accuracy.kde_log_density(pts, particle, bandwidth=0.7)
    want = log_normal(pts, particle[0], 0.49 * torch.eye(3, dtype=F64))
    torch.testing.assert_close(scalar, want, rtol=1e-10, atol=1e-10)


def test_silverman_bandwidth_is_the_one_dimensional_rule_of_thumb():
    x = sample(torch.zeros(1, dtype=F64), torch.eye(1, dtype=F64) * 4.0, 1000, 6)
    sd = float(x.std(correction=0))
    # d = 1: (4 / (3 N))^{1/5} σ = 1.0592 σ N^{-1/5}
    assert float(accuracy.silverman_bandwidth(x)[0]) == pytest.approx(1.0592 * sd * 1000**-0.2, rel=1e-4)
    # equal weights give the same bandwidth; effective sample size shrinks with unequal weights
    torch.testing.assert_close(
        accuracy.silverman_bandwidth(x, torch.zeros(1000, dtype=F64)), accuracy.silverman_bandwidth(x)
    )


def test_kde_weights_exact_identities():
    x = sample(MEAN2, COV2, 50, 7)
    pts = sample(MEAN2, COV2, 20, 8)
    h = torch.tensor([0.4, 0.6], dtype=F64)
    counts = torch.randint(1, 5, (50,), generator=rng.generator(9))
    got = accuracy.kde_log_density(pts, x, bandwidth=h, log_weights=counts.to(F64).log())
    want = accuracy.kde_log_density(pts, x.repeat_interleave(counts, dim=0), bandwidth=h)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    lw = torch.zeros(50, dtype=F64)
    lw[1::2] = -math.inf
    got = accuracy.kde_log_density(pts, x, bandwidth=h, log_weights=lw)
    torch.testing.assert_close(got, accuracy.kde_log_density(pts, x[0::2], bandwidth=h), rtol=1e-10, atol=1e-10)


def test_kde_of_large_gaussian_sample_is_close_to_the_exact_density():
    x = sample(MEAN2, COV2, 20000, 10)
    pts = sample(MEAN2, COV2, 200, 11)
    L = gaussian.cholesky(COV2[None])[0]
    maha = torch.linalg.solve_triangular(L, (pts - MEAN2).T, upper=False).norm(dim=0)
    pts = pts[maha < 1.5][:50]
    err = (accuracy.kde_log_density(pts, x) - log_normal(pts, MEAN2, COV2)).abs()
    # smoothing bias ≤ ½ log|I + H Σ⁻¹| ≈ 0.04 and relative KDE noise ≈ 0.03 here
    assert float(err.max()) < 0.1, float(err.max())


def test_kde_batched_matches_loop():
    xs = torch.stack([sample(MEAN2, COV2, 100, 20 + b) for b in range(3)])
    lws = torch.randn(3, 100, generator=rng.generator(1), dtype=F64)
    pts = sample(MEAN2, COV2, 40, 30)
    got = accuracy.kde_log_density(pts, xs, log_weights=lws)
    assert got.shape == (3, 40)
    loop = torch.stack([accuracy.kde_log_density(pts, xs[b], log_weights=lws[b]) for b in range(3)])
    torch.testing.assert_close(got, loop, rtol=1e-10, atol=1e-10)


# ----------------------------------------------------------------------------------------- cross-entropy


def test_cross_entropy_of_own_law_is_the_entropy_and_mismatch_is_larger():
    p = sample(MEAN2, COV2, 4000, 40)
    q = sample(MEAN2, COV2, 4000, 41)
    entropy = float(gaussian.entropy(gaussian.cholesky(COV2[None]))[0])  # ½ log|2πeΣ|
    ce = float(accuracy.cross_entropy(p, q))
    # MC sd of −log p(y) is sqrt(d/2) = 1 → SE 0.016; KDE smoothing adds ≈ +0.01
    assert abs(ce - entropy) < 0.06, (ce, entropy)
    # q shifted by one marginal sd along x1: H(p, q) − H(p) = KL = ½ δᵀΣ⁻¹δ = 0.667
    delta = torch.tensor([1.0, 0.0], dtype=F64)
    kl = 0.5 * float(delta @ torch.linalg.solve(COV2, delta))
    ce_shift = float(accuracy.cross_entropy(p, q + delta))
    assert ce_shift - ce > 0.3 and abs(ce_shift - ce - kl) < 0.1, (ce_shift - ce, kl)


def test_cross_entropy_weighted_agrees_with_resampled():
    p = sample(MEAN2, COV2, 3000, 42)
    x, lw = is_cloud(MEAN2, COV2, 4000, 43)
    entropy = float(gaussian.entropy(gaussian.cholesky(COV2[None]))[0])
    weighted = float(accuracy.cross_entropy(p, x, q_log_weights=lw))
    resampled = float(accuracy.cross_entropy(p, resample(x, lw, 4000, 44)))
    assert abs(weighted - entropy) < 0.08 and abs(resampled - entropy) < 0.08, (weighted, resampled, entropy)
    assert abs(weighted - resampled) < 0.08
    batched = accuracy.cross_entropy(p, torch.stack([x, x]), q_log_weights=torch.stack([lw, torch.zeros_like(lw)]))
    assert batched.shape == (2,) and float(batched[0]) == pytest.approx(weighted, rel=1e-12)
    assert float(batched[1]) > weighted + 0.1  # the unweighted proposal is the wrong law


# ------------------------------------------------------------------------------------------------ integrals

A3 = torch.tensor([[2.0, -0.5, 0.1], [0.3, 1.0, 0.4], [-0.2, 0.7, 1.5]], dtype=F64)  # not symmetric
AK = torch.tensor([[1.0, 0.5, -1.0], [0.2, -0.3, 0.8]], dtype=F64)
BK = torch.tensor([[0.4, 1.0, 0.0], [-1.0, 0.6, 0.3]], dtype=F64)
a_k = torch.tensor([0.5, -1.0], dtype=F64)
b_k = torch.tensor([1.5, 0.2], dtype=F64)


def h_values(x: torch.Tensor, h: str) -> torch.Tensor:
    if h == "x":
        return x
    if h == "quadratic":
        return torch.einsum("ni,ij,nj->n", x, A3, x)
    return ((x @ AK.T + a_k) * (x @ BK.T + b_k)).sum(-1)


def kwargs(h: str) -> dict:
    return {"x": {}, "quadratic": {"A": A3}, "bilinear": {"A": AK, "a": a_k, "Bm": BK, "b": b_k}}[h]


@pytest.mark.parametrize("h", accuracy.INTEGRANDS)
def test_integral_particle_expectation_equals_direct_average(h):
    # with p = N(0, 0) the closed form is h(0), so the discrepancy is |mean_i h(x_i) − h(0)| exactly
    x = sample(MEAN3, COV3, 500, 50)
    lw = torch.randn(500, generator=rng.generator(2), dtype=F64)
    w = torch.softmax(lw, 0)
    zero = torch.zeros(3, dtype=F64)
    for weights in (None, lw):
        got = accuracy.integral_discrepancy(
            x, zero, torch.zeros(3, 3, dtype=F64), h, q_log_weights=weights, **kwargs(h)
        )
        vals = h_values(x, h)
        avg = vals.mean(0) if weights is None else (w[:, None] * vals).sum(0) if h == "x" else (w * vals).sum()
        want = (avg - h_values(zero[None], h)[0]).norm() if h == "x" else (avg - h_values(zero[None], h)[0]).abs()
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("h", accuracy.INTEGRANDS)
def test_integral_closed_form_against_monte_carlo(h):
    n = 200_000
    x = sample(MEAN3, COV3, n, 51)
    vals = h_values(x, h)
    got = float(accuracy.integral_discrepancy(x, MEAN3, COV3, h, **kwargs(h)))
    # Monte-Carlo standard error of the particle average (norm of the vector error for h = x)
    se = math.sqrt(float(vals.var(0).sum()) / n)
    assert got < 4 * se, (got, se)
    # a shifted cloud: the discrepancy is the exact change of E h (to MC error)
    delta = torch.tensor([0.4, -0.2, 0.3], dtype=F64)
    shifted = float(accuracy.integral_discrepancy(x + delta, MEAN3, COV3, h, **kwargs(h)))
    # for these h the covariance terms of E h(x + δ) and E h(x) cancel: the change is h(μ + δ) − h(μ)
    true_change = float((h_values(MEAN3[None] + delta, h) - h_values(MEAN3[None], h))[0].norm())
    assert abs(shifted - true_change) < 4 * se + 1e-3, (shifted, true_change)


@pytest.mark.parametrize("h", accuracy.INTEGRANDS)
def test_integral_weighted_agrees_with_resampled_and_batches(h):
    x, lw = is_cloud(MEAN3, COV3, 20000, 52)
    weighted = float(accuracy.integral_discrepancy(x, MEAN3, COV3, h, q_log_weights=lw, **kwargs(h)))
    resampled = float(accuracy.integral_discrepancy(resample(x, lw, 20000, 53), MEAN3, COV3, h, **kwargs(h)))
    sd = math.sqrt(float(h_values(sample(MEAN3, COV3, 5000, 54), h).var(0).sum()))
    tol = 5 * sd / math.sqrt(5000)  # errors of a few × 1/sqrt(ESS ≈ 5–10k)
    assert weighted < tol and resampled < tol and abs(weighted - resampled) < tol, (weighted, resampled, tol)
    xs = torch.stack([x[:1000], x[1000:2000]])
    lws = torch.stack([lw[:1000], lw[1000:2000]])
    got = accuracy.integral_discrepancy(xs, MEAN3, COV3, h, q_log_weights=lws, **kwargs(h))
    loop = [accuracy.integral_discrepancy(xs[b], MEAN3, COV3, h, q_log_weights=lws[b], **kwargs(h)) for b in range(2)]
    assert got.shape == (2,)
    torch.testing.assert_close(got, torch.stack(loop), rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------------------------------------ moments


def test_moment_errors_hand_computed():
    mean_q = torch.tensor([1.0, 2.0])  # float32 inputs are cast to float64
    mean_p = torch.tensor([0.0, 0.0])
    cov_p = torch.tensor([[4.0, 0.3], [0.3, 1.0]], dtype=F64)
    cov_q = torch.tensor([[2.0, 0.0], [0.0, 3.0]])
    # z = (1/2, 2/1) → sqrt((0.25 + 4) / 2)
    assert float(accuracy.mean_error_sd(mean_q, mean_p, cov_p)) == pytest.approx(math.sqrt(2.125), rel=1e-12)
    torch.testing.assert_close(accuracy.variance_ratio(cov_q, cov_p), torch.tensor([0.5, 3.0], dtype=F64))
    dm, dc = accuracy.mean_cov_errors(mean_q, cov_q, mean_p, cov_p)
    assert float(dm) == pytest.approx(math.sqrt(5.0), rel=1e-12)
    assert float(dc) == pytest.approx(math.sqrt(2.0**2 + 2 * 0.3**2 + 2.0**2), rel=1e-12)
    assert dm.dtype == F64 and dc.dtype == F64
    # batched over leading dims [2, 3]
    mq = mean_q.expand(2, 3, 2) * torch.arange(1, 4, dtype=torch.float32)[None, :, None]
    got = accuracy.mean_error_sd(mq, mean_p, cov_p)
    assert got.shape == (2, 3)
    torch.testing.assert_close(got[1], math.sqrt(2.125) * torch.arange(1, 4, dtype=F64))
    assert accuracy.variance_ratio(cov_q.expand(4, 2, 2), cov_p).shape == (4, 2)
    assert accuracy.mean_cov_errors(mq, cov_q.expand(2, 3, 2, 2), mean_p, cov_p)[1].shape == (2, 3)


def test_particle_moments_reuse_gaussian_moments():
    x = sample(MEAN3, COV3, 100, 60).float()
    lw = torch.randn(100, generator=rng.generator(4))
    m, c = accuracy.particle_moments(x, lw)
    assert m.shape == (3,) and c.shape == (3, 3) and m.dtype == F64
    m_ref, c_ref = gaussian.moments(x[None].double(), lw[None].double())
    torch.testing.assert_close(m, m_ref[0])
    torch.testing.assert_close(c, c_ref[0])
    mb, cb = accuracy.particle_moments(torch.stack([x, x]))
    assert mb.shape == (2, 3) and cb.shape == (2, 3, 3)


# ------------------------------------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda: accuracy.mmd2(torch.zeros(5), torch.zeros(5, 1)), "x"),
        (lambda: accuracy.mmd2(torch.zeros(5, 2), torch.zeros(5, 3)), "y"),
        (lambda: accuracy.mmd2(torch.zeros(5, 2), torch.zeros(5, 2), bandwidths=[1.0, -1.0]), "bandwidths"),
        (
            lambda: accuracy.mmd2(torch.zeros(5, 2), torch.zeros(5, 2), x_log_weights=torch.zeros(4)),
            "x_log_weights",
        ),
        (lambda: accuracy.kde_log_density(torch.zeros(3, 2), torch.zeros(5, 2), bandwidth=[1.0]), "bandwidth"),
        (lambda: accuracy.kde_log_density(torch.zeros(3, 2), torch.full((5, 2), math.nan)), "particles"),
        (lambda: accuracy.integral_discrepancy(torch.zeros(5, 2), torch.zeros(2), torch.eye(2), "cubic"), "h"),
        (
            lambda: accuracy.integral_discrepancy(torch.zeros(5, 2), torch.zeros(2), torch.eye(2), "quadratic"),
            "A",
        ),
        (lambda: accuracy.integral_discrepancy(torch.zeros(5, 2), torch.zeros(3), torch.eye(2)), "p_mean"),
        (lambda: accuracy.mean_error_sd(torch.zeros(2), torch.zeros(2), -torch.eye(2)), "cov_p"),
    ],
)
def test_bad_input_raises_value_error_naming_the_field(call, field):
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        call()

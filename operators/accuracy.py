"""Accuracy metrics: how far a particle cloud q is from a posterior p (MPF paper §5 and App. C.1).

Everything is computed in float64 (inputs are cast). Sample-based metrics take ``[N, d]`` or batched
``[B, N, d]`` clouds and return a scalar or ``[B]``; a 2-D argument is broadcast against a 3-D one
(e.g. one set of reference samples against B clouds). Particles may carry log importance weights
``[N]`` / ``[B, N]`` (self-normalised: w = softmax(log w)); ``-inf`` marks a particle of weight 0.

Metrics (MPF = Chen et al., "Meta Particle Flow for Sequential Bayesian Inference", §5, App. C.1
(ICML 2019)):

* **MMD²** (Gretton et al., JMLR 2012, "A kernel two-sample test"; MPF App. C.1)

      MMD²[p, q] = E k(x, x') − 2 E k(x, y) + E k(y, y'),   x, x' ~ q,  y, y' ~ p,

  with k a SUM of five RBF kernels k(x, y) = Σ_s exp(−‖x − y‖² / (2 h_s²)), h_s = c_s · median pairwise
  distance of the pooled sample, c_s ∈ (0.25, 0.5, 1, 2, 4). The estimator is the UNBIASED U-statistic
  (Gretton et al. eq. 3: the i = j terms of the two within-sample sums are dropped), as the MPF reference
  code does; it can be slightly negative when p = q. With weights w on x the within-x term is
  Σ_{i≠j} w_i w_j k_ij / (1 − Σ_i w_i²) (the U-statistic for uniform w); ``unbiased=False`` gives the
  V-statistic Σ_ij w_i w_j k_ij (then weights with integer ratios equal duplicated particles exactly).
  Note: the MPF reference code (pfbayes/common/metric.py, ``square_mmd_fine``) reports MMD² for five
  kernel *types* (gaussian, laplacian, sigmoid, polynomial, cosine; sklearn defaults); its Gaussian one is
  the single kernel exp(−‖x − y‖² / d), i.e. ``bandwidths=[sqrt(d / 2)]`` here.

* **KDE** (MPF eq. 20, with a per-dimension bandwidth as the reference code uses)

      q̂(y) = Σ_i w_i Π_d N(y_d; x_{i,d}, h_d²),   h_d = (4 / ((d + 2) n))^{1/(d+4)} σ_d     (Silverman),

  σ_d² the (weighted, 1/N) particle variance of dimension d, n the effective sample size 1 / Σ w_i²
  (= N for equal weights). Evaluated in the log domain with logsumexp. (The reference code's σ_d is the
  N − 1 standard deviation; the difference is a factor sqrt(N / (N − 1)).)

* **Cross-entropy** (MPF eq. 30): H(p, q̂) = −E_{y~p} log q̂(y) ≈ −(1/M) Σ_m log q̂(y_m), y_m ~ p
  (the reference code uses M = max(5000, 10 N) samples of the exact posterior). H(p, q̂) ≥ H(p), with
  equality only for q̂ = p; for a Gaussian p, H(p) = ½ log|2πeΣ|.

* **Integral discrepancy** (MPF §5, App. C.1): |E_q h − E_p h| (‖·‖₂ for vector h), p = N(μ, Σ):

      h(x) = x:                   E_p h = μ
      h(x) = xᵀAx:                E_p h = tr(AΣ) + μᵀAμ
      h(x) = (Ax + a)ᵀ(Bx + b):   E_p h = tr(AΣBᵀ) + (Aμ + a)ᵀ(Bμ + b).

  The same identities hold exactly for the empirical (weighted) measure of the particles with their
  weighted mean and 1/N covariance, so E_q h is computed from :func:`mpflow.operators.gaussian.moments`.

* **Moment errors**: mean error in posterior-sd units sqrt(mean_d ((m_q,d − m_p,d) / σ_p,d)²), the
  per-dimension variance ratio var_q,d / var_p,d, and (‖m_q − m_p‖₂, ‖C_q − C_p‖_F).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch
from mpflow.operators import gaussian
from mpflow.operators.validation import as_tensor

F64 = torch.float64
MMD_BANDWIDTH_FACTORS = (0.25, 0.5, 1.0, 2.0, 4.0)
MEDIAN_SUBSAMPLE = 1000  # the median heuristic uses at most this many evenly spaced pooled points
_CHUNK_ELEMENTS = 1 << 20  # pairwise blocks are computed in row chunks of about this many entries
INTEGRANDS = ("x", "quadratic", "bilinear")
_DOUBLING = all(b == 2 * a for a, b in itertools.pairwise(MMD_BANDWIDTH_FACTORS))


# ----------------------------------------------------------------------------------------------------------
# shape helpers


def _cloud(name: str, t) -> tuple[torch.Tensor, bool]:
    """A point set [N, d] or [B, N, d] as float64 [B, N, d] (B = 1 if not) and whether it was batched."""
    t = as_tensor(name, t, F64)
    if t.dim() not in (2, 3) or t.shape[-1] == 0 or t.shape[-2] == 0:
        raise ValueError(f"{name}: expected shape [N, d] or [B, N, d] with N, d ≥ 1, got {list(t.shape)}")
    return (t if t.dim() == 3 else t[None]), t.dim() == 3


def _log_weights(name: str, lw, cloud: torch.Tensor, batched: bool) -> torch.Tensor | None:
    """Log weights [N] or [B, N] matching ``cloud`` [B, N, d], returned as [B, N] float64 (−inf allowed)."""
    if lw is None:
        return None
    lw = lw.to(F64) if isinstance(lw, torch.Tensor) else torch.as_tensor(lw, dtype=F64)
    lw = lw.to(cloud.device)
    want = cloud.shape[:2] if batched else cloud.shape[1:2]
    if tuple(lw.shape) != tuple(want) or torch.isnan(lw).any() or (lw == math.inf).any():
        raise ValueError(f"{name}: expected finite or -inf log weights of shape {list(want)}, got {list(lw.shape)}")
    if (lw == -math.inf).all(-1).any():
        raise ValueError(f"{name}: every weight of a cloud is zero")
    return lw if batched else lw[None]


def _broadcast(*ts: torch.Tensor | None) -> list[torch.Tensor | None]:
    """Expand batch dims of size 1 to the common batch size B."""
    sizes = {t.shape[0] for t in ts if t is not None} - {1}
    if len(sizes) > 1:
        raise ValueError(f"batch: inconsistent batch sizes {sorted(sizes)}")
    B = sizes.pop() if sizes else 1
    return [None if t is None else t.expand(B, *t.shape[1:]) for t in ts]


def _out(t: torch.Tensor, batched: bool) -> torch.Tensor:
    return t if batched else t[0]


def _weights(lw: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """Normalised weights [B, N] (uniform when ``lw`` is None)."""
    if lw is None:
        return torch.full(like.shape[:2], 1.0 / like.shape[1], dtype=F64, device=like.device)
    return torch.softmax(lw, dim=-1)


def _sq_dists(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """‖a_i − b_j‖² for a [B, n, d], b [B, m, d] → [B, n, m] (expanded form, clamped at 0)."""
    sq = (a * a).sum(-1)[:, :, None] + (b * b).sum(-1)[:, None, :]
    return torch.baddbmm(sq, a, b.transpose(-1, -2), alpha=-2.0).clamp_min_(0.0)


def _row_blocks(n: int, m: int, B: int) -> list[slice]:
    """Row slices of an [B, n, m] pairwise block, each with about ``_CHUNK_ELEMENTS`` entries."""
    step = max(1, _CHUNK_ELEMENTS // max(1, B * m))
    return [slice(i, i + step) for i in range(0, n, step)]


# ----------------------------------------------------------------------------------------------------------
# MMD²


def median_bandwidth(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Median heuristic: the median pairwise Euclidean distance of the pooled sample [x; y] → [B].

    x [B, N, d], y [B, M, d]; at most ``MEDIAN_SUBSAMPLE`` evenly spaced pooled points are used (so the
    cost stays O(1000²) whatever N and M are); the weights of weighted particles are ignored here."""
    z = torch.cat([x, y], dim=1)
    n = z.shape[1]
    if n > MEDIAN_SUBSAMPLE:
        z = z[:, torch.linspace(0, n - 1, MEDIAN_SUBSAMPLE, device=z.device).round().long()]
        n = MEDIAN_SUBSAMPLE
    z = z - z.mean(1, keepdim=True)
    iu = torch.triu_indices(n, n, offset=1, device=z.device)
    dist = _sq_dists(z, z)[:, iu[0], iu[1]].sqrt()
    return dist.median(dim=-1).values.clamp_min(1e-12)


def _rbf_sum(d2: torch.Tensor, gam: torch.Tensor, doubling: bool) -> torch.Tensor:
    """Σ_s exp(−γ_s d²) for d² [B, n, m], γ [B, S] (overwrites d²).

    With ``doubling`` (widths that double from one kernel to the next, γ_s = 4 γ_{s+1}) the narrower
    kernels are fourth powers of the wider ones: one exp and two squarings per kernel. Values are floored
    at 1e-75 before each squaring so that no subnormal numbers (very slow on CPUs) appear; this changes
    the kernel by less than 1e-75."""
    if not doubling:
        k = torch.zeros_like(d2)
        for s in range(gam.shape[1]):
            k += torch.exp(-gam[:, s, None, None] * d2)
        return k
    e = d2.mul_(gam[:, -1, None, None]).clamp_max_(172.0).neg_().exp_()
    k = e.clone()
    for _ in range(gam.shape[1] - 1):
        e.clamp_min_(1e-75).square_().square_()
        k += e
    return k


def _kernel_sum(
    a: torch.Tensor,
    wa: torch.Tensor,
    b: torch.Tensor | None,
    wb: torch.Tensor | None,
    gam: torch.Tensor,
    doubling: bool,
) -> torch.Tensor:
    """Σ_ij wa_i wb_j Σ_s exp(−γ_s ‖a_i − b_j‖²) → [B]; a [B, n, d], b [B, m, d], γ [B, S].

    ``b = None`` means b = a, wb = wa: then only the blocks on and above the diagonal are computed."""
    total = torch.zeros(a.shape[0], dtype=F64, device=a.device)
    symmetric = b is None
    b, wb = (a, wa) if symmetric else (b, wb)
    for rows in _row_blocks(a.shape[1], b.shape[1], a.shape[0]):
        cols = slice(rows.start if symmetric else 0, None)
        wcol = wb[:, cols]
        if symmetric:  # columns right of this row block stand for themselves and their mirror image
            wcol = wcol.clone()
            wcol[:, rows.stop - rows.start :] *= 2.0
        k = _rbf_sum(_sq_dists(a[:, rows], b[:, cols]), gam, doubling)
        total += (wa[:, rows] * (k @ wcol[:, :, None])[:, :, 0]).sum(-1)
    return total


def mmd2(
    x,
    y,
    bandwidths: Sequence[float] | torch.Tensor | None = None,
    x_log_weights=None,
    *,
    unbiased: bool = True,
) -> torch.Tensor:
    """Squared MMD between the (weighted) cloud x and the sample y, with a sum of RBF kernels.

    x [N, d] or [B, N, d] (the particles, optionally weighted by ``x_log_weights`` [N] / [B, N]),
    y [M, d] or [B, M, d] (e.g. samples of the exact posterior). ``bandwidths``: the kernel widths h_s,
    a sequence / tensor [S] or [B, S]; default: median heuristic × (0.25, 0.5, 1, 2, 4).
    Unbiased U-statistic by default (see the module docstring). Returns a scalar or [B]."""
    xb, x_batched = _cloud("x", x)
    yb, y_batched = _cloud("y", y)
    if xb.shape[-1] != yb.shape[-1]:
        raise ValueError(f"y: dimension {yb.shape[-1]} differs from x's {xb.shape[-1]}")
    lw = _log_weights("x_log_weights", x_log_weights, xb, x_batched)
    xb, yb, lw = _broadcast(xb, yb, lw)
    batched = x_batched or y_batched
    B = xb.shape[0]
    if unbiased and yb.shape[1] < 2:
        raise ValueError("y: the unbiased MMD² needs at least 2 samples")
    shift = yb.mean(1, keepdim=True)  # MMD is shift invariant; centring improves the expanded distances
    xb, yb = xb - shift, yb - shift

    if bandwidths is None:
        h = median_bandwidth(xb, yb)[:, None] * torch.tensor(MMD_BANDWIDTH_FACTORS, dtype=F64, device=xb.device)
    else:
        h = as_tensor("bandwidths", bandwidths, F64).to(xb.device)
        if h.dim() == 1:
            h = h[None].expand(B, -1)
        if h.dim() != 2 or h.shape[0] != B or h.shape[1] == 0 or (h <= 0).any():
            raise ValueError(f"bandwidths: expected positive widths of shape [S] or [{B}, S], got {list(h.shape)}")
    gam = 0.5 / h**2
    n_kernels = h.shape[1]

    wx = _weights(lw, xb)
    wy = _weights(None, yb)
    doubling = bandwidths is None and _DOUBLING
    kxx = _kernel_sum(xb, wx, None, None, gam, doubling)
    kyy = _kernel_sum(yb, wy, None, None, gam, doubling)
    kxy = _kernel_sum(xb, wx, yb, wy, gam, doubling)
    if unbiased:  # drop the i = j terms (k(x, x) = n_kernels exactly) and renormalise
        sx = (wx * wx).sum(-1)
        if (sx > 1 - 1e-12).any():
            raise ValueError("x: the unbiased MMD² needs at least 2 particles of nonzero weight")
        kxx = (kxx - n_kernels * sx) / (1 - sx)
        sy = 1.0 / yb.shape[1]
        kyy = (kyy - n_kernels * sy) / (1 - sy)
    return _out(kxx + kyy - 2 * kxy, batched)


# ----------------------------------------------------------------------------------------------------------
# KDE and cross-entropy


def silverman_bandwidth(particles, log_weights=None) -> torch.Tensor:
    """Per-dimension Silverman bandwidth h_d = (4 / ((d + 2) n))^{1/(d+4)} σ_d → [d] or [B, d].

    σ_d² from the weighted 1/N covariance (:func:`particle_moments`), n = 1 / Σ w_i² (effective size)."""
    xb, batched = _cloud("particles", particles)
    lw = _log_weights("log_weights", log_weights, xb, batched)
    _, cov = gaussian.moments(xb, lw)
    w = _weights(lw, xb)
    n_eff = 1.0 / (w * w).sum(-1)  # [B]
    d = xb.shape[-1]
    factor = (4.0 / ((d + 2) * n_eff)) ** (1.0 / (d + 4))
    sd = torch.diagonal(cov, dim1=-2, dim2=-1).clamp_min(1e-300).sqrt()
    return _out(factor[:, None] * sd, batched)


def kde_log_density(points, particles, bandwidth=None, log_weights=None) -> torch.Tensor:
    """log q̂(y) of the Gaussian KDE of ``particles`` at ``points`` (MPF eq. 20, diagonal bandwidth).

    points [M, d] or [B, M, d]; particles [N, d] or [B, N, d]; ``bandwidth``: None (per-dimension
    Silverman, :func:`silverman_bandwidth`), a number, or a tensor [d] / [B, d]; ``log_weights`` [N] /
    [B, N]. Returns [M] or [B, M]."""
    yb, y_batched = _cloud("points", points)
    xb, x_batched = _cloud("particles", particles)
    if xb.shape[-1] != yb.shape[-1]:
        raise ValueError(f"points: dimension {yb.shape[-1]} differs from the particles' {xb.shape[-1]}")
    lw = _log_weights("log_weights", log_weights, xb, x_batched)
    d = xb.shape[-1]
    batched = x_batched or y_batched
    if bandwidth is None:
        h = silverman_bandwidth(xb, lw)  # [Bx, d]
    else:
        h = as_tensor("bandwidth", bandwidth, F64).to(xb.device)
        h = h.expand(d) if h.dim() == 0 else h
        batched = batched or h.dim() == 2
        h = h[None] if h.dim() == 1 else h
        if h.dim() != 2 or h.shape[-1] != d or (h <= 0).any():
            raise ValueError(f"bandwidth: expected a positive number or widths [d] / [B, d], got {list(h.shape)}")
    yb, xb, lw, h = _broadcast(yb, xb, lw, h)
    if lw is None:
        log_w = torch.full(xb.shape[:2], -math.log(xb.shape[1]), dtype=F64, device=xb.device)
    else:
        log_w = torch.log_softmax(lw, -1)
    center = xb.mean(1, keepdim=True)
    zx = (xb - center) / h[:, None, :]
    zy = (yb - center) / h[:, None, :]
    log_norm = -torch.log(h).sum(-1) - 0.5 * d * gaussian.LOG_2PI  # [B]
    out = []
    for rows in _row_blocks(zy.shape[1], zx.shape[1], zy.shape[0]):
        d2 = _sq_dists(zy[:, rows], zx)  # [B, m, N]
        out.append(torch.logsumexp(log_w[:, None, :] - 0.5 * d2, dim=-1))
    return _out(torch.cat(out, dim=1) + log_norm[:, None], batched)


def cross_entropy(p_samples, q_particles, q_log_weights=None, bandwidth=None) -> torch.Tensor:
    """H(p, q̂) = −(1/M) Σ_m log q̂(y_m), y_m ~ p, q̂ the KDE of the q particles (MPF eq. 30).

    p_samples [M, d] or [B, M, d]; q_particles [N, d] or [B, N, d]. Returns a scalar or [B]."""
    return -kde_log_density(p_samples, q_particles, bandwidth, q_log_weights).mean(-1)


# ----------------------------------------------------------------------------------------------------------
# integral discrepancies


def _expectation(h: str, mean: torch.Tensor, cov: torch.Tensor, A, a, Bm, b) -> torch.Tensor:
    """E h under any law with mean [.., d] and covariance [.., d, d] (the closed forms of the docstring)."""
    if h == "x":
        return mean
    if h == "quadratic":
        quad = (mean[..., None, :] @ A @ mean[..., :, None])[..., 0, 0]
        return torch.diagonal(A @ cov, dim1=-2, dim2=-1).sum(-1) + quad
    ua = (A @ mean[..., :, None])[..., 0] + a
    ub = (Bm @ mean[..., :, None])[..., 0] + b
    return torch.diagonal(A @ cov @ Bm.transpose(-1, -2), dim1=-2, dim2=-1).sum(-1) + (ua * ub).sum(-1)


def integral_discrepancy(
    q_particles,
    p_mean,
    p_cov,
    h: str = "x",
    A=None,
    a=None,
    Bm=None,
    b=None,
    q_log_weights=None,
) -> torch.Tensor:
    """|E_q h − E_p h| for p = N(p_mean, p_cov) in closed form and E_q h from the (weighted) particles.

    h = "x" (‖E_q x − μ‖₂), "quadratic" (xᵀAx, A [d, d] or [B, d, d]) or "bilinear" ((Ax + a)ᵀ(Bx + b),
    A, Bm [k, d] or [B, k, d], a, b [k] or [B, k]; a, b default to 0). q_particles [N, d] / [B, N, d],
    p_mean [d] / [B, d], p_cov [d, d] / [B, d, d]. Returns a scalar or [B]."""
    if h not in INTEGRANDS:
        raise ValueError(f"h: expected one of {INTEGRANDS}, got {h!r}")
    xb, batched = _cloud("q_particles", q_particles)
    d = xb.shape[-1]
    lw = _log_weights("q_log_weights", q_log_weights, xb, batched)
    mu = as_tensor("p_mean", p_mean, F64).to(xb.device)
    cov = as_tensor("p_cov", p_cov, F64).to(xb.device)
    if mu.shape[-1:] != (d,) or mu.dim() > 2:
        raise ValueError(f"p_mean: expected shape [{d}] or [B, {d}], got {list(mu.shape)}")
    if cov.shape[-2:] != (d, d) or cov.dim() > 3:
        raise ValueError(f"p_cov: expected shape [{d}, {d}] or [B, {d}, {d}], got {list(cov.shape)}")
    batched = batched or mu.dim() == 2 or cov.dim() == 3
    if h == "quadratic":
        if A is None:
            raise ValueError("A: required for h='quadratic'")
        A = as_tensor("A", A, F64).to(xb.device)
        if A.shape[-2:] != (d, d):
            raise ValueError(f"A: expected shape [{d}, {d}] or [B, {d}, {d}], got {list(A.shape)}")
    elif h == "bilinear":
        if A is None or Bm is None:
            raise ValueError("A: A and Bm are required for h='bilinear'")
        A, Bm = as_tensor("A", A, F64).to(xb.device), as_tensor("Bm", Bm, F64).to(xb.device)
        if A.shape[-1] != d or A.dim() not in (2, 3):
            raise ValueError(f"A: expected shape [k, {d}] or [B, k, {d}], got {list(A.shape)}")
        if Bm.shape[-2:] != A.shape[-2:] or Bm.dim() not in (2, 3):
            raise ValueError(f"Bm: expected shape [{A.shape[-2]}, {d}] like A, got {list(Bm.shape)}")
        k = A.shape[-2]
        a = torch.zeros(k, dtype=F64, device=xb.device) if a is None else as_tensor("a", a, F64).to(xb.device)
        b = torch.zeros(k, dtype=F64, device=xb.device) if b is None else as_tensor("b", b, F64).to(xb.device)
        for name, v in (("a", a), ("b", b)):
            if v.shape[-1:] != (k,) or v.dim() > 2:
                raise ValueError(f"{name}: expected shape [{k}] or [B, {k}], got {list(v.shape)}")
        batched = batched or Bm.dim() == 3 or a.dim() == 2 or b.dim() == 2
    batched = batched or (A is not None and A.dim() == 3)
    m_q, c_q = gaussian.moments(xb, lw)  # [Bx, d], [Bx, d, d]
    diff = _expectation(h, m_q, c_q, A, a, Bm, b) - _expectation(h, mu, cov, A, a, Bm, b)
    err = torch.linalg.vector_norm(diff, dim=-1) if h == "x" else diff.abs()  # [B] (B = 1 if unbatched)
    return err if batched else err[0]


# ----------------------------------------------------------------------------------------------------------
# moment errors


def particle_moments(particles, log_weights=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted mean and 1/N covariance of a cloud in float64 (:func:`mpflow.operators.gaussian.moments`).

    particles [N, d] → ([d], [d, d]); [B, N, d] → ([B, d], [B, d, d])."""
    xb, batched = _cloud("particles", particles)
    lw = _log_weights("log_weights", log_weights, xb, batched)
    m, c = gaussian.moments(xb, lw)
    return _out(m, batched), _out(c, batched)


def _pair(name_q: str, q, name_p: str, p, event_dims: int) -> tuple[torch.Tensor, torch.Tensor]:
    q, p = as_tensor(name_q, q, F64), as_tensor(name_p, p, F64)
    if q.dim() < event_dims or p.dim() < event_dims:
        raise ValueError(f"{name_q}: expected at least {event_dims} dimensions, got {list(q.shape)}")
    if q.shape[-event_dims:] != p.shape[-event_dims:]:
        raise ValueError(f"{name_q}: shape {list(q.shape)} does not match {name_p} {list(p.shape)}")
    return q, p


def _marginal_sd(cov_p: torch.Tensor) -> torch.Tensor:
    var = torch.diagonal(cov_p, dim1=-2, dim2=-1)
    if (var <= 0).any():
        raise ValueError("cov_p: diagonal entries (variances) must be positive")
    return var.sqrt()


def mean_error_sd(mean_q, mean_p, cov_p) -> torch.Tensor:
    """sqrt(mean_d ((m_q,d − m_p,d) / σ_p,d)²), σ_p,d = sqrt(cov_p[d, d]) (RMS error in sd units) → [...]."""
    mean_q, mean_p = _pair("mean_q", mean_q, "mean_p", mean_p, 1)
    cov_p = as_tensor("cov_p", cov_p, F64)
    if cov_p.dim() < 2 or cov_p.shape[-2:] != (mean_p.shape[-1],) * 2:
        d = mean_p.shape[-1]
        raise ValueError(f"cov_p: expected shape [..., {d}, {d}], got {list(cov_p.shape)}")
    z = (mean_q - mean_p) / _marginal_sd(cov_p)
    return (z * z).mean(-1).sqrt()


def variance_ratio(cov_q, cov_p) -> torch.Tensor:
    """Per-dimension var_q,d / var_p,d → [..., d]."""
    cov_q, cov_p = _pair("cov_q", cov_q, "cov_p", cov_p, 2)
    return torch.diagonal(cov_q, dim1=-2, dim2=-1) / _marginal_sd(cov_p) ** 2


def mean_cov_errors(mean_q, cov_q, mean_p, cov_p) -> tuple[torch.Tensor, torch.Tensor]:
    """(‖m_q − m_p‖₂, ‖C_q − C_p‖_F), batched over leading dims."""
    mean_q, mean_p = _pair("mean_q", mean_q, "mean_p", mean_p, 1)
    cov_q, cov_p = _pair("cov_q", cov_q, "cov_p", cov_p, 2)
    return (
        torch.linalg.vector_norm(mean_q - mean_p, dim=-1),
        torch.linalg.matrix_norm(cov_q - cov_p, ord="fro"),
    )

"""The flow as the proposal of a marginal particle filter: importance weights against the exact mixture predictive
(Klaas, de Freitas & Doucet 2005, "Toward practical N² Monte Carlo: the marginal particle filter", UAI, §3 eq. 6),
the flow's Jacobian entering the proposal density as in Li & Coates 2017 ("Particle filtering with invertible
particle flow", IEEE TSP 65(15), Alg. 1: w ∝ p(x₁ | ·) p(o | x₁) |det ∂x₁/∂x̃| / p(x̃ | ·)).

A one-dimensional step (a factorised family runs its d dimensions as d such steps,
:meth:`~mpflow.operators.models.base.ModelFamily.per_dimension`), from the weighted cloud {x_j, w_j} of
p(x_{m−1} | o_<m) that the last step left (``factorised.carried``; uniform weights at the start and after
another method's step):

1. predict  x̃ᵢ ~ p̂(x) = Σ_j w_j p(x | x_j), the exact mixture predictive, by sequential quasi-Monte Carlo
            (:func:`mpflow.operators.sqmc.resample_move`, which resamples by the weights) with two independently
            shifted point sets, one per half of the points (:func:`mpflow.operators.sqmc.replicated_points`);
2. flow     each half is moment-matched onto the predictive's pushed moments and moved by the base flow
            (:mod:`~mpflow.operators.mpf.scalar_flow`): both affine, so the half's map is x₁ = α x̃ + β, read off
            its two clouds by least squares (exact for an affine map up to rounding; a relative residual above
            :data:`AFFINE_TOLERANCE` — a trained residual — leaves the stream without these weights). Each half's
            points then take the *other* half's map (:func:`crossed_maps`), so that no point's map depends on it;
3. weight   the second half of each half keeps its draw x̃ from p̂ (the defensive component: Hesterberg 1995;
            Owen & Zhou 2000, "Safe and effective importance sampling", JASA 95, eq. 4), the rest take their map;
            every point of a half is weighted against that half's mixture, q(x) = ½ p̂((x − β)/α)/|α| + ½ p̂(x)
            (1/|α| the map's Jacobian):
                wᵢ = p(o | xᵢ) p̂(xᵢ) / q(xᵢ),
            an importance sample of the posterior ∝ p(o | x) p̂(x) with the flow as proposal — not of a Gaussian fit
            to it — whose weights are bounded by 2 p(o | x) where the flow misses. The defensive share ½ was the
            best of ¼, ½ and 1 (1: the SQMC marginal filter without the flow) on the GBP/USD run (32 seeds, N = 256:
            sd of the total 0.123 / 0.106 / 0.110, of day 144's error 0.193 / 0.117 / 0.150, worst step 0.77 /
            0.26 / 0.46): the predictive's own draws are what puts weighted points in the posterior's upper tail,
            where the next outlier's evidence lives;
4. evidence log p(o_m | o_<m) ≈ log (1/N) Σᵢ wᵢ, unbiased for ∫ p(o | x) p̂(x) dx (each point is marginally its
            component's draw, and each half's map is independent of its points); over a stream the product of the
            increments is unbiased for p(o_1:m) (Klaas et al. §3), so the total's log may only sit slightly low.
            Its standard error, the carried cloud's share included, goes with it (:func:`log_evidence_sd`);
5. carry    the weighted points {xᵢ, wᵢ} to the next step's p̂ (``factorised.carry``), and give the stream N uniformly
            weighted particles for reads by systematic resampling of the sorted cloud
            (:func:`mpflow.operators.sqmc.sorted_systematic`). The next predict resamples the weighted cloud itself
            (step 1), so the reads' resampling adds no noise to the filter: on the GBP/USD run (N = 256, 32 seeds)
            the total's sd over seeds was 0.185 with the next step starting from the resampled copy, 0.123 from the
            weighted cloud.

Measured (docs/benchmarks.md "Anomaly scores"): against the exact mixture evidence of its own cloud it is within
0.011 nat at an 8-sd outlier (``tests/unit/test_sqmc.py``); on the GBP/USD run (32 seeds, N = 256) the estimator's
part of the total error (its increments less its cloud's exact mixture evidence) is +0.009, sd 0.056, and the
cloud's — the N weighted points standing for the posterior — carries the rest: what is left against an exact filter
is the N-particle cloud's, largest at the outlier of day 144.
Cost (:func:`work`): 2 N² transition densities per one-dimensional problem, one batched outer product
(:func:`mixture_pairs`), and a quarter of that again for the standard error (:func:`log_evidence_sd`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from mpflow.operators.models.base import ModelFamily

F64 = torch.float64
#: the largest relative residual of the least-squares affine fit x₁ ≈ α x̃ + β for which the map is taken as affine
AFFINE_TOLERANCE = 1e-4
#: the last 1 / DEFENSIVE_EVERY of each half of the points is drawn from the mixture predictive itself, not the flow
#: (the defensive component; ½, module docstring step 3)
DEFENSIVE_EVERY = 2


#: floating-point operations' worth of one pair of a point and a component of :func:`mixture_pairs` (a
#: product, a sum and an exponential in the float32 log-sum: about 24 counted) — measured, not counted, as
#: :data:`~mpflow.operators.updaters.base.PARTICLE_STEP_FLOPS` is: ``benchmarks/price_audit.py`` fits it from the
#: marginal ``mpf`` step of ``stochastic_volatility`` d = 1 at N = 7094 (the largest the defaults accepted at 24:
#: 0.57 to 0.83 s CPU, priced at an eighth of that), 131 to 204 at 25 Gflop/s in four runs on 2026-11-28
PAIR_FLOPS = 180.0
#: the error estimate's work per pair (:func:`log_evidence_sd`: an exponential in place and a product-sum), in pairs
#: of :data:`PAIR_FLOPS`: it added 11–14 % to the step of ``stochastic_volatility`` d = 1 at N = 256 (64 streams)
#: and N = 4096 (one stream) on 2026-11-29, a quarter of the step's 2 n² pairs
SHARE_PAIRS = 0.25
#: float32 [n, n] arrays per dimension held at a step's peak: the [2n, n] log-densities and as many temporaries —
#: measured, the peak RSS of one step of ``stochastic_volatility`` d = 1 rose 137 MB at N = 3000 and 549 MB at
#: N = 6000 over the process before it (3.8 and 3.8 n² float32 arrays; issue 54's +549 MB against a price of 275 MiB)
PAIR_COPIES = 4.0


def work(d: int, n: int) -> tuple[float, float]:
    """(flops, peak bytes) of one stream's weights (the cost model): per dimension 2 n² pairs of a point and a
    component (the mixture density at the weighted points and at their pre-images), :data:`PAIR_FLOPS` each, and
    :data:`SHARE_PAIRS` n² pairs' worth for the shares of the error estimate, and the sorts of the points and the
    cloud (20 n log₂ n each); the [2n, n] log-densities of every dimension in float32 (:func:`mixture_pairs`) and as
    many again for their log-sum's and the error estimate's temporaries (:data:`PAIR_COPIES`)."""
    flops = d * ((2.0 + SHARE_PAIRS) * n * n * PAIR_FLOPS + 2.0 * 20.0 * n * math.log2(max(n, 2)))
    return flops, PAIR_COPIES * 4.0 * d * n * n


class MarginalWeights(NamedTuple):
    """One step's unnormalised log-weights [R, N] (float64) and which rows had an affine map (the others' weights
    are zero: the caller keeps its own estimate there)."""

    log_weights: torch.Tensor
    affine: torch.Tensor
    #: the weighted points [R, N, 1]: x₁ and, at every DEFENSIVE_EVERY-th, the predicted draw
    points: torch.Tensor
    #: the standard error [R] of log (1/N) Σᵢ wᵢ as an estimate of the step's exact evidence, the carried cloud's
    #: share included (:func:`log_evidence_sd`); NaN where the row had no affine map
    log_sd: torch.Tensor


def mixture_log_density(
    model: ModelFamily, x: torch.Tensor, x_prev: torch.Tensor, prev_log_weights: torch.Tensor | None = None
) -> torch.Tensor:
    """log p̂(xᵢ) = log Σ_j w_j p(xᵢ | x_prev_j) for x [R, M, 1] and the cloud x_prev [R, N, 1] with ``prev_log_weights``
    [R, N] (None: uniform, w_j = 1/N) → [R, M] (float64): the log-sum-exp of :func:`mixture_pairs`."""
    pairs, rest = mixture_pairs(model, x, x_prev, prev_log_weights)
    return torch.logsumexp(pairs, -1).to(F64) + rest


def mixture_pairs(
    model: ModelFamily, x: torch.Tensor, x_prev: torch.Tensor, prev_log_weights: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The terms of log p̂(xᵢ) = log Σ_j w_j p(xᵢ | x_prev_j) for x [R, M, 1] and the cloud x_prev [R, N, 1] with
    ``prev_log_weights`` [R, N] (None: uniform, w_j = 1/N): the pairs [R, M, N] (float32) and the rest [R, M]
    (float64), log p̂(xᵢ) = logsumexp_j pairs_ij + rest_i; softmax_j pairs_ij is component j's share of p̂(xᵢ).
    One-dimensional: with x_m = f(x_{m−1}) + √Q ε and centred values x̄ = x − c, f̄_j = f(x_prev_j) − c (c the mean of
    the f_j),

        log p̂(x) = logsumexp_j (x̄ f̄_j / Q + log w_j − f̄_j² / 2Q) − x̄² / 2Q − ½ log 2πQ,

    so the [R, M, N] pairs are one batched outer product (``baddbmm``), in float32 — four passes over half the bytes
    where float64 squared differences took nine passes; the pairs are the step's whole cost at N = 256. The float32
    pairs are within 1e-5 nat of float64 (measured 6.5·10⁻⁶ over log-densities down to −134), far below the
    weights' Monte Carlo error. (The family's
    :meth:`~mpflow.operators.models.base.ModelFamily.transition_log_density` is the same density for any d.)"""
    m64 = model.to(F64)
    f = m64.transition_mean(x_prev.to(F64))[..., 0]  # [R, N]
    var = m64.transition_noise()[:, 0, :1]  # [R, 1]
    if prev_log_weights is None:
        log_w = torch.full_like(f, -math.log(x_prev.shape[1]))
    else:
        log_w = torch.log_softmax(prev_log_weights.to(F64), -1)
    centre = f.mean(-1, keepdim=True)
    fc, xc = f - centre, x.to(F64)[..., 0] - centre  # [R, N], [R, M]
    bias, slope = (log_w - 0.5 * fc.square() / var).float(), (fc / var).float()
    pairs = torch.baddbmm(bias[:, None, :], xc.float()[:, :, None], slope[:, None, :])
    return pairs, -0.5 * xc.square() / var - 0.5 * torch.log(2 * math.pi * var)


def log_evidence_sd(
    log_w: torch.Tensor, shares: torch.Tensor, prev_log_weights: torch.Tensor | None = None
) -> torch.Tensor:
    """The standard error [R] of log Ẑ, Ẑ = (1/M) Σᵢ ωᵢ, as an estimate of the step's exact evidence
    Z = ∫ p(o | x) p(x | o_<m) dx, from the weights ω = exp(``log_w``) [R, M] of the points xᵢ and the ``shares``
    [R, M, N] of the carried cloud's components {x_j, w_j} in their mixture predictive, r_ij = w_j p(xᵢ | x_j) /
    p̂(xᵢ) (the softmax over j of :func:`mixture_pairs`). Two parts, each
    by the delta method for independent draws:

    * the draws': Var(ω) / M, Ẑ's error against the cloud's own evidence Z_cloud = Σ_j w_j g(x_j),
      g(x′) = ∫ p(o | x) p(x | x′) dx (as :mod:`~mpflow.operators.mixture_evidence`);
    * the cloud's: the carried points are a self-normalised importance sample of p(x_{m−1} | o_<m), so Z_cloud's
      error against Z has variance ≈ Σ_j w_j² (g(x_j) − Z)² (the delta method for a ratio estimate:
      Owen 2013, "Monte Carlo theory, methods and examples", §9.2, self-normalised importance sampling). Each
      w_j g(x_j) is read off the same draws: c_j = (1/M) Σᵢ ωᵢ r_ij estimates it and Σ_j c_j = Ẑ exactly, so the
      variance is Σ_j (c_j − w_j Ẑ)².

    sd(log Ẑ) ≈ √(Var(ω)/M + Σ_j (c_j − w_j Ẑ)²) / Ẑ. The cloud's part is what the draws' sd alone misses: at an
    outlier the evidence lives in the tail of a few carried points. Measured on GBP/USD (N = 256, 64 seeds; docs/
    benchmarks.md "Anomaly scores") it is an upper estimate: the quasi-random points are better than independent
    draws, so it overstates the error's sd about 2 × at the outlier of day 144 and 3–4 × at ordinary steps, and
    every step whose error passed 0.1 nat but one reported at least 0.05. NaN where every ω is zero."""
    m, n = log_w.shape[1], shares.shape[2]
    omega = torch.exp(log_w - log_w.amax(-1, keepdim=True))  # [R, M], scaled so that the largest is 1
    z = omega.mean(-1)
    contribution = torch.bmm(omega.float()[:, None, :], shares)[:, 0].to(F64) / m  # [R, N]: c_j
    if prev_log_weights is None:
        w = torch.full_like(contribution, 1.0 / n)
    else:
        w = torch.softmax(prev_log_weights.to(F64), -1)
    cloud = (contribution - w * z[:, None]).square().sum(-1)
    return (omega.var(-1) / m + cloud).sqrt() / z


def affine_fit(x_pred: torch.Tensor, x1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(α [R], the relative residual [R]) of the least-squares fit x₁ ≈ α x̃ + β of the clouds [R, N, 1]."""
    a, b = x_pred[..., 0].to(F64), x1[..., 0].to(F64)
    ac, bc = a - a.mean(-1, keepdim=True), b - b.mean(-1, keepdim=True)
    alpha = (ac * bc).sum(-1) / (ac * ac).sum(-1)
    resid = (bc - alpha[:, None] * ac).square().mean(-1).sqrt() / bc.square().mean(-1).sqrt().clamp_min(1e-300)
    return alpha, resid


def crossed_maps(x_pred: torch.Tensor, x1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per point, the slope and offset [R, N] (float64) of the *other* half's flow: the two halves of the point set
    (its first and last N/2 points: each a net of its own, :func:`mpflow.operators.sqmc.resample_move`) were flowed
    as two clouds (x̃ → x₁, :func:`affine_fit` of each), and each half is given the map fitted to the other, so that
    no point's map depends on the point itself (a map fitted to its own points makes their weights look more even
    than they are)."""
    alpha, beta = torch.empty(x1.shape[:2], dtype=F64), torch.empty(x1.shape[:2], dtype=F64)
    for own, other in zip(halves(x1.shape[1]), reversed(halves(x1.shape[1])), strict=True):
        a, _ = affine_fit(x_pred[:, other], x1[:, other])
        b = x1[:, other, 0].to(F64).mean(-1) - a * x_pred[:, other, 0].to(F64).mean(-1)
        alpha[:, own], beta[:, own] = a[:, None], b[:, None]
    return alpha, beta


def halves(n: int) -> tuple[slice, slice]:
    """The first ⌈n / 2⌉ and the last ⌊n / 2⌋ points (the two independent replicates of the quasi-random points,
    :func:`mpflow.operators.sqmc.replicated_points`)."""
    return slice(0, -(-n // 2)), slice(-(-n // 2), n)


def defensive_mask(n: int) -> torch.Tensor:
    """[n] bool: the last ⌊m / :data:`DEFENSIVE_EVERY`⌋ points of each half of m points
    (:func:`halves`), the points that keep their predicted draw. Each half is then, by itself, the deterministic
    mixture that its weights' proposal density describes (Owen & Zhou 2000, eq. 4: a fraction a of the draws
    from the flow, 1 − a from the predictive); they are the tail of the half's Sobol' block, a net of its
    own for a power-of-two half."""
    mask = torch.zeros(n, dtype=torch.bool)
    for h in halves(n):
        m = len(range(n)[h])
        mask[h.start + m - m // DEFENSIVE_EVERY : h.start + m] = True
    return mask


def log_weights(
    model: ModelFamily,
    obs: torch.Tensor,
    x_prev: torch.Tensor,
    x_pred: torch.Tensor,
    x1: torch.Tensor,
    prev_log_weights: torch.Tensor | None = None,
) -> MarginalWeights:
    """Steps 2–3 of the module docstring for R one-dimensional problems: ``model`` of batch R, obs [R, 1], the previous
    cloud x_prev [R, N, 1] with its ``prev_log_weights`` [R, N] (None: uniform), the predicted draws x̃ = x_pred
    [R, N, 1] and x₁, the flowed halves (:func:`crossed_maps`). The last points of each half
    (:func:`defensive_mask`) keeps its predicted draw x̃; the others take their crossed map, and every point of a
    half is weighted by the density of that half's own mixture,

        q_h(x) = a p̂((x − β_h) / α_h) / |α_h| + (1 − a) p̂(x),    wᵢ = p(o | xᵢ) p̂(xᵢ) / q_h(xᵢ)      (Owen & Zhou eq. 4)

    with a the half's flowed share and (α_h, β_h) the map fitted to the *other* half, independent of these points:
    so (1/m) Σ_{i∈h} wᵢ is unbiased for ∫ p(o | x) p̂(x) dx (Klaas et al. 2005 eq. 6 with proposal q_h), and so is
    the mean over both halves. The two mixture densities (at the points and their pre-images) are one batched
    evaluation."""
    n = x1.shape[1]
    resid = torch.stack([affine_fit(x_pred[:, h], x1[:, h])[1] for h in halves(n)]).amax(0)
    alpha, beta = crossed_maps(x_pred, x1)
    affine = (resid < AFFINE_TOLERANCE) & torch.isfinite(alpha).all(-1) & (alpha != 0).all(-1)
    defensive = defensive_mask(n)
    share = torch.empty(n, dtype=F64)  # a: the flowed share of each point's half
    for h in halves(n):
        share[h] = 1.0 - float(defensive[h].sum()) / len(range(n)[h])
    pred = x_pred.to(F64)
    x = torch.where(defensive[None, :, None], pred, alpha[..., None] * pred + beta[..., None]).to(x1.dtype)
    pre = (x.to(F64) - beta[..., None]) / alpha[..., None]  # the map's pre-image of each point
    pairs, rest = mixture_pairs(model, torch.cat([x.to(F64), pre], 1), x_prev, prev_log_weights)
    total = torch.logsumexp(pairs, -1)
    both = total.to(F64) + rest
    log_mix, log_flow = both[:, :n], both[:, n:] - torch.log(alpha.abs())
    log_q = torch.logaddexp(torch.log(share) + log_flow, torch.log1p(-share) + log_mix)
    ll = torch.nan_to_num(model.log_likelihood(obs, x).to(F64), nan=-math.inf)
    log_w = torch.nan_to_num(ll + log_mix - log_q, nan=-math.inf, posinf=-math.inf)
    log_w = torch.where(affine[:, None], log_w, torch.full_like(log_w, -math.inf))
    shares = pairs[:, :n].sub_(total[:, :n, None]).exp_()  # in place: the pairs are not read again
    return MarginalWeights(log_w, affine, x, log_evidence_sd(log_w, shares, prev_log_weights))

"""The flows' log-evidence without the Gaussian floor: defensive importance sampling of the exact mixture predictive.

A flow maps its predicted cloud onto the predictive's Gaussian fit N(m, C) and reports that Gaussian's evidence
(:func:`~mpflow.operators.evidence.gaussian_fit`): on the GBP/USD returns under SV even an exact-moment Gaussian
filter is 0.37 nat low in total and 0.13 nat low at the largest outlier — the filter's predictive is not Gaussian.
The predictive the step's particles stand for is the mixture over the previous cloud {x_i, w_i},

    p̂(x) = Σ_i w_i p(x | x_i)                                    (the transition density, ModelFamily),

and the step's evidence p(o | o_<m) ≈ Z = ∫ p(o | x) p̂(x) dx. It is estimated by importance sampling,

    Z ≈ (1/M) Σ_j ω_j,   ω_j = p(o | x_j) p̂(x_j) / q(x_j),   x_j ~ q,

with a *defensive* proposal (Hesterberg 1995; Owen & Zhou 2000, "Safe and effective importance sampling", JASA
95, eq. 4 and Theorem 1): q = α N(m₁, ρ² C₁) + (1 − α) N(m, C), N(m₁, C₁) the Gaussian fitted to the flowed
(posterior) cloud, its covariance inflated by ρ², and the predictive's Gaussian fit N(m, C) as the defensive
component, which bounds ω_j / Z by about p(o | x_j)/((1 − α) Z) wherever p̂ ≈ N(m, C). The flow has already found
where p(o | x) p̂(x) lives — the posterior — so the weights have small variance even at an outlier, where the
particle average log mean_i p(o | x_i) collapses. The draws come in fixed numbers αM and (1 − α)M from the two
components, weighted by the mixture density (Owen & Zhou §3: the deterministic allocation of a mixture sample,
unbiased, with smaller variance than drawing the component at random).

Its own error. The delta method gives the standard error of log Z from the weights' sample moments,

    sd(log Ẑ) ≈ √(Var(ω) / (M · mean(ω)²)),

reported with each step (``log_evidence_sd``); Jensen's bias of log Ẑ is about −sd²/2.

Cost (:func:`work`): M N transition densities per stream (M draws against N mixture components; one [M, d] × [d, N]
product, :meth:`~mpflow.operators.models.base.ModelFamily.transition_log_density`) and M likelihoods. Above
:data:`MAX_COMPONENTS` components the mixture is read from an evenly strided subset of the previous cloud (its
weights renormalised) and M is capped at :data:`MAX_DRAWS`; a family without a transition density (static, or a
deterministic transition) keeps the Gaussian fit's evidence.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from mpflow.operators import evidence, gaussian
from mpflow.operators.rng import Generators, side_streams
from mpflow.operators.smoothing.backward_simulation import KERNEL_TERM_FLOPS

#: the share α of the draws from the flowed cloud's (inflated) Gaussian; the rest come from the predictive's fit
POSTERIOR_SHARE = 0.75
#: ρ: the flowed cloud's Gaussian fit is widened by ρ² in covariance, so its tails cover the posterior's
INFLATION = 1.5
#: at most this many draws M per stream (M = N below it)
MAX_DRAWS = 1024
#: at most this many components of the mixture predictive (a strided subset of a larger cloud)
MAX_COMPONENTS = 1024
#: the tag of the side stream the draws come from (:func:`~mpflow.operators.rng.side_streams`)
SIDE_STREAM_TAG = 0x45564944  # "EVID"


def work(model, n: int) -> tuple[float, float]:
    """(flops, peak bytes) of one stream's estimate for a cloud of ``n`` (the cost model,
    :meth:`~mpflow.operators.updaters.base.Updater.step_work`): M × K pairs of draws and components (M ≤
    :data:`MAX_DRAWS`, K ≤ :data:`MAX_COMPONENTS`), each a transition log-density in the log-sum priced as the
    smoothers' kernel term (:data:`~mpflow.operators.smoothing.backward_simulation.KERNEL_TERM_FLOPS`: about
    2 d + 20 are counted, the rest is memory traffic over the [M, K] pairs; it was priced 2 d + 20, which
    ``benchmarks/price_audit.py`` measured at an eighth of its time at N = 1024, d = 8; its own fit there was 260
    to 456 at 25 Gflop/s in four runs on 2026-11-28, about the kernel term's 330), K transition means,
    M likelihoods and the two proposal densities; the [M, K] log-densities in float64, twice (the pairs and their
    weighted sum)."""
    d, m, k = model.state_dim, min(n, MAX_DRAWS), min(n, MAX_COMPONENTS)
    flops = m * k * KERNEL_TERM_FLOPS + k * model.transition_flops() + m * (model.likelihood_flops() + 8.0 * d * d)
    return flops, 16.0 * m * k


def _strided(x: torch.Tensor, log_weights: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The previous cloud [B, N, d] and its normalised log weights [B, N], as at most :data:`MAX_COMPONENTS`
    evenly strided components (weights renormalised)."""
    B, N, _ = x.shape
    lw = torch.full((B, N), -math.log(N), dtype=torch.float64) if log_weights is None else log_weights.double()
    if N > MAX_COMPONENTS:
        idx = torch.linspace(0, N - 1, MAX_COMPONENTS).round().long()
        x, lw = x[:, idx], lw[:, idx]
    return x, torch.log_softmax(lw, -1)


class MixtureEvidence(NamedTuple):
    """One step's estimate: log Ẑ [B], its delta-method sd [B], and the weighted draws that stand for the exact
    posterior given the mixture predictive (draws [B, M, d], normalised log weights [B, M])."""

    log_z: torch.Tensor
    sd: torch.Tensor
    draws: torch.Tensor
    log_weights: torch.Tensor


def defensive_evidence(
    model,
    obs: torch.Tensor,
    x_prev: torch.Tensor,
    prev_log_weights: torch.Tensor | None,
    posterior: torch.Tensor,
    predictive: tuple[torch.Tensor, torch.Tensor],
    gens: Generators,
) -> MixtureEvidence | None:
    """The step's :class:`MixtureEvidence` (module docstring) from the previous cloud x_prev [B, N, d] (log
    weights, None: uniform), the flowed
    cloud ``posterior`` [B, N', d] and the predictive's Gaussian fit ``predictive`` (mean [B, d], cov [B, d, d]);
    the draws come from a side stream of each stream's generator (its counter is not advanced). None where the
    family has no transition density (the caller keeps its Gaussian-fit evidence)."""
    B, N, d = x_prev.shape
    comps, comp_lw = _strided(x_prev, prev_log_weights)
    M = min(posterior.shape[1], MAX_DRAWS)
    m_post, c_post = gaussian.moments(posterior.detach().double())
    l_post = gaussian.cholesky(c_post * INFLATION**2, jitter=1e-9)
    m_pred, c_pred = (t.double() for t in predictive)
    l_pred = gaussian.cholesky(c_pred, jitter=1e-9)
    m1 = round(POSTERIOR_SHARE * M)
    z = torch.stack([torch.randn(M, d, generator=g, dtype=torch.float64) for g in side_streams(gens, SIDE_STREAM_TAG)])
    xs = torch.cat(
        [
            m_post[:, None] + z[:, :m1] @ l_post.transpose(-1, -2),
            m_pred[:, None] + z[:, m1:] @ l_pred.transpose(-1, -2),
        ],
        1,
    )  # [B, M, d]
    log_pairs = model.transition_log_density(xs, comps)
    if log_pairs is None:
        return None
    log_mix = torch.logsumexp(log_pairs + comp_lw[:, None, :], -1)  # log p̂(x_j) [B, M]
    log_fit = gaussian.log_prob(xs, m_pred, l_pred)  # the predictive's Gaussian fit: defensive part, control variate
    log_q = torch.logaddexp(
        math.log(POSTERIOR_SHARE) + gaussian.log_prob(xs, m_post, l_post), math.log1p(-POSTERIOR_SHARE) + log_fit
    )
    ll = model.to(torch.float64).log_likelihood(obs.double(), xs)
    log_w = torch.nan_to_num(ll + log_mix - log_q, nan=-math.inf)
    posterior_lw = torch.log_softmax(log_w, -1)
    exact_fit = evidence.gaussian_fit(model, obs, m_pred, c_pred)
    if exact_fit is None:
        top = log_w.max(-1, keepdim=True).values
        w = torch.exp(log_w - top)  # ω_j / max ω
        mean_w = w.mean(-1)
        sd = (w.var(-1, correction=1) / (M * mean_w.square())).sqrt()
        return MixtureEvidence(torch.log(mean_w) + top[:, 0], sd, xs, posterior_lw)
    # the ratio to the Gaussian fit's own estimate from the same draws, times its exact value (a control variate)
    log_g = torch.nan_to_num(ll + log_fit - log_q, nan=-math.inf)
    top = torch.maximum(log_w.max(-1, keepdim=True).values, log_g.max(-1, keepdim=True).values)
    w, g = torch.exp(log_w - top), torch.exp(log_g - top)
    mw, mg = w.mean(-1), g.mean(-1)
    sd = ((w / mw[:, None] - g / mg[:, None]).var(-1, correction=1) / M).sqrt()
    return MixtureEvidence(exact_fit + torch.log(mw) - torch.log(mg), sd, xs, posterior_lw)

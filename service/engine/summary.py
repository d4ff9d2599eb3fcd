"""Posterior summaries and draws of one stream's state (docs/API.md "the stream document", "samples").

A state represents its posterior either exactly — the ``kalman`` method keeps the filtering Gaussian
N(m, P) in ``extras["mean"]``/``extras["cov"]`` (float64) — or by a particle cloud {x_i} with normalised
weights w_i (uniform for every method but ``smc`` and ``mpf`` with ``flow_fraction: "auto"``). From it, in float64:

* mean m = Σ w_i x_i and covariance C = Σ w_i (x_i − m)(x_i − m)ᵀ (GPF eq. 15,
  :func:`mpflow.operators.gaussian.moments`),
  std = √diag C; for the exact Gaussian, m and P themselves;
* marginal quantiles q ∈ :data:`QUANTILES` (0.025, 0.05, 0.5, 0.95, 0.975: the bounds of the 95 % and 90 %
  central intervals and the median; a request may ask for other ``levels``, :func:`quantile_rows`): the inverse of
  the weighted empirical CDF, min{x : Σ_{x_i ≤ x} w_i ≥ q} (particles of zero weight never matter); for the exact
  Gaussian m_j + Φ⁻¹(q) √P_jj; keyed by :func:`level_key` (``"0.975"``);
* ESS = 1 / Σ w_i² of a cloud — null for the exact Gaussian, whose particles are fresh draws for the particle
  views, not a cloud with an effective size — and log_evidence = log p̂(o_1..o_step) (0 at step 0);
* ``params`` — a stream that learns unknown model parameters (``smc2``): per parameter, the mean, sd and the 0.025,
  0.05, 0.95 and 0.975 quantiles of its θ-particles θ_j under their weights ω_j (the weighted empirical CDF as
  above), the posterior p(θ | o_1..o_step) (docs/methods.md eq. P6); beside it how much of that θ-cloud is left —
  ``params_ess`` (1 / Σ ω_j²), ``params_distinct`` (its distinct θ-particles) and ``params_degenerate``
  (:func:`mpflow.operators.updaters.smc2.cloud_health`).

Draws (``n`` may exceed N):

* exact Gaussian: m + L ξ, L Lᵀ = P;
* weighted clouds (``smc``; any cloud whose weights are not uniform, as ``mpf``'s with ``flow_fraction:
  "auto"``): multinomial resampling of the particles by their weights — the SMC approximation itself;
* unweighted clouds of a model whose posterior is Gaussian (linear-Gaussian families): the Gaussian N(m, C) the
  cloud represents. GPF eq. 16 (x = m + Σ_i √w_i (x_i − m) ξ_i,
  :class:`~mpflow.operators.samplers.GaussianFlowResampler`)
  draws it without a factorisation but costs O(n N d); when N ≥ ``CHOLESKY_RATIO``·d the covariance has full
  rank and m + L ξ with L Lᵀ = C gives the same distribution in O(d³ + n d²), so that is used; below (N close to
  or under d, a rank-deficient C) the resampler is;
* unweighted clouds of any other model (a multimodal ``gmm`` posterior, say): the cloud's shrunk kernel density
  — a uniformly chosen particle moved by the Liu–West kernel a x_i + (1 − a) m + √(1 − a²) L ξ, a = 0.98 as in
  ``smc``'s rejuvenation (:func:`mpflow.operators.gaussian.liu_west`): it keeps the cloud's modes, and its mean and
  covariance exactly (a Gaussian fit would fill the space between modes). Silverman's factor (√(1 − a²) ≈ 0.4
  at N = 256, d = 2) would smear modes that are narrow against C: the kernel is L ξ, C's factor, not the modes'.

Draws use a generator seeded from (stream seed, step): the same stream at the same step gives the same draws.
"""

from __future__ import annotations

import hashlib
import math
import sys
from dataclasses import dataclass
from typing import Any

import torch
from mpflow.operators import gaussian
from mpflow.operators.rng import generator
from mpflow.operators.samplers import GaussianFlowResampler
from mpflow.operators.state import ParticleState, StepInfo
from mpflow.operators.updaters import smc2_mh
from mpflow.operators.updaters.smc2 import PARAM, PARAM_LOG_WEIGHTS, cloud_health, param_names
from mpflow.service.engine import anomaly

#: the default quantile levels of every summary, ``per_step`` entry and forecast: the bounds of the 95 % central
#: interval (the credible region the docs, the CLI's ``--plot`` and the dashboard draw), of the 90 % one, and the median
QUANTILES = (0.025, 0.05, 0.5, 0.95, 0.975)
#: the most quantile levels a request may ask for (docs/API.md "levels"), so that answers stay bounded
MAX_LEVELS = 9
#: the decimals a level is kept to (its JSON key: :func:`level_key`)
LEVEL_DECIMALS = 6
#: the fields of a summary about the learned parameters (:func:`parameter_summaries`): every answer's ``summary``
#: carries them; a ``per_step`` entry only when the request asks (``per_step_params``, docs/API.md)
PARAM_FIELDS = ("params", "params_ess", "params_distinct", "params_degenerate", "params_rejuvenation")
CHOLESKY_RATIO = 4


def _normal_ppf(q: float) -> float:
    return math.sqrt(2.0) * torch.special.erfinv(torch.tensor(2 * q - 1, dtype=torch.float64)).item()


_Z = torch.tensor([_normal_ppf(q) for q in QUANTILES], dtype=torch.float64)


def level_key(q: float) -> str:
    """The JSON key of quantile level ``q`` in (0, 1), everywhere (summaries, ``per_step``, forecasts): its decimal
    digits, at most :data:`LEVEL_DECIMALS`, no trailing zeros — ``"0.025"``, ``"0.5"``, ``"0.975"``."""
    return f"{q:.{LEVEL_DECIMALS}f}".rstrip("0").rstrip(".")


def check_levels(levels: list[float] | tuple[float, ...], field: str = "levels") -> tuple[float, ...]:
    """A request's quantile levels, rounded to :data:`LEVEL_DECIMALS` decimals, sorted, without repeats; ValueError
    naming ``field`` for none, more than :data:`MAX_LEVELS`, or a level outside (0, 1)."""
    if not 1 <= len(levels) <= MAX_LEVELS:
        raise ValueError(f"{field}: 1 to {MAX_LEVELS} quantile levels, got {len(levels)}")
    out = set()
    for i, q in enumerate(levels):
        if isinstance(q, bool) or not isinstance(q, int | float) or not math.isfinite(q):
            raise ValueError(f"{field}[{i}]: a number in (0, 1), e.g. 0.025 or 0.975")
        r = round(float(q), LEVEL_DECIMALS)
        if not 0.0 < r < 1.0:
            raise ValueError(f"{field}[{i}]: {q} is not in (0, 1); send levels such as 0.025, 0.5, 0.975")
        out.add(r)
    return tuple(sorted(out))


def quantile_rows(state: ParticleState, levels: tuple[float, ...]) -> dict[str, list[float]]:
    """The marginal quantiles of one stream's state (B = 1) at ``levels``: ``{level_key(q): [d]}`` — the exact
    Gaussian's m + Φ⁻¹(q) √P_jj, or the cloud's weighted quantiles (module docstring)."""
    post = Posterior.of(state)
    if post.exact is not None:
        mean, cov = post.exact
        z = torch.tensor([_normal_ppf(q) for q in levels], dtype=torch.float64)
        rows = mean[None] + z[:, None] * torch.diagonal(cov).clamp_min(0).sqrt()[None]
    else:
        rows = weighted_quantiles(post.x, post.w, levels)
    return {level_key(q): row for q, row in zip(levels, rows.tolist(), strict=True)}


@dataclass
class Posterior:
    """One stream's posterior as float64 tensors: particles x [N, d], normalised weights w [N], and the exact
    Gaussian (mean [d], cov [d, d]) when the method keeps one."""

    x: torch.Tensor
    w: torch.Tensor
    exact: tuple[torch.Tensor, torch.Tensor] | None

    @classmethod
    def of(cls, state: ParticleState) -> Posterior:
        if state.batch_size != 1:
            raise ValueError("state: summaries are per stream (B = 1)")
        x, w, exact = _float64(state)
        return cls(x[0], w[0], None if exact is None else (exact[0][0], exact[1][0]))

    def moments(self) -> tuple[torch.Tensor, torch.Tensor]:
        exact = None if self.exact is None else (self.exact[0][None], self.exact[1][None])
        mean, cov = _moments(self.x[None], self.w[None], exact)
        return mean[0], cov[0]


def _float64(state: ParticleState) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """A batch's posteriors in float64: particles [B, N, d], normalised weights [B, N], and the exact Gaussian
    (mean [B, d], cov [B, d, d]) when the method keeps one."""
    x = state.particles.to(torch.float64)
    w = torch.softmax(state.log_weights.to(torch.float64), -1)
    exact = None
    if gaussian_state(state):
        exact = (state.extras["mean"].to(torch.float64), state.extras["cov"].to(torch.float64))
    return x, w, exact


def gaussian_state(state: ParticleState) -> bool:
    """Whether the state keeps its posterior as a Gaussian N(m, P) (``kalman``, ``ukf``: extras ``mean``, ``cov``)
    rather than as a particle cloud."""
    return "mean" in state.extras and "cov" in state.extras


def _moments(x: torch.Tensor, w: torch.Tensor, exact) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean [B, d], cov [B, d, d]): the exact Gaussian's when there is one, else the weighted cloud's."""
    return exact if exact is not None else gaussian.moments(x, torch.log(w))


def weighted_quantiles(x: torch.Tensor, w: torch.Tensor, qs: tuple[float, ...]) -> torch.Tensor:
    """Per-column quantiles of x [N, d] under weights w [N] (summing to 1) → [len(qs), d]: the inverse of the
    weighted empirical CDF, min{x : F(x) ≥ q} (numpy's ``inverted_cdf`` for uniform weights)."""
    return batch_weighted_quantiles(x[None], w[None], qs)[0]


def batch_weighted_quantiles(x: torch.Tensor, w: torch.Tensor, qs: tuple[float, ...]) -> torch.Tensor:
    """:func:`weighted_quantiles` of every stream of a batch: x [B, N, d], w [B, N] → [B, len(qs), d]."""
    B, N, d = x.shape
    xs, order = torch.sort(x, dim=1)  # [B, N, d]
    cdf = torch.cumsum(torch.gather(w[..., None].expand(B, N, d), 1, order), 1).transpose(1, 2).contiguous()
    q = torch.tensor(qs, dtype=cdf.dtype).expand(B, d, len(qs)) * cdf[..., -1:]  # [B, d, Q]
    idx = torch.searchsorted(cdf, q.contiguous()).clamp_max(N - 1)
    return torch.gather(xs.transpose(1, 2), 2, idx).transpose(1, 2)


def summaries(state: ParticleState) -> list[dict]:
    """The document's ``summary`` of every stream of a batch (B dicts: mean, cov, std, quantiles, ess,
    log_evidence; the module docstring's definitions), computed for the whole batch at once — the update engine
    summarises a micro-batch in one pass instead of one per stream."""
    x, w, exact = _float64(state)  # [B, N, d], [B, N]
    mean, cov = _moments(x, w, exact)
    std = torch.diagonal(cov, dim1=-2, dim2=-1).clamp_min(0).sqrt()  # [B, d]
    # [B, Q, d]: the exact Gaussian's m + z_q sd, or the cloud's weighted quantiles
    qs = (
        mean[:, None] + _Z[None, :, None] * std[:, None]
        if exact is not None
        else batch_weighted_quantiles(x, w, QUANTILES)
    )
    ess = [None] * state.batch_size if exact is not None else (1.0 / (w * w).sum(-1)).tolist()
    params = parameter_summaries(state)
    rows = zip(mean.tolist(), cov.tolist(), std.tolist(), qs.tolist(), ess, state.log_evidence.tolist(), strict=True)
    docs = [
        {
            "mean": m,
            "cov": c,
            "std": s,
            "quantiles": {level_key(q): row for q, row in zip(QUANTILES, qrows, strict=True)},
            "ess": e,
            "log_evidence": float(le),
        }
        for m, c, s, qrows, e, le in rows
    ]
    if params is not None:
        for doc, p in zip(docs, params, strict=True):
            doc.update(p)
    return docs


def parameter_summaries(state: ParticleState) -> list[dict[str, Any]] | None:
    """Per stream of a batch, the :data:`PARAM_FIELDS` of the unknown parameters a ``smc2`` state learns (its
    ``param.<name>`` θ-particles and ``param_log_weights``): ``params`` ``{name: {"mean", "sd", "q025", "q05", "q95",
    "q975"}}`` (the bounds of the 95 % and 90 % credible intervals),
    and the θ-cloud's ``params_ess``, ``params_distinct`` and ``params_degenerate`` (and, with the MH kernel,
    ``params_rejuvenation``: whether its moves target the exact posterior or a checkpoint's summary of its older
    observations); None for a state without any."""
    names = param_names(state.extras)
    if not names:
        return None
    health = cloud_health(state.extras)
    w = torch.softmax(state.extras[PARAM_LOG_WEIGHTS].to(torch.float64), -1)  # [B, M]
    theta = torch.stack([state.extras[PARAM + n].to(torch.float64) for n in names], -1)  # [B, M, p]
    mean = (w[..., None] * theta).sum(1)
    sd = (w[..., None] * (theta - mean[:, None]) ** 2).sum(1).clamp_min(0).sqrt()
    q = batch_weighted_quantiles(theta, w, (0.025, 0.05, 0.95, 0.975))  # [B, 4, p]
    stats = {"mean": mean, "sd": sd, "q025": q[:, 0], "q05": q[:, 1], "q95": q[:, 2], "q975": q[:, 3]}  # each [B, p]
    checkpointed = smc2_mh.checkpointed(state.extras)  # None without the MH kernel
    return [
        {
            "params": {n: {k: float(v[b, i]) for k, v in stats.items()} for i, n in enumerate(names)},
            "params_ess": float(health.ess[b]),
            "params_distinct": int(health.distinct[b]),
            "params_degenerate": bool(health.degenerate[b]),
            **({} if checkpointed is None else {"params_rejuvenation": "checkpointed" if checkpointed[b] else "exact"}),
        }
        for b in range(state.batch_size)
    ]


def summary(state: ParticleState) -> dict:
    """The document's ``summary`` of one stream's state (B = 1): mean, cov, std, quantiles, ess, log_evidence."""
    if state.batch_size != 1:
        raise ValueError("state: summaries are per stream (B = 1); summaries() takes a batch")
    return summaries(state)[0]


@dataclass(frozen=True)
class StepView:
    """What a request asks its ``per_step`` entries to show beyond the defaults (docs/API.md): quantiles at its own
    ``levels`` (:func:`check_levels`; None: :data:`QUANTILES`) and each step's covariance (``per_step_cov``)."""

    levels: tuple[float, ...] | None = None
    cov: bool = False

    @property
    def custom_levels(self) -> bool:
        return self.levels is not None and self.levels != QUANTILES


def step_summary(
    state: ParticleState,
    info: StepInfo,
    row: int = 0,
    state_summary: dict | None = None,
    view: StepView | None = None,
) -> dict:
    """A ``per_step`` entry for the state just after a step: step, mean, std, quantiles (when ``state_summary``
    has them, or at ``view.levels`` when the request asked for its own), ``cov`` when the request asked
    (``view.cov``), log_evidence_increment, ess (null for a Gaussian state: :func:`summaries`), ``pit`` (the step's
    predictive p-value of each observed entry, null where not observed; absent for a family without an observation
    CDF) and ``pit_two_sided`` (:func:`two_sided` of it), ``log_tail_lower`` and ``log_tail_upper`` (the step's
    non-saturating natural-log tails, :func:`log_tails`; absent with ``pit``) and ``surprise``
    (:func:`mpflow.service.engine.anomaly.surprise` of them: null where the step has none — nothing observed, or
    a family without an observation CDF; the stream adds ``anomaly_score``), ``log_evidence_sd`` where the method
    estimates the increment's standard error (mpf's marginal filter, and mpf with ``evidence: "mixture"``; absent
    where that step has none),
    ``acceptance`` when the step ran posterior moves (``info.extras["acceptance"]``, mpf on a static family), and
    ``flow_fraction`` and ``rescued`` when the step chose its flow's share (mpf with ``flow_fraction: "auto"``),
    ``relocked`` when the stream re-locks (``ienkf`` with ``relock``: whether this step re-seeded the ensemble),
    the :data:`PARAM_FIELDS` when the stream learns unknown parameters (:func:`parameter_summaries`; the answer
    keeps them only where the request asks, ``per_step_params``).
    ``state_summary``: this state's :func:`summary` when it is computed anyway (its mean and std are reused)."""
    if state_summary is None:
        mean, cov = Posterior.of(state).moments()
        state_summary = {"mean": mean.tolist(), "std": torch.diagonal(cov).clamp_min(0).sqrt().tolist()}
        params = parameter_summaries(state)
        if params is not None:
            state_summary.update(params[0])
    entry = {
        "step": int(state.step[0]),
        "mean": state_summary["mean"],
        "std": state_summary["std"],
        **({"quantiles": state_summary["quantiles"]} if "quantiles" in state_summary else {}),
        "log_evidence_increment": float(info.log_evidence_increment[row]),
        "ess": None if gaussian_state(state) else float(info.ess[row]),
    }
    if view is not None and view.custom_levels:
        entry["quantiles"] = quantile_rows(state, view.levels)
    if view is not None and view.cov:
        entry["cov"] = state_summary["cov"] if "cov" in state_summary else Posterior.of(state).moments()[1].tolist()
    entry.update({k: state_summary[k] for k in PARAM_FIELDS if k in state_summary})
    pit = info.extras.get("pit")
    if pit is not None:
        entry["pit"] = [None if math.isnan(u) else u for u in pit[row].tolist()]
        entry["pit_two_sided"] = two_sided(entry["pit"])
    lower, upper = info.extras.get("log_tail_lower"), info.extras.get("log_tail_upper")
    if lower is not None and upper is not None:
        entry["log_tail_lower"] = log_tails(lower[row])
        entry["log_tail_upper"] = log_tails(upper[row])
    entry["surprise"] = anomaly.surprise(entry.get("log_tail_lower"), entry.get("log_tail_upper"))
    evidence_sd = info.extras.get("log_evidence_sd")
    evidence_sd = None if evidence_sd is None else float(evidence_sd[row])
    if evidence_sd is not None and math.isfinite(evidence_sd):
        entry["log_evidence_sd"] = evidence_sd
    acceptance = info.extras.get("acceptance")
    if acceptance is not None:
        entry["acceptance"] = float(acceptance[row])
    share = info.extras.get("flow_fraction")
    if share is not None:
        entry["flow_fraction"] = float(share[row])
        entry["rescued"] = bool(info.extras["rescued"][row])
    relocked = info.extras.get("relocked")
    if relocked is not None:
        entry["relocked"] = bool(relocked[row])
    return entry


def log_tails(t: torch.Tensor) -> list[float | None]:
    """One row of log tails as JSON numbers: null where not observed (NaN), and a reading of probability 0 under
    the predictive (−inf: a degenerate predictive) at the most negative float, so the answer stays JSON."""
    return [None if math.isnan(v) else max(v, -sys.float_info.max) for v in t.tolist()]


def two_sided(pit: list[float | None]) -> list[float | None]:
    """Per observed entry, the two-sided p-value 2 min(u, 1 − u) of its predictive p-value u (null where not
    observed): what a user thresholds — below α exactly where the stream's ``pit_alert`` α flags the entry."""
    return [None if u is None else 2.0 * min(u, 1.0 - u) for u in pit]


def sample_seed(seed: int, step: int) -> int:
    """A 63-bit seed for the draws of stream ``seed`` at ``step`` (independent of the update generator)."""
    digest = hashlib.sha256(f"mpflow-samples:{seed}:{step}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def draw(state: ParticleState, n: int, *, weighted: bool, seed: int, gaussian_posterior: bool = True) -> torch.Tensor:
    """n draws [n, d] from the stream's posterior approximation (module docstring); ``gaussian_posterior``: the
    model's posterior is Gaussian (linear-Gaussian families), so an unweighted cloud stands for N(m, C)."""
    post = Posterior.of(state)
    g = generator(seed)
    n_particles, d = post.x.shape
    if post.exact is None and (weighted or bool((post.w != post.w[0]).any())):
        idx = torch.multinomial(post.w, n, replacement=True, generator=g)
        return post.x[idx]
    if post.exact is None and not gaussian_posterior and n_particles > d:
        mean, cov = post.moments()
        idx = torch.randint(n_particles, (n,), generator=g)
        xi = torch.randn(n, d, generator=g, dtype=torch.float64)
        return gaussian.liu_west(post.x[idx], mean, gaussian.cholesky(cov), gaussian.LIU_WEST_SHRINKAGE, xi)
    if post.exact is None and n_particles < CHOLESKY_RATIO * d:
        return GaussianFlowResampler(post.x[None]).sample(n, [g])[0]
    mean, cov = post.moments()
    L = gaussian.cholesky(cov)
    xi = torch.randn(n, d, generator=g, dtype=torch.float64)
    return mean[None] + xi @ L.T


__all__ = [
    "MAX_LEVELS",
    "PARAM_FIELDS",
    "QUANTILES",
    "StepView",
    "batch_weighted_quantiles",
    "check_levels",
    "draw",
    "level_key",
    "parameter_summaries",
    "quantile_rows",
    "sample_seed",
    "step_summary",
    "summaries",
    "summary",
    "two_sided",
    "weighted_quantiles",
]

"""Meta-training tasks for MPF (Chen, Dai & Song, §3.1 and Algorithm 1).

A task T = (π(x), p(· | x), O_M) is a prior, a likelihood (one stream of a model family, with its own
parameters where the family has them) and an observation sequence. :func:`sample_tasks` draws a batch of B
tasks at once, each from its own torch.Generator (:mod:`operators.rng`), so task b is the same whatever the
batch around it. Priors are diverse (§3.1): N(μ, Σ) with μ ~ N(0, I) and Σ = Q diag(s) Qᵀ,
log s_i ~ U[log s_lo, log s_hi] (default [0.5, 2]) and Q a Haar-random rotation, or — ``prior="dpgmm"`` —
a mixture drawn from a truncated Dirichlet-process Gaussian mixture (§3.1 "generative model approach":
stick-breaking weights with concentration α, component means from the base measure N(0, I), component
covariances from the Gaussian recipe above shrunk by ``dp_shrink``). Posteriors after k observations come
in through sequence segmentation (eq. 21, :mod:`training.meta_train`).

Per family (the true x is drawn from the prior unless said otherwise):

* ``linear_gaussian`` (MPF §5.1): o ~ N(x, r I) (H = I, r = 3 as in the paper).
* ``lds`` (MPF §5 LDS): x_m = A x_{m−1} + N(0, I), o_m = B x_m + N(0, I) with a random pair per task:
  A = ρ·(Haar rotation), ρ ~ U[ρ_lo, ρ_hi] (default [0.7, 1.0]), B with N(0, 1) entries — evaluation
  draws new pairs, unseen in training.
* ``gmm`` (MPF §5.2): o ~ ½ N(x₁, 1) + ½ N(x₁ + x₂, 1), prior N(0, scale² I) and the paper's true
  x = (1, −2) (``true_x="prior"`` draws it from the prior instead).
* ``logistic`` (MPF §5.4, synthetic): minibatches of 32 rows a ~ N(0, I_d), y ~ Bernoulli(σ(wᵀa)).
* ``stochastic_volatility``: per task μ ~ N(0, 0.5²) per dimension, φ ~ U[0.85, 0.98], σ ~ U[0.2, 0.5];
  the prior is the Gaussian recipe centred at μ with covariance scaled to the stationary variance
  σ²/(1 − φ²).

Observations [B, T, *obs_shape] are simulated with the family's ``simulate``. The per-task generators are
returned with the task: the trainer draws the initial particles X_0 ~ π from them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from operators.models import make_model
from operators.models.base import ModelFamily
from operators.models.priors import GaussianMixture
from operators.rng import generator, haar_orthogonal, rand, randn

TASK_FAMILIES = ("linear_gaussian", "lds", "gmm", "logistic", "stochastic_volatility")


@dataclass
class Tasks:
    """A batch of B tasks: model (B streams), prior, observations [B, T, ...], true states [B, d]."""

    model: ModelFamily
    prior: GaussianMixture
    obs: torch.Tensor
    x_true: torch.Tensor
    gens: list[torch.Generator]

    @property
    def batch_size(self) -> int:
        return self.obs.shape[0]

    @property
    def length(self) -> int:
        return self.obs.shape[1]


def _uniform(gens, shape, lo: float, hi: float, dtype) -> torch.Tensor:
    return lo + (hi - lo) * rand(gens, shape, dtype)


def random_covariance(gens: list[torch.Generator], d: int, dtype, scale_range: tuple[float, float]) -> torch.Tensor:
    """Σ = Q diag(s) Qᵀ, log s_i ~ U[log lo, log hi], Q Haar-random → [B, d, d]."""
    lo, hi = scale_range
    if not 0 < lo <= hi:
        raise ValueError(f"scale_range: must satisfy 0 < lo <= hi, got {scale_range!r}")
    s = torch.exp(_uniform(gens, [d], math.log(lo), math.log(hi), dtype))
    Q = haar_orthogonal(gens, d, dtype)
    cov = Q @ torch.diag_embed(s) @ Q.transpose(-1, -2)
    return 0.5 * (cov + cov.transpose(-1, -2))


def dp_mixture_prior(
    gens: list[torch.Generator], d: int, dtype, *, alpha: float, components: int, shrink: float, scale_range
) -> GaussianMixture:
    """A truncated Dirichlet-process Gaussian mixture (stick-breaking, MPF §3.1): weights
    β_k ~ Beta(1, α) sticks (via the inverse CDF 1 − U^{1/α}), means ~ N(0, I), covariances ``shrink``·Σ_k."""
    if not alpha > 0 or components < 1 or not 0 < shrink <= 1:
        raise ValueError("dp: alpha > 0, components >= 1 and 0 < shrink <= 1 are required")
    beta = 1 - rand(gens, [components], torch.float64) ** (1.0 / alpha)
    beta[:, -1] = 1.0
    rest = torch.cumprod(torch.cat([torch.ones_like(beta[:, :1]), 1 - beta[:, :-1]], 1), 1)
    weights = (beta * rest).clamp_min(1e-6)
    weights = (weights / weights.sum(1, keepdim=True)).to(dtype)
    means = randn(gens, [components, d], dtype)
    covs = torch.stack([random_covariance(gens, d, dtype, scale_range) for _ in range(components)], 1) * shrink
    return GaussianMixture(weights, means, covs)


def _gaussian_prior(gens, d, dtype, scale_range, centre=None, scale=None) -> GaussianMixture:
    mean = randn(gens, [d], dtype) if centre is None else centre
    cov = random_covariance(gens, d, dtype, scale_range)
    if scale is not None:
        cov = cov * scale[:, None, None]
    return GaussianMixture.gaussian(mean, cov)


def _stack(family: str, params: list[dict[str, Any]], d: int, dtype) -> ModelFamily:
    models = [make_model(family, p, d, dtype) for p in params]
    return type(models[0]).stack(models)


Builder = Callable[..., tuple[ModelFamily, GaussianMixture]]


def _linear_gaussian(gens, d, dtype, kw) -> tuple[ModelFamily, GaussianMixture]:
    r = kw.get("obs_var", 3.0)
    if not r > 0:
        raise ValueError(f"obs_var: must be positive, got {r!r}")
    one = make_model("linear_gaussian", {"R": (r * torch.eye(d)).tolist()}, d, dtype)
    return type(one).stack([one] * len(gens)), _prior(gens, d, dtype, kw)


def _lds(gens, d, dtype, kw) -> tuple[ModelFamily, GaussianMixture]:
    lo, hi = kw.get("rho_range", (0.7, 1.0))
    rho = _uniform(gens, [1], lo, hi, torch.float64)
    A = rho[:, :, None] * haar_orthogonal(gens, d, torch.float64)
    Bm = randn(gens, [d, d], torch.float64)
    params = [{"A": A[b].tolist(), "B": Bm[b].tolist()} for b in range(len(gens))]
    return _stack("lds", params, d, dtype), _prior(gens, d, dtype, kw)


def _gmm(gens, d, dtype, kw) -> tuple[ModelFamily, GaussianMixture]:
    if d != 2:
        raise ValueError(f"dim: the gmm family has a 2-dimensional state, got {d}")
    one = make_model("gmm", None, d, dtype)
    model = type(one).stack([one] * len(gens))
    if kw.get("prior", "gaussian") == "dpgmm":
        return model, _prior(gens, d, dtype, kw)
    scale = kw.get("prior_scale", 1.0)
    if not scale > 0:
        raise ValueError(f"prior_scale: must be positive, got {scale!r}")
    eye = torch.eye(d, dtype=dtype).expand(len(gens), d, d)
    return model, GaussianMixture.gaussian(torch.zeros(len(gens), d, dtype=dtype), scale**2 * eye.clone())


def _logistic(gens, d, dtype, kw) -> tuple[ModelFamily, GaussianMixture]:
    one = make_model("logistic", None, d, dtype)
    return type(one).stack([one] * len(gens)), _prior(gens, d, dtype, kw)


def _stochastic_volatility(gens, d, dtype, kw) -> tuple[ModelFamily, GaussianMixture]:
    mu = 0.5 * randn(gens, [d], torch.float64)
    phi = _uniform(gens, [1], 0.85, 0.98, torch.float64)
    sigma = _uniform(gens, [1], 0.2, 0.5, torch.float64)
    params = [
        {"mu": mu[b].tolist(), "phi": [float(phi[b, 0])] * d, "sigma": [float(sigma[b, 0])] * d}
        for b in range(len(gens))
    ]
    stationary = (sigma[:, 0] ** 2 / (1 - phi[:, 0] ** 2)).to(dtype)
    prior = _gaussian_prior(gens, d, dtype, kw.get("scale_range", (0.5, 2.0)), mu.to(dtype), stationary)
    return _stack("stochastic_volatility", params, d, dtype), prior


def _prior(gens, d, dtype, kw) -> GaussianMixture:
    kind = kw.get("prior", "gaussian")
    scale_range = kw.get("scale_range", (0.5, 2.0))
    if kind == "gaussian":
        return _gaussian_prior(gens, d, dtype, scale_range)
    if kind == "dpgmm":
        return dp_mixture_prior(
            gens,
            d,
            dtype,
            alpha=kw.get("dp_alpha", 1.0),
            components=kw.get("dp_components", 4),
            shrink=kw.get("dp_shrink", 0.3),
            scale_range=scale_range,
        )
    raise ValueError(f"prior: expected 'gaussian' or 'dpgmm', got {kind!r}")


BUILDERS: dict[str, Builder] = {
    "linear_gaussian": _linear_gaussian,
    "lds": _lds,
    "gmm": _gmm,
    "logistic": _logistic,
    "stochastic_volatility": _stochastic_volatility,
}
TASK_OPTIONS = (
    "obs_var",
    "scale_range",
    "prior",
    "prior_scale",
    "true_x",
    "rho_range",
    "dp_alpha",
    "dp_components",
    "dp_shrink",
)


def sample_tasks(
    family: str, dim: int, batch: int, T: int, gen: torch.Generator, *, dtype: torch.dtype = torch.float32, **options
) -> Tasks:
    """Draw ``batch`` tasks of ``T`` observations of ``family`` in dimension ``dim`` (module docstring).

    ``gen`` seeds one generator per task. ``options`` (see :data:`TASK_OPTIONS`): ``obs_var``
    (linear_gaussian), ``scale_range``, ``prior`` ("gaussian" | "dpgmm", with ``dp_alpha``,
    ``dp_components``, ``dp_shrink``), ``prior_scale`` and ``true_x`` ("paper" = (1, −2), "prior", or a
    point; gmm), ``rho_range`` (lds).
    """
    if family not in BUILDERS:
        raise ValueError(f"family: meta-training tasks exist for {list(TASK_FAMILIES)}, got {family!r}")
    unknown = sorted(set(options) - set(TASK_OPTIONS))
    if unknown:
        raise ValueError(f"task options: unknown {unknown}; allowed: {list(TASK_OPTIONS)}")
    for name, value in (("dim", dim), ("batch", batch), ("T", T)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: must be a positive integer, got {value!r}")
    seeds = torch.randint(0, 2**62, (batch,), generator=gen).tolist()
    gens = [generator(s) for s in seeds]
    model, prior = BUILDERS[family](gens, dim, dtype, options)
    true_x = options.get("true_x", "paper" if family == "gmm" else "prior")
    if true_x == "prior":
        x0 = prior.sample(1, gens)[:, 0]
    else:
        point = (1.0, -2.0) if true_x == "paper" else true_x
        if isinstance(point, str) or len(point) != dim:
            raise ValueError(f"true_x: must be 'paper', 'prior' or a point of length {dim}, got {true_x!r}")
        x0 = torch.tensor(point, dtype=dtype).expand(batch, dim).clone()
    _, obs = model.simulate(T, x0, gens)  # dynamic families: x0 ~ π is x_0, moved before the first observation
    return Tasks(model, prior, obs, x0, gens)

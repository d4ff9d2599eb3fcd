"""A learned parameter observer: the unknown static parameters θ of a scalar stream, read off its last W observations
— neural posterior estimation (Papamakarios & Murray 2016; Greenberg, Nonnenmacher & Macke 2019; the ``sbi``
package) amortised over a family's broad task domain.

What it is for. ``smc2``'s exact rejuvenation (:mod:`mpflow.operators.updaters.smc2_mh`) moves its θ-particles by
Metropolis–Hastings; a random walk scaled by the cloud's own spread cannot leave a cloud that collapsed onto a wrong
value (a run of identical readings, a prior far from the data). The observer's answer q(θ | o_window) is an
*independence* proposal inside that move (:mod:`mpflow.operators.updaters.smc2_proposal`): it proposes where the
data say θ is, and the MH ratio keeps the exact target, so it changes how fast the cloud travels, never where it
ends up.

The answer. Each parameter θ_i of the family's :attr:`~mpflow.operators.models.base.ModelFamily.observer_params` is
answered in its coordinate v_i (``log`` θ, ``atanh`` θ or θ itself) as one Gaussian

    v ~ N(μ, L Lᵀ),   μ = μ_net + s ⊙ log σ̂²_o,   L lower triangular, diag(L) = softplus(·) + 10⁻³,        (O1)

σ̂²_o the window's variance and s_i = 1 for the coordinates that move by log c² when the observations are scaled by c
(lds's log Q and log R, stochastic volatility's μ): the network reads scale-free features only, so one θ serves every
scale (scale equivariance by construction).

The features (:func:`window_features`), of the observed values y_t (a mask marks the observed ones and the window's
start) standardised z_t = (y_t − ȳ) / σ̂_o: the normalised variogram log(Σ (z_{t+l} − z_t)² / 2n_l) at lags
:data:`VARIOGRAM_LAGS` (with a flag where no pair exists), the autocorrelations at :data:`ACF_LAGS`, skewness and
log-kurtosis, the mean, log-sd and autocorrelations at :data:`LOG_SQUARE_LAGS` of log(z_t² + 10⁻³) (a volatility's
signature), and log n / log :data:`MAX_WINDOW`; beside them the family's fixed parameters
(:meth:`~mpflow.operators.models.base.ModelFamily.observer_context`: lds's A and log B², linear_gaussian's log H²).

Trained (:mod:`mpflow.training.param_observer_train`) by the negative log-density of the true v under eq. O1 — the
logarithmic score, strictly proper (Gneiting & Raftery 2007, §2) — on trajectories simulated from the family's
:meth:`~mpflow.operators.models.base.ModelFamily.observer_tasks`, windows of 8 to 1000 steps.
"""

from __future__ import annotations

import itertools
import math
from functools import lru_cache

import torch
from torch import nn

#: the registry's ``architecture.kind`` of a parameter observer
ARCHITECTURE_KIND = "param_observer"
#: the lags of the normalised variogram, of the autocorrelation and of the log-squares' autocorrelation
VARIOGRAM_LAGS = (1, 2, 3, 5, 8, 13, 21, 34, 55)
ACF_LAGS = (1, 2, 3)
LOG_SQUARE_LAGS = (1, 2, 5, 10, 20)
#: the most observations an observer reads, and the fewest it answers from
MAX_WINDOW = 1000
MIN_WINDOW = 8
#: the number of features :func:`window_features` gives
N_FEATURES = 2 * len(VARIOGRAM_LAGS) + len(ACF_LAGS) + 2 + 2 + len(LOG_SQUARE_LAGS) + 1
#: the floor of the window's variance, relative to 1 + its mean square (a run of identical readings)
VAR_FLOOR = 1e-12
#: the floor inside log(z² + ·) of the log-squares
LOG_SQUARE_FLOOR = 1e-3


def _lagged(x: torch.Tensor, m: torch.Tensor, lag: int):
    """(x_{t+l} [n, W−l], x_t, both-observed mask, pair count [n])."""
    pm = m[:, lag:] * m[:, :-lag]
    return x[:, lag:], x[:, :-lag], pm, pm.sum(-1)


def window_features(y: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The features [n, :data:`N_FEATURES`] of windows y [n, W] whose observed entries ``mask`` [n, W] marks (module
    docstring), and each window's log-variance [n] (eq. O1's log σ̂²_o), float64."""
    y = y.to(torch.float64)
    m = mask.to(torch.float64)
    y = torch.where(m > 0, y, 0.0)
    n_obs = m.sum(-1).clamp_min(1.0)
    mean = (y * m).sum(-1) / n_obs
    z = (y - mean[:, None]) * m
    var = (z * z).sum(-1) / n_obs + VAR_FLOOR * (1.0 + mean * mean)
    log_var = torch.log(var)
    z = z / var.sqrt()[:, None]
    feats = []
    for lag in VARIOGRAM_LAGS:
        if lag >= y.shape[1]:
            feats += [torch.zeros_like(mean)] * 2
            continue
        a, b, pm, pairs = _lagged(z, m, lag)
        g = ((a - b) ** 2 * pm).sum(-1) / (2 * pairs.clamp_min(1.0))
        feats += [torch.where(pairs > 0, torch.log(g + 1e-6), 0.0), (pairs > 0).to(torch.float64)]
    for lag in ACF_LAGS:
        a, b, pm, pairs = _lagged(z, m, lag)
        feats.append((a * b * pm).sum(-1) / pairs.clamp_min(1.0))
    feats.append(((z**3) * m).sum(-1).div(n_obs).clamp(-10.0, 10.0))
    feats.append(torch.log(((z**4) * m).sum(-1).div(n_obs).clamp(1e-3, 1e3)))
    ls = torch.log(z * z + LOG_SQUARE_FLOOR) * m
    ls_mean = ls.sum(-1) / n_obs
    lc = (ls - ls_mean[:, None]) * m
    ls_var = (lc * lc).sum(-1) / n_obs
    feats += [ls_mean, 0.5 * torch.log(ls_var + 1e-6)]
    for lag in LOG_SQUARE_LAGS:
        a, b, pm, pairs = _lagged(lc, m, lag) if lag < y.shape[1] else (None, None, None, None)
        feats.append(
            torch.zeros_like(mean) if a is None else (a * b * pm).sum(-1) / (pairs.clamp_min(1.0) * (ls_var + 1e-6))
        )
    feats.append(torch.log(n_obs) / math.log(MAX_WINDOW))
    return torch.stack(feats, -1), log_var


class ParamObserver(nn.Module):
    """Eq. O1: an MLP (``layers`` hidden layers of ``hidden`` units, SiLU) from the window's features and the fixed
    parameters to the Gaussian of the ``n_params`` coordinates v; ``scaled``: the flags s of eq. O1."""

    def __init__(self, n_params: int, n_context: int, scaled: list[bool], hidden: int = 128, layers: int = 3):
        super().__init__()
        self.config = {"n_params": n_params, "n_context": n_context, "scaled": list(scaled), "hidden": hidden,
                       "layers": layers}  # fmt: skip
        dims = [N_FEATURES + n_context] + [hidden] * layers
        body: list[nn.Module] = []
        for a, b in itertools.pairwise(dims):
            body += [nn.Linear(a, b), nn.SiLU()]
        self.body = nn.Sequential(*body)
        self.n_params = n_params
        self.head = nn.Linear(hidden, 2 * n_params + n_params * (n_params - 1) // 2)
        self.register_buffer("scaled", torch.tensor([float(s) for s in scaled]))

    def forward(self, features: torch.Tensor, context: torch.Tensor, log_var: torch.Tensor):
        """(μ [n, p], L [n, p, p]) of eq. O1 for features [n, F], context [n, c] and log σ̂²_o [n]."""
        p = self.n_params
        dtype = self.head.weight.dtype
        out = self.head(self.body(torch.cat([features, context], -1).to(dtype))).to(torch.float64)
        mean = out[:, :p] + self.scaled.to(torch.float64) * log_var[:, None]
        diag = nn.functional.softplus(out[:, p : 2 * p]) + 1e-3
        L = torch.diag_embed(diag)
        rows, cols = torch.tril_indices(p, p, -1)
        L[:, rows, cols] = out[:, 2 * p :]
        return mean, L


# ---------------------------------------------------------------------- coordinates
#: each coordinate v(θ) of :func:`to_v`: (v(θ), its inverse θ(v), log |dv/dθ|)
COORDINATES = {
    "log": (torch.log, torch.exp, lambda t: -torch.log(t)),
    "atanh": (torch.atanh, torch.tanh, lambda t: -torch.log1p(-t * t)),
    "identity": (lambda t: t, lambda v: v, torch.zeros_like),
}


def to_v(theta: torch.Tensor, kind: str) -> torch.Tensor:
    """v of θ in the observer's coordinate ``kind`` (:data:`COORDINATES`)."""
    return COORDINATES[kind][0](theta)


def from_v(v: torch.Tensor, kind: str) -> torch.Tensor:
    """θ of v (the inverse of :func:`to_v`)."""
    return COORDINATES[kind][1](v)


def log_dv_dtheta(theta: torch.Tensor, kind: str) -> torch.Tensor:
    """log |dv/dθ| of :func:`to_v`."""
    return COORDINATES[kind][2](theta)


# ---------------------------------------------------------------------- the registry
def find_observer(family: str, dirs=None, *, include_named_only: bool = False):
    """The newest parameter observer registered for ``family`` (``architecture.kind`` :data:`ARCHITECTURE_KIND`) in
    ``dirs`` (default: the registry's default folders), or None; one whose config says ``"auto_select": false``
    (not shown to win by a benchmark) serves only a stream that names it, so it is skipped unless
    ``include_named_only``."""
    from mpflow.operators import registry

    found = [
        r
        for r in registry.list_operators(registry.default_dirs() if dirs is None else dirs)
        if r.family == family
        and (r.config.get("architecture") or {}).get("kind") == ARCHITECTURE_KIND
        and (include_named_only or r.auto_select)
    ]
    return max(found, key=lambda r: r.version, default=None)


def observer_from_record(record) -> ParamObserver:
    """The trained observer (eval mode) of a registry record of kind :data:`ARCHITECTURE_KIND`, cached per folder and
    content hash; ValueError when the record is of another kind or its weights do not fit."""
    arch = record.config.get("architecture")
    if not (isinstance(arch, dict) and arch.get("kind") == ARCHITECTURE_KIND):
        raise ValueError(f"{record.name} is not a parameter observer (architecture {arch!r})")
    return _load(str(record.path), record.content_hash)


@lru_cache(maxsize=16)
def _load(path: str, content_hash: str) -> ParamObserver:
    from mpflow.operators import registry

    record = registry.load_record(path)
    arch = {k: v for k, v in record.config["architecture"].items() if k != "kind"}
    net = ParamObserver(**arch)
    try:
        net.load_state_dict(registry.load_weights(record))
    except RuntimeError as exc:
        raise ValueError(f"the weights of {record.name} do not fit its architecture ({exc})") from None
    return net.eval()


__all__ = [
    "ARCHITECTURE_KIND",
    "MAX_WINDOW",
    "MIN_WINDOW",
    "ParamObserver",
    "find_observer",
    "from_v",
    "log_dv_dtheta",
    "observer_from_record",
    "to_v",
    "window_features",
]

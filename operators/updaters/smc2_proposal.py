"""The independence proposal of ``smc2``'s ``mh`` kernel from a learned parameter observer
(:mod:`mpflow.operators.param_observer`; :mod:`mpflow.operators.updaters.smc2_mh`, eq. M1).

For R streams about to move, the observer reads each stream's last W ≤
:data:`~mpflow.operators.param_observer.MAX_WINDOW` kept observations (``mh_history``, whatever the block) and the
model's fixed parameters, and answers the Gaussian N(μ, Σ) of eq. O1 over every parameter of its family's
:attr:`~mpflow.operators.models.base.ModelFamily.observer_params`. The parameters the stream gives as numbers are
conditioned on (the Gaussian's conditional law, Σ_UU − Σ_UK Σ_KK⁻¹ Σ_KU), the others proposed from a multivariate
Student-t of :data:`DOF` degrees of freedom around μ_U with the scale :data:`INFLATION` L_U — heavier tails and a
wider body than the observer's answer, so that the ratio q(u) / q(u') of eq. M1 stays bounded where the observer is
overconfident. In the move's coordinates u (the prior's support, :mod:`mpflow.operators.models.param_priors`)

    log q(u) = log t_ν(v(θ(u)); μ_U, INFLATION² Σ_U) + Σ_i log |dv_i/dθ_i| + log |dθ/du|,

and a draw whose θ falls outside the prior's support has no u: it is proposed as NaN, which the move rejects.
"""

from __future__ import annotations

import math
import os
from functools import lru_cache

import torch
from mpflow.operators.models.base import ModelFamily
from mpflow.operators.models.param_priors import from_unconstrained, to_unconstrained
from mpflow.operators.param_observer import (
    MAX_WINDOW,
    MIN_WINDOW,
    ParamObserver,
    find_observer,
    from_v,
    log_dv_dtheta,
    observer_from_record,
    to_v,
    window_features,
)
from mpflow.operators.rng import randn
from mpflow.operators.updaters import smc2_mh

#: the Student-t's degrees of freedom and the scale over the observer's
DOF = 5
INFLATION = 1.2
#: a θ-particle's proposal draw or density (a few dozen elementwise operations on ≤ 3 coordinates, the t's
#: χ² from DOF normal draws) in the cost model's operations
DRAW_FLOPS = 40.0 + (DOF + 3) * 20.0
#: the observer's answer: its features, about 40 passes over the window, and the network's products
FEATURE_PASSES = 40.0
#: the ``observer`` option's values besides a registered name
OBSERVER_OFF, OBSERVER_AUTO = "none", "auto"


def resolve(option: str, model: ModelFamily, names: list[str]) -> ParamObserver | None:
    """The observer the ``observer`` option names for a stream of ``model`` learning ``names``: None for "none",
    or for "auto" where the family has no registered observer or the model lies outside its domain
    (:meth:`~mpflow.operators.models.base.ModelFamily.observer_context`, every unknown among its parameters); a
    registered name must be one for this family and model (ValueError naming ``options.observer`` otherwise)."""
    if option == OBSERVER_OFF:
        return None
    served = {name for name, _, _ in model.observer_params}
    fits = bool(served) and set(names) <= served and model.observer_context() is not None
    if option == OBSERVER_AUTO:
        record = _auto(model.name, _dirs()) if fits else None
        return None if record is None else observer_from_record(record)
    record = _named(option, _dirs())
    if record.family != model.name or not fits:
        raise ValueError(
            f"options.observer: {option} is a parameter observer of {record.family} (scalar models learning "
            f"{', '.join(sorted(served)) or 'nothing'}); this stream is {model.name} learning {', '.join(names)}"
        )
    return observer_from_record(record)


def answer_flops(hidden: int = 256, layers: int = 3) -> float:
    """An upper bound on one answer of the observer (:func:`observer_proposal`) in the cost model's operations: the
    features over MAX_WINDOW observations and an MLP of up to ``layers`` × ``hidden`` units (the shipped ones have
    128)."""
    return FEATURE_PASSES * 10.0 * MAX_WINDOW + 2.0 * (64 * hidden + (layers - 1) * hidden * hidden + hidden * 16)


def _dirs() -> tuple[str, ...]:
    return _dirs_of(os.environ.get("MPFLOW_OPERATOR_DIRS", ""))


@lru_cache(maxsize=8)
def _dirs_of(env: str) -> tuple[str, ...]:
    """The registry's default folders while ``$MPFLOW_OPERATOR_DIRS`` is ``env`` (read once per value)."""
    from mpflow.operators import registry

    return tuple(str(d) for d in registry.default_dirs())


@lru_cache(maxsize=32)
def _auto(family: str, dirs: tuple[str, ...]):
    """The newest observer of ``family`` in ``dirs``, looked up once per process (a stream's step reads the cache)."""
    return find_observer(family, list(dirs))


@lru_cache(maxsize=32)
def _named(option: str, dirs: tuple[str, ...]):
    """The registered parameter observer named ``option``; ValueError naming ``options.observer`` otherwise."""
    from mpflow.operators import registry

    try:
        record = registry.resolve_name(option, list(dirs))
        observer_from_record(record)
    except (KeyError, ValueError, FileNotFoundError) as exc:
        raise ValueError(f"options.observer: {exc}; use none, auto or a registered parameter observer") from None
    return record


def observer_proposal(
    net: ParamObserver, model: ModelFamily, names: list[str], extras_rows, los, his
) -> smc2_mh.Proposal | None:
    """The proposal (module docstring) of R streams whose model is ``model`` (R rows, or one shared), learning
    ``names``, with their history extras ``extras_rows`` and supports' bounds ``los``, ``his`` [R, 1, p]; None when
    some stream has fewer than MIN_WINDOW observations kept."""
    kept = extras_rows[smc2_mh.KEPT]
    if bool((kept < MIN_WINDOW).any()):
        return None
    hist, seen = extras_rows[smc2_mh.HISTORY][..., 0], extras_rows[smc2_mh.OBSERVED][..., 0]
    W = min(hist.shape[1], MAX_WINDOW)
    position = torch.arange(W, dtype=torch.float64)[None]
    mask = (seen[:, -W:] > 0) & (position >= W - kept[:, None])
    feats, log_var = window_features(hist[:, -W:], mask)
    R = hist.shape[0]
    context = model.observer_context().expand(R, -1)
    with torch.no_grad():
        mean, L = net(feats, context, log_var)
    kinds = {name: kind for name, kind, _ in model.observer_params}
    order = [name for name, _, _ in model.observer_params]
    U = [order.index(n) for n in names]
    K = [i for i, n in enumerate(order) if n not in names]
    cov = L @ L.transpose(-1, -2)
    mu, S = mean[:, U], cov[:, U][:, :, U]
    if K:
        given = (model.params[order[i]].to(torch.float64) for i in K)  # [1 or R, ...], a number per stream
        known = torch.stack(
            [to_v(v.reshape(v.shape[0], -1)[:, 0].expand(R), kinds[order[i]]) for i, v in zip(K, given, strict=True)],
            -1,
        )
        gain = torch.linalg.solve(cov[:, K][:, :, K], cov[:, K][:, :, U]).transpose(-1, -2)  # Σ_UK Σ_KK⁻¹
        mu = mu + (gain @ (known - mean[:, K])[..., None])[..., 0]
        S = S - gain @ cov[:, K][:, :, U]
    chol = INFLATION * torch.linalg.cholesky(0.5 * (S + S.transpose(-1, -2)))
    p = len(names)
    const = math.lgamma((DOF + p) / 2) - math.lgamma(DOF / 2) - 0.5 * p * math.log(DOF * math.pi)
    log_det = torch.log(torch.diagonal(chol, 0, -2, -1)).sum(-1)  # [R]

    def log_prob(u: torch.Tensor) -> torch.Tensor:
        theta = from_unconstrained(u, los, his)
        v = torch.stack([to_v(theta[..., i], kinds[n]) for i, n in enumerate(names)], -1)
        z = torch.linalg.solve_triangular(chol[:, None], (v - mu[:, None])[..., None], upper=False)[..., 0]
        lt = const - log_det[:, None] - 0.5 * (DOF + p) * torch.log1p((z * z).sum(-1) / DOF)
        jac = sum(log_dv_dtheta(theta[..., i], kinds[n]) for i, n in enumerate(names))
        return lt + jac + smc2_mh.log_jacobian(u, los, his).sum(-1)

    def sample(gens, M: int) -> torch.Tensor:
        z = randn(gens, [M, p], torch.float64)
        g = (randn(gens, [M, DOF], torch.float64) ** 2).sum(-1)
        v = mu[:, None] + (z @ chol.transpose(-1, -2)) / torch.sqrt(g / DOF)[..., None]
        theta = torch.stack([from_v(v[..., i], kinds[n]) for i, n in enumerate(names)], -1)
        inside = (theta > los) & (theta < his)
        return torch.where(inside.all(-1, keepdim=True), to_unconstrained(theta, los, his), math.nan)

    return smc2_mh.Proposal(sample, log_prob)


__all__ = ["OBSERVER_AUTO", "OBSERVER_OFF", "observer_proposal", "resolve"]

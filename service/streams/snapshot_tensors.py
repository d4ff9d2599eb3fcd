"""Every tensor a method keeps, checked on import as creation would make it (docs/API.md "export / import"). The
snapshot's description and core tensors are :mod:`.snapshot_checks`'; here the values of the rest — the smoothing
window, the θ-cloud of a stream that learns its model's parameters (``smc2``), the method's other extras — as the
method and its smoother describe them (``Updater.kept``, ``FixedLagSmoother.kept``: :mod:`mpflow.operators.kept`).
Shapes and dtypes were checked against a fresh stream's (:func:`.snapshot_checks.check_fields`), finiteness with
the core's. Each refusal is a 422 ``snapshot: state.<field>: …`` naming the field, before anything is written:

* every float tensor of the extras within ±:data:`~mpflow.service.engine.numerics.FLOAT32_MAX`, the range of every
  number the API accepts (a float32 tensor is by its dtype; the float64 ones — the RTS window's moments, the
  θ-particles, the Kalman filters' moments — are not);
* a weighted cloud {x_i, w_i}: its weights normalised, |log Σ_i w_i| ≤
  :data:`~.snapshot_checks.LOG_WEIGHT_TOLERANCE` (as the core log-weights), and its weighted mean m = Σ w_i x_i and
  covariance Σ w_i (x_i − m)(x_i − m)ᵀ (GPF eq. 15) within ±FLOAT32_MAX — the bound a new stream's summary must
  meet (:func:`~mpflow.service.engine.numerics.within_float32`): each row of ``smc``'s window is the cloud the
  stream held at that step, and ``GET .../smoothed`` answers it reweighted. So a window whose particles were moved
  to 3e38 (a covariance of ~1e76) is refused, as a prior of such particles is at creation;
* a covariance: symmetric (|C − Cᵀ| ≤ :data:`SYMMETRY_TOLERANCE` · max |C|) and positive semi-definite — its
  Cholesky factor exists once :data:`PSD_JITTER` · max C_ii is added to the diagonal, so a singular covariance's
  rounding-level negative eigenvalues pass;
* bounded values within their closed bounds (particle indices 0 … N − 1, a parameter within its prior's support);
* fixed values equal to what the rest of the state determines, within :data:`FIXED_TOLERANCE` (relative and
  absolute): a window's rows of steps not yet taken are zero, ``smc``'s newest row is the state's own cloud.

The work is a pass over the window's clouds (N d² a row: less than the ``/smoothed`` read its price bounds) and a
Cholesky factorisation per covariance (d³ / 3: less than the RTS read's 40 d³ a row, or the step's per θ).
"""

from __future__ import annotations

import torch
from mpflow.operators import gaussian, smoothing
from mpflow.operators.kept import Kept
from mpflow.operators.models.base import ModelFamily
from mpflow.operators.state import ParticleState
from mpflow.operators.updaters import Updater
from mpflow.service.engine.numerics import FLOAT32_MAX
from mpflow.service.streams.snapshot_checks import LOG_WEIGHT_TOLERANCE, normalised, refuse

F64 = torch.float64
#: |C − Cᵀ| allowed, relative to max |C| (a covariance the server computed is symmetric to rounding)
SYMMETRY_TOLERANCE = 1e-6
#: the diagonal added, relative to max C_ii, before the Cholesky factorisation that tells positive semi-definite
PSD_JITTER = 1e-6
#: |v − expected| ≤ FIXED_TOLERANCE (1 + |expected|) for a fixed value (the server writes them exactly)
FIXED_TOLERANCE = 1e-6
_RANGE = f"±{FLOAT32_MAX:.4g}, the float32 range of every number the service accepts"


def kept(updater: Updater, model: ModelFamily, state: ParticleState) -> Kept:
    """What the method's tensors of ``state`` hold, its smoothing window's included."""
    window, core = smoothing.split(state)
    described = updater.kept(core, model)
    return (described | updater.smoother.kept(updater, window, core)) if window else described


def check_tensors(updater: Updater, model: ModelFamily, state: ParticleState) -> None:
    """Every tensor the method keeps in ``state`` (module docstring): 422 naming the first field that fails."""
    check_range(state)
    described = kept(updater, model, state)
    for bound in described.bounds:
        if bound.values.numel() and not bool(((bound.values >= bound.lo) & (bound.values <= bound.hi)).all()):
            raise refuse(f"state.{bound.field}: values from {bound.lo:g} to {bound.hi:g}")
    for cloud in described.clouds:
        check_cloud(cloud.points_field, cloud.points, cloud.weights_field, cloud.log_weights)
    for name, cov in described.covariances.items():
        if not positive_semidefinite(cov):
            raise refuse(f"state.{name}: covariances must be symmetric positive semi-definite")
    for fixed in described.fixed:
        values, expected = fixed.values.to(F64), fixed.expected.to(F64)
        if values.numel() and not bool(((values - expected).abs() <= FIXED_TOLERANCE * (1 + expected.abs())).all()):
            raise refuse(f"state.{fixed.field}: must be {fixed.what}")


def check_range(state: ParticleState) -> None:
    """Every float tensor of the extras within ±FLOAT32_MAX."""
    for name, t in state.extras.items():
        if t.is_floating_point() and t.numel() and float(t.abs().max()) > FLOAT32_MAX:
            raise refuse(f"state.extras.{name}: beyond {_RANGE}")


def check_cloud(points_field: str, points: torch.Tensor, weights_field: str, log_weights: torch.Tensor) -> None:
    """The clouds ``points`` [..., N, d] with ``log_weights`` [..., N]: weights normalised, moments within range."""
    n, d = points.shape[-2], points.shape[-1]
    if log_weights.numel() and not normalised(log_weights.reshape(-1, n)):
        raise refuse(
            f"state.{weights_field}: the weights of each cloud must sum to 1 (|logsumexp| ≤ {LOG_WEIGHT_TOLERANCE})"
        )
    if not (points.numel() and d):
        return
    mean, cov = gaussian.moments(points.reshape(-1, n, d).to(F64), log_weights.reshape(-1, n).to(F64))
    if not all(bool((t.abs() <= FLOAT32_MAX).all()) for t in (mean, cov)):  # NaN fails too
        raise refuse(
            f"state.{points_field}: each cloud's weighted mean and covariance must lie within {_RANGE}, as a new "
            "stream's summary must"
        )


def positive_semidefinite(cov: torch.Tensor) -> bool:
    """Whether every matrix of ``cov`` [..., d, d] is symmetric positive semi-definite (module docstring)."""
    if not cov.numel():
        return True
    c = cov.reshape(-1, *cov.shape[-2:]).to(F64)
    scale = c.abs().amax((-1, -2))
    if not bool(((c - c.transpose(-1, -2)).abs().amax((-1, -2)) <= SYMMETRY_TOLERANCE * scale).all()):
        return False
    diagonal = torch.diagonal(c, dim1=-2, dim2=-1)
    jitter = PSD_JITTER * diagonal.amax(-1).clamp_min(0) + torch.finfo(F64).tiny
    eye = torch.eye(c.shape[-1], dtype=F64)
    _, info = torch.linalg.cholesky_ex(0.5 * (c + c.transpose(-1, -2)) + jitter[:, None, None] * eye)
    return bool((info == 0).all())


__all__ = [
    "FIXED_TOLERANCE",
    "PSD_JITTER",
    "SYMMETRY_TOLERANCE",
    "check_cloud",
    "check_range",
    "check_tensors",
    "kept",
    "positive_semidefinite",
]

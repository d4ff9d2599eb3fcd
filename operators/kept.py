"""What the tensors a method keeps in a state hold, for the checks of a state read from outside — a snapshot's, on
import (:mod:`mpflow.service.streams.snapshot_tensors`, docs/API.md "export / import"). A state's shapes and
dtypes are checked against a fresh stream's; its values only its method knows the meaning of, so the method
(``Updater.kept``) and its smoother (``FixedLagSmoother.kept``) describe them, and the service checks each against
the bound creation puts on a new stream's:

* a weighted **cloud** {x_i, w_i} — points [..., N, d] and log-weights [..., N], each leading index one cloud: its
  weights normalised, |log Σ_i w_i| within the service's tolerance, and its weighted moments (mean Σ w_i x_i,
  covariance Σ w_i (x_i − m)(x_i − m)ᵀ, GPF eq. 15) within the float32 range, as a new stream's summary must be;
* a **covariance** [..., d, d]: symmetric and positive semi-definite;
* **bounded** values: lo ≤ v ≤ hi (particle indices, a parameter's support);
* **equal** values: what the rest of the state determines (the smoothing window's newest row is the state's own
  cloud, its rows of steps not yet taken are zero; a θ-particle's support is the model's).

Each is named by its field in the serialised state (``extras.lag.log_weights``), so a refusal names it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch


class Cloud(NamedTuple):
    """A weighted cloud: ``points`` [..., N, d] of field ``points_field``, ``log_weights`` [..., N] of field
    ``weights_field``."""

    points_field: str
    points: torch.Tensor
    weights_field: str
    log_weights: torch.Tensor


class Bound(NamedTuple):
    """``values`` of field ``field`` within [lo, hi]."""

    field: str
    values: torch.Tensor
    lo: float
    hi: float


class Fixed(NamedTuple):
    """``values`` of field ``field`` equal to ``expected`` (a refusal says ``what`` they must be)."""

    field: str
    values: torch.Tensor
    expected: torch.Tensor
    what: str


@dataclass
class Kept:
    """What a state's tensors hold (module docstring): its ``clouds``, ``covariances`` by field name, ``bounds`` and
    ``fixed`` values."""

    clouds: list[Cloud] = field(default_factory=list)
    covariances: dict[str, torch.Tensor] = field(default_factory=dict)
    bounds: list[Bound] = field(default_factory=list)
    fixed: list[Fixed] = field(default_factory=list)

    def __or__(self, other: Kept) -> Kept:
        return Kept(
            [*self.clouds, *other.clouds],
            {**self.covariances, **other.covariances},
            [*self.bounds, *other.bounds],
            [*self.fixed, *other.fixed],
        )


__all__ = ["Bound", "Cloud", "Fixed", "Kept"]

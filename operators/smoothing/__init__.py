"""Fixed-lag smoothing: p(x_s | o_1..t) for the last min(L, t) steps s = t − L + 1 … t of a stream.

A stream created with a smoothing lag L ≥ 1 carries a *window* — what its method's smoother needs of each of
the last L steps — in its state, as extras named ``lag.<field>`` with shape [B, L, …] (a fixed size: the newest
step last, rows of steps not yet taken zero; the count of valid rows is min(L, step)). Being part of the state, the
window is stored, exported, imported and batched with it, and its bytes are counted as the state's.

Each updater names its smoother (``Updater.smoother``): how a method smooths is the method's knowledge, and lives in
one module per approach here —

* :class:`~mpflow.operators.smoothing.rts.GaussianRTS`: the Rauch–Tung–Striebel backward pass over Gaussian
  moments (exact for ``kalman``; the ensemble RTS smoother for the ensemble and flow methods);
* :class:`~mpflow.operators.smoothing.particles.ParticleSmoother` (``smc``): FFBSm for small clouds, backward
  simulation by rejection (:mod:`~mpflow.operators.smoothing.backward_simulation`) for large ones, the filter's
  genealogy where the transition has no density.

:meth:`FixedLagSmoother.entry` computes the window's row of a step from the states before and after it;
:func:`pushed` appends it (dropping the oldest); :meth:`FixedLagSmoother.smooth` answers the smoothed marginals.
The base updater wraps every step (``Updater.update``): the window is taken off the state before the method runs
(:func:`split`), so no method ever sees it, and put back moved on by one step (:func:`attach`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
from mpflow.operators.kept import Fixed, Kept
from mpflow.operators.state import ParticleState, StepInfo

if TYPE_CHECKING:  # the updaters import this package
    from mpflow.operators.models.base import ModelFamily
    from mpflow.operators.updaters.base import Updater

#: the prefix of the window's extras
PREFIX = "lag."
#: the largest lag a stream may keep (docs/API.md "Limits")
MAX_LAG = 100


@dataclass
class Smoothed:
    """The smoothed marginals of one stream: steps [n] (oldest first), means [n, d] and covariances [n, d, d]
    (float64) of p(x_s | o_1..t), s = t − n + 1 … t."""

    steps: torch.Tensor
    means: torch.Tensor
    covs: torch.Tensor


class FixedLagSmoother:
    """How a method smooths over its last L steps (module docstring). Subclasses name their window's fields and
    give a step's row (:meth:`entry`) and the backward pass (:meth:`smooth`)."""

    name: ClassVar[str] = ""

    def empty(self, state: ParticleState, lag: int) -> dict[str, torch.Tensor]:
        """The window of a new stream (``state`` at step 0) with room for ``lag`` steps, zero-filled."""
        raise NotImplementedError

    def entry(
        self, updater: Updater, before: ParticleState, after: ParticleState, info: StepInfo | None, model: ModelFamily
    ) -> dict[str, torch.Tensor]:
        """The window's row [B, …] for the step from ``before`` to ``after`` under ``model`` (``info``: the step's,
        None when another method computed it)."""
        raise NotImplementedError

    def smooth(self, updater: Updater, window: dict[str, torch.Tensor], state: ParticleState) -> Smoothed:
        """p(x_s | o_1..t) for the window's valid rows, of one stream (B = 1)."""
        raise NotImplementedError

    def window_bytes(self, lag: int, n: int, d: int) -> float:
        """The bytes of one stream's window."""
        raise NotImplementedError

    def smooth_flops(self, model: ModelFamily, lag: int, n: int) -> float:
        """The floating-point operations of one :meth:`smooth` of a stream of ``model`` (its d, and its transition:
        how the method smooths may depend on it)."""
        raise NotImplementedError

    def kept(self, updater: Updater, window: dict[str, torch.Tensor], state: ParticleState) -> Kept:
        """What the window's values hold (:mod:`mpflow.operators.kept`), for a window read from outside (a snapshot;
        its shapes and dtypes are checked against a fresh stream's): here, that its rows of steps not yet taken are
        zero, as :meth:`empty` made them — the rest is each smoother's. ``state``: the stream's state without it."""
        idle = lag_of(window) - valid_rows(window, int(state.step[0]))
        what = "zero in the rows of steps not yet taken"
        return Kept(fixed=[Fixed(field_name(k), v[:, :idle], v.new_zeros(()), what) for k, v in window.items()])


def field_name(name: str) -> str:
    """The serialised name of the window's field ``name`` (``extras.lag.<name>``), as a refusal names it."""
    return f"extras.{PREFIX}{name}"


def split(state: ParticleState) -> tuple[dict[str, torch.Tensor], ParticleState]:
    """(window, the state without it): the window's fields by their names without :data:`PREFIX`."""
    window = {k[len(PREFIX) :]: v for k, v in state.extras.items() if k.startswith(PREFIX)}
    if not window:
        return window, state
    return window, state.replace(extras={k: v for k, v in state.extras.items() if not k.startswith(PREFIX)})


def attach(state: ParticleState, window: dict[str, torch.Tensor]) -> ParticleState:
    """``state`` carrying ``window``."""
    if not window:
        return state
    return state.replace(extras={**state.extras, **{PREFIX + k: v for k, v in window.items()}})


def lag_of(window: dict[str, torch.Tensor]) -> int:
    """The number of steps a window has room for (0: no window)."""
    return next(iter(window.values())).shape[1] if window else 0


def pushed(window: dict[str, torch.Tensor], entry: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The window with ``entry`` appended as its newest row and its oldest dropped."""
    return {k: torch.cat([w[:, 1:], entry[k][:, None].to(w.dtype)], 1) for k, w in window.items()}


def valid_rows(window: dict[str, torch.Tensor], step: int) -> int:
    """How many of the window's rows hold a step: min(L, step)."""
    return min(lag_of(window), step)


def check_lag(lag: object, field: str = "smoothing_lag") -> int:
    """``lag`` as an int in 0 … :data:`MAX_LAG`; ValueError naming ``field`` otherwise."""
    if isinstance(lag, bool) or not isinstance(lag, int) or not 0 <= lag <= MAX_LAG:
        raise ValueError(f"{field}: an integer from 0 to {MAX_LAG} (the steps kept for smoothing), got {lag!r}")
    return lag


__all__ = [
    "MAX_LAG",
    "PREFIX",
    "FixedLagSmoother",
    "Smoothed",
    "attach",
    "check_lag",
    "field_name",
    "lag_of",
    "pushed",
    "split",
    "valid_rows",
]

"""``ienkf``'s ``relock``: a stream whose innovations say the ensemble lost the truth is re-seeded around a learned
observer's estimate (:mod:`mpflow.operators.mpf.ring_observer`), and the IEnKF takes over from there.

The test. Each step's first Gauss–Newton iterate forecasts the inflated previous ensemble, F = f(x̄0 + A0); with ē
the mean innovation and Y the observation anomalies of F (:func:`~mpflow.operators.updaters.enkf.ensemble_innovations`),
the step's innovation ratio is

    ν_m = (1/k) Σ_j ē_j² / (Σ_i Y_ij² / (N − 1) + R_jj),

the innovations' mean square over the variance the ensemble predicts for them: about 1 (0.74 measured) while the
filter tracks the truth, 5 and more once it has lost it (spantini2019, 16 twins × 500 cycles: 99 % of tracking cycles
below 2, the median of lost cycles 5.2). The stream keeps its exponential average r_m = β r_{m−1} + (1 − β) ν_m
(:data:`MEMORY` β; r_0 = 1) and re-locks where r_m > :data:`THRESHOLD` once its window holds K observations.

The re-lock. The observer reads the stream's last K observations (the window, carried in the state's extras: each
step's observation on the ring, with a mask of the sites observed — the values are 0 elsewhere, so every float of the
state stays finite, which the service checks after every step) and answers N(μ_i, σ_i²) per site; the analysis ensemble
becomes x_n = μ + σ ⊙ ε_n, ε_n ~ N(0, I) — an ensemble that knows no more than the observations say, so the next
steps' observations are weighed again — and r resets to 1. The draws are made on every step of a re-locking
stream, fired or not, so a stream's numbers do not depend on which streams share its batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from mpflow.operators import rng
from mpflow.operators.models.base import ModelFamily
from mpflow.operators.state import ParticleState
from mpflow.operators.updaters.enkf import ensemble_innovations

if TYPE_CHECKING:  # the network's module is imported when a stream names one (ienkf.load_learned)
    from mpflow.operators.mpf.ring_observer import RingObserver

#: the state's extras: the window of the last K observations on the ring [B, K, d] (0 where not observed), its mask
#: of observed sites [B, K, d] (bool) and the ratio's average r [B]
WINDOW, SEEN, RATIO = "relock_window", "relock_seen", "relock_ratio"
#: β of the ratio's exponential average (module docstring)
MEMORY = 0.5
#: the average ratio above which a stream re-locks
THRESHOLD = 3.0


def started(state: ParticleState, history: int) -> ParticleState:
    """``state`` with an empty window of ``history`` observations and r = 1 (a new stream, or one taken over)."""
    B, _, d = state.particles.shape
    window = torch.zeros(B, history, d, dtype=torch.float64)
    ratio = torch.ones(B, dtype=torch.float64)
    seen = torch.zeros(B, history, d, dtype=torch.bool)
    return state.replace(extras={**state.extras, WINDOW: window, SEEN: seen, RATIO: ratio})


def carried(new: ParticleState, before: ParticleState, obs: torch.Tensor, model: ModelFamily) -> ParticleState:
    """``new`` (another method's step on this stream) with ``before``'s window moved on by ``obs`` and its r."""
    return new.replace(extras={**new.extras, **pushed(before.extras, obs, model), RATIO: before.extras[RATIO]})


def pushed(extras: dict[str, torch.Tensor], obs: torch.Tensor | None, model: ModelFamily) -> dict[str, torch.Tensor]:
    """The window and its mask of ``extras`` with ``obs`` [B, k] on the ring as the newest row (None: a step without
    one, nothing observed) → {WINDOW, SEEN}."""
    window, seen = extras[WINDOW], extras[SEEN]
    B, _, d = window.shape
    row = torch.full((B, d), torch.nan, dtype=torch.float64) if obs is None else model.on_sites(obs)
    observed = torch.isfinite(row)
    return {
        WINDOW: torch.cat([window[:, 1:], torch.where(observed, row, 0.0)[:, None]], 1),
        SEEN: torch.cat([seen[:, 1:], observed[:, None]], 1),
    }


def observed_window(extras: dict[str, torch.Tensor]) -> torch.Tensor:
    """The window [B, K, d] as the observer reads it: NaN at a site not observed."""
    return torch.where(extras[SEEN], extras[WINDOW], torch.nan)


def innovation_ratio(first: torch.Tensor, obs: torch.Tensor, model: ModelFamily) -> torch.Tensor:
    """ν [B] of the module docstring from the first iterate's forecast [B, N, d] and the observed entries ``obs``."""
    m64 = model.to(torch.float64)
    _, e_bar, Y = ensemble_innovations(first.to(torch.float64), obs.to(torch.float64), m64)
    N = first.shape[1]
    var = Y.pow(2).sum(1) / (N - 1) + m64.observation_noise().expand(first.shape[0], -1, -1).diagonal(dim1=-2, dim2=-1)
    return (e_bar.pow(2) / var).mean(-1)


def relocked(
    observer: RingObserver,
    state: ParticleState,
    xa: torch.Tensor,
    first: torch.Tensor,
    obs: tuple[torch.Tensor, torch.Tensor],
    model: tuple[ModelFamily, ModelFamily],
    gens: rng.Generators,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """One step's test and re-lock (module docstring) → (the analysis ensemble [B, N, d], the state's new extras,
    which streams re-locked [B] bool). ``obs``/``model``: the full observation and model (the window) and their
    observed part (the ratio, as the iterations saw them); ``xa``: the IEnKF's analysis; ``first``: its first
    iterate's forecast."""
    (full_obs, sub_obs), (full_model, sub_model) = obs, model
    B, N, d = xa.shape
    extras = {**state.extras, **pushed(state.extras, full_obs, full_model)}
    ratio = MEMORY * state.extras[RATIO] + (1 - MEMORY) * innovation_ratio(first, sub_obs, sub_model)
    eps = rng.randn(gens, (N, d), torch.float64)
    full = extras[SEEN].any(-1).all(-1)  # every row of the window holds an observation
    fire = (ratio > THRESHOLD) & full
    if bool(fire.any()):
        p = full_model.expanded(B)
        with torch.no_grad():
            window = observed_window(extras)
            mean, sd = observer(window, *(p[k].reshape(B).to(torch.float64) for k in ("delta", "R", "F")))
        seeded = mean.to(torch.float64)[:, None] + sd.to(torch.float64)[:, None] * eps
        xa = torch.where(fire[:, None, None], seeded, xa)
        ratio = torch.where(fire, 1.0, ratio)
    return xa, {**extras, RATIO: ratio}, fire


__all__ = [
    "MEMORY",
    "RATIO",
    "SEEN",
    "THRESHOLD",
    "WINDOW",
    "carried",
    "innovation_ratio",
    "observed_window",
    "pushed",
    "relocked",
    "started",
]

"""The particle filter's genealogy as a fixed-lag smoother (``smc``; Kitagawa 1996, Doucet & Johansen 2011,
*A tutorial on particle filtering and smoothing*, §5.1 eq. 46, the "path-space" smoother).

The particle filter's weighted paths {(x^i_1:t, w^i_t)} approximate p(x_1:t | o_1:t); its marginal at s is the
weighted cloud of the ancestors at s of today's particles,

    p(x_s | o_1:t) ≈ Σ_i w^i_t δ(x_s − x_s^{a_s(i)}),   a_t(i) = i,  a_{s−1}(i) = A_s[a_s(i)],

where A_s[j] is the index at step s − 1 of the parent of particle j of step s (the resampling's ancestor index;
j itself at a step that did not resample). The window keeps, for each of the last L steps, the particles after
it [N, d] (the state's dtype) and its ancestor indices [N] (int64): L N (d + 2) numbers. The estimate degrades as
the lag grows (the paths coalesce: few distinct ancestors remain L steps back), which is why L is bounded and
short lags are the use. A step computed by another method (a fall-back) has no ancestry: its particles are
taken as their own ancestors' successors, index for index.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from mpflow.operators import gaussian
from mpflow.operators.smoothing import FixedLagSmoother, Smoothed, valid_rows
from mpflow.operators.state import ParticleState, StepInfo

if TYPE_CHECKING:
    from mpflow.operators.models.base import ModelFamily
    from mpflow.operators.updaters.base import Updater


class Genealogy(FixedLagSmoother):
    """The genealogy smoother (module docstring)."""

    name = "genealogy"

    def empty(self, state: ParticleState, lag: int) -> dict[str, torch.Tensor]:
        B, N, d = state.particles.shape
        return {
            "particles": torch.zeros(B, lag, N, d, dtype=state.particles.dtype),
            "ancestors": torch.zeros(B, lag, N, dtype=torch.int64),
        }

    def entry(
        self, updater: Updater, before: ParticleState, after: ParticleState, info: StepInfo | None, model: ModelFamily
    ) -> dict[str, torch.Tensor]:
        B, N, _ = after.particles.shape
        ancestors = info.ancestors if info is not None and info.ancestors is not None else None
        if ancestors is None:
            ancestors = torch.arange(N).expand(B, N)
        return {"particles": after.particles, "ancestors": ancestors}

    def smooth(self, updater: Updater, window: dict[str, torch.Tensor], state: ParticleState) -> Smoothed:
        t = int(state.step[0])
        n = valid_rows(window, t)
        particles, ancestors = window["particles"][0], window["ancestors"][0]
        lag = particles.shape[0]
        lw = torch.log_softmax(state.log_weights.to(torch.float64), -1)
        lineage = torch.arange(particles.shape[1])
        means, covs = [], []
        for row in range(lag - 1, lag - n - 1, -1):
            mean, cov = gaussian.moments(particles[row][lineage][None].to(torch.float64), lw)
            means.insert(0, mean[0])
            covs.insert(0, cov[0])
            lineage = ancestors[row][lineage]
        return Smoothed(torch.arange(t - n + 1, t + 1), torch.stack(means), torch.stack(covs))

    def window_bytes(self, lag: int, n: int, d: int) -> float:
        return lag * n * (4.0 * d + 8.0)

    def smooth_flops(self, lag: int, n: int, d: int) -> float:
        return lag * n * (2.0 * d * d + 4.0 * d)

    def check(self, window: dict[str, torch.Tensor], n: int) -> None:
        a = window["ancestors"]
        if a.numel() and not bool(((a >= 0) & (a < n)).all()):
            raise ValueError(f"state.extras.lag.ancestors: particle indices from 0 to {n - 1}")


__all__ = ["Genealogy"]

"""A learned observer on a ring (``lorenz96``): the state x_m estimated from the last K observations alone, no
ensemble — what ``ienkf``'s ``relock`` re-seeds a stream from when its innovations say it lost the truth.

Why. The global IEnKF (:mod:`mpflow.operators.updaters.ienkf`) at Δ = 0.4 (spantini2019) tracks the truth at an
analysis RMSE of about 0.51 on most cycles, but on some twins the ensemble drifts away from the truth — its spread far
below its error in a few directions, the truth no longer within reach of the ensemble's span (measured: the truth's
ridge projection onto x̄0 + A0ᵀ w misses it by 0.06 on tracking cycles and by 0.97 in such episodes) — and a filter
that lost the truth stays lost: its overconfident ensemble discounts the observations that would bring it back.
More inflation does not help (docs/benchmarks.md: every inflation rule lost more twins). A fresh ensemble around
an estimate that does not depend on the lost one does: seeded around truth + N(0, I) at the episodes, the IEnKF is
back on track within a few cycles (16 twins × 500 cycles: 0.533 against 0.736 for the IEnKF alone). This network is
that estimate, learned.

The network. The last K observations o_{m−K+1}, …, o_m of one stream, placed on the ring of d sites
(:meth:`~mpflow.operators.models.lorenz96.Lorenz96.on_sites`: NaN at a site not observed), as 2K channels — the
standardised value (o − 2.3) / 3.6 (Lorenz-96's climatological mean and sd at F = 8) where observed, else 0, and
the observed mask — plus three regime channels broadcast along the ring: log(Δ / 0.2), log R, F − 8. ``layers``
circular convolutions of width ``kernel`` and ``hidden`` channels (GELU; receptive field ±layers·(kernel − 1)/2
sites, shared along the ring, so one θ serves any d, any stride, any observed subset) and a 1 × 1 head give per site
a Gaussian

    x_m,i ~ N(μ_i, σ_i²),   μ_i = 2.3 + 3.6 · a_i,   σ_i = softplus(b_i) + σ_min,

μ and σ of the state at the newest observation's time. The unobserved sites are read off their observed neighbours'
recent history (the ring's dynamics dx_i/dt = (x_{i+1} − x_{i−2}) x_{i−1} − x_i + F tie them together); a lone
observation is not enough (its neighbours' mean misses the re-lock: 0.694 on the same twins).

Trained by the per-site CRPS of N(μ_i, σ_i²) against the simulated truth (:func:`gaussian_crps`, a strictly proper
scoring rule: minimised in expectation by the true conditional marginals; Gneiting & Raftery 2007, eq. 21) over the
task distribution of :mod:`mpflow.training.ring_train` (F, Δ, R, ``obs_every``): :mod:`mpflow.training.observer_train`.
"""

from __future__ import annotations

import math

import torch
from mpflow.operators.mpf.ring import _circular, learned_from_record
from torch import nn

#: the registry's ``architecture.kind`` of a ring observer (:func:`observer_from_record`)
ARCHITECTURE_KIND = "ring_observer"
#: Lorenz-96's climatological mean and sd of a variable at F = 8: the observations' standardisation
CLIMATE_MEAN, CLIMATE_SD = 2.3, 3.6
#: the least σ_i the observer answers (a floor: the CRPS of a collapsed Gaussian is not differentiable)
SD_MIN = 0.02
#: the regime channels: log(Δ / DELTA_SCALE), log R, F − F_CENTRE
DELTA_SCALE, F_CENTRE = 0.2, 8.0


class RingObserver(nn.Module):
    """The observer of the module docstring over the last ``history`` observations."""

    def __init__(self, history: int = 4, hidden: int = 32, layers: int = 6, kernel: int = 5):
        super().__init__()
        if kernel % 2 != 1:
            raise ValueError(f"kernel: an odd width, got {kernel}")
        self.config = {"history": history, "hidden": hidden, "layers": layers, "kernel": kernel}
        self.history = history
        body: list[nn.Module] = []
        for i in range(layers):
            body += [_circular(2 * history + 3 if i == 0 else hidden, hidden, kernel), nn.GELU()]
        self.body = nn.Sequential(*body)
        self.head = nn.Conv1d(hidden, 2, 1)

    def forward(
        self, window: torch.Tensor, delta: torch.Tensor, R: torch.Tensor, F: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``window`` [B, K, d]: the last K observations on the ring, oldest first, NaN at a site not observed;
        ``delta``, ``R``, ``F`` [B] → (μ [B, d], σ [B, d])."""
        seen = torch.isfinite(window)
        value = torch.where(seen, (window - CLIMATE_MEAN) / CLIMATE_SD, 0.0)
        regime = torch.stack([(delta / DELTA_SCALE).log(), R.log(), F - F_CENTRE], 1)
        x = torch.cat([value, seen.to(value.dtype), regime[:, :, None].expand(-1, -1, window.shape[-1])], 1)
        out = self.head(self.body(x.to(self.head.weight.dtype)))
        mean = CLIMATE_MEAN + CLIMATE_SD * out[:, 0]
        return mean, nn.functional.softplus(out[:, 1]) + SD_MIN

    def flops(self, d: int) -> float:
        """Multiply-adds ×2 of one evaluation on a ring of d sites (for the cost model)."""
        k, h, K = self.config["kernel"], self.config["hidden"], self.history
        return 2.0 * d * (k * (2 * K + 3) * h + (self.config["layers"] - 1) * k * h * h + 2 * h)


def gaussian_crps(mean: torch.Tensor, sd: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The CRPS of N(μ, σ²) at y, element-wise (Gneiting & Raftery 2007, eq. 21):
    σ [z (2 Φ(z) − 1) + 2 φ(z) − 1/√π], z = (y − μ)/σ."""
    z = (y - mean) / sd
    cdf = 0.5 * (1 + torch.erf(z / math.sqrt(2)))
    pdf = torch.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)
    return sd * (z * (2 * cdf - 1) + 2 * pdf - 1 / math.sqrt(math.pi))


def observer_from_record(record) -> RingObserver:
    """The trained observer (eval mode, float32) of a registry record whose ``architecture`` is
    ``{"kind": "ring_observer", <RingObserver's arguments>}``; ValueError otherwise."""
    return learned_from_record(record, ARCHITECTURE_KIND, RingObserver, "ring observer")


__all__ = ["ARCHITECTURE_KIND", "RingObserver", "gaussian_crps", "observer_from_record"]

"""A learned flow after the LETKF on a ring (``lorenz96``): the analysis that the Gaussian update misses.

The LETKF (:mod:`mpflow.operators.updaters.enkf`, ``localisation`` c) turns the forecast ensemble X^f into a
Gaussian-consistent analysis X^a: each variable's mean and anomalies are those of a Kalman update of the ensemble's
Gaussian fit. Where the forecast is strongly non-Gaussian (Lorenz-96 with Δ = 0.4 between observations: 8 Lyapunov
e-folding times of 0.05 … the prior is skewed and curved) that update is wrong, and a particle filter's weights
collapse at d = 40. This module transports X^a further along a learned velocity field in pseudo-time λ ∈ [0, 1] —
an MPF flow with the LETKF as its base step —

    dx_n,i/dλ = s_i · h_θ(features of member n around site i, λ)_i,        s_i the analysis ensemble's sd at site i,

integrated by RK4 in ``steps`` equal steps. h_θ is a stack of circular 1-D convolutions shared along the ring (a
kernel of width k per layer: a receptive field of ±L(k − 1)/2 sites, local like the LETKF's tapering, so the same θ
serves any d), with a DeepSet over the members after every layer (the member mean of the hidden channels,
concatenated back: h_θ is equivariant under permuting the members, as the analysis must be). Its input channels
per member n and site i (:meth:`RingFlow.context`, :meth:`RingFlow.features`):

* the member's standardised analysis anomaly (x_n,i(λ) − m^a_i) / s^a_i (changing with λ) and forecast anomaly
  (x^f_n,i − m^f_i) / s^f_i (which carries the forecast's skewness and curvature);
* the ensemble's m^a_i / 5, log s^a_i, log s^f_i and the analysis increment (m^a_i − m^f_i) / s^f_i;
* the observation where site i is observed: (o_i − m^a_i) / √R, (o_i − m^f_i) / √(R + (s^f_i)²), a mask;
* the regime: log(R), log(Δ / 0.2), F − 8 (broadcast), and λ.

The last layer starts at zero, so an untrained flow is the LETKF itself. Trained by the energy score of X(1) against
the simulated truth (:mod:`mpflow.training.ring_train`), which is minimised by the true filtering distribution, so the
flow may move the mean and widen or narrow the ensemble as the truth requires.
"""

from __future__ import annotations

from typing import Any

import torch
from mpflow.operators.models.base import ModelFamily
from mpflow.operators.rng import Generators
from mpflow.operators.state import ParticleState, StepInfo
from mpflow.operators.updaters.enkf import EnKFUpdater
from torch import nn

#: member channels (analysis anomaly, forecast anomaly) and shared channels (module docstring)
MEMBER_CHANNELS = 2
SHARED_CHANNELS = 4 + 3 + 3 + 1
#: the smallest sd a standardisation divides by
_SD_FLOOR = 1e-3


def _circular(c_in: int, c_out: int, kernel: int) -> nn.Conv1d:
    return nn.Conv1d(c_in, c_out, kernel, padding=kernel // 2, padding_mode="circular")


def learned_from_record(record, kind: str, build: type[nn.Module], what: str) -> nn.Module:
    """The trained ring network (eval mode, float32) of a registry record (:mod:`mpflow.operators.registry`) whose
    ``architecture`` is ``{"kind": kind, <build's arguments>}`` and whose family is ``lorenz96``; a ValueError naming
    ``what`` it is not, or its weights' misfit, otherwise (a ring correction, a ring observer)."""
    from mpflow.operators import registry

    arch = record.config.get("architecture")
    if not (isinstance(arch, dict) and arch.get("kind") == kind) or record.family != "lorenz96":
        raise ValueError(f"{record.name} is not a Lorenz-96 {what} (architecture {arch!r})")
    net = build(**{k: v for k, v in arch.items() if k != "kind"})
    try:
        net.load_state_dict(registry.load_weights(record))
    except RuntimeError as exc:
        raise ValueError(f"the weights of {record.name} do not fit its architecture ({exc})") from None
    return net.eval()


def ring_context(forecast: torch.Tensor, analysis: torch.Tensor, obs: torch.Tensor, model: ModelFamily) -> dict:
    """Everything fixed during one analysis: moments [B, d], the forecast anomalies [B, N, d] and the shared
    channels [B, C, d] (module docstring) from the forecast and LETKF ensembles [B, N, d] and obs [B, k]."""
    B, N, d = analysis.shape
    dtype = analysis.dtype
    mf, sf = forecast.mean(1), forecast.std(1).clamp_min(_SD_FLOOR)
    ma, sa = analysis.mean(1), analysis.std(1).clamp_min(_SD_FLOOR)
    p = model.expanded(B)
    R, delta, F = (p[k].to(dtype).reshape(B, 1) for k in ("R", "delta", "F"))
    idx = p["obs_index"].long().reshape(B, -1)
    o = obs.to(dtype).reshape(B, -1)
    seen = torch.isfinite(o)
    blank = torch.zeros(B, d, dtype=dtype, device=analysis.device)
    full = blank.scatter(1, idx, torch.where(seen, o, torch.zeros_like(o)))
    mask = blank.scatter(1, idx, seen.to(dtype))
    shared = torch.stack(
        [
            ma / 5.0,
            sa.log(),
            sf.log(),
            (ma - mf) / sf,
            mask * (full - ma) / R.sqrt(),
            mask * (full - mf) / (R + sf.square()).sqrt(),
            mask,
            R.log().expand(B, d),
            (delta / 0.2).log().expand(B, d),
            (F - 8.0).expand(B, d),
        ],
        1,
    )  # [B, C - 1, d]: λ is appended per evaluation
    return {"mean": ma, "sd": sa, "forecast_anomaly": (forecast - mf[:, None]) / sf[:, None], "shared": shared}


class RingFlow(nn.Module):
    """h_θ of the module docstring: ``layers`` circular convolutions of width ``kernel`` and ``hidden`` channels, a
    member-mean DeepSet after each, and the velocity bounded by ``bound`` analysis sds per unit λ."""

    def __init__(self, hidden: int = 32, layers: int = 4, kernel: int = 5, steps: int = 1, bound: float = 2.0):
        super().__init__()
        if kernel % 2 == 0 or kernel < 1:
            raise ValueError(f"kernel: an odd width, got {kernel}")
        self.config = {"hidden": hidden, "layers": layers, "kernel": kernel, "steps": steps, "bound": bound}
        self.steps, self.bound = steps, bound
        c_in = MEMBER_CHANNELS + SHARED_CHANNELS
        self.first = _circular(c_in, hidden, kernel)
        self.hidden = nn.ModuleList(_circular(2 * hidden, hidden, kernel) for _ in range(layers - 2))
        self.last = _circular(2 * hidden, 1, kernel)
        nn.init.zeros_(self.last.weight)  # an untrained flow is the identity: the LETKF's analysis
        nn.init.zeros_(self.last.bias)

    # ------------------------------------------------------------------ per analysis step
    context = staticmethod(ring_context)

    def velocity(self, x: torch.Tensor, lam: float, ctx: dict) -> torch.Tensor:
        """dx/dλ [B, N, d] at members x [B, N, d] (module docstring)."""
        B, N, d = x.shape
        u = (x - ctx["mean"][:, None]) / ctx["sd"][:, None]
        member = torch.stack([u, ctx["forecast_anomaly"]], 2)  # [B, N, 2, d]
        shared = torch.cat([ctx["shared"], torch.full_like(ctx["shared"][:, :1], lam)], 1)  # [B, C, d]
        h = torch.cat([member, shared[:, None].expand(B, N, -1, d)], 2).reshape(B * N, -1, d)
        h = torch.tanh(self.first(h))
        for layer in [*self.hidden, self.last]:
            pooled = h.reshape(B, N, -1, d).mean(1, keepdim=True).expand(B, N, -1, d).reshape(B * N, -1, d)
            h = layer(torch.cat([h, pooled], 1))
            if layer is not self.last:
                h = torch.tanh(h)
        v = self.bound * torch.tanh(h.reshape(B, N, d) / self.bound)
        return ctx["sd"][:, None] * v

    def forward(self, forecast: torch.Tensor, analysis: torch.Tensor, obs: torch.Tensor, model: ModelFamily):
        """X(1) [B, N, d]: the LETKF's analysis transported over λ ∈ [0, 1] by RK4 in ``steps`` steps."""
        ctx = self.context(forecast, analysis, obs, model)
        x, h = analysis, 1.0 / self.steps
        for k in range(self.steps):
            lam = k * h
            k1 = self.velocity(x, lam, ctx)
            k2 = self.velocity(x + 0.5 * h * k1, lam + 0.5 * h, ctx)
            k3 = self.velocity(x + 0.5 * h * k2, lam + 0.5 * h, ctx)
            k4 = self.velocity(x + h * k3, lam + h, ctx)
            x = x + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
        return x


class RingLETKF(EnKFUpdater):
    """The LETKF followed by a trained :class:`RingFlow` (module docstring); options as ``enkf``'s (``localisation``
    required). Serves the ``lorenz96`` family with a linear observation."""

    def __init__(self, flow: RingFlow, **options: Any):
        super().__init__(**options)
        if self.options["localisation"] is None:
            raise ValueError("options.localisation: the ring flow follows the LETKF; give its half-width")
        self.flow = flow.eval()

    def check_compatible(self, model: ModelFamily, prior=None) -> None:
        super().check_compatible(model, prior)
        if model.name != "lorenz96" or not model.linear_observation():
            raise ValueError("the ring flow serves lorenz96 with a linear observation (no arctan)")

    def _update(self, state: ParticleState, obs: torch.Tensor, model: ModelFamily, gens: Generators):
        B, N, _ = state.particles.shape
        forecast = model.transition(state.particles, gens)
        xa, log_pred = self.analysis(forecast, obs, model, gens)
        dtype = next(self.flow.parameters()).dtype
        with torch.no_grad():
            x = self.flow(forecast.to(dtype), xa.to(dtype), obs, model.to(dtype))
        n = torch.full((B,), float(N), dtype=torch.float64)
        return state.replace(particles=x.to(state.particles.dtype)), StepInfo(log_pred, n)


__all__ = ["RingFlow", "RingLETKF", "ring_context"]

"""A learned local correction of the LETKF's analysis on a ring (``lorenz96``): one network evaluation, no ODE. The
same network corrects the iterative EnKF's analysis (``ring_train --base ienkf``; served as ``ienkf``'s
``correction``, :func:`correction_from_record`).

The LETKF (:mod:`mpflow.operators.updaters.enkf`) gives each variable i the analysis of a Kalman update of the local
ensemble's Gaussian fit: mean m^a_i, sd s^a_i, members x^a_n,i. At Δ = 0.4 between observations the forecast is
skewed and curved and that Gaussian analysis is biased (PSEF, arXiv 2606.26497, §4: a learned correction on top of
the EnKF is the better choice while the posterior stays near-Gaussian; Bocquet et al. 2024, arXiv 2408.04739: a
residual analysis on the ensemble). This module corrects it, per site and shared along the ring,

    x'_n,i = m^a_i + s^a_i · (δ_i + exp(α_i) · u_n,i + v_n,i − (1/N) Σ_k v_k,i),   u_n,i = (x^a_n,i − m^a_i) / s^a_i,

so the new mean is m^a_i + s^a_i δ_i and the anomalies are the LETKF's, rescaled by exp(α_i) (a learned, local
inflation) and bent by a member-wise nonlinear term v (what a Gaussian transform cannot do: skew, curvature).

* a member embedding e_n = tanh(conv_k([u_n, u^f_n])) (u^f the standardised forecast anomaly, which carries the
  forecast's skewness) and its member mean ē (a DeepSet: ē is a learned set of local moments, invariant under
  permuting the members);
* a site network on [B, C, d] — the ring channels of :func:`~mpflow.operators.mpf.ring.ring_context` (moments,
  increment, innovations, the observation mask, log R, log Δ, F) and ē — of ``layers`` circular convolutions of
  width ``kernel`` (receptive field ±layers·(kernel − 1)/2 sites, local like the LETKF's taper, so one θ serves any
  d) giving δ_i, α_i and a site code H_i;
* v_n,i = MLP_1×1([e_n,i, H_i]): members see their site's code only, so the cost per member is two 1 × 1 layers.

The output is equivariant under permuting the members, δ, α and v are bounded (``bound`` sds, |α| ≤ 1), and the last
layers start at zero: an untrained correction is the LETKF itself.

``gate`` (``ring_train --gate``): the correction is scaled by a learned gate of the regime,

    X'' = X^a + γ(z) · (X' − X^a),   γ(z) = tanh(MLP(z)),   z = (log R, log(Δ/0.2), observed fraction, log q),

q the mean over the observed sites of the squared innovation standardised by R + s^f² (an innovation statistic: near
1 when the forecast is calibrated). The gate's last layer starts at zero, so the untrained gate is exactly the base
analysis whatever the correction's θ (its last layers then start small and random instead of zero: with both zero
the gradient of each would be zero); a regime where the correction does not pay can learn γ = 0 and keep the base.

``mean_only`` (``ring_train --mean-only``): X' = X^a + s^a δ — the mean shift alone, the base's anomalies kept (no
inflation α, no bend v): the correction cannot narrow an ensemble whose spread the base's ρ was tuned to keep.

The member-independent work runs once per twin,
not once per member — a step costs a small multiple of the LETKF's. Trained by the energy score of X' against the
simulated truth (:mod:`mpflow.training.ring_train`, ``--arch correction``).
"""

from __future__ import annotations

import itertools

import torch
from mpflow.operators.mpf.ring import SHARED_CHANNELS, _circular, learned_from_record, ring_context
from torch import nn

#: the shared ring channels of ring_context (λ, a flow's pseudo-time, is not one of them here)
CONTEXT_CHANNELS = SHARED_CHANNELS - 1


class RingCorrection(nn.Module):
    """The correction of the module docstring: member embedding of ``embed`` channels, a site network of ``layers``
    circular convolutions of width ``kernel`` and ``hidden`` channels, corrections bounded by ``bound`` sds."""

    def __init__(
        self,
        hidden: int = 48,
        layers: int = 4,
        kernel: int = 5,
        embed: int = 16,
        bound: float = 2.0,
        gate: int = 0,
        mean_only: int = 0,
    ):
        super().__init__()
        if kernel % 2 == 0 or kernel < 1 or layers < 2:
            raise ValueError(f"kernel: an odd width and layers ≥ 2, got kernel {kernel}, layers {layers}")
        self.config = {"hidden": hidden, "layers": layers, "kernel": kernel, "embed": embed, "bound": bound}
        if gate:  # the keys only when set: an operator's config without them is as before
            self.config["gate"] = gate
        if mean_only:
            self.config["mean_only"] = 1
        self.mean_only = bool(mean_only)
        self.bound = bound
        self.embed = _circular(2, embed, kernel)
        sizes = [CONTEXT_CHANNELS + embed] + [hidden] * (layers - 1)
        self.site = nn.ModuleList(_circular(a, b, kernel) for a, b in itertools.pairwise(sizes))
        self.site_out = _circular(hidden, 2, kernel)  # δ, α
        self.member = nn.Sequential(nn.Conv1d(embed + hidden, embed, 1), nn.Tanh(), nn.Conv1d(embed, 1, 1))
        #: the regime gate γ(z) (``gate`` hidden units), None without one
        self.gate = nn.Sequential(nn.Linear(GATE_FEATURES, gate), nn.Tanh(), nn.Linear(gate, 1)) if gate else None
        for last in (self.site_out, self.member[-1]):  # untrained: the LETKF's analysis (gated: small, random)
            if gate:
                last.weight.data.mul_(0.1)
                last.bias.data.zero_()
            else:
                nn.init.zeros_(last.weight)
                nn.init.zeros_(last.bias)
        if gate:  # γ = 0: the base analysis exactly
            nn.init.zeros_(self.gate[-1].weight)
            nn.init.zeros_(self.gate[-1].bias)

    def forward(self, forecast: torch.Tensor, analysis: torch.Tensor, obs: torch.Tensor, model) -> torch.Tensor:
        """X' [B, N, d] from the forecast and LETKF ensembles [B, N, d] and the observations [B, k]."""
        B, N, d = analysis.shape
        ctx = ring_context(forecast, analysis, obs, model)
        m, s = ctx["mean"][:, None], ctx["sd"][:, None]
        u = (analysis - m) / s
        e = torch.tanh(self.embed(torch.stack([u, ctx["forecast_anomaly"]], 2).reshape(B * N, 2, d)))
        e = e.reshape(B, N, -1, d)
        h = torch.cat([ctx["shared"], e.mean(1)], 1)  # [B, C, d]
        for layer in self.site:
            h = torch.tanh(layer(h))
        out = self.site_out(h)
        delta = self.bound * torch.tanh(out[:, 0] / self.bound)[:, None]  # [B, 1, d]
        alpha = torch.tanh(out[:, 1])[:, None]
        shift = s * delta  # X' − X^a
        if not self.mean_only:
            code = torch.cat([e, h[:, None].expand(B, N, -1, d)], 2).reshape(B * N, -1, d)
            v = self.bound * torch.tanh(self.member(code).reshape(B, N, d) / self.bound)
            shift = shift + s * ((alpha.exp() - 1) * u + v - v.mean(1, keepdim=True))
        if self.gate is None:
            return analysis + shift
        return analysis + self.gamma(ctx["shared"]) * shift

    def gamma(self, shared: torch.Tensor) -> torch.Tensor:
        """The gate γ(z) [B, 1, 1] (module docstring) from the ring channels [B, C, d] of ``ring_context``."""
        return torch.tanh(self.gate(gate_features(shared)))[:, :, None]

    def flops(self, n: int, d: int) -> float:
        """Multiply-adds × 2 of one :meth:`forward` on n members of a ring of d sites: the member embedding
        (2 → embed channels, width kernel) and the member MLP ((embed + hidden) → embed → 1) per member and site, the
        site convolutions per site, and about 40 n d for the context's moments and the output's arithmetic."""
        c = self.config
        k, e, h, L = c["kernel"], c["embed"], c["hidden"], c["layers"]
        member = 2.0 * (2 * e * k + (e + h) * e + e)
        site = 2.0 * k * ((CONTEXT_CHANNELS + e) * h + (L - 2) * h * h + 2 * h)
        gate = 2.0 * (GATE_FEATURES + 2) * c.get("gate", 0) + 4.0 * d
        return n * d * (member + 40.0) + d * site + gate


#: the gate's inputs: log R, log(Δ/0.2), the observed fraction and the log mean squared standardised innovation
GATE_FEATURES = 4


def gate_features(shared: torch.Tensor) -> torch.Tensor:
    """z [B, 4] of the gate from the ring channels [B, C, d] of :func:`~mpflow.operators.mpf.ring.ring_context`
    (channel 5: the innovation (o − m^f)/√(R + s^f²) on observed sites, 6: the mask, 7: log R, 8: log(Δ/0.2))."""
    mask = shared[:, 6]
    seen = mask.sum(-1).clamp_min(1.0)
    q = (shared[:, 5].square() * mask).sum(-1) / seen
    return torch.stack([shared[:, 7, 0], shared[:, 8, 0], mask.mean(-1), q.clamp_min(1e-6).log()], -1)


#: ``config.json``'s ``architecture.kind`` of a correction in the registry (an MPF operator's architecture has none)
ARCHITECTURE_KIND = "ring_correction"


def correction_from_record(record) -> RingCorrection:
    """The trained correction (eval mode, float32) of a registry record whose ``architecture`` is
    ``{"kind": "ring_correction", <RingCorrection's arguments>}``; ValueError otherwise."""
    return learned_from_record(record, ARCHITECTURE_KIND, RingCorrection, "ring correction")


__all__ = ["ARCHITECTURE_KIND", "RingCorrection", "correction_from_record"]

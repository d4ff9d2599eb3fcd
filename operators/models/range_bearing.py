"""``range_bearing``: a constant-velocity target seen by one range-bearing sensor (the tracking textbook model;
Bar-Shalom, Li & Kirubarajan 2001, §6.2.2 and §10.3).

State x = (p_x, p_y, v_x, v_y). Over a step of duration Δ (``dt``) the velocity takes the white-noise acceleration
of intensity q (the continuous white noise acceleration model):

    x_m = F x_{m-1} + N(0, Q),   F = [[I, Δ I], [0, I]],   Q = q [[Δ³/3 I, Δ²/2 I], [Δ²/2 I, Δ I]]   (2×2 blocks).

A sensor at s = (s_x, s_y) measures the range and the bearing (radians, counter-clockwise from the x axis):

    o = (‖p − s‖, atan2(p_y − s_y, p_x − s_x)) + N(0, diag(σ_r², σ_b²)).

The bearing's residual is wrapped into [−π, π) wherever it is formed
(:mod:`mpflow.operators.models.diagonal_observation`), so a target passing behind the sensor — its bearing crossing
±π — moves the posterior smoothly. The transition is affine, so every method runs it; the likelihood is curved (a
banana around the sensor when the range is short).
Partial observations: a range alone or a bearing alone (``[r, null]``, ``[null, b]``) conditions on that entry; a
step with no detection is ``null``.
"""

from __future__ import annotations

from typing import Any

import torch
from mpflow.operators import validation
from mpflow.operators.models.base import ModelFamily, scaled_step, span
from mpflow.operators.models.diagonal_observation import DiagonalGaussianObservation
from mpflow.operators.models.spec import FamilySpec, kind, parse_positive

STATE_NAMES = ("px", "py", "vx", "vy")
#: a guard that keeps the range's gradient finite at the sensor itself
RANGE_EPS = 1e-12
#: the meta-training geometry (:class:`mpflow.training.family_tasks.range_bearing.RangeBearingTasks`), drawn
#: log-uniformly where a range is a scale: noise and acceleration intensities of real sensors and targets, the
#: prior's centre at a range from the sensor, its speed, and its position and velocity variances (the benchmark's
#: crossing and close pass lie inside)
TASK_RANGES = {
    "q": (0.005, 0.2),
    "range_sd": (0.1, 1.0),
    "bearing_sd": (0.02, 0.3),
    "prior range": (2.0, 12.0),
    "prior speed": (0.2, 1.5),
    "prior position variance": (0.1, 2.0),
    "prior velocity variance": (0.005, 0.5),
}


@kind("point [x, y]")
def parse_point(name: str, value, d: int, dtype) -> torch.Tensor:
    """A point of the plane: [x, y]."""
    return validation.vector(name, value, 2, dtype)


class RangeBearing(DiagonalGaussianObservation):
    name = "range_bearing"
    dynamic = True
    fixed_state_dim = 4
    angular = (1,)
    spec = FamilySpec(
        description=(
            "constant-velocity target x = (px, py, vx, vy), acceleration noise q; a sensor at `sensor` measures range "
            "and bearing (radians, wrapped at ±π) with noise sd range_sd, bearing_sd"
        ),
        observation="[range, bearing]; null for an entry not measured",
        params=(
            ("dt", parse_positive, lambda d, dtype: torch.tensor(1.0, dtype=dtype)),
            ("q", parse_positive, lambda d, dtype: torch.tensor(0.1, dtype=dtype)),
            ("sensor", parse_point, lambda d, dtype: torch.zeros(2, dtype=dtype)),
            ("range_sd", parse_positive, lambda d, dtype: torch.tensor(1.0, dtype=dtype)),
            ("bearing_sd", parse_positive, lambda d, dtype: torch.tensor(0.05, dtype=dtype)),
        ),
    )

    # ----------------------------------------------------------------- dynamics
    def at_step(self, dt: float = 1.0, u: torch.Tensor | None = None, field: str = "observation") -> ModelFamily:
        """A step lasting ``dt`` model steps: the interval Δ·dt (Δ = ``model.params.dt``)."""
        return scaled_step(self, "dt", dt, u, field)

    def transition_affine(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        dt, q = self.params["dt"], self.params["q"]
        B, dtype = dt.shape[0], dt.dtype
        eye = torch.eye(2, dtype=dtype).expand(B, 2, 2)
        t = dt[:, None, None]
        zero, one = torch.zeros_like(eye), eye
        F = torch.cat([torch.cat([one, t * eye], -1), torch.cat([zero, one], -1)], -2)
        Q = q[:, None, None] * torch.cat(
            [torch.cat([t**3 / 3 * eye, t**2 / 2 * eye], -1), torch.cat([t**2 / 2 * eye, t * eye], -1)], -2
        )
        return F, torch.zeros(B, 4, dtype=dtype), Q

    # ----------------------------------------------------------------- observation
    def observed_mean(self, x: torch.Tensor) -> torch.Tensor:
        """(‖p − s‖, atan2(p_y − s_y, p_x − s_x))."""
        return self._geometry(x)[2]

    def _geometry(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(p − s [B, N, 2], ‖p − s‖² [B, N, 1], h(x) [B, N, 2]) for x [B, N, 4]."""
        rel = x[..., :2] - self.params["sensor"][:, None].to(x.dtype)
        r2 = (rel * rel).sum(-1, keepdim=True)
        return rel, r2, torch.cat([torch.sqrt(r2 + RANGE_EPS), torch.atan2(rel[..., 1:], rel[..., :1])], -1)

    def observation_sd(self) -> torch.Tensor:
        return torch.stack([self.params["range_sd"], self.params["bearing_sd"]], -1)

    def score(self, obs: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """∇x log p = Jᵀ (r ⊘ s²) over the observed entries, J the Jacobian of h: ∂ρ/∂p = (p − s)/ρ,
        ∂θ/∂p = (−(p_y − s_y), p_x − s_x)/ρ²; the velocity is not observed."""
        s = self.observation_sd().to(x.dtype)[:, None]
        rel, r2, h = self._geometry(x)
        w = self._weighted_by_seen(self.observation_residual(obs.to(x.dtype), h) / (s * s))
        d_range = rel / h[..., :1]
        d_bearing = torch.cat([-rel[..., 1:], rel[..., :1]], -1) / r2.clamp_min(torch.finfo(x.dtype).tiny)
        grad_p = w[..., :1] * d_range + w[..., 1:] * d_bearing
        return torch.cat([grad_p, torch.zeros_like(grad_p)], -1)

    @classmethod
    def state_names(cls, d: int) -> list[str]:
        """x = (p_x, p_y, v_x, v_y): position and velocity in the plane."""
        return list(STATE_NAMES)

    # ----------------------------------------------------------------- meta-training tasks
    @classmethod
    def task_domain(cls, options: dict[str, Any]) -> dict[str, list[float]]:
        """``TASK_RANGES`` as trained (the sensor at the origin)."""
        return {"sensor": [0.0, 0.0], **{k: [float(lo), float(hi)] for k, (lo, hi) in TASK_RANGES.items()}}

    def domain_measures(self, prior_mean: torch.Tensor, prior_cov: torch.Tensor) -> dict[str, tuple[float, float]]:
        p = {k: self.params[k][0].to(torch.float64) for k in ("q", "range_sd", "bearing_sd", "sensor")}
        m, var = prior_mean.to(torch.float64), prior_cov.to(torch.float64).diagonal()
        return {
            "sensor": span(p["sensor"]),
            **{k: span(p[k]) for k in ("q", "range_sd", "bearing_sd")},
            "prior range": span(torch.linalg.vector_norm(m[:2] - p["sensor"])),
            "prior speed": span(torch.linalg.vector_norm(m[2:])),
            "prior position variance": span(var[:2]),
            "prior velocity variance": span(var[2:]),
        }

    @classmethod
    def example_params(cls, d: int) -> dict[str, Any]:
        """The defaults: a sensor at the origin, Δ = 1, q = 0.1."""
        return {}

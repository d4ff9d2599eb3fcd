"""``range_bearing``'s meta-training tasks, evaluation and benchmark settings (:class:`RangeBearingTasks`)."""

from __future__ import annotations

import math
from typing import Any

import torch
from mpflow.operators.models.base import ModelFamily
from mpflow.operators.models.priors import GaussianMixture
from mpflow.operators.models.range_bearing import TASK_RANGES, RangeBearing
from mpflow.operators.rng import Generators
from mpflow.training.task_distribution import FamilyTasks, register_tasks, stack_params
from mpflow.training.task_priors import uniform

#: the task ranges drawn log-uniformly (a scale: noise and acceleration intensities, variances); the others
#: uniformly
LOG_UNIFORM = ("q", "range_sd", "bearing_sd", "prior position variance", "prior velocity variance")


@register_tasks
class RangeBearingTasks(FamilyTasks):
    family = RangeBearing

    benchmark_model = "dt = 1, q = 0.1, sensor at the origin, range_sd = 1, bearing_sd = 0.05"

    latency_benchmark = False

    eval_steps = 30

    def sample_task_models(
        self, gens: Generators, d: int, dtype: torch.dtype, options: dict[str, Any]
    ) -> tuple[ModelFamily, GaussianMixture]:
        """Tracking geometries (``TASK_RANGES``; log-uniform for noise levels and variances, uniform otherwise):
        the sensor at the origin, q, σ_r and σ_b per task; the prior N(m, diag(v_p, v_p, v_v, v_v)) centred on a
        target at a range from the sensor in a uniform direction, moving at a speed in a uniform heading — so
        tasks include targets passing close to the sensor and behind it (bearing through ±π)."""
        draw = {}
        for name, (lo, hi) in TASK_RANGES.items():
            if name in LOG_UNIFORM:
                draw[name] = torch.exp(uniform(gens, [1], math.log(lo), math.log(hi), torch.float64))[:, 0]
            else:
                draw[name] = uniform(gens, [1], lo, hi, torch.float64)[:, 0]
        angles = uniform(gens, [2], -math.pi, math.pi, torch.float64)
        model = stack_params(
            self.family,
            [{k: float(draw[k][b]) for k in ("q", "range_sd", "bearing_sd")} for b in range(len(gens))],
            d,
            dtype,
        )
        direction = torch.stack([angles.cos(), angles.sin()], -1)  # [B, 2 (position, heading), 2]
        scale = torch.stack([draw["prior range"], draw["prior speed"]], -1)[..., None]  # [B, 2, 1]
        mean = (scale * direction).flatten(1)  # (px, py, vx, vy)
        var = torch.stack([draw["prior position variance"]] * 2 + [draw["prior velocity variance"]] * 2, -1)
        return model, GaussianMixture.gaussian(mean.to(dtype), torch.diag_embed(var).to(dtype))

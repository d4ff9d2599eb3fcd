"""``GET /v1/streams/{id}/forecast``: the predictive distributions of the state and of the observation 1..k steps
ahead (docs/API.md), read off the stored state without changing it.

The engine computes them (:meth:`mpflow.operators.updaters.Updater.forecast`: exact for ``kalman``, by propagating
the particles for the other methods); here they become the answer: per horizon j the mean, covariance and marginal
quantiles — the Gaussian's m + z_q σ where the predictive is exact, else the weighted particles' (the definitions
of :mod:`mpflow.service.engine.summary`) — and, on request, n draws of each (from the Gaussian, or the particles
resampled by weight). Draws come from a generator seeded from (stream seed, step), so the same stream at the same
step gives the same forecast. The read is priced with its stored state and placed by that price
(:mod:`mpflow.service.streams.state_reads`).
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from mpflow.operators import gaussian
from mpflow.operators.models.base import ModelFamily
from mpflow.operators.rng import generator
from mpflow.operators.state import ParticleState
from mpflow.operators.updaters import Updater
from mpflow.operators.updaters.predictive import Predictive
from mpflow.service.engine.numerics import finite_json
from mpflow.service.engine.summary import QUANTILES, batch_weighted_quantiles, level_key
from mpflow.service.errors import invalid, too_large
from mpflow.service.settings import Settings
from mpflow.service.streams import costs
from mpflow.service.streams.deps import StreamPart
from mpflow.service.streams.documents import state_names
from mpflow.service.streams.state_reads import reading

_Z = torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor(QUANTILES, dtype=torch.float64))


def finite(pred: Predictive) -> bool:
    """Whether every moment of the predictive is finite (a long horizon of an unstable model overflows)."""
    parts = [pred.state_mean, pred.state_cov, pred.observation_mean, pred.observation_cov]
    return all(bool(torch.isfinite(t).all()) for t in parts if t is not None)


def forecast_seed(seed: int, step: int) -> int:
    """A 63-bit seed for the forecast draws of stream ``seed`` at ``step`` (independent of its update generator)."""
    digest = hashlib.sha256(f"mpflow-forecast:{seed}:{step}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _part(
    mean: torch.Tensor, cov: torch.Tensor, cloud: torch.Tensor | None, lw: torch.Tensor | None, n: int, g
) -> list[dict[str, Any]]:
    """One predictive (of the state or of the observation) per horizon: mean [k, p], cov [k, p, p], quantiles, and
    ``n`` draws when asked."""
    std = torch.diagonal(cov, dim1=-2, dim2=-1).clamp_min(0).sqrt()
    if cloud is None:
        qs = mean[:, None] + _Z[None, :, None] * std[:, None]
    else:
        w = torch.softmax(lw, -1).expand(cloud.shape[0], -1)
        qs = batch_weighted_quantiles(cloud, w, QUANTILES)
    out = []
    for j in range(mean.shape[0]):
        entry: dict[str, Any] = {
            "mean": mean[j].tolist(),
            "cov": cov[j].tolist(),
            "quantiles": {level_key(q): row for q, row in zip(QUANTILES, qs[j].tolist(), strict=True)},
        }
        if n > 0:
            if cloud is None:
                xi = torch.randn(n, mean.shape[1], generator=g, dtype=torch.float64)
                draws = mean[j] + xi @ gaussian.cholesky(cov[j]).T
            else:
                draws = cloud[j][torch.multinomial(torch.softmax(lw, -1), n, replacement=True, generator=g)]
            entry["samples"] = draws.tolist()
        out.append(entry)
    return out


def document(
    stream_id: str, step: int, dt: float, pred: Predictive, n: int, g, names: list[str] | None = None
) -> dict[str, Any]:
    """The forecast answer of docs/API.md; ``names``: the stream's ``state_names`` (None: it has none)."""
    states = _part(pred.state_mean, pred.state_cov, pred.state_cloud, pred.log_weights, n, g)
    observations: list[dict[str, Any] | None] = [None] * len(states)
    if pred.observation_mean is not None and pred.observation_cov is not None:
        observations = list(
            _part(pred.observation_mean, pred.observation_cov, pred.observation_cloud, pred.log_weights, n, g)
        )
    horizons = [
        {"step": step + j + 1, "t": (j + 1) * dt, "state": s, "observation": o}
        for j, (s, o) in enumerate(zip(states, observations, strict=True))
    ]
    return {"stream_id": stream_id, "step": step, "state_names": names, "forecast": horizons}


def check_work(
    settings: Settings, meta: dict[str, Any], model: ModelFamily, updater: Updater, steps: int, dt: float, samples: int
) -> costs.Cost:
    """The forecast's estimated cost; 413 before any tensor work for a ``dt`` that integrates in too many
    sub-steps, or a forecast over the cost model's budget (:mod:`mpflow.service.streams.costs`): ``samples`` named when
    even one horizon of them is over it, else ``steps``, with how many fit."""
    costs.check_substeps(settings, model, dt, "")
    n = int(meta["num_particles"])
    what = f"a forecast of this {meta['method']} stream (N = {n}, d = {model.state_dim})"
    if samples > 0:
        costs.check(settings, "samples", samples, lambda m: costs.forecast_cost(model, updater, n, 1, dt, m), what)
    return costs.check(settings, "steps", steps, lambda k: costs.forecast_cost(model, updater, n, k, dt, samples), what)


class Forecasts(StreamPart):
    """Answers forecast requests (module docstring)."""

    async def forecast(self, tenant: str, stream_id: str, steps: int, dt: float, samples: int) -> dict[str, Any]:
        """The answer to ``GET .../forecast?steps=&dt=&samples=``; 413 over ``max_forecast_steps`` or
        ``max_samples_per_request``, 422 for a ``dt`` the model cannot take."""
        if steps > self.settings.max_forecast_steps:
            limit = self.settings.max_forecast_steps
            raise too_large(f"steps: at most {limit} steps ahead (MPFLOW_MAX_FORECAST_STEPS), got {steps}")
        if samples > self.settings.max_samples_per_request:
            limit = self.settings.max_samples_per_request
            raise too_large(f"samples: at most {limit} draws (MPFLOW_MAX_SAMPLES_PER_REQUEST), got {samples}")
        peeked = await self.reads.peek(tenant, stream_id)  # priced before its state is fetched (.state_reads)
        meta = peeked.meta
        model, updater = await self.work.off_loop(self.methods.resolve, meta)
        cost = check_work(self.settings, meta, model, updater, steps, dt, samples)
        try:
            step_model = model.at_step(dt, None, "")
        except ValueError as exc:
            raise invalid(str(exc)) from None

        names = state_names(meta)

        def compute(meta: dict[str, Any], data: bytes) -> dict[str, Any]:
            state = ParticleState.from_bytes(data)
            step = int(state.step[0])
            g = generator(forecast_seed(int(meta["seed"]), step))
            with torch.inference_mode():
                try:
                    pred = updater.forecast(state, step_model, steps, g)
                    doc = document(stream_id, step, dt, pred, samples, g, names) if finite(pred) else None
                except (ValueError, RuntimeError):  # a covariance that is no longer one (overflow)
                    doc = None
            if doc is None or not finite_json(doc):
                raise invalid(
                    f"steps, dt: the forecast over {steps} steps of {dt:g} is not finite in floating point; forecast "
                    "fewer or shorter steps"
                )
            return doc

        return await self.reads.run(peeked, reading(peeked.size, cost), compute, off_loop=True)


__all__ = ["Forecasts", "check_work", "document", "forecast_seed"]

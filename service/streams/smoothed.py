"""``GET /v1/streams/{id}/smoothed``: the fixed-lag smoothed marginals p(x_s | o_1..t), s = t − min(L, t) + 1 … t,
of a stream created with ``smoothing_lag`` L ≥ 1 (docs/API.md), read off its stored state without changing it.

The stream's method computes them from the window its state carries (``Updater.smoothed``:
:mod:`mpflow.operators.smoothing` — exact RTS for ``kalman``, FFBSm or backward simulation for ``smc``, the
ensemble RTS smoother for the other methods); here they become the answer. The work is priced before it starts
(:func:`~mpflow.service.streams.costs.smoothing_cost`: 413 naming ``smoothing_lag`` over the budget, which creation
already refused); a read using more than :data:`~mpflow.service.streams.costs.HEAVY_SHARE` of the budget runs on
the engine's thread for heavy reads (:meth:`~mpflow.service.engine.update_engine.UpdateEngine.run_heavy`), so that
concurrent large reads wait for one another and not the auxiliary threads other requests need. A stream without
a window is answered 409 ``smoothing_disabled``, saying how to make one that has it.
"""

from __future__ import annotations

from typing import Any

import torch
from mpflow.operators.state import ParticleState
from mpflow.service.engine import views
from mpflow.service.engine.numerics import finite_json
from mpflow.service.errors import ApiError, invalid
from mpflow.service.streams import costs
from mpflow.service.streams.deps import StreamPart


def disabled(stream_id: str) -> ApiError:
    """409 for a stream that keeps no smoothing window."""
    return ApiError(
        409,
        "smoothing_disabled",
        f"smoothing_lag: stream {stream_id!r} was created with smoothing_lag 0 and keeps no smoothing window; create "
        'the stream with "smoothing_lag": L (1 to 100) to read p(x_s | o_1..t) for its last L steps',
    )


def document(stream_id: str, lag: int, step: int, steps: list[int], means: list, covs: list) -> dict[str, Any]:
    """The answer of docs/API.md."""
    rows = [{"step": s, "mean": m, "cov": c} for s, m, c in zip(steps, means, covs, strict=True)]
    return {"stream_id": stream_id, "step": step, "lag": lag, "steps": rows}


class Smoothing(StreamPart):
    """Answers ``GET .../smoothed`` (module docstring)."""

    async def smoothed(self, tenant: str, stream_id: str) -> dict[str, Any]:
        meta, data = await views.read(self.store, tenant, stream_id)
        lag = int(meta.get("smoothing_lag") or 0)
        if lag == 0:
            raise disabled(stream_id)
        model, updater = await self.work.off_loop(self.methods.resolve, meta)
        n, d = int(meta["num_particles"]), int(meta["state_dim"])
        what = f"the smoothed marginals of this {meta['method']} stream (L = {lag}, N = {n}, d = {d})"
        cost = costs.check(
            self.settings, "smoothing_lag", lag, lambda m: costs.smoothing_cost(model, updater, n, m), what
        )

        def compute() -> dict[str, Any]:
            state = ParticleState.from_bytes(data)
            with torch.inference_mode():
                out = updater.smoothed(state)
            doc = document(
                stream_id, lag, int(state.step[0]), out.steps.tolist(), out.means.tolist(), out.covs.tolist()
            )
            if not finite_json(doc):
                raise invalid("smoothing_lag: the smoothed marginals are not finite in floating point")
            return doc

        if costs.heavy(self.settings, cost):  # a large window: on the heavy reads' own thread, one at a time
            return await self.work.heavy(compute)
        return await self.work.off_loop(compute)


__all__ = ["Smoothing", "disabled", "document"]

"""``GET /v1/streams/{id}/smoothed``: the fixed-lag smoothed marginals p(x_s | o_1..t), s = t − min(L, t) + 1 … t,
of a stream created with ``smoothing_lag`` L ≥ 1 (docs/API.md), read off its stored state without changing it.

The stream's method computes them from the window its state carries (``Updater.smoothed``:
:mod:`mpflow.operators.smoothing` — exact RTS for ``kalman``, FFBSm or backward simulation for ``smc``, the
ensemble RTS smoother for the other methods); here they become the answer. The work is priced before it starts
(:func:`~mpflow.service.streams.costs.smoothing_cost`: 413 naming ``smoothing_lag`` over the budget, which creation
already refused), with the fetch and decode of its stored state; a read using more than
:data:`~mpflow.service.streams.costs.HEAVY_SHARE` of the budget fetches its state in the process's heavy-read slot and
runs on the engine's thread for heavy reads (:mod:`mpflow.service.streams.state_reads`), so that concurrent large
reads wait for one another and not the auxiliary threads, or the store calls, other requests need. A stream without
a window is answered 409 ``smoothing_disabled``, saying how to make one that has it.
"""

from __future__ import annotations

from typing import Any

import torch
from mpflow.operators.state import ParticleState
from mpflow.service.engine.numerics import finite_json
from mpflow.service.errors import ApiError, invalid
from mpflow.service.streams import costs
from mpflow.service.streams.deps import StreamPart
from mpflow.service.streams.state_reads import state_cost


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
        peeked = await self.reads.peek(tenant, stream_id)  # priced before its state is fetched (.state_reads)
        meta = peeked.meta
        lag = int(meta.get("smoothing_lag") or 0)
        if lag == 0:
            raise disabled(stream_id)
        model, updater = await self.work.off_loop(self.methods.resolve, meta)
        n, d = int(meta["num_particles"]), int(meta["state_dim"])
        what = f"the smoothed marginals of this {meta['method']} stream (L = {lag}, N = {n}, d = {d})"
        cost = costs.check(
            self.settings, "smoothing_lag", lag, lambda m: costs.smoothing_cost(model, updater, n, m), what
        )

        def compute(meta: dict[str, Any], data: bytes) -> dict[str, Any]:
            state = ParticleState.from_bytes(data)
            with torch.inference_mode():
                out = updater.smoothed(state)
            doc = document(
                stream_id, lag, int(state.step[0]), out.steps.tolist(), out.means.tolist(), out.covs.tolist()
            )
            if not finite_json(doc):
                raise invalid("smoothing_lag: the smoothed marginals are not finite in floating point")
            return doc

        # smoothing_cost holds the window four times over already: the state's part adds its work, not its bytes
        price = state_cost(peeked.size).then(cost)
        return await self.reads.run(peeked, price, compute, off_loop=True)


__all__ = ["Smoothing", "disabled", "document"]

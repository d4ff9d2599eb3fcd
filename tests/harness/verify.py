"""Exactly-once, checked against an independent computation.

The fault scenarios use ``kalman`` streams (deterministic), so the float64 Kalman filter of
:mod:`mpflow.operators.references.exact_kalman` run offline on the acknowledged observations must reproduce the stored
posterior mean, covariance and log-evidence, and every acknowledged answer's per-step mean — a step applied twice,
skipped or applied out of order shows as a mismatch (**reference mismatches**). The stored state itself is read
back from Redis and decoded (``ParticleState.from_bytes``); finally each stream takes one more update
(``seq = step + 1``) to show that it is not corrupted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import httpx
import numpy as np
import torch
from mpflow.service.store.stream_store import StreamStore

from mpflow.client.http import AsyncStream, MpflowError
from tests.harness.specs import PRIOR, STATE_DIM, TENANT
from tests.harness.traffic import StreamRun, simulate

REFERENCE_ATOL = 1e-9


def kalman_reference(model_spec: dict, obs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Float64 Kalman filter of the observations from the prior: means [T, d], covs [T, d, d], log Z [T]."""
    from mpflow.operators.models import make_model
    from mpflow.operators.models.priors import prior_from_spec
    from mpflow.operators.references.exact_kalman import kalman_filter

    # the service's kalman reads its model and observations in float64 (Updater.model_dtype), as this does
    model = make_model(model_spec["family"], model_spec.get("params") or {}, STATE_DIM, torch.float64)
    mean, cov = prior_from_spec(PRIOR).moments()
    o = torch.as_tensor(obs, dtype=torch.float64)[None]
    means, covs, logz = kalman_filter(mean.to(torch.float64), cov.to(torch.float64), model, o)
    return means[0].numpy(), covs[0].numpy(), logz[0].numpy()


async def verify_streams(
    pairs: Sequence[tuple[AsyncStream, StreamRun]], store_url: str, prefix: str, model_spec: dict
) -> dict[str, Any]:
    """Stored vs acknowledged steps, the Kalman reference (exactly once), the stored state decoded, and one more
    update per stream (not corrupted)."""
    from mpflow.operators.state import ParticleState

    store = StreamStore.from_url(store_url, prefix=prefix)
    out = {"acknowledged": 0, "stored": 0, "lost": 0, "reference_mismatches": 0, "state_mismatches": 0}
    out |= {"next_update_failures": 0, "step_mean_checks": 0}
    try:
        for stream, run in pairs:
            doc = await stream.get()
            step = int(doc["step"])
            out["acknowledged"] += len(run.acked)
            out["stored"] += step
            out["lost"] += run.lost + max(0, run.acked_top - step)
            means, covs, logz = kalman_reference(model_spec, run.obs[:step])
            s = doc["summary"]
            ok = run.acked == set(range(1, step + 1)) and step > 0
            ok = ok and np.allclose(s["mean"], means[-1], rtol=0, atol=REFERENCE_ATOL)
            ok = ok and np.allclose(s["cov"], covs[-1], rtol=0, atol=REFERENCE_ATOL)
            ok = ok and abs(s["log_evidence"] - float(logz.sum())) <= 1e-6 * max(1.0, abs(float(logz.sum())))
            for m, mean in run.step_means.items():
                out["step_mean_checks"] += 1
                ok = ok and m <= step and np.allclose(mean, means[m - 1], rtol=0, atol=REFERENCE_ATOL)
            out["reference_mismatches"] += not ok
            got = await store.get(TENANT, run.stream_id)
            state = ParticleState.from_bytes(got[1]) if got else None
            state_ok = (
                state is not None
                and int(state.step[0]) == step == int(got[0]["step"])
                and np.allclose(state.extras["mean"][0].numpy(), means[-1], rtol=0, atol=REFERENCE_ATOL)
            )
            out["state_mismatches"] += not state_ok
            extra = simulate(model_spec, 99, 1).tolist()
            try:
                nxt = await stream.update(extra, seq=step + 1)
                out["next_update_failures"] += int(nxt["step"]) != step + 1 or bool(nxt.get("duplicate"))
            except (MpflowError, httpx.HTTPError):
                out["next_update_failures"] += 1
    finally:
        await store.aclose()
    return out

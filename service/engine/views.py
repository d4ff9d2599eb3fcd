"""What the read endpoints show of a stored stream: its summary, draws from its posterior and its particles.

The functions on a decoded or encoded state are blocking tensor work;
:class:`~mpflow.service.engine.tensor_work.TensorWork`
decides where they run.
"""

from __future__ import annotations

import re
import sys
from typing import Any

import torch
from mpflow.operators.models import FAMILIES
from mpflow.operators.state import ParticleState
from mpflow.service.engine import summary as summaries
from mpflow.service.engine.methods import weighted
from mpflow.service.errors import invalid, not_found
from mpflow.service.schemas import STREAM_ID_PATTERN
from mpflow.service.store.stream_store import StreamStore

#: the log-weight ``GET .../particles`` shows for a particle of zero weight (−inf: not JSON) — the most negative double
ZERO_WEIGHT_LOG = -sys.float_info.max
_STREAM_ID = re.compile(STREAM_ID_PATTERN)


def valid_id(stream_id: str) -> bool:
    """Whether ``stream_id`` could name a stream."""
    return _STREAM_ID.match(stream_id) is not None


def check_id(stream_id: str) -> None:
    """The 422 naming ``stream_id`` of an id (from a path) that no stream can have, with the message of every other
    id field's (creation's, an import's, a batch update's); never echoed (a path may hold 64 KiB of it), never
    looked up."""
    if not valid_id(stream_id):
        raise invalid(f"stream_id: String should match pattern '{STREAM_ID_PATTERN}'")


async def read(store: StreamStore, tenant: str, stream_id: str) -> tuple[dict[str, Any], bytes]:
    """(meta, state bytes) of a stored stream; 404 for an unknown one (or one of another tenant), 422 for an id
    that no stream can have."""
    check_id(stream_id)
    got = await store.get(tenant, stream_id)
    if got is None:
        raise not_found(stream_id)
    return got


def draws(meta: dict[str, Any], state: ParticleState, n: int) -> torch.Tensor | None:
    """``n`` draws [n, d] from the stream's posterior (None for none), reproducible per (seed, step)."""
    if n <= 0:
        return None
    family = FAMILIES.get(meta["model"]["family"])  # None: a stored family this server does not know
    gaussian_posterior = family.linear_gaussian if family is not None else True
    seed = summaries.sample_seed(meta["seed"], int(state.step[0]))
    return summaries.draw(state, n, weighted=weighted(meta), seed=seed, gaussian_posterior=gaussian_posterior)


def draw(meta: dict[str, Any], state: ParticleState, n: int) -> list | None:
    """:func:`draws` as nested lists (for a JSON document)."""
    drawn = draws(meta, state, n)
    return None if drawn is None else drawn.tolist()


def summary_and_draws(
    meta: dict[str, Any], data: bytes, n_samples: int, levels: tuple[float, ...] | None = None
) -> tuple[dict[str, Any], list | None]:
    """(summary, ``n_samples`` draws) of a stored state; ``levels``: its quantiles at those levels instead of the
    defaults."""
    state = ParticleState.from_bytes(data)
    summary = summaries.summary(state)
    if levels is not None:
        summary["quantiles"] = summaries.quantile_rows(state, levels)
    return summary, draw(meta, state, n_samples)


def samples(meta: dict[str, Any], data: bytes, n: int) -> torch.Tensor:
    """``GET .../samples``: ``n`` draws [n, d] of a stored state (a tensor: the answer is encoded in chunks,
    :mod:`mpflow.service.api.json_stream`)."""
    drawn = draws(meta, ParticleState.from_bytes(data), n)
    assert drawn is not None  # n >= 1 (the route's check)
    return drawn


def particles(data: bytes) -> dict[str, torch.Tensor]:
    """``GET .../particles``: the particles [N, d] and their normalised log-weights [N] (tensors: the answer is
    encoded in chunks, :mod:`mpflow.service.api.json_stream`)."""
    state = ParticleState.from_bytes(data)
    lw = torch.log_softmax(state.log_weights[0].to(torch.float64), -1)
    # a particle of zero weight (smc) has log-weight −inf, which JSON cannot carry: the most negative double
    lw = torch.nan_to_num(lw, neginf=ZERO_WEIGHT_LOG)
    return {"particles": state.particles[0], "log_weights": lw}


__all__ = [
    "ZERO_WEIGHT_LOG",
    "check_id",
    "draw",
    "draws",
    "particles",
    "read",
    "samples",
    "summary_and_draws",
    "valid_id",
]

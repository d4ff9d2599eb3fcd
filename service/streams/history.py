"""A stream's per-step history (docs/API.md "GET /v1/streams/{stream_id}/history"): what each applied step did, kept
in the store with the stream so that a reader who came late (the dashboard opened after the observations) sees the
steps before it.

One entry per applied step, oldest first, at most ``MPFLOW_HISTORY_STEPS`` (the latest ones)::

    {"step": m, "mean": [...], "std": [...], "log_evidence_increment": ..., "ess": ...,   # the step's per_step entry,
     "fallback": "<method>",                                   # but its quantiles; fallback only when the step
                                                               # fell back (as in per_step)
     "observation": <the value as posted>, "dt": ..., "u": [...]}   # dt and u only when the step gave them

An observation whose JSON is longer than ``MAX_OBSERVATION_BYTES`` (a large logistic minibatch, say) is kept as
``"observation": null, "observation_omitted": true``: the history's size stays about ``steps × (2 d numbers + a
small observation)`` whatever the requests carry. The ``per_step`` entry's ``quantiles`` (and the ``cov`` a request
may ask for, ``per_step_cov``) are left out: they would
double the history's memory in the store (379 bytes a step instead of 214 at d = 2, ``MEMORY USAGE`` of 500
steps), and what reads the history — the dashboard's bands, a late reader's table — has the mean and std.

The entries are written by the stream's compare-and-set itself (:meth:`~mpflow.service.store.stream_store.StreamStore.
compare_and_set`, ``history=``), so they are exactly the steps of the updates that were stored: a duplicate ``seq``
(nothing applied) or a write that lost its race adds nothing. They are stored as JSON text and answered verbatim.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from mpflow.service.engine import views
from mpflow.service.errors import invalid, not_found
from mpflow.service.store.stream_store import StreamStore

#: the longest observation (its JSON, in bytes) a history entry keeps; a longer one is left out (module docstring)
MAX_OBSERVATION_BYTES = 4096
#: the fields of a ``per_step`` entry its history entry leaves out (module docstring)
_LEFT_OUT = frozenset({"quantiles", "cov"})
#: what a step may carry besides its value (docs/API.md "observations")
_STEP_FIELDS = ("dt", "u")


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), allow_nan=False)


def entries(per_step: Sequence[dict[str, Any]], observations: Sequence[Any]) -> list[str]:
    """The encoded history entries of a request's applied steps: each step's ``per_step`` entry with the
    observation that was applied (and its ``dt``/``u`` when given)."""
    out = []
    for summary, item in zip(per_step, observations, strict=True):
        timed = isinstance(item, dict) and "value" in item
        value = item["value"] if timed else item
        entry = {k: v for k, v in summary.items() if k not in _LEFT_OUT}
        if len(_compact(value)) <= MAX_OBSERVATION_BYTES:
            entry["observation"] = value
        else:
            entry["observation"], entry["observation_omitted"] = None, True
        if timed:
            entry.update({k: item[k] for k in _STEP_FIELDS if k in item})
        out.append(_compact(entry))
    return out


async def read(store: StreamStore, tenant: str, stream_id: str, limit: int | None, kept: int) -> bytes:
    """The JSON answer of ``GET .../history``: the latest ``limit`` steps (all that are kept when ``None``) of at
    most ``kept`` (``MPFLOW_HISTORY_STEPS``); 422 naming ``limit`` above that (or ``stream_id``, one that no stream
    can have), 404 for an unknown stream."""
    if limit is not None and limit > kept:
        raise invalid(f"limit: at most {kept} steps are kept per stream (MPFLOW_HISTORY_STEPS), got {limit}")
    views.check_id(stream_id)
    got = await store.history(tenant, stream_id, kept if limit is None else limit)
    if got is None:
        raise not_found(stream_id)
    step, steps = got
    head = _compact({"stream_id": stream_id, "step": step, "history_steps": kept})
    return head[:-1].encode() + b',"steps":[' + b",".join(steps) + b"]}"


__all__ = ["MAX_OBSERVATION_BYTES", "entries", "read"]

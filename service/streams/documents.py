"""The JSON documents of docs/API.md that describe streams: the stream document, the answer to an observation
request and an entry of the stream list. Plain dicts built from the stored metadata (``meta``) and a summary."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from mpflow.operators.models import FAMILIES
from mpflow.service.engine.methods import capabilities
from mpflow.service.engine.summary import PARAM_FIELDS
from mpflow.service.streams import pit

#: the metadata fields of an entry of ``GET /v1/streams``
LIST_FIELDS = ("stream_id", "model", "method", "operator", "step", "created_at", "updated_at")


def now() -> str:
    """The current time as the documents write it (ISO 8601, UTC, milliseconds)."""
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def state_names(meta: dict[str, Any]) -> list[str] | None:
    """The names of the stream's state dimensions: those its creation request gave, else its family's (None: the
    family gives none, or the server does not know the stored family)."""
    if meta.get("state_names") is not None:
        return meta["state_names"]
    family = FAMILIES.get(meta["model"]["family"])
    return family.state_names(meta["state_dim"]) if family is not None else None


def untrained(meta: dict[str, Any]) -> bool:
    """Whether the stream runs the untrained flow: method ``mpf`` without a trained operator (the Daum–Huang base
    flow, no learned correction)."""
    return meta["method"] == "mpf" and meta.get("operator") is None


def document(stream_id: str, meta: dict[str, Any], summary: dict[str, Any]) -> dict[str, Any]:
    """The stream document of docs/API.md."""
    return {
        "stream_id": stream_id,
        "model": meta["model"],
        "method": meta["method"],
        "operator": meta.get("operator"),
        "untrained": untrained(meta),
        "method_options": meta.get("method_options") or {},
        "method_reason": meta.get("method_reason"),
        "capabilities": capabilities(meta),
        "operator_domain": meta.get("operator_domain"),
        "num_particles": meta["num_particles"],
        "state_bytes": meta.get("state_bytes"),
        "state_dim": meta["state_dim"],
        "state_names": state_names(meta),
        "seed": meta["seed"],
        "ttl_seconds": meta["ttl_seconds"],
        "step": meta["step"],
        "smoothing_lag": meta.get("smoothing_lag") or 0,
        "summary": {**summary, **pit.view(meta)},
        "created_at": meta["created_at"],
        "updated_at": meta["updated_at"],
    }


def observation_document(
    stream_id: str,
    meta: dict[str, Any],
    summary: dict[str, Any],
    per_step: list[dict[str, Any]],
    samples: list | None,
    *,
    duplicate: bool,
    per_step_params: bool = False,
) -> dict[str, Any]:
    """The answer to an observation request: the stream document, ``duplicate``, ``per_step``, the draws asked
    for, and ``fallback`` (the last fall-back method) when some step was computed by a safe method instead. A
    stream's learned parameters (``summary.params`` and the θ-cloud's health, ``PARAM_FIELDS``) are in the summary
    once; in each ``per_step`` entry only with ``per_step_params`` (the request's field: they made a 1000-step
    ``smc2`` answer five times longer)."""
    doc = document(stream_id, meta, summary)
    doc["duplicate"] = duplicate
    doc["per_step"] = (
        per_step if per_step_params else [{k: v for k, v in e.items() if k not in PARAM_FIELDS} for e in per_step]
    )
    if samples is not None:
        doc["samples"] = samples
    fell_back = [step["fallback"] for step in per_step if "fallback" in step]
    if fell_back:
        doc["fallback"] = fell_back[-1]
    return doc


def list_entry(item: dict[str, Any]) -> dict[str, Any]:
    """One stream of ``GET /v1/streams``, from what the store lists."""
    return {k: item.get(k) for k in LIST_FIELDS}


__all__ = ["LIST_FIELDS", "document", "list_entry", "now", "observation_document", "state_names", "untrained"]

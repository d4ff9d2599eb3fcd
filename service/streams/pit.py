"""The stream's latest predictive p-values and their flag (docs/API.md "Predictive p-values").

Each ``per_step`` entry carries ``pit``: for each observed entry j, u_j = P(O_j ≤ o_j | o_<m) under the method's
predictive (:meth:`mpflow.operators.updaters.base.Updater.pit`). Under the model u_j ~ U(0, 1), so a reading is
flagged at the two-sided level α — the stream's ``pit_alert``, set at creation, default :data:`DEFAULT_PIT_ALERT` —
when |u_j − ½| > ½ − α/2, i.e. u_j < α/2 or u_j > 1 − α/2: a fraction α of the steps of a stream that follows its
model are flagged, for each entry — exactly the entries whose two-sided p-value ``pit_two_sided``,
2 min(u_j, 1 − u_j) (beside ``pit`` in every ``per_step`` entry and in the summary), is below α. The latest observed
step's values are kept in the stream's metadata (a step without a measurement leaves them) and shown in the stream
document's ``summary`` (``pit``, ``pit_two_sided``, ``pit_step``, ``pit_alert``, ``pit_flagged``), with the same
step's non-saturating log tails (``log_tail_lower``, ``log_tail_upper``), ``surprise`` and ``anomaly_score``
(:mod:`mpflow.service.engine.anomaly`).
"""

from __future__ import annotations

from typing import Any

#: the two-sided level α of a stream that sets none: 1 % of a well-specified stream's readings are flagged
DEFAULT_PIT_ALERT = 0.01
#: the fields of the latest observed step's ``per_step`` entry kept beside ``pit`` (null where the step had none)
LATEST_FIELDS = ("log_tail_lower", "log_tail_upper", "surprise", "anomaly_score", "change_score")


def flagged(pit: list[float | None], alert: float) -> list[bool]:
    """Per entry: |u − ½| > ½ − α/2 (False where the entry was not observed)."""
    return [u is not None and abs(u - 0.5) > 0.5 - alert / 2 for u in pit]


def latest(per_step: list[dict[str, Any]]) -> dict[str, Any]:
    """The metadata fields that keep the p-values of the request's last observed step — one whose ``pit`` has a
    value: a step without a measurement has no ``pit``, or one of nulls —, none when no step of the request was
    observed (the stream keeps those of an earlier request)."""
    for entry in reversed(per_step):
        if any(u is not None for u in entry.get("pit") or ()):
            return {"pit": entry["pit"], "pit_step": entry["step"], **{k: entry.get(k) for k in LATEST_FIELDS}}
    return {}


def view(meta: dict[str, Any]) -> dict[str, Any]:
    """The ``summary`` fields of the stream document: the latest p-values, the step they belong to, the stream's
    level α and which entries it flags (empty before the first observed step)."""
    alert = float(meta.get("pit_alert") or DEFAULT_PIT_ALERT)
    pit = meta.get("pit")
    if pit is None:
        return {"pit_alert": alert}
    marks = flagged(pit, alert)
    return {
        "pit": pit,
        "pit_two_sided": [None if u is None else 2.0 * min(u, 1.0 - u) for u in pit],
        "pit_step": meta.get("pit_step"),
        "pit_alert": alert,
        "pit_flagged": any(marks),
        "pit_flags": marks,
        **{k: meta[k] for k in LATEST_FIELDS if k in meta},
    }

"""The live feed's ``update`` event stays within ``MAX_EVENT_NUMBERS`` numbers whatever a request's per-step
entries carry (service.dashboard.publish)."""

from __future__ import annotations

from mpflow.service.streams.publish import MAX_EVENT_NUMBERS, event_of


def _numbers(value) -> int:
    if isinstance(value, dict):
        return sum(_numbers(v) for v in value.values())
    if isinstance(value, list):
        return sum(_numbers(v) for v in value)
    return 1 if isinstance(value, float) else 0


def test_an_event_of_1000_steps_with_quantiles_keeps_within_the_bound():
    d = 64
    entry = {
        "step": 1,
        "mean": [0.0] * d,
        "std": [1.0] * d,
        "quantiles": {q: [0.5] * d for q in ("0.05", "0.5", "0.95")},
        "log_evidence_increment": -1.0,
        "ess": 256.0,
    }
    doc = {
        "stream_id": "s",
        "step": 1000,
        "updated_at": "t",
        "method": "smc",
        "summary": {"mean": [0.0] * d, "cov": [[0.0] * d] * d},
        "per_step": [dict(entry, step=i) for i in range(1, 1001)],
    }
    event = event_of(doc)
    per_entry = 5 * d + 2
    assert len(event["per_step"]) == MAX_EVENT_NUMBERS // (5 * d)
    assert _numbers(event["per_step"]) <= MAX_EVENT_NUMBERS + len(event["per_step"]) * (per_entry - 5 * d)
    assert event["per_step"][-1]["step"] == 1000  # the last entries are kept

"""Assertions shared by the fault-injection tests on a result of :mod:`tests.harness.faults`."""

from __future__ import annotations

from typing import Any


def assert_exactly_once(r: dict[str, Any], total: int, batch: int) -> None:
    """Every acknowledged step of the load is stored exactly once — none lost, none applied twice or skipped
    (the float64 Kalman reference and the decoded stored states agree) — and every stream takes its next update."""
    assert r["lost"] == 0
    assert r["acknowledged"] == r["stored"] == total
    assert r["reference_mismatches"] == 0
    assert r["state_mismatches"] == 0
    assert r["bad_answers"] == 0
    assert r["step_mean_checks"] >= total - batch * r["duplicates"]
    assert r["next_update_failures"] == 0
    # no conflict and nothing the client gave up on
    assert r["http_409"] == 0
    assert r["client_errors"] == {}

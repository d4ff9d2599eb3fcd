"""The pure parts of the per-tenant limits: which paths need a key, secret redaction in any case, the in-process
slot counts (feeds, WebSockets, body bytes) and a stream's accounted size. The store-backed quotas are tested
against real Redis (tests/integration/test_quotas.py) and a real server (tests/reliability/test_tenant_quotas.py)."""

from __future__ import annotations

import json

import pytest
from mpflow.service.api.auth import redact
from mpflow.service.api.middleware import needs_key
from mpflow.service.errors import ApiError
from mpflow.service.store.quotas import SIZE_UNIT, TenantSlots, stored_size

FULL = ApiError(503, "full", "the process is full")


#: (path, whether /metrics is public) that need a key, and that need none
NEED_KEY = [("/v1/streams", True), ("/v1", True), ("/v1/nowhere", True), ("/metrics", False)]
NO_KEY = [("/v1x", True), ("/healthz", False), ("/readyz", False), ("/metrics", True), ("/docs", False)]
NO_KEY += [("/", False), ("/streams/abc", False), ("/dashboard/app.js", False)]


def test_which_paths_need_a_key() -> None:
    assert [needs_key(*case) for case in NEED_KEY] == [True] * len(NEED_KEY)
    assert [needs_key(*case) for case in NO_KEY] == [False] * len(NO_KEY)


@pytest.mark.parametrize(
    ("line", "kept"),
    [
        ("GET /v1/streams/x/ws?API_KEY=secret1 101", "GET /v1/streams/x/ws?API_KEY=<redacted> 101"),
        ("ws?Api_Key=secret1&x=1", "ws?Api_Key=<redacted>&x=1"),
        ("ws?API%5FKEY=secret1", "ws?API%5FKEY=<redacted>"),
        ("ws?api_key=secret1", "ws?api_key=<redacted>"),
        ("Authorization: BEARER secret1", "Authorization: BEARER <redacted>"),
        ("Authorization: bearer secret1", "Authorization: bearer <redacted>"),
    ],
)
def test_secrets_are_redacted_in_any_case(line: str, kept: str) -> None:
    assert redact(line) == kept and "secret1" not in redact(line)


def test_slots_refuse_a_tenant_at_its_cap_and_everyone_at_the_process_cap() -> None:
    slots = TenantSlots("live feeds", per_tenant=2, per_process=3, setting="MPFLOW_MAX_FEEDS_PER_TENANT")
    slots.take("a", FULL)
    slots.take("a", FULL)
    with pytest.raises(ApiError) as refused:
        slots.take("a", FULL)
    assert refused.value.status == 429 and refused.value.code == "quota_exceeded"
    assert int(refused.value.headers["Retry-After"]) >= 1 and "MPFLOW_MAX_FEEDS_PER_TENANT" in refused.value.message
    slots.take("b", FULL)  # another tenant is not blocked by a's cap
    with pytest.raises(ApiError) as full:
        slots.take("c", FULL)
    assert full.value is FULL and slots.total == 3
    slots.give("a")
    slots.take("c", FULL)
    for tenant in ("a", "b", "c"):
        slots.give(tenant)
    assert slots.total == 0 and not slots.open


def test_slots_count_amounts_and_no_tenant_has_no_share() -> None:
    budget = TenantSlots("body bytes", per_tenant=100, per_process=150, setting="X")
    budget.take("a", FULL, 60)
    with pytest.raises(ApiError):
        budget.take("a", FULL, 41)  # 101 > the tenant's 100
    budget.take(None, FULL, 90)  # open mode: only the process's cap
    with pytest.raises(ApiError) as full:
        budget.take(None, FULL, 1)
    assert full.value is FULL
    budget.give("a", 60)
    budget.give(None, 90)
    assert budget.total == 0


def test_the_accounted_size_counts_state_meta_and_history_in_whole_kib() -> None:
    meta = {"model": {"family": "linear_gaussian"}, "step": 3}
    base = len(json.dumps(meta, separators=(",", ":")))
    assert stored_size(5000, meta, 0) == -(-(5000 + base) // SIZE_UNIT) * SIZE_UNIT
    entries = ["x" * 100, "y" * 300]  # mean 200 bytes per entry
    with_history = stored_size(5000, meta, 10, entries, history_steps=500)
    assert with_history == -(-(5000 + base + 200 * 10) // SIZE_UNIT) * SIZE_UNIT
    capped = stored_size(5000, meta, 10_000, entries, history_steps=500)  # at most the entries kept
    assert capped == -(-(5000 + base + 200 * 500) // SIZE_UNIT) * SIZE_UNIT

